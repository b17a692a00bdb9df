//! Images: read-only root filesystems that serve as the lower layer of sandboxes.
//!
//! `state_dir/images/<name>/rootfs` holds the tree, `image.json` its metadata ([`ImageMeta`]:
//! size, source label, the uid that imported it, what was left out). An import is built under
//! a temporary name and renamed into place, so a half-imported image is never visible.
//!
//! Sources ([`import`]) are descriptors opened with the rights of whoever asked: a directory
//! is walked by the `tree` helper running as the caller's uid, gid and supplementary groups
//! (never following a symlink) and streamed as a tar through a pipe; a regular file is read
//! as a tar archive, plain, gzip or zstd (detected by magic bytes). Both are unpacked by the
//! overlay crate's hardened tree builder ([`belayer_overlay::install_image`]): nothing is
//! written outside the new rootfs, device nodes are refused except under `/dev` (dropped:
//! every sandbox mounts its own `/dev`), whiteouts and overlay attributes are refused.

pub mod import;

use std::fs;
use std::path::{Path, PathBuf};

use belayer_ipc::ImageInfo;
use belayer_overlay::InstallError;
use serde::{Deserialize, Serialize};

use crate::sys;

pub use import::{Credentials, ImportSource};

/// Image errors.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The name is not `[A-Za-z0-9._-]{1,64}` or starts with a dot.
    #[error("invalid image name {0:?}")]
    InvalidName(String),
    /// An image of that name exists.
    #[error("image {0} already exists")]
    AlreadyExists(String),
    /// No image of that name.
    #[error("unknown image {0}")]
    Unknown(String),
    /// The source cannot be opened or examined, or is neither a directory nor a regular
    /// file.
    #[error("cannot read image source {path}")]
    Source {
        /// Source path or label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The `tree` helper could not be started or waited for.
    #[error("running the tree helper for {path} failed")]
    Helper {
        /// Source label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Walking the source directory with the caller's credentials failed (typically an
    /// entry the caller may not read); nothing was imported.
    #[error("reading image source {path} as uid {uid} failed: {message}")]
    ReadTree {
        /// Source label.
        path: PathBuf,
        /// The uid the tree was read as.
        uid: u32,
        /// Whether the cause is an entry that uid may not read (`EACCES`/`EPERM`).
        denied: bool,
        /// The helper's report (the failed call and the entry).
        message: String,
    },
    /// Setting up decompression of an archive failed.
    #[error("decompressing {path} failed")]
    Decompress {
        /// Archive label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The tar stream was refused or could not be unpacked (a device node outside `/dev`, a
    /// whiteout, a hostile name, a truncated stream, ...): the cause names the entry.
    #[error("unpacking {path} failed")]
    Unpack {
        /// Source label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: InstallError,
    },
    /// The unpacked tree has no `/bin/sh`, which every sandbox init needs.
    #[error("image source {0} has no /bin/sh")]
    NoShell(PathBuf),
    /// Writing the image store failed.
    #[error("image store operation on {path} failed")]
    Store {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// What `image.json` records about an image. Fields added later have serde defaults, so
/// older metadata still loads (an image without an owner belongs to root).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageMeta {
    /// Image name.
    pub name: String,
    /// Bytes of regular-file content.
    pub bytes: u64,
    /// Import time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// The source as the importer named it (a label, never opened again).
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
}

impl ImageMeta {
    /// Whether a sandbox owned by `uid` may run on this image: root's images are shared, an
    /// image a peer imported serves only that peer (its name was the importer's to choose, so
    /// it must not stand in for an image someone else expects).
    pub fn serves(&self, uid: u32) -> bool {
        self.owner_uid == 0 || self.owner_uid == uid
    }

    /// The client view.
    pub fn info(&self) -> ImageInfo {
        ImageInfo {
            name: self.name.clone(),
            bytes: self.bytes,
            created_unix_ms: self.created_unix_ms,
            owner_uid: self.owner_uid,
            dropped_devices: self.dropped_devices,
            skipped_sockets: self.skipped_sockets,
        }
    }
}

/// The image store under `state_dir/images`.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
}

/// Validates an image or tag name: `[A-Za-z0-9._-]{1,64}`, not starting with `.`
/// ([`belayer_ipc::names::valid_name`]).
pub fn valid_name(name: &str) -> bool {
    belayer_ipc::names::valid_name(name, belayer_ipc::names::MAX_IMAGE_NAME, false)
}

impl ImageStore {
    /// Opens (creating) the store below `state_dir`.
    pub fn open(state_dir: &Path) -> Result<ImageStore, ImageError> {
        let dir = state_dir.join("images");
        fs::create_dir_all(&dir).map_err(|source| ImageError::Store {
            path: dir.clone(),
            source,
        })?;
        Ok(ImageStore { dir })
    }

    /// Root filesystem of image `name`, checked to exist.
    pub fn rootfs(&self, name: &str) -> Result<PathBuf, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_string()));
        }
        let p = self.dir.join(name).join("rootfs");
        if p.is_dir() {
            Ok(p)
        } else {
            Err(ImageError::Unknown(name.to_string()))
        }
    }

    /// Metadata of image `name`.
    ///
    /// Errors: [`ImageError::InvalidName`], [`ImageError::Unknown`] (also for unreadable
    /// metadata: such an image is not listed either).
    pub fn meta(&self, name: &str) -> Result<ImageMeta, ImageError> {
        self.rootfs(name)?;
        fs::read(self.dir.join(name).join("image.json"))
            .ok()
            .and_then(|text| serde_json::from_slice::<ImageMeta>(&text).ok())
            .ok_or_else(|| ImageError::Unknown(name.to_string()))
    }

    /// Lists images, sorted by name.
    pub fn list(&self) -> Result<Vec<ImageInfo>, ImageError> {
        let mut out = Vec::new();
        let entries = fs::read_dir(&self.dir).map_err(|source| ImageError::Store {
            path: self.dir.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            if let Ok(text) = fs::read(entry.path().join("image.json")) {
                if let Ok(m) = serde_json::from_slice::<ImageMeta>(&text) {
                    out.push(m.info());
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
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
        self.rootfs(name)?;
        let dir = self.dir.join(name);
        let trash = self.dir.join(format!(".rm-{name}-{}", sys::random_hex(4)));
        fs::rename(&dir, &trash).map_err(|source| ImageError::Store {
            path: dir.clone(),
            source,
        })?;
        Ok(trash)
    }

    /// Deletes a dir [`Self::detach`] returned. Errors: [`ImageError::Store`].
    pub fn delete_detached(&self, trash: PathBuf) -> Result<(), ImageError> {
        belayer_overlay::remove_dir_all(&trash).map_err(|source| ImageError::Store {
            path: trash,
            source,
        })
    }

    /// The store directory (`state_dir/images`).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}
