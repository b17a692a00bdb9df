//! Images: read-only root filesystems that serve as the lower layer of sandboxes.
//!
//! `state_dir/images/<name>/rootfs` holds the tree, `image.json` its metadata. An import is
//! built under a temporary name and renamed into place, so a half-imported image is never
//! visible. Sources: a rootfs directory (copied with `cp -a`, which keeps owners, modes, xattrs,
//! hardlinks and device nodes) or a tar archive, plain, gzip or zstd (detected by magic bytes),
//! unpacked with the `tar` crate (which refuses entries escaping the destination).

use std::fs;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use belayer_ipc::ImageInfo;
use serde::{Deserialize, Serialize};

use crate::sys;

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
    /// The source path does not exist or is neither a directory nor a file.
    #[error("cannot read image source {path}")]
    Source {
        /// Source path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Copying a directory failed.
    #[error("copying {path} failed: {stderr}")]
    Copy {
        /// Source path.
        path: PathBuf,
        /// Output of `cp`.
        stderr: String,
    },
    /// Unpacking a tar archive failed.
    #[error("unpacking {path} failed")]
    Unpack {
        /// Archive path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
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

#[derive(Debug, Serialize, Deserialize)]
struct ImageMeta {
    name: String,
    bytes: u64,
    created_unix_ms: u64,
    source: String,
}

/// The image store under `state_dir/images`.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
}

/// Validates an image or tag name: `[A-Za-z0-9._-]{1,64}`, not starting with `.`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
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

    /// Imports `source` (directory or tar/tar.gz/tar.zst) as image `name`.
    pub fn import(&self, name: &str, source: &Path) -> Result<ImageInfo, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_string()));
        }
        let final_dir = self.dir.join(name);
        if final_dir.exists() {
            return Err(ImageError::AlreadyExists(name.to_string()));
        }
        let meta = fs::metadata(source).map_err(|e| ImageError::Source {
            path: source.to_path_buf(),
            source: e,
        })?;
        let tmp = self
            .dir
            .join(format!(".import-{name}-{}", sys::random_hex(4)));
        let rootfs = tmp.join("rootfs");
        let store_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ImageError::Store { path, source }
        };
        fs::create_dir_all(&tmp).map_err(store_err(&tmp))?;
        let result = (|| {
            if meta.is_dir() {
                copy_dir(source, &rootfs)?;
            } else {
                fs::create_dir(&rootfs).map_err(store_err(&rootfs))?;
                unpack(source, &rootfs)?;
            }
            if fs::symlink_metadata(rootfs.join("bin/sh")).is_err() {
                return Err(ImageError::NoShell(source.to_path_buf()));
            }
            let bytes = tree_bytes(&rootfs);
            let info = ImageMeta {
                name: name.to_string(),
                bytes,
                created_unix_ms: sys::now_unix_ms(),
                source: source.display().to_string(),
            };
            let json = serde_json::to_vec_pretty(&info).unwrap_or_default();
            fs::write(tmp.join("image.json"), json).map_err(store_err(&tmp))?;
            fs::rename(&tmp, &final_dir).map_err(store_err(&final_dir))?;
            Ok(ImageInfo {
                name: info.name,
                bytes,
                created_unix_ms: info.created_unix_ms,
            })
        })();
        if result.is_err() {
            let _ = belayer_overlay::remove_dir_all(&tmp);
        }
        result
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
                    out.push(ImageInfo {
                        name: m.name,
                        bytes: m.bytes,
                        created_unix_ms: m.created_unix_ms,
                    });
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes image `name` (the caller checks that no sandbox uses it).
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        self.rootfs(name)?;
        let dir = self.dir.join(name);
        let trash = self.dir.join(format!(".rm-{name}-{}", sys::random_hex(4)));
        fs::rename(&dir, &trash).map_err(|source| ImageError::Store {
            path: dir.clone(),
            source,
        })?;
        belayer_overlay::remove_dir_all(&trash).map_err(|source| ImageError::Store {
            path: trash,
            source,
        })
    }
}

fn copy_dir(source: &Path, dest: &Path) -> Result<(), ImageError> {
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg("--no-target-directory")
        .arg(source)
        .arg(dest)
        .output()
        .map_err(|e| ImageError::Source {
            path: source.to_path_buf(),
            source: e,
        })?;
    if !out.status.success() {
        return Err(ImageError::Copy {
            path: source.to_path_buf(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn unpack(archive: &Path, dest: &Path) -> Result<(), ImageError> {
    let err = |source| ImageError::Unpack {
        path: archive.to_path_buf(),
        source,
    };
    let mut file = BufReader::new(fs::File::open(archive).map_err(err)?);
    let mut magic = [0u8; 4];
    let n = file.get_mut().read(&mut magic).map_err(err)?;
    let file = {
        let mut f = file.into_inner();
        std::io::Seek::rewind(&mut f).map_err(err)?;
        BufReader::with_capacity(1 << 20, f)
    };
    let reader: Box<dyn Read> = if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(file))
    } else if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        Box::new(zstd::stream::read::Decoder::with_buffer(file).map_err(err)?)
    } else {
        Box::new(file)
    };
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(true);
    ar.set_overwrite(true);
    ar.unpack(dest).map_err(err)
}

/// Sum of the apparent sizes of regular files below `root` (no symlinks followed; the walk
/// is the overlay crate's bounded one); 0, with a warning, when it cannot be measured.
pub(crate) fn tree_bytes(root: &Path) -> u64 {
    belayer_overlay::tree_bytes(root, belayer_overlay::DIGEST_MAX_NAMES).unwrap_or_else(|e| {
        tracing::warn!(path = %root.display(), error = %e, "cannot measure the image size");
        0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("busybox"));
        assert!(valid_name("bookworm-python_3.11"));
        assert!(!valid_name(""));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"x".repeat(65)));
    }

    #[test]
    fn import_dir_and_tar_variants() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        fs::create_dir_all(src.join("bin")).unwrap();
        std::os::unix::fs::symlink("busybox", src.join("bin/sh")).unwrap();
        fs::write(src.join("bin/busybox"), b"x").unwrap();
        let store = ImageStore::open(&tmp.path().join("state")).unwrap();
        store.import("dir", &src).unwrap();
        assert!(matches!(
            store.import("dir", &src),
            Err(ImageError::AlreadyExists(_))
        ));
        // tar, gzip, zstd
        let tar_path = tmp.path().join("img.tar");
        {
            let mut b = tar::Builder::new(fs::File::create(&tar_path).unwrap());
            b.append_dir_all(".", &src).unwrap();
            b.finish().unwrap();
        }
        let raw = fs::read(&tar_path).unwrap();
        let gz = tmp.path().join("img.tar.gz");
        {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(
                fs::File::create(&gz).unwrap(),
                flate2::Compression::fast(),
            );
            e.write_all(&raw).unwrap();
            e.finish().unwrap();
        }
        let zst = tmp.path().join("img.tar.zst");
        fs::write(&zst, zstd::encode_all(&raw[..], 1).unwrap()).unwrap();
        for (name, p) in [("t", &tar_path), ("g", &gz), ("z", &zst)] {
            store.import(name, p).unwrap();
            assert!(store.rootfs(name).unwrap().join("bin/busybox").is_file());
        }
        assert_eq!(store.list().unwrap().len(), 4);
        store.remove("t").unwrap();
        assert!(matches!(store.rootfs("t"), Err(ImageError::Unknown(_))));
        // no shell → rejected, nothing left behind
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        assert!(matches!(
            store.import("e", &empty),
            Err(ImageError::NoShell(_))
        ));
        assert_eq!(store.list().unwrap().len(), 3);
    }
}
