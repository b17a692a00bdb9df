//! The node's layer store: every OCI layer unpacked once, by the digest of its uncompressed
//! tar (its `diff_id`), shared by every image that lists it.
//!
//! `state_dir/layers/sha256/<hex>/tree` is the unpacked layer (overlay whiteouts and opaque
//! directories in place, ready to be a lower layer), `layer.json` beside it its
//! [`LayerMeta`]. A layer is unpacked into `layers/.tmp-<random>/tree` ([`Staging`]), its
//! metadata written, the file system synced, and the directory renamed into place: a layer
//! dir without `layer.json` never exists, and leftovers of an interrupted unpack are hidden
//! names removed at the next start. Two imports unpacking the same layer at once both finish;
//! the second rename finds the first one's layer and drops its own copy.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::stream::valid_sha256;
use super::ImageError;
use crate::sys;

/// What `layer.json` records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// `sha256:<hex>` of the uncompressed tar.
    pub diff_id: String,
    /// Digest of the blob it was unpacked from, when a manifest named one (compressed).
    pub blob_digest: Option<String>,
    /// Bytes of regular-file content.
    pub bytes: u64,
    /// Members of the tar.
    pub entries: u64,
    /// OCI whiteouts turned into overlay whiteouts.
    pub whiteouts: u64,
    /// Opaque directories.
    pub opaque_dirs: u64,
    /// Unpack time, ms since the Unix epoch.
    pub created_unix_ms: u64,
}

/// The layer store under `state_dir/layers`.
#[derive(Debug, Clone)]
pub struct LayerStore {
    dir: PathBuf,
}

/// A layer being unpacked: `tree()` is an empty directory to unpack into. Dropping it
/// removes it unless it was published.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    done: bool,
}

impl Staging {
    /// The directory to unpack into.
    pub fn tree(&self) -> PathBuf {
        self.dir.join("tree")
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            let _ = belayer_overlay::remove_dir_all(&self.dir);
        }
    }
}

fn store_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Store {
        path: path.to_path_buf(),
        source,
    }
}

impl LayerStore {
    /// Opens (creating) the store below `state_dir` and removes leftovers of interrupted
    /// unpacks and removals.
    ///
    /// Errors: [`ImageError::Store`].
    pub fn open(state_dir: &Path) -> Result<LayerStore, ImageError> {
        let dir = state_dir.join("layers");
        let by_digest = dir.join("sha256");
        fs::create_dir_all(&by_digest).map_err(store_err(&by_digest))?;
        let store = LayerStore { dir };
        if let Ok(entries) = fs::read_dir(&store.dir) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with('.') {
                    let _ = belayer_overlay::remove_dir_all(entry.path());
                }
            }
        }
        Ok(store)
    }

    fn layer_dir(&self, diff_id: &str) -> Option<PathBuf> {
        valid_sha256(diff_id).then(|| self.dir.join("sha256").join(&diff_id[7..]))
    }

    /// The unpacked tree of layer `diff_id`, when it is stored.
    pub fn tree(&self, diff_id: &str) -> Option<PathBuf> {
        self.meta(diff_id)?;
        let tree = self.layer_dir(diff_id)?.join("tree");
        tree.is_dir().then_some(tree)
    }

    /// The metadata of layer `diff_id`, when it is stored.
    pub fn meta(&self, diff_id: &str) -> Option<LayerMeta> {
        let text = fs::read(self.layer_dir(diff_id)?.join("layer.json")).ok()?;
        serde_json::from_slice::<LayerMeta>(&text)
            .ok()
            .filter(|m| m.diff_id == diff_id)
    }

    /// Every stored layer.
    pub fn all(&self) -> Vec<LayerMeta> {
        let Ok(entries) = fs::read_dir(self.dir.join("sha256")) else {
            return Vec::new();
        };
        let mut out: Vec<LayerMeta> = entries
            .flatten()
            .filter_map(|e| self.meta(&format!("sha256:{}", e.file_name().to_string_lossy())))
            .collect();
        out.sort_by(|a, b| a.diff_id.cmp(&b.diff_id));
        out
    }

    /// Content bytes of every stored layer together.
    pub fn total_bytes(&self) -> u64 {
        self.all().iter().map(|l| l.bytes).sum()
    }

    /// A fresh staging directory to unpack a layer into.
    ///
    /// Errors: [`ImageError::Store`].
    pub fn stage(&self) -> Result<Staging, ImageError> {
        let dir = self.dir.join(format!(".tmp-{}", sys::random_hex(8)));
        let tree = dir.join("tree");
        fs::create_dir_all(&tree).map_err(store_err(&tree))?;
        Ok(Staging { dir, done: false })
    }

    /// Publishes `staging` as layer `meta.diff_id`: writes `layer.json`, syncs the file
    /// system, renames the directory into place. Returns `false` when the layer was already
    /// there (another import stored it meanwhile): the staged copy is dropped.
    ///
    /// Errors: [`ImageError::Store`] (also for a `diff_id` that is not `sha256:<64 hex>`).
    pub fn publish(&self, mut staging: Staging, meta: &LayerMeta) -> Result<bool, ImageError> {
        let Some(dest) = self.layer_dir(&meta.diff_id) else {
            return Err(ImageError::Store {
                path: self.dir.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("layer digest {:?} is not sha256:<64 hex>", meta.diff_id),
                ),
            });
        };
        let json = serde_json::to_vec_pretty(meta).unwrap_or_default();
        let file = staging.dir.join("layer.json");
        fs::write(&file, json).map_err(store_err(&file))?;
        let dir = fs::File::open(&staging.dir).map_err(store_err(&staging.dir))?;
        rustix::fs::syncfs(&dir).map_err(|e| ImageError::Store {
            path: staging.dir.clone(),
            source: e.into(),
        })?;
        if self.meta(&meta.diff_id).is_some() {
            return Ok(false);
        }
        match fs::rename(&staging.dir, &dest) {
            Ok(()) => {
                staging.done = true;
                Ok(true)
            }
            Err(e) if self.meta(&meta.diff_id).is_some() => {
                tracing::debug!(layer = %meta.diff_id, error = %e, "layer stored meanwhile");
                Ok(false)
            }
            // A directory without valid metadata (damaged by hand): replace it.
            Err(_) if dest.exists() => {
                let trash = self.dir.join(format!(".rm-{}", sys::random_hex(8)));
                fs::rename(&dest, &trash).map_err(store_err(&dest))?;
                let _ = belayer_overlay::remove_dir_all(&trash);
                fs::rename(&staging.dir, &dest).map_err(store_err(&dest))?;
                staging.done = true;
                Ok(true)
            }
            Err(e) => Err(ImageError::Store {
                path: dest,
                source: e,
            }),
        }
    }

    /// Removes every stored layer for which `keep` is false (each renamed to a hidden name
    /// first, so it vanishes at once); returns how many and their content bytes.
    ///
    /// Errors: [`ImageError::Store`].
    pub fn remove_unused(&self, keep: impl Fn(&str) -> bool) -> Result<(u64, u64), ImageError> {
        let by_digest = self.dir.join("sha256");
        let entries = fs::read_dir(&by_digest).map_err(store_err(&by_digest))?;
        let (mut count, mut bytes) = (0u64, 0u64);
        for entry in entries.flatten() {
            let diff_id = format!("sha256:{}", entry.file_name().to_string_lossy());
            if keep(&diff_id) {
                continue;
            }
            let size = self.meta(&diff_id).map_or(0, |m| m.bytes);
            let trash = self.dir.join(format!(".rm-{}", sys::random_hex(8)));
            fs::rename(entry.path(), &trash).map_err(store_err(&entry.path()))?;
            belayer_overlay::remove_dir_all(&trash).map_err(store_err(&trash))?;
            tracing::info!(layer = %diff_id, bytes = size, "removed an unused layer");
            count += 1;
            bytes += size;
        }
        Ok((count, bytes))
    }
}
