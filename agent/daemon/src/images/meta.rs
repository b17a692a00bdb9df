//! What `image.json` records about an image ([`ImageMeta`]) and its client view.

use belayer_ipc::{ImageConfig, ImageInfo, LayerInfo};
use serde::{Deserialize, Serialize};

/// How an image's tree is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageKind {
    /// One unpacked tree, `rootfs/` beside `image.json`.
    #[default]
    Flat,
    /// A stack of layers of the layer store ([`ImageMeta::layers`]).
    Oci,
}

impl ImageKind {
    /// `flat` or `oci`.
    pub fn as_str(self) -> &'static str {
        match self {
            ImageKind::Flat => "flat",
            ImageKind::Oci => "oci",
        }
    }
}

/// What `image.json` records about an image. Fields added later have serde defaults, so
/// older metadata still loads (an image without an owner belongs to root, one without a kind
/// is flat, one without a digest is never compared at restore).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageMeta {
    /// Image name.
    pub name: String,
    /// Bytes of regular-file content (all layers together for an OCI image).
    pub bytes: u64,
    /// Import time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// The source as the importer named it (a label or a registry reference, never opened
    /// again).
    pub source: String,
    /// Uid of the peer that imported it.
    #[serde(default)]
    pub owner_uid: u32,
    /// Device nodes under `/dev` left out.
    #[serde(default)]
    pub dropped_devices: u64,
    /// Unix sockets of a source directory left out.
    #[serde(default)]
    pub skipped_sockets: u64,
    /// Flat or OCI.
    #[serde(default)]
    pub kind: ImageKind,
    /// Content digest ([`ImageInfo::digest`]).
    #[serde(default)]
    pub digest: Option<String>,
    /// Layers of an OCI image by uncompressed digest, bottom-most first.
    #[serde(default)]
    pub layers: Vec<String>,
    /// Run configuration of an OCI image.
    #[serde(default)]
    pub config: Option<ImageConfig>,
}

impl ImageMeta {
    /// Whether a sandbox owned by `uid` may run on this image: root's images are shared, an
    /// image a peer imported serves only that peer (its name was the importer's to choose, so
    /// it must not stand in for an image someone else expects).
    pub fn serves(&self, uid: u32) -> bool {
        self.owner_uid == 0 || self.owner_uid == uid
    }

    /// The client view, with the layers described by the layer store.
    pub fn info(&self, layers: Vec<LayerInfo>) -> ImageInfo {
        ImageInfo {
            name: self.name.clone(),
            bytes: self.bytes,
            created_unix_ms: self.created_unix_ms,
            owner_uid: self.owner_uid,
            dropped_devices: self.dropped_devices,
            skipped_sockets: self.skipped_sockets,
            digest: self.digest.clone(),
            source: self.source.clone(),
            kind: self.kind.as_str().to_string(),
            layers,
            config: self.config.clone(),
        }
    }
}
