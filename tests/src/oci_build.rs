//! OCI images for tests: built with `umoci` (one layer per step, from a directory the step
//! changes, or a tar given verbatim with `umoci raw add-layer`), pushed into a
//! [`crate::registry::TestRegistry`] with `skopeo`, and raw OCI layouts written by hand for
//! the hostile cases a real tool never makes (a wrong digest, a truncated or missing blob).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest as _, Sha256};

use crate::registry::TestRegistry;

/// Runs `cmd`, panicking with its output when it fails ([`crate::oci`]'s).
pub fn run(cmd: &mut Command) -> String {
    crate::oci::run(cmd)
}

/// An OCI image layout with one tagged image, built step by step with `umoci`.
#[derive(Debug)]
pub struct OciBuilder {
    layout: PathBuf,
    tag: String,
    work: PathBuf,
}

impl OciBuilder {
    /// `umoci init` + `umoci new` of `layout:tag` (an image without layers); `work` is a
    /// scratch dir for bundles.
    pub fn new(layout: &Path, tag: &str, work: &Path) -> OciBuilder {
        if !layout.join("index.json").exists() {
            run(Command::new("umoci").args(["init", "--layout"]).arg(layout));
        }
        run(Command::new("umoci")
            .args(["new", "--image"])
            .arg(format!("{}:{tag}", layout.display())));
        fs::create_dir_all(work).unwrap();
        OciBuilder {
            layout: layout.to_path_buf(),
            tag: tag.to_string(),
            work: work.to_path_buf(),
        }
    }

    /// `DIR:TAG` of the image for umoci and skopeo's `oci:` transport.
    pub fn image(&self) -> String {
        format!("{}:{}", self.layout.display(), self.tag)
    }

    /// The layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }

    /// Unpacks the image, lets `change` modify its rootfs, and repacks the difference as a
    /// new layer (umoci writes whiteouts for what `change` removed).
    pub fn layer(&mut self, change: impl FnOnce(&Path)) -> &mut Self {
        let bundle = self.work.join(format!("bundle-{}", crate::unique()));
        run(Command::new("umoci")
            .args(["unpack", "--image", &self.image()])
            .arg(&bundle));
        change(&bundle.join("rootfs"));
        run(Command::new("umoci")
            .args(["repack", "--image", &self.image()])
            .arg(&bundle));
        let _ = fs::remove_dir_all(&bundle);
        self
    }

    /// A layer holding the busybox test rootfs ([`crate::busybox_rootfs`]).
    pub fn busybox_layer(&mut self) -> &mut Self {
        self.layer(|root| {
            run(Command::new("cp")
                .arg("-a")
                .arg(format!("{}/.", crate::busybox_rootfs().display()))
                .arg(root));
        })
    }

    /// Appends `tar` (uncompressed) verbatim as a layer (`umoci raw add-layer`).
    pub fn raw_layer(&mut self, tar: &[u8]) -> &mut Self {
        let file = self.work.join(format!("layer-{}.tar", crate::unique()));
        fs::write(&file, tar).unwrap();
        run(Command::new("umoci")
            .args(["raw", "add-layer", "--image", &self.image()])
            .arg(&file));
        let _ = fs::remove_file(&file);
        self
    }

    /// `umoci config --image … ARGS` (e.g. `--config.env=A=1`, `--config.user=app`).
    pub fn config(&mut self, args: &[&str]) -> &mut Self {
        run(Command::new("umoci")
            .args(["config", "--image", &self.image()])
            .args(args));
        self
    }

    /// The image's merged tree as umoci unpacks it (whiteouts applied): `dest/rootfs`.
    pub fn unpack(&self, dest: &Path) -> PathBuf {
        run(Command::new("umoci")
            .args(["unpack", "--image", &self.image()])
            .arg(dest));
        dest.join("rootfs")
    }

    /// Pushes the image to `registry` as `repo_tag` (`REPO:TAG`) with skopeo.
    pub fn push(&self, registry: &TestRegistry, repo_tag: &str) -> String {
        let dest = format!("docker://{}/{repo_tag}", registry.addr());
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--dest-tls-verify=false"]);
        if let Some(creds) = registry.creds_arg() {
            cmd.arg("--dest-creds").arg(creds);
        }
        run(cmd.arg(format!("oci:{}", self.image())).arg(&dest));
        format!("{}/{repo_tag}", registry.addr())
    }
}

/// One member of a hand-made layer tar.
#[derive(Debug, Clone)]
pub enum Member<'a> {
    /// A directory (mode 0755).
    Dir(&'a str),
    /// A regular file (mode 0644).
    File(&'a str, &'a [u8]),
    /// A symbolic link to a target.
    Symlink(&'a str, &'a str),
    /// A hard link to an earlier member.
    Hardlink(&'a str, &'a str),
    /// A character device.
    CharDevice(&'a str, u32, u32),
    /// A member with a raw name (bypasses the tar crate's path checks: `../x`, `/abs`).
    RawName(&'a [u8], &'a [u8]),
}

/// A plain tar of `members`, in order, with an end-of-archive marker.
pub fn layer_tar(members: &[Member<'_>]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for m in members {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        match m {
            Member::Dir(p) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o755);
                h.set_size(0);
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
            Member::File(p, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            Member::Symlink(p, t) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_mode(0o777);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            Member::Hardlink(p, t) => {
                h.set_entry_type(tar::EntryType::Link);
                h.set_mode(0o644);
                h.set_size(0);
                b.append_link(&mut h, p, t).unwrap();
            }
            Member::CharDevice(p, major, minor) => {
                h.set_entry_type(tar::EntryType::Char);
                h.set_mode(0o600);
                h.set_size(0);
                h.set_device_major(*major).unwrap();
                h.set_device_minor(*minor).unwrap();
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
            Member::RawName(name, data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_mode(0o644);
                h.set_size(data.len() as u64);
                let gnu = h.as_gnu_mut().unwrap();
                gnu.name[..name.len()].copy_from_slice(name);
                h.set_cksum();
                b.append(&h, *data).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    format!(
        "sha256:{}",
        d.iter().map(|b| format!("{b:02x}")).collect::<String>()
    )
}

/// What to break in a [`raw_layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    /// Nothing.
    None,
    /// Flip a byte of the last layer's blob after its digest was computed.
    FlipLayerByte,
    /// Cut the last layer's blob in half (digest and size still name the whole).
    TruncateLayer,
    /// Delete the last layer's blob file.
    MissingLayer,
    /// Name a config digest the config does not have.
    WrongConfigDigest,
}

/// Writes an OCI layout at `dir` with one image tagged `tag`: the given uncompressed layer
/// tars (stored gzip-compressed), a config whose `diff_ids` match, broken as `tamper` says.
pub fn raw_layout(dir: &Path, tag: &str, layers: &[Vec<u8>], tamper: Tamper) {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| -> String {
        let d = sha256(bytes);
        fs::write(blobs.join(&d[7..]), bytes).unwrap();
        d
    };
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    for tar in layers {
        diff_ids.push(sha256(tar));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, tar).unwrap();
        let gz = gz.finish().unwrap();
        let d = put(&gz);
        descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": d, "size": gz.len()}));
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }))
    .unwrap();
    let mut config_digest = put(&config);
    if tamper == Tamper::WrongConfigDigest {
        config_digest = sha256(b"another config");
    }
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": config_digest, "size": config.len()},
        "layers": descs,
    }))
    .unwrap();
    let m = put(&manifest);
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "digest": m, "size": manifest.len(),
                           "annotations": {"org.opencontainers.image.ref.name": tag}}],
        }))
        .unwrap(),
    )
    .unwrap();
    if let Some(last) = descs.last() {
        let path = blobs.join(&last["digest"].as_str().unwrap()[7..]);
        match tamper {
            Tamper::FlipLayerByte => {
                let mut b = fs::read(&path).unwrap();
                let i = b.len() / 2;
                b[i] ^= 0x40;
                fs::write(&path, b).unwrap();
            }
            Tamper::TruncateLayer => {
                let b = fs::read(&path).unwrap();
                fs::write(&path, &b[..b.len() / 2]).unwrap();
            }
            Tamper::MissingLayer => fs::remove_file(&path).unwrap(),
            Tamper::None | Tamper::WrongConfigDigest => {}
        }
    }
}

/// A listing of the tree under `root` for comparisons: one line per entry, sorted, with its
/// type, permission bits, size and content digest (files) or target (symlinks). Owners are
/// left out (a sandbox's view goes through its id map).
pub fn listing(root: &Path, subtrees: &[&str]) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = subtrees.iter().map(|s| root.join(s)).collect();
    while let Some(p) = stack.pop() {
        let Ok(md) = fs::symlink_metadata(&p) else {
            continue;
        };
        let rel = p.strip_prefix(root).unwrap().display().to_string();
        let mode = md.permissions().mode() & 0o7777;
        let ft = md.file_type();
        if ft.is_dir() {
            out.push(format!("d {rel} {mode:o}"));
            for e in fs::read_dir(&p).unwrap().flatten() {
                stack.push(e.path());
            }
        } else if ft.is_symlink() {
            out.push(format!(
                "l {rel} -> {}",
                fs::read_link(&p).unwrap().display()
            ));
        } else if ft.is_file() {
            out.push(format!(
                "f {rel} {mode:o} {} {}",
                md.len(),
                sha256(&fs::read(&p).unwrap())
            ));
        } else {
            out.push(format!("o {rel} {mode:o}"));
        }
    }
    out.sort();
    out
}
