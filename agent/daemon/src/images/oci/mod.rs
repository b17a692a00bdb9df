//! OCI images: a manifest (or a docker archive's list), a config and layer blobs, from a
//! registry ([`pull`]) or from descriptors a client opened ([`blobs::FdBlobs`]), imported into
//! the layer store and published as one image ([`ImageStore::import_oci`]).
//!
//! Every part is untrusted. The manifest's config digest must be the config's, each blob
//! must hash to the manifest's digest and size, and each decompressed layer to the config's
//! `diff_id`; the digests are computed while the bytes stream into the hardened unpacker
//! ([`belayer_overlay::install_oci_layer`]), which writes only below a staging directory
//! that is dropped unless everything matched. A layer already in the store (same `diff_id`)
//! is not fetched again. The image is published (under the store's lock, after pinning its
//! layers against a concurrent `image rm`) only once all its layers are stored and its stack
//! has a `/bin/sh`.

pub mod blobs;
pub mod inspect;
pub mod parts;
pub mod pull;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use belayer_ipc::ImageInfo;
use belayer_overlay::{install_oci_layer, LayerOptions};

use super::layers::LayerMeta;
use super::stream::{decompress, drain, sha256_digest, Hashing};
use super::{valid_name, ImageError, ImageKind, ImageMeta, ImageStore};
use crate::sys;

pub use parts::{ImageParts, LayerBlob};

/// Most bytes accepted after a layer's end-of-archive marker (tar writers pad to a 10 KiB
/// record; anything far beyond is refused).
const MAX_TRAILING_BYTES: u64 = 1 << 20;

/// Where the blobs of an import come from.
pub trait BlobSource {
    /// Opens layer `index` (0 = bottom-most) as a byte stream; `blob` is its manifest entry
    /// (none for a docker archive).
    fn open_layer(
        &mut self,
        index: usize,
        blob: Option<&LayerBlob>,
    ) -> std::io::Result<Box<dyn Read + Send + '_>>;

    /// How often a layer whose stream failed is fetched again from its start (a network
    /// source: 3; a file: 0).
    fn retries(&self) -> u32 {
        0
    }
}

/// The parts of an OCI import besides its blobs.
#[derive(Debug, Clone)]
pub struct OciImport<'a> {
    /// Image name.
    pub name: &'a str,
    /// Source label or reference (recorded).
    pub source: &'a str,
    /// Uid of the peer importing it (its owner).
    pub owner_uid: u32,
    /// The manifest's bytes, when there is one.
    pub manifest: Option<&'a [u8]>,
    /// The config's bytes.
    pub config: &'a [u8],
}

/// Unpins a set of layers when dropped.
struct Pinned<'a> {
    store: &'a ImageStore,
    diff_ids: Vec<String>,
}

impl Drop for Pinned<'_> {
    fn drop(&mut self) {
        let mut pins = self.store.lock();
        for d in &self.diff_ids {
            pins.unpin(d);
        }
    }
}

impl ImageStore {
    /// Imports an OCI image: checks its manifest and config, stores each layer it lacks
    /// (fetched from `blobs`, verified, unpacked hardened), inspects the stack and publishes
    /// the image under `import.name`.
    ///
    /// Errors: [`ImageError::InvalidName`], [`ImageError::AlreadyExists`],
    /// [`ImageError::BadOci`], [`ImageError::DigestMismatch`], [`ImageError::BlobRead`],
    /// [`ImageError::LayerRefused`], [`ImageError::NoShell`], [`ImageError::Inspect`],
    /// [`ImageError::Store`]. Nothing of a failed import stays visible (layers it stored
    /// completely stay in the store, unreferenced, until the next `image rm` collects them).
    pub fn import_oci(
        &self,
        import: &OciImport<'_>,
        blobs: &mut dyn BlobSource,
    ) -> Result<ImageInfo, ImageError> {
        let name = import.name;
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_string()));
        }
        if self.exists(name) {
            return Err(ImageError::AlreadyExists(name.to_string()));
        }
        let parts = parts::parse(name, import.manifest, import.config)?;
        // Pinned from here: an `image rm` meanwhile keeps these layers.
        let _pinned = {
            let mut pins = self.lock();
            for d in &parts.diff_ids {
                pins.pin(d);
            }
            Pinned {
                store: self,
                diff_ids: parts.diff_ids.clone(),
            }
        };
        let mut bytes = 0u64;
        let mut fetched = 0usize;
        for (index, diff_id) in parts.diff_ids.iter().enumerate() {
            if let Some(stored) = self.layers().meta(diff_id) {
                bytes += stored.bytes;
                continue;
            }
            let meta = self.fetch_layer(name, index, diff_id, parts.blobs.get(index), blobs)?;
            bytes += meta.bytes;
            fetched += 1;
        }
        let lowers: Vec<PathBuf> = parts
            .diff_ids
            .iter()
            .rev()
            .map(|d| {
                self.layers()
                    .tree(d)
                    .ok_or_else(|| ImageError::LayerMissing {
                        image: name.to_string(),
                        diff_id: d.clone(),
                    })
            })
            .collect::<Result<_, _>>()?;
        let found = inspect::inspect(name, self.dir(), &lowers, parts.config.user.as_deref())?;
        if !found.has_shell {
            return Err(ImageError::NoShell(PathBuf::from(import.source)));
        }
        let mut config = parts.config.clone();
        config.user_ids = found.user_ids;
        let digest = match import.manifest {
            Some(m) => sha256_digest(m),
            None => sha256_digest(import.config),
        };
        let meta = ImageMeta {
            name: name.to_string(),
            bytes,
            created_unix_ms: sys::now_unix_ms(),
            source: clean_label(import.source),
            owner_uid: import.owner_uid,
            dropped_devices: 0,
            skipped_sockets: 0,
            kind: ImageKind::Oci,
            digest: Some(digest),
            layers: parts.diff_ids.clone(),
            config: Some(config),
        };
        self.publish_meta(&meta)?;
        tracing::info!(image = %name, source = %meta.source, layers = meta.layers.len(), fetched,
                       bytes, digest = ?meta.digest, "OCI image imported");
        Ok(self.info(&meta))
    }

    /// Writes `meta` as a new image directory (under a temporary name, renamed into place
    /// under the store's lock). Errors: [`ImageError::AlreadyExists`], [`ImageError::Store`].
    fn publish_meta(&self, meta: &ImageMeta) -> Result<(), ImageError> {
        let tmp = self.dir().join(format!(".import-{}", sys::random_hex(8)));
        let store_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ImageError::Store { path, source }
        };
        fs::create_dir(&tmp).map_err(store_err(&tmp))?;
        let json = serde_json::to_vec_pretty(meta).unwrap_or_default();
        let result = fs::write(tmp.join("image.json"), json)
            .map_err(store_err(&tmp))
            .and_then(|()| {
                let _pins = self.lock();
                let dest = self.image_dir(&meta.name);
                if dest.exists() {
                    return Err(ImageError::AlreadyExists(meta.name.clone()));
                }
                fs::rename(&tmp, &dest).map_err(store_err(&dest))
            });
        if result.is_err() {
            let _ = belayer_overlay::remove_dir_all(&tmp);
        }
        result
    }

    /// Fetches, verifies and stores layer `index` of image `image`, retrying a stream that
    /// failed as often as the source allows.
    fn fetch_layer(
        &self,
        image: &str,
        index: usize,
        diff_id: &str,
        blob: Option<&LayerBlob>,
        blobs: &mut dyn BlobSource,
    ) -> Result<LayerMeta, ImageError> {
        let mut attempt = 0;
        loop {
            match self.fetch_layer_once(image, index, diff_id, blob, blobs) {
                Err(e @ ImageError::BlobRead { .. }) if attempt < blobs.retries() => {
                    attempt += 1;
                    tracing::warn!(image, layer = index, attempt, error = %sys::error_chain(&e),
                                   "layer stream failed; fetching it again");
                    std::thread::sleep(std::time::Duration::from_millis(200 << attempt.min(5)));
                }
                other => return other,
            }
        }
    }

    fn fetch_layer_once(
        &self,
        image: &str,
        index: usize,
        diff_id: &str,
        blob: Option<&LayerBlob>,
        blobs: &mut dyn BlobSource,
    ) -> Result<LayerMeta, ImageError> {
        let what = format!("layer {index}");
        let shown = blob.map_or(diff_id, |b| b.digest.as_str()).to_string();
        let read_err = |source: std::io::Error| ImageError::BlobRead {
            image: image.to_string(),
            what: what.clone(),
            digest: shown.clone(),
            source,
        };
        let blob_mismatch = |b: &LayerBlob, got: String, bytes: u64| ImageError::DigestMismatch {
            image: image.to_string(),
            what: what.clone(),
            expected: format!("{} ({} bytes)", b.digest, b.size),
            got,
            bytes,
        };
        let staging = self.layers().stage()?;
        let raw = blobs.open_layer(index, blob).map_err(read_err)?;
        let mut outer = Hashing::new(raw);
        let label = PathBuf::from(format!("{image} {what}"));
        let unpacked = {
            let (decoded, _) = decompress(&mut outer).map_err(read_err)?;
            let mut inner = Hashing::new(decoded);
            let opts = LayerOptions::default();
            match install_oci_layer(&mut inner, &label, &staging.tree(), &opts) {
                // What follows the end-of-archive marker (padding) is part of the digest;
                // more than a little of it is no tar a builder writes (a decompression bomb
                // would otherwise keep this thread busy).
                Ok(stats) => match drain(&mut (&mut inner).take(MAX_TRAILING_BYTES + 1)) {
                    Ok(n) if n > MAX_TRAILING_BYTES => Err(Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "more than {MAX_TRAILING_BYTES} bytes after the end of the archive"
                        ),
                    ))),
                    Ok(_) => Ok((stats, inner.digest(), inner.count())),
                    Err(e) => Err(Err(e)),
                },
                Err(e) => Err(Ok(e)),
            }
        };
        let (stats, got, inner_bytes) = match unpacked {
            Ok(done) => done,
            // The stream failed under the unpacker (a cut connection): worth another try.
            Err(_) if outer.failure().is_some() => {
                let cause = outer.failure().unwrap_or_default().to_string();
                return Err(read_err(std::io::Error::other(cause)));
            }
            Err(Err(io)) => return Err(read_err(io)),
            Err(Ok(source)) => {
                // A blob that is not the one the manifest names (cut, tampered) is reported
                // as such: read the rest of it, no further than its declared size.
                if let Some(b) = blob {
                    let left = b.size.saturating_sub(outer.count()) + 1;
                    let _ = std::io::copy(&mut (&mut outer).take(left), &mut std::io::sink());
                    if outer.digest() != b.digest || outer.count() != b.size {
                        return Err(blob_mismatch(b, outer.digest(), outer.count()));
                    }
                }
                return Err(ImageError::LayerRefused {
                    image: image.to_string(),
                    index,
                    digest: shown.clone(),
                    source: Box::new(source),
                });
            }
        };
        if got != diff_id {
            return Err(ImageError::DigestMismatch {
                image: image.to_string(),
                what: format!("uncompressed layer {index}"),
                expected: diff_id.to_string(),
                got,
                bytes: inner_bytes,
            });
        }
        // The rest of the blob (a compressed stream's trailer), no further than its size.
        let cap = blob.map_or(MAX_TRAILING_BYTES, |b| b.size.saturating_sub(outer.count())) + 1;
        drain(&mut (&mut outer).take(cap)).map_err(read_err)?;
        if let Some(b) = blob {
            let got = outer.digest();
            if got != b.digest || outer.count() != b.size {
                return Err(blob_mismatch(b, got, outer.count()));
            }
        }
        let meta = LayerMeta {
            diff_id: diff_id.to_string(),
            blob_digest: blob.map(|b| b.digest.clone()),
            bytes: stats.content_bytes,
            entries: stats.entries,
            whiteouts: stats.whiteouts,
            opaque_dirs: stats.opaque_dirs,
            created_unix_ms: sys::now_unix_ms(),
        };
        self.layers().publish(staging, &meta)?;
        Ok(meta)
    }
}

/// The client's label without control characters, at most 4096 bytes.
pub(crate) fn clean_label(label: &str) -> String {
    let mut out: String = label
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if out.len() > 4096 {
        let mut end = 4096;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}
