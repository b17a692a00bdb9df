//! OCI layouts written by hand (no umoci): blobs, `index.json` tags, image indexes, and
//! damaged layouts ([`Tamper`]) for hostile tests.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// OCI media types used by the hand-written layouts.
pub mod media {
    /// Image manifest.
    pub const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    /// Image index.
    pub const INDEX: &str = "application/vnd.oci.image.index.v1+json";
    /// Image config.
    pub const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
    /// Uncompressed layer.
    pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
    /// Gzip layer.
    pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
    /// Zstd layer.
    pub const LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    let sum = Sha256::digest(bytes);
    let mut out = String::with_capacity(71);
    out.push_str("sha256:");
    for b in sum.iter() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

pub(super) fn blob_file(layout: &Path, digest: &str) -> PathBuf {
    let (algo, hex) = digest.split_once(':').expect("algo:hex");
    layout.join("blobs").join(algo).join(hex)
}

pub(super) fn tag_descriptor(layout: &Path, tag: &str) -> serde_json::Value {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(layout.join("index.json")).expect("index.json"))
            .expect("index.json parses");
    index["manifests"]
        .as_array()
        .expect("manifests")
        .iter()
        .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
        .unwrap_or_else(|| panic!("tag {tag} not in {}", layout.display()))
        .clone()
}

/// Writes `bytes` as a blob of `layout`; returns its digest.
pub fn put_blob(layout: &Path, bytes: &[u8]) -> String {
    let digest = sha256_digest(bytes);
    let path = blob_file(layout, &digest);
    std::fs::create_dir_all(path.parent().expect("blob dir")).expect("mkdir blobs");
    std::fs::write(path, bytes).expect("write blob");
    digest
}

/// Points `tag` of `layout` at `descriptor` in `index.json` (replacing an entry of that
/// tag).
pub fn set_tag(layout: &Path, tag: &str, mut descriptor: serde_json::Value) {
    descriptor["annotations"] = serde_json::json!({ "org.opencontainers.image.ref.name": tag });
    let path = layout.join("index.json");
    let mut index: serde_json::Value = match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b).expect("index.json parses"),
        Err(_) => serde_json::json!({ "schemaVersion": 2, "manifests": [] }),
    };
    let list = index["manifests"].as_array_mut().expect("manifests");
    list.retain(|m| m["annotations"]["org.opencontainers.image.ref.name"] != tag);
    list.push(descriptor);
    std::fs::write(&path, serde_json::to_vec(&index).expect("json")).expect("write index.json");
}

/// Adds to `layout` an image index tagged `index_tag` whose entries are the manifests of
/// the layout's tags `entries` = `(tag, os, architecture)`; returns the index digest. Push
/// it with [`skopeo_push`] and `--all`.
pub fn write_index(layout: &Path, index_tag: &str, entries: &[(&str, &str, &str)]) -> String {
    let manifests: Vec<serde_json::Value> = entries
        .iter()
        .map(|(tag, os, arch)| {
            let d = tag_descriptor(layout, tag);
            serde_json::json!({
                "mediaType": d["mediaType"], "digest": d["digest"], "size": d["size"],
                "platform": { "os": os, "architecture": arch },
            })
        })
        .collect();
    let index = serde_json::json!({
        "schemaVersion": 2, "mediaType": media::INDEX, "manifests": manifests,
    });
    let bytes = serde_json::to_vec(&index).expect("json");
    let digest = put_blob(layout, &bytes);
    set_tag(
        layout,
        index_tag,
        serde_json::json!({ "mediaType": media::INDEX, "digest": digest, "size": bytes.len() }),
    );
    digest
}

/// How [`write_raw_layout`] damages the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    /// A well-formed layout.
    None,
    /// The manifest names layer `i` by a digest its bytes do not hash to (the bytes are
    /// stored under that wrong name).
    LayerDigest(usize),
    /// Layer `i`'s blob holds only its first half (the descriptor keeps the full size and
    /// digest).
    TruncatedLayer(usize),
    /// Layer `i`'s blob is not written.
    MissingLayer(usize),
    /// Layer `i`'s descriptor says one byte more than the blob has.
    LayerSize(usize),
}

/// What [`write_raw_layout`] wrote.
#[derive(Debug, Clone)]
pub struct RawLayout {
    /// Manifest digest.
    pub manifest_digest: String,
    /// Manifest bytes.
    pub manifest: Vec<u8>,
    /// Config digest.
    pub config_digest: String,
    /// The layer descriptors as the manifest names them: `(digest, size)`.
    pub layers: Vec<(String, u64)>,
}

/// The layer media type for `bytes`: gzip or zstd by magic number, else plain tar.
pub fn layer_media_type(bytes: &[u8]) -> &'static str {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        media::LAYER_GZIP
    } else if bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        media::LAYER_ZSTD
    } else {
        media::LAYER_TAR
    }
}

/// Writes an OCI layout by hand (no umoci) in `dir`: the `layers` (tar bytes, plain or
/// compressed, bottom first), the config `config_json`, a manifest naming them, and
/// `index.json` tagging it `tag`; damaged as `tamper` says.
pub fn write_raw_layout(
    dir: &Path,
    tag: &str,
    layers: &[Vec<u8>],
    config_json: &[u8],
    tamper: Tamper,
) -> RawLayout {
    std::fs::create_dir_all(dir.join("blobs/sha256")).expect("mkdir layout");
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("oci-layout");
    let mut descs = Vec::new();
    let mut named = Vec::new();
    for (i, bytes) in layers.iter().enumerate() {
        let mut digest = sha256_digest(bytes);
        let mut size = bytes.len() as u64;
        match tamper {
            Tamper::LayerDigest(t) if t == i => {
                let mut other = bytes.clone();
                other.push(b'x');
                digest = sha256_digest(&other);
                let path = blob_file(dir, &digest);
                std::fs::write(path, bytes).expect("write blob");
            }
            Tamper::TruncatedLayer(t) if t == i => {
                let path = blob_file(dir, &digest);
                std::fs::write(path, &bytes[..bytes.len() / 2]).expect("write blob");
            }
            Tamper::MissingLayer(t) if t == i => {}
            Tamper::LayerSize(t) if t == i => {
                put_blob(dir, bytes);
                size += 1;
            }
            _ => {
                put_blob(dir, bytes);
            }
        }
        descs.push(serde_json::json!({
            "mediaType": layer_media_type(bytes), "digest": digest, "size": size,
        }));
        named.push((digest, size));
    }
    let config_digest = put_blob(dir, config_json);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media::MANIFEST,
        "config": { "mediaType": media::CONFIG, "digest": config_digest, "size": config_json.len() },
        "layers": descs,
    });
    let manifest = serde_json::to_vec(&manifest).expect("json");
    let manifest_digest = put_blob(dir, &manifest);
    set_tag(
        dir,
        tag,
        serde_json::json!({
            "mediaType": media::MANIFEST, "digest": manifest_digest, "size": manifest.len(),
        }),
    );
    RawLayout {
        manifest_digest,
        manifest,
        config_digest,
        layers: named,
    }
}

/// A minimal linux/amd64 image config with the layers' uncompressed digests `diff_ids`.
pub fn minimal_config(diff_ids: &[String]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": { "Env": ["PATH=/usr/bin:/bin"] },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    }))
    .expect("json")
}
