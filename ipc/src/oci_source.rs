//! Client side of `ImportOci`: finds the parts of an OCI image in an **OCI image layout**
//! (`oci:DIR[:TAG]`, what `skopeo copy … oci:DIR:TAG` and `umoci` write) or a **docker
//! archive** (`docker-archive:FILE[:REF]`, what `docker save` and `podman save` write), reads
//! its small JSON parts and opens its layer blobs, all with the caller's own rights. The daemon
//! trusts none of it: every digest is verified on its side ([`crate::OciImportRequest`]).
//!
//! Layout: `index.json` lists manifests, each tagged by the annotation
//! `org.opencontainers.image.ref.name`; a tag selects one (no tag: the only one); an image
//! index is resolved to its `linux/amd64` manifest; blobs are `blobs/<alg>/<hex>`, only
//! `sha256` digests of 64 hex digits are accepted (so a digest never becomes another path).
//! Docker archive: `manifest.json` lists images (`Config`, `RepoTags`, `Layers`, paths inside
//! the tar); each layer is passed as a byte range of the one archive descriptor (symlinked
//! duplicate layers, as `docker save` writes them, are followed inside the archive).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::image::BlobRange;

/// Largest JSON part read (index, manifest, config, docker `manifest.json`), bytes.
pub const MAX_JSON_BYTES: u64 = 4 << 20;

/// Most distinct layer files one import may pass (the server's descriptor limit).
pub const MAX_LAYER_FILES: usize = crate::transport::MAX_REQUEST_FDS;

/// Annotation that tags a manifest in an OCI layout's `index.json`.
const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// An image's parts, ready for [`crate::Client::import_oci`].
#[derive(Debug)]
pub struct OciSource {
    /// How the source is named in the daemon's records.
    pub label: String,
    /// The manifest's bytes (a layout), none for a docker archive.
    pub manifest: Option<Vec<u8>>,
    /// The config's bytes.
    pub config: Vec<u8>,
    /// Files to pass; [`BlobRange::fd`] indexes them.
    pub files: Vec<OwnedFd>,
    /// Layer blobs, bottom-most first.
    pub layers: Vec<BlobRange>,
}

/// Why a layout or archive cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum OciSourceError {
    /// A file of it cannot be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// It is not a layout or archive of the expected shape.
    #[error("{path}: {reason}")]
    Invalid {
        /// The layout or archive.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A source named on the command line: `oci:DIR[:TAG]` or `docker-archive:FILE[:REF]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSpec {
    /// An OCI image layout and an optional tag.
    Oci(PathBuf, Option<String>),
    /// A docker archive and an optional `REPO:TAG` inside it.
    DockerArchive(PathBuf, Option<String>),
}

impl SourceSpec {
    /// Parses `oci:DIR[:TAG]` / `docker-archive:FILE[:REF]`; `None` for anything else (a
    /// plain path). The tag is what follows the last `:` after the last `/` of the path.
    pub fn parse(s: &str) -> Option<SourceSpec> {
        let split = |rest: &str| -> (PathBuf, Option<String>) {
            let slash = rest.rfind('/').map_or(0, |i| i + 1);
            match rest[slash..].find(':') {
                Some(i) => (
                    PathBuf::from(&rest[..slash + i]),
                    Some(rest[slash + i + 1..].to_string()).filter(|t| !t.is_empty()),
                ),
                None => (PathBuf::from(rest), None),
            }
        };
        if let Some(rest) = s.strip_prefix("oci:") {
            let (p, t) = split(rest);
            Some(SourceSpec::Oci(p, t))
        } else if let Some(rest) = s.strip_prefix("docker-archive:") {
            // A reference has its own `:` (REPO:TAG): only a second `:` after the file
            // name starts it.
            match rest.find(".tar:").map(|i| i + 4) {
                Some(i) => Some(SourceSpec::DockerArchive(
                    PathBuf::from(&rest[..i]),
                    Some(rest[i + 1..].to_string()).filter(|t| !t.is_empty()),
                )),
                None => Some(SourceSpec::DockerArchive(PathBuf::from(rest), None)),
            }
        } else {
            None
        }
    }

    /// Opens the source ([`open_oci_layout`], [`open_docker_archive`]).
    pub fn open(&self) -> Result<OciSource, OciSourceError> {
        match self {
            SourceSpec::Oci(dir, tag) => open_oci_layout(dir, tag.as_deref()),
            SourceSpec::DockerArchive(file, r) => open_docker_archive(file, r.as_deref()),
        }
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> OciSourceError {
    OciSourceError::Invalid {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn read_err(path: &Path) -> impl FnOnce(io::Error) -> OciSourceError + '_ {
    move |source| OciSourceError::Read {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a small file whole (at most [`MAX_JSON_BYTES`]).
fn read_small(path: &Path) -> Result<Vec<u8>, OciSourceError> {
    let mut out = Vec::new();
    File::open(path)
        .and_then(|f| f.take(MAX_JSON_BYTES + 1).read_to_end(&mut out))
        .map_err(read_err(path))?;
    if out.len() as u64 > MAX_JSON_BYTES {
        return Err(invalid(path, format!("larger than {MAX_JSON_BYTES} bytes")));
    }
    Ok(out)
}

fn json(path: &Path, bytes: &[u8]) -> Result<Value, OciSourceError> {
    serde_json::from_slice(bytes).map_err(|e| invalid(path, format!("not JSON: {e}")))
}

/// `blobs/sha256/<hex>` of `digest`, for `sha256:` and 64 lowercase hex digits only.
fn blob_path(dir: &Path, digest: &str) -> Result<PathBuf, OciSourceError> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => {
            Ok(dir.join("blobs").join("sha256").join(h))
        }
        _ => Err(invalid(
            dir,
            format!("digest {digest:?} is not sha256:<64 hex>"),
        )),
    }
}

fn digest_of(desc: &Value) -> &str {
    desc.get("digest").and_then(Value::as_str).unwrap_or("")
}

/// Opens the image `tag` (or the only one) of the OCI layout `dir`.
///
/// Errors: [`OciSourceError`] naming the file or what is missing (no such tag: the tags
/// there are listed).
pub fn open_oci_layout(dir: &Path, tag: Option<&str>) -> Result<OciSource, OciSourceError> {
    let index_path = dir.join("index.json");
    let index = json(&index_path, &read_small(&index_path)?)?;
    let manifests = index
        .get("manifests")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(&index_path, "no \"manifests\" list"))?;
    let tag_of = |m: &Value| {
        m.pointer(&format!("/annotations/{}", REF_NAME.replace('/', "~1")))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let chosen = match tag {
        Some(t) => manifests.iter().find(|m| tag_of(m).as_deref() == Some(t)),
        None if manifests.len() == 1 => manifests.first(),
        None => None,
    };
    let Some(chosen) = chosen else {
        let tags: Vec<String> = manifests.iter().filter_map(tag_of).collect();
        return Err(invalid(
            dir,
            match tag {
                Some(t) => format!("no image tagged {t:?} (tags: {})", tags.join(", ")),
                None => format!(
                    "{} images, name one with oci:DIR:TAG (tags: {})",
                    manifests.len(),
                    tags.join(", ")
                ),
            },
        ));
    };
    let mut desc = chosen.clone();
    // An image index (a multi-platform image): its linux/amd64 manifest.
    for _ in 0..4 {
        let media = desc.get("mediaType").and_then(Value::as_str).unwrap_or("");
        if !media.contains("index") && !media.contains("manifest.list") {
            break;
        }
        let path = blob_path(dir, digest_of(&desc))?;
        let inner = json(&path, &read_small(&path)?)?;
        desc = inner
            .get("manifests")
            .and_then(Value::as_array)
            .and_then(|ms| {
                ms.iter().find(|m| {
                    m.pointer("/platform/os").and_then(Value::as_str) == Some("linux")
                        && m.pointer("/platform/architecture").and_then(Value::as_str)
                            == Some("amd64")
                })
            })
            .cloned()
            .ok_or_else(|| invalid(&path, "the image index has no linux/amd64 manifest"))?;
    }
    let manifest_path = blob_path(dir, digest_of(&desc))?;
    let manifest = read_small(&manifest_path)?;
    let m = json(&manifest_path, &manifest)?;
    let config_path = blob_path(
        dir,
        m.pointer("/config/digest")
            .and_then(Value::as_str)
            .unwrap_or(""),
    )?;
    let config = read_small(&config_path)?;
    let mut files: Vec<OwnedFd> = Vec::new();
    let mut opened: HashMap<String, u32> = HashMap::new();
    let mut layers = Vec::new();
    for layer in m
        .get("layers")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(&manifest_path, "no \"layers\" list"))?
    {
        let digest = digest_of(layer).to_string();
        let fd = match opened.get(&digest) {
            Some(&i) => i,
            None => {
                if files.len() >= MAX_LAYER_FILES {
                    return Err(invalid(
                        dir,
                        format!("more than {MAX_LAYER_FILES} distinct layers"),
                    ));
                }
                let path = blob_path(dir, &digest)?;
                let f = File::open(&path).map_err(read_err(&path))?;
                files.push(f.into());
                opened.insert(digest.clone(), (files.len() - 1) as u32);
                (files.len() - 1) as u32
            }
        };
        let len = layer
            .get("size")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX);
        layers.push(BlobRange { fd, offset: 0, len });
    }
    Ok(OciSource {
        label: format!(
            "oci:{}{}",
            std::path::absolute(dir)
                .unwrap_or_else(|_| dir.to_path_buf())
                .display(),
            tag.map(|t| format!(":{t}")).unwrap_or_default()
        ),
        manifest: Some(manifest),
        config,
        files,
        layers,
    })
}

/// Opens the image `reference` (a `REPO:TAG` of its `RepoTags`, or the only one) of the
/// docker archive `file`.
///
/// Errors: [`OciSourceError`].
pub fn open_docker_archive(
    file: &Path,
    reference: Option<&str>,
) -> Result<OciSource, OciSourceError> {
    let f = File::open(file).map_err(read_err(file))?;
    // Member name → (data offset, size, link target: (is a symlink, target)).
    type Member = (u64, u64, Option<(bool, String)>);
    let mut members: HashMap<String, Member> = HashMap::new();
    {
        let mut archive = tar::Archive::new(&f);
        let entries = archive.entries().map_err(read_err(file))?;
        for entry in entries {
            let entry = entry.map_err(read_err(file))?;
            let name = entry
                .path()
                .map_err(read_err(file))?
                .to_string_lossy()
                .trim_start_matches("./")
                .to_string();
            let kind = entry.header().entry_type();
            let link = match kind {
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    entry.link_name().ok().flatten().map(|l| {
                        (
                            kind == tar::EntryType::Symlink,
                            l.to_string_lossy().into_owned(),
                        )
                    })
                }
                _ => None,
            };
            members.insert(name, (entry.raw_file_position(), entry.size(), link));
            if members.len() > 1_000_000 {
                return Err(invalid(file, "more than 10^6 members"));
            }
        }
    }
    let resolve = |name: &str| -> Result<(u64, u64), OciSourceError> {
        let mut cur = name.trim_start_matches("./").to_string();
        for _ in 0..8 {
            let (offset, size, link) = members
                .get(&cur)
                .cloned()
                .ok_or_else(|| invalid(file, format!("no member {cur:?}")))?;
            match link {
                None => return Ok((offset, size)),
                Some((symlink, target)) => {
                    // A symlink is relative to its directory, a hard link to the archive root.
                    let base = Path::new(&cur).parent().unwrap_or(Path::new(""));
                    let joined = if symlink && !target.starts_with('/') {
                        normalize(&base.join(&target))
                    } else {
                        normalize(Path::new(&target))
                    };
                    cur = joined
                        .ok_or_else(|| invalid(file, format!("link {cur:?} leaves the archive")))?;
                }
            }
        }
        Err(invalid(file, format!("link chain at {name:?} too long")))
    };
    let read_member = |name: &str| -> Result<Vec<u8>, OciSourceError> {
        let (offset, size) = resolve(name)?;
        if size > MAX_JSON_BYTES {
            return Err(invalid(
                file,
                format!("{name} larger than {MAX_JSON_BYTES} bytes"),
            ));
        }
        let mut buf = vec![0u8; size as usize];
        f.read_exact_at(&mut buf, offset).map_err(read_err(file))?;
        Ok(buf)
    };
    let list = json(file, &read_member("manifest.json")?)?;
    let images = list
        .as_array()
        .ok_or_else(|| invalid(file, "manifest.json is not a list"))?;
    let tags_of = |m: &Value| -> Vec<String> {
        m.get("RepoTags")
            .and_then(Value::as_array)
            .map(|t| {
                t.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let chosen = match reference {
        Some(r) => images.iter().find(|m| tags_of(m).iter().any(|t| t == r)),
        None if images.len() == 1 => images.first(),
        None => None,
    }
    .ok_or_else(|| {
        let all: Vec<String> = images.iter().flat_map(tags_of).collect();
        invalid(
            file,
            format!(
                "choose an image with docker-archive:FILE:REF (tags: {})",
                all.join(", ")
            ),
        )
    })?;
    let config = read_member(
        chosen
            .get("Config")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(file, "an image without \"Config\""))?,
    )?;
    let mut layers = Vec::new();
    for l in chosen
        .get("Layers")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid(file, "an image without \"Layers\""))?
    {
        let name = l
            .as_str()
            .ok_or_else(|| invalid(file, "a layer name is not a string"))?;
        let (offset, len) = resolve(name)?;
        layers.push(BlobRange { fd: 0, offset, len });
    }
    Ok(OciSource {
        label: format!(
            "docker-archive:{}{}",
            std::path::absolute(file)
                .unwrap_or_else(|_| file.to_path_buf())
                .display(),
            reference.map(|r| format!(":{r}")).unwrap_or_default()
        ),
        manifest: None,
        config,
        files: vec![f.into()],
        layers,
    })
}

/// `a/b/../c` → `a/c`; `None` when it climbs above the root.
fn normalize(p: &Path) -> Option<String> {
    let mut out: Vec<&str> = Vec::new();
    for c in p.to_str()?.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop()?;
            }
            c => out.push(c),
        }
    }
    Some(out.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert_eq!(
            SourceSpec::parse("oci:/tmp/lay:v1"),
            Some(SourceSpec::Oci("/tmp/lay".into(), Some("v1".into())))
        );
        assert_eq!(
            SourceSpec::parse("oci:./a:b/lay"),
            Some(SourceSpec::Oci("./a:b/lay".into(), None))
        );
        assert_eq!(
            SourceSpec::parse("docker-archive:/x/img.tar:repo/a:latest"),
            Some(SourceSpec::DockerArchive(
                "/x/img.tar".into(),
                Some("repo/a:latest".into())
            ))
        );
        assert_eq!(
            SourceSpec::parse("docker-archive:/x/img.tar"),
            Some(SourceSpec::DockerArchive("/x/img.tar".into(), None))
        );
        assert_eq!(SourceSpec::parse("/x/rootfs"), None);
    }

    #[test]
    fn normalizes() {
        assert_eq!(normalize(Path::new("a/b/../c")).as_deref(), Some("a/c"));
        assert_eq!(normalize(Path::new("../x")), None);
    }

    #[test]
    fn refuses_digest_paths() {
        let d = Path::new("/l");
        assert!(blob_path(d, "sha256:../../etc/passwd").is_err());
        assert!(blob_path(d, "md5:00").is_err());
        assert!(blob_path(d, &format!("sha256:{}", "a".repeat(64))).is_ok());
    }
}
