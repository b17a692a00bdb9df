//! What the sandbox instance code calls: make an instance directory (`inst-<n>`, holding the
//! overlay's `upper`, `work` and `merged`) as a volume with the sandbox's limit, and remove one
//! again, whichever kind it is.

use std::fs;
use std::io;
use std::path::Path;

use super::volume::{is_volume, Volume};
use super::{QuotaError, QuotaFs};

/// Smallest disk limit a sandbox may ask for, bytes (an overlay upper dir needs some room).
pub const MIN_DISK_LIMIT: u64 = 1 << 20;

/// An instance directory as made by [`make_instance_dir`].
#[derive(Debug)]
pub enum InstanceDir {
    /// A btrfs subvolume whose qgroup carries the limit (if any).
    Volume(Volume),
    /// A plain directory: no quota on this file system and no limit asked for.
    Plain,
}

/// The disk limit of a new sandbox: the one its spec asks for (`SandboxSpec::disk_max`), else
/// the daemon's `default_disk_max_bytes` (0 = none). A sandbox cannot opt out of a configured
/// default.
///
/// Errors: [`QuotaError::InvalidLimit`] for a requested limit below [`MIN_DISK_LIMIT`].
pub fn resolve_limit(requested: Option<u64>, default: u64) -> Result<Option<u64>, QuotaError> {
    match requested {
        Some(bytes) if bytes < MIN_DISK_LIMIT => Err(QuotaError::InvalidLimit {
            bytes,
            min: MIN_DISK_LIMIT,
        }),
        Some(bytes) => Ok(Some(bytes)),
        None if default == 0 => Ok(None),
        None => Ok(Some(default)),
    }
}

/// Makes the instance directory `path` (must not exist; its parent must): a volume limited to
/// `limit` bytes when `quota` is available; a volume without limit (usage still accounted,
/// deletion still O(1)) when `limit` is `None`; a plain directory when there is no quota and
/// no limit. A limit without quota is refused: the daemon never runs a sandbox without the
/// limit it was given.
///
/// Errors: [`QuotaError::Unavailable`] (a limit but no quota), the errors of
/// [`Volume::create`], [`QuotaError::Mkdir`].
pub fn make_instance_dir(
    quota: Option<&QuotaFs>,
    path: &Path,
    limit: Option<u64>,
) -> Result<InstanceDir, QuotaError> {
    match (quota, limit) {
        (Some(q), limit) => q.create_volume(path, limit).map(InstanceDir::Volume),
        (None, Some(bytes)) => Err(QuotaError::Unavailable {
            path: path.to_path_buf(),
            bytes,
        }),
        (None, None) => fs::create_dir(path)
            .map(|()| InstanceDir::Plain)
            .map_err(|source| QuotaError::Mkdir {
                path: path.to_path_buf(),
                source,
            }),
    }
}

/// Removes the instance directory `path` with its contents, whichever kind it is: a volume is
/// deleted by the kernel ([`Volume::delete`]); a plain directory (made without quota, or by an
/// older daemon) is emptied by [`remove_contents`] and removed. A missing `path` is fine.
///
/// The caller must have killed the instance's processes and unmounted its overlay first.
///
/// Errors: those of [`Volume::open`] and [`Volume::delete`], [`QuotaError::RemoveContents`].
pub fn remove_instance_dir(path: &Path) -> Result<(), QuotaError> {
    if is_volume(path) {
        return Volume::open(path)?.delete();
    }
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Ok(m) if !m.is_dir() => {
            return fs::remove_file(path).map_err(|source| QuotaError::RemoveContents {
                path: path.to_path_buf(),
                source,
            })
        }
        _ => {}
    }
    let err = |source| QuotaError::RemoveContents {
        path: path.to_path_buf(),
        source,
    };
    remove_contents(path).map_err(err)?;
    fs::remove_dir(path).map_err(err)
}

/// Removes everything inside directory `dir` (which stays), never following symlinks.
///
/// The one place that walks a sandbox-written tree to delete it: the hardened iterative
/// remover of `belayer_overlay` (bounded fds and memory at any depth, never follows a symlink,
/// never crosses into another mount). Volumes never come here: the kernel deletes them.
pub fn remove_contents(dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            belayer_overlay::remove_dir_all(&path)?;
        } else {
            fs::remove_file(&path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_resolve() {
        assert_eq!(resolve_limit(None, 0).unwrap(), None);
        assert_eq!(resolve_limit(None, 10 << 30).unwrap(), Some(10 << 30));
        assert_eq!(resolve_limit(Some(64 << 20), 0).unwrap(), Some(64 << 20));
        assert_eq!(
            resolve_limit(Some(64 << 20), 10 << 30).unwrap(),
            Some(64 << 20)
        );
        assert!(matches!(
            resolve_limit(Some(0), 10 << 30),
            Err(QuotaError::InvalidLimit { bytes: 0, .. })
        ));
    }

    #[test]
    fn plain_instance_dirs_without_quota() {
        let tmp = tempfile::tempdir().unwrap();
        let inst = tmp.path().join("inst-0");
        assert!(matches!(
            make_instance_dir(None, &inst, None).unwrap(),
            InstanceDir::Plain
        ));
        fs::create_dir_all(inst.join("upper/a/b")).unwrap();
        fs::write(inst.join("upper/a/b/f"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", inst.join("upper/link")).unwrap();
        assert!(matches!(
            make_instance_dir(None, &tmp.path().join("inst-1"), Some(1 << 30)),
            Err(QuotaError::Unavailable { .. })
        ));
        remove_instance_dir(&inst).unwrap();
        assert!(!inst.exists());
        assert!(Path::new("/etc/passwd").exists());
        remove_instance_dir(&inst).unwrap();
    }
}
