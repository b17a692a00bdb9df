//! Images: read-only root filesystems that serve as the lower layers of sandboxes.
//!
//! Two kinds live side by side under `state_dir/images/<dir>/` (`<dir>` is the name itself
//! for a plain name, `ref-<blake3 of the name>` for a registry reference such as
//! `localhost:5000/swe/task:latest`), each with an `image.json` ([`ImageMeta`]):
//!
//! - **flat** images ([`import`]): one unpacked tree in `rootfs/`, imported from a directory
//!   or a tar archive;
//! - **OCI** images ([`oci`]): no tree of their own but a list of layers of the node's
//!   [`layers::LayerStore`] (stored once by digest, shared by every image that has them),
//!   mounted as a stack of overlay lower layers (`lowerdir=top:…:bottom`), and the image's
//!   run configuration (Env, WorkingDir, User, Cmd).
//!
//! An import is built under a temporary name and renamed into place, so a half-imported
//! image is never visible; an OCI image is published only once every layer it names is in
//! the layer store, under [`ImageStore::lock`], which also guards the removal of unused
//! layers (`image rm`).
//!
//! Sources of flat images are descriptors opened with the rights of whoever asked: a
//! directory is walked by the `tree` helper running as the caller's uid, gid and
//! supplementary groups (never following a symlink) and streamed as a tar through a pipe; a
//! regular file is read as a tar archive, plain, gzip or zstd (detected by magic bytes). Both
//! are unpacked by the overlay crate's hardened tree builder
//! ([`belayer_overlay::install_image`]): nothing is written outside the new rootfs, device
//! nodes are refused except under `/dev` (dropped: every sandbox mounts its own `/dev`),
//! whiteouts and overlay attributes are refused. OCI layers go through
//! [`belayer_overlay::install_oci_layer`] (OCI whiteouts become overlay whiteouts).

pub mod error;
pub mod import;
pub mod layers;
pub mod meta;
pub mod oci;
pub mod registry;
pub mod stream;

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use belayer_ipc::{ImageInfo, LayerInfo};

use crate::sys;

pub use error::ImageError;
pub use import::{Credentials, ImportSource};
pub use layers::LayerStore;
pub use meta::{ImageKind, ImageMeta};

/// The image store under `state_dir/images`, with the layer store under `state_dir/layers`.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
    layers: LayerStore,
    /// Held to publish an image, to remove one and its unused layers, and to pin the layers
    /// an import in flight relies on.
    lock: Arc<Mutex<Pins>>,
}

/// Layers an import in flight found in the store (or put there) and will reference once it
/// publishes: layer gc keeps them.
#[derive(Debug, Default)]
pub struct Pins {
    counts: std::collections::HashMap<String, u32>,
}

impl Pins {
    /// Pins `diff_id` once more.
    pub fn pin(&mut self, diff_id: &str) {
        *self.counts.entry(diff_id.to_string()).or_default() += 1;
    }

    /// Drops one pin of `diff_id`.
    pub fn unpin(&mut self, diff_id: &str) {
        if let Some(n) = self.counts.get_mut(diff_id) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(diff_id);
            }
        }
    }

    fn pinned(&self, diff_id: &str) -> bool {
        self.counts.contains_key(diff_id)
    }
}

/// Validates an image name ([`belayer_ipc::valid_image_name`]): a plain name or a registry
/// reference.
pub fn valid_name(name: &str) -> bool {
    belayer_ipc::valid_image_name(name)
}

/// Validates a rollout tag: `[A-Za-z0-9._-]{1,64}`, not starting with `.`
/// ([`belayer_ipc::names::valid_name`]).
pub fn valid_tag(tag: &str) -> bool {
    belayer_ipc::names::valid_name(tag, belayer_ipc::names::MAX_IMAGE_NAME, false)
}

/// The directory name of image `name` below the store: the name itself when it is a plain
/// file name, `ref-<32 hex of blake3(name)>` otherwise.
fn dir_name(name: &str) -> String {
    if belayer_ipc::names::valid_name(name, belayer_ipc::names::MAX_IMAGE_NAME, false) {
        name.to_string()
    } else {
        let hash = blake3::hash(name.as_bytes()).to_hex();
        format!("ref-{}", &hash[..32])
    }
}

impl ImageStore {
    /// Opens (creating) the store below `state_dir`; removes what interrupted imports left.
    pub fn open(state_dir: &Path) -> Result<ImageStore, ImageError> {
        let dir = state_dir.join("images");
        fs::create_dir_all(&dir).map_err(|source| ImageError::Store {
            path: dir.clone(),
            source,
        })?;
        let layers = LayerStore::open(state_dir)?;
        Ok(ImageStore {
            dir,
            layers,
            lock: Arc::new(Mutex::new(Pins::default())),
        })
    }

    /// The store's lock (publication, removal, layer pins). Never held across an unpack.
    pub fn lock(&self) -> MutexGuard<'_, Pins> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The layer store.
    pub fn layers(&self) -> &LayerStore {
        &self.layers
    }

    /// Directory of image `name` (which may not exist).
    pub(crate) fn image_dir(&self, name: &str) -> PathBuf {
        self.dir.join(dir_name(name))
    }

    /// Metadata of image `name`.
    ///
    /// Errors: [`ImageError::InvalidName`], [`ImageError::Unknown`] (also for unreadable
    /// metadata, or metadata of another name: such an image is not listed either).
    pub fn meta(&self, name: &str) -> Result<ImageMeta, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_string()));
        }
        fs::read(self.image_dir(name).join("image.json"))
            .ok()
            .and_then(|text| serde_json::from_slice::<ImageMeta>(&text).ok())
            .filter(|m| m.name == name)
            .ok_or_else(|| ImageError::Unknown(name.to_string()))
    }

    /// Whether an image of that name exists.
    pub fn exists(&self, name: &str) -> bool {
        self.image_dir(name).exists()
    }

    /// The lower layers of image `name`, top-most first (what an overlay mount takes): the
    /// rootfs of a flat image, the layer trees of an OCI image; with its metadata.
    ///
    /// Errors: those of [`Self::meta`], [`ImageError::Unknown`] for a flat image without its
    /// tree, [`ImageError::LayerMissing`].
    pub fn lowers(&self, name: &str) -> Result<(Vec<PathBuf>, ImageMeta), ImageError> {
        let meta = self.meta(name)?;
        let lowers = match meta.kind {
            ImageKind::Flat => {
                let rootfs = self.image_dir(name).join("rootfs");
                if !rootfs.is_dir() {
                    return Err(ImageError::Unknown(name.to_string()));
                }
                vec![rootfs]
            }
            ImageKind::Oci => meta
                .layers
                .iter()
                .rev()
                .map(|diff_id| {
                    self.layers
                        .tree(diff_id)
                        .ok_or_else(|| ImageError::LayerMissing {
                            image: name.to_string(),
                            diff_id: diff_id.clone(),
                        })
                })
                .collect::<Result<_, _>>()?,
        };
        Ok((lowers, meta))
    }

    /// Every image's metadata, sorted by name.
    pub fn all(&self) -> Result<Vec<ImageMeta>, ImageError> {
        let mut out = Vec::new();
        let entries = fs::read_dir(&self.dir).map_err(|source| ImageError::Store {
            path: self.dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let dir = entry.file_name().to_string_lossy().into_owned();
            if dir.starts_with('.') {
                continue;
            }
            if let Ok(text) = fs::read(entry.path().join("image.json")) {
                if let Ok(m) = serde_json::from_slice::<ImageMeta>(&text) {
                    if dir_name(&m.name) == dir {
                        out.push(m);
                    }
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Lists images, sorted by name, each OCI image with its layers (sizes, and how many
    /// images share each).
    pub fn list(&self) -> Result<Vec<ImageInfo>, ImageError> {
        let all = self.all()?;
        Ok(all.iter().map(|m| self.info_among(m, &all)).collect())
    }

    /// The client view of `meta`, its layers' sharing counted over every image.
    pub fn info(&self, meta: &ImageMeta) -> ImageInfo {
        let all = self.all().unwrap_or_default();
        self.info_among(meta, &all)
    }

    fn info_among(&self, meta: &ImageMeta, all: &[ImageMeta]) -> ImageInfo {
        let layers = meta
            .layers
            .iter()
            .map(|diff_id| {
                let stored = self.layers.meta(diff_id);
                LayerInfo {
                    diff_id: diff_id.clone(),
                    bytes: stored.as_ref().map_or(0, |l| l.bytes),
                    entries: stored.as_ref().map_or(0, |l| l.entries),
                    images: all
                        .iter()
                        .filter(|m| m.layers.iter().any(|d| d == diff_id))
                        .count()
                        .max(1) as u32,
                }
            })
            .collect();
        meta.info(layers)
    }

    /// Removes image `name` (the caller checks that no sandbox uses it and who may):
    /// [`Self::detach`], then [`Self::delete_detached`].
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let trash = self.detach(name)?;
        self.delete_detached(trash)
    }

    /// Takes image `name` out of the store by renaming it to a hidden trash dir (atomic: from
    /// then on the name is unknown and free); returns that dir.
    ///
    /// Errors: [`ImageError::InvalidName`], [`ImageError::Unknown`], [`ImageError::Store`].
    pub fn detach(&self, name: &str) -> Result<PathBuf, ImageError> {
        self.meta(name)?;
        let dir = self.image_dir(name);
        let trash = self
            .dir
            .join(format!(".rm-{}-{}", dir_name(name), sys::random_hex(4)));
        fs::rename(&dir, &trash).map_err(|source| ImageError::Store {
            path: dir.clone(),
            source,
        })?;
        Ok(trash)
    }

    /// Deletes a dir [`Self::detach`] returned, then every layer no image uses any more and
    /// no import in flight has pinned. Errors: [`ImageError::Store`].
    pub fn delete_detached(&self, trash: PathBuf) -> Result<(), ImageError> {
        belayer_overlay::remove_dir_all(&trash).map_err(|source| ImageError::Store {
            path: trash,
            source,
        })?;
        self.remove_unused_layers().map(|_| ())
    }

    /// Removes every stored layer that no image names and no import in flight has pinned;
    /// returns how many and their content bytes.
    ///
    /// Errors: [`ImageError::Store`].
    pub fn remove_unused_layers(&self) -> Result<(u64, u64), ImageError> {
        let pins = self.lock();
        let used: HashSet<String> = self
            .all()?
            .into_iter()
            .flat_map(|m| m.layers.into_iter())
            .collect();
        self.layers
            .remove_unused(|diff_id| used.contains(diff_id) || pins.pinned(diff_id))
    }

    /// The store directory (`state_dir/images`).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}
