//! A volume: one btrfs subvolume whose level-0 qgroup carries a byte limit.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::qgroup::{qgroups, Qgroup};
use super::sys;
use super::QuotaError;

/// Usage of a volume, as of the file system's last committed transaction (every few seconds,
/// or [`super::QuotaFs::commit`]). The limit itself is enforced at once, on reservations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeUsage {
    /// Bytes the volume references (what the limit bounds).
    pub referenced: u64,
    /// Bytes only this volume references (equal to `referenced` under simple quotas).
    pub exclusive: u64,
    /// The limit on referenced bytes, if any.
    pub limit: Option<u64>,
}

/// A btrfs subvolume with a qgroup limit, reached through an fd of its parent directory.
///
/// Dropping a `Volume` keeps the subvolume; [`Volume::delete`] removes it.
#[derive(Debug)]
pub struct Volume {
    path: PathBuf,
    /// The parent directory, outside the subvolume: qgroup and delete ioctls go through it, so
    /// the transactions they start reserve metadata from the parent's qgroup, not from the
    /// volume's (which refuses once the volume is at its limit).
    parent: OwnedFd,
    id: u64,
    dev: u64,
}

impl Volume {
    /// Creates subvolume `path` and limits its referenced bytes to `limit` (`None`: no limit,
    /// usage still accounted). The parent directory must exist on a btrfs file system with
    /// quotas on; the last component must be a new name of at most 4039 bytes. If setting the
    /// limit fails, the new subvolume is deleted again: a volume never exists without the
    /// limit asked for.
    ///
    /// Errors: [`QuotaError::InvalidPath`], [`QuotaError::Open`] (parent), [`QuotaError::Create`]
    /// (`EEXIST`, `ENOTTY` on other file systems, ...), [`QuotaError::SetLimit`] (`ENOTCONN`
    /// when quotas are off).
    pub fn create(path: &Path, limit: Option<u64>) -> Result<Volume, QuotaError> {
        let (parent, name) = split(path)?;
        let parent_fd = open(parent, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        sys::subvol_create(parent_fd.as_fd(), name.as_bytes()).map_err(|source| {
            QuotaError::Create {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let vol = match Volume::open(path) {
            Ok(v) => v,
            Err(e) => {
                let _ = sys::snap_destroy(parent_fd.as_fd(), name.as_bytes());
                return Err(e);
            }
        };
        if let Err(e) = vol.set_limit(limit) {
            let _ = sys::snap_destroy(parent_fd.as_fd(), name.as_bytes());
            return Err(e);
        }
        Ok(vol)
    }

    /// Opens the existing subvolume whose root directory is `path` (symlinks are not
    /// followed).
    ///
    /// Errors: [`QuotaError::InvalidPath`], [`QuotaError::Open`], [`QuotaError::NotAVolume`]
    /// (a plain directory), [`QuotaError::Lookup`].
    pub fn open(path: &Path) -> Result<Volume, QuotaError> {
        let (parent, _) = split(path)?;
        let parent = open(parent, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        let fd = open(path, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        let st = rustix::fs::fstat(&fd).map_err(|e| QuotaError::Open {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        let fs_type = sys::fs_type(fd.as_fd()).map_err(|source| QuotaError::Lookup {
            path: path.to_path_buf(),
            source,
        })?;
        if fs_type != sys::BTRFS_SUPER_MAGIC || st.st_ino != sys::SUBVOL_ROOT_INO {
            return Err(QuotaError::NotAVolume {
                path: path.to_path_buf(),
            });
        }
        let id = sys::subvol_id(fd.as_fd()).map_err(|source| QuotaError::Lookup {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Volume {
            path: path.to_path_buf(),
            parent,
            id,
            dev: st.st_dev,
        })
    }

    /// Snapshots this volume as `dest` (a new name, at most 4039 bytes, in an existing
    /// directory of the same file system), read-only with `readonly`, without a limit (set
    /// one with [`Volume::set_limit`]). The snapshot's files keep their inode
    /// numbers, times and data extents, which it shares with this volume (under simple quotas
    /// they stay charged to whichever volume wrote them; the snapshot's qgroup counts what is
    /// written into it later). The kernel writes back this volume's dirty data and commits a
    /// transaction first (a few ms to tens of ms). The ioctl goes through `dest`'s parent, so
    /// a source volume at its limit can still be snapshotted. If the new name does not open as
    /// a volume, the snapshot is deleted again.
    ///
    /// Errors: [`QuotaError::InvalidPath`], [`QuotaError::Open`], [`QuotaError::Replaced`]
    /// (this volume's name leads elsewhere now), [`QuotaError::Snapshot`] (`EEXIST`, `ENOSPC`,
    /// `EXDEV` across file systems, ...), the errors of [`Volume::open`].
    pub fn snapshot(&self, dest: &Path, readonly: bool) -> Result<Volume, QuotaError> {
        let (dest_parent, name) = split(dest)?;
        let root = open(&self.path, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        self.still_this(rustix::fs::fstat(&root))?;
        let parent_fd = open(dest_parent, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        sys::snap_create(parent_fd.as_fd(), root.as_fd(), name.as_bytes(), readonly).map_err(
            |source| QuotaError::Snapshot {
                from: self.path.clone(),
                path: dest.to_path_buf(),
                source,
            },
        )?;
        Volume::open(dest).inspect_err(|_| {
            let _ = sys::snap_destroy(parent_fd.as_fd(), name.as_bytes());
        })
    }

    /// Checks that `stat` (of this volume's name, or of an fd opened by it) is still this
    /// volume's root: the subvolume root inode on this volume's device.
    ///
    /// Errors: [`QuotaError::Open`] (the stat failed), [`QuotaError::Replaced`].
    fn still_this(&self, stat: rustix::io::Result<rustix::fs::Stat>) -> Result<(), QuotaError> {
        let st = stat.map_err(|e| QuotaError::Open {
            path: self.path.clone(),
            source: e.into(),
        })?;
        if st.st_ino != sys::SUBVOL_ROOT_INO || st.st_dev != self.dev {
            return Err(QuotaError::Replaced {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// Whether the subvolume is read-only (`BTRFS_SUBVOL_RDONLY`).
    ///
    /// Errors: [`QuotaError::Open`], [`QuotaError::Lookup`].
    pub fn read_only(&self) -> Result<bool, QuotaError> {
        let root = open(&self.path, libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        let flags = sys::subvol_flags(root.as_fd()).map_err(|source| QuotaError::Lookup {
            path: self.path.clone(),
            source,
        })?;
        Ok(flags & sys::SUBVOL_RDONLY != 0)
    }

    /// The subvolume's root directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The subvolume id (its qgroup is `0/<id>`).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Sets the limit on referenced bytes (`None` clears it). Lowering it below the current
    /// usage is allowed: further allocations then fail with `EDQUOT`.
    ///
    /// Errors: [`QuotaError::SetLimit`].
    pub fn set_limit(&self, limit: Option<u64>) -> Result<(), QuotaError> {
        sys::qgroup_limit(self.parent.as_fd(), self.id, limit).map_err(|source| {
            QuotaError::SetLimit {
                path: self.path.clone(),
                id: self.id,
                source,
            }
        })
    }

    /// Usage and limit of the volume's qgroup (see [`VolumeUsage`] on freshness).
    ///
    /// Errors: [`QuotaError::Usage`] (tree search failed), [`QuotaError::NoQgroup`].
    pub fn usage(&self) -> Result<VolumeUsage, QuotaError> {
        let groups = qgroups(&self.parent, Some(self.id)).map_err(|source| QuotaError::Usage {
            path: self.path.clone(),
            id: self.id,
            source,
        })?;
        let Some(Qgroup {
            referenced,
            exclusive,
            max_referenced,
            ..
        }) = groups.into_iter().find(|g| g.id == self.id)
        else {
            return Err(QuotaError::NoQgroup {
                path: self.path.clone(),
                id: self.id,
            });
        };
        Ok(VolumeUsage {
            referenced,
            exclusive,
            limit: max_referenced,
        })
    }

    /// Deletes the subvolume with everything in it (`BTRFS_IOC_SNAP_DESTROY_V2`): the name is
    /// gone when this returns; the kernel frees the tree in the background and then drops
    /// the qgroup when it accounts no bytes by then (else the qgroup stays: see
    /// [`super::QuotaFs::stale_qgroups`]). Nothing of the (sandbox-written) tree is walked in user space, so
    /// depth, entry count, symlinks and races inside it do not matter.
    ///
    /// The caller must have ended every process using the volume and unmounted what it
    /// mounted inside (the overlay at `inst-<n>/merged`): deleting a subvolume detaches, in
    /// every mount namespace, mounts that sit on directories inside it. Mounts of this mount
    /// namespace are checked and refused with [`QuotaError::Busy`].
    ///
    /// Errors: [`QuotaError::Busy`], [`QuotaError::Open`], [`QuotaError::Replaced`] (the name no longer leads to this subvolume),
    /// [`QuotaError::Delete`].
    pub fn delete(self) -> Result<(), QuotaError> {
        if let Some(mount) = mount_below(&self.path) {
            return Err(QuotaError::Busy {
                path: self.path.clone(),
                mount,
            });
        }
        let (_, name) = split(&self.path)?;
        self.still_this(rustix::fs::statat(
            &self.parent,
            name,
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        ))?;
        sys::snap_destroy(self.parent.as_fd(), name.as_bytes()).map_err(|source| {
            QuotaError::Delete {
                path: self.path.clone(),
                source,
            }
        })
    }
}

/// Whether `path` is the root directory of a btrfs subvolume (`false` when it is missing or
/// a plain directory).
pub fn is_volume(path: &Path) -> bool {
    let Ok(fd) = open(path, libc::O_DIRECTORY | libc::O_NOFOLLOW) else {
        return false;
    };
    rustix::fs::fstat(&fd).is_ok_and(|st| st.st_ino == sys::SUBVOL_ROOT_INO)
        && sys::fs_type(fd.as_fd()).ok() == Some(sys::BTRFS_SUPER_MAGIC)
}

/// `(parent, name)` of an absolute path whose last component is a plain name.
fn split(path: &Path) -> Result<(&Path, &OsStr), QuotaError> {
    let invalid = || QuotaError::InvalidPath {
        path: path.to_path_buf(),
    };
    let name = path.file_name().ok_or_else(invalid)?;
    let parent = path.parent().ok_or_else(invalid)?;
    let bytes = name.as_bytes();
    if !path.is_absolute()
        || bytes.is_empty()
        || bytes.len() > sys::SUBVOL_NAME_MAX
        || bytes.contains(&0)
        || bytes == b"."
        || bytes == b".."
    {
        return Err(invalid());
    }
    Ok((parent, name))
}

fn open(path: &Path, flags: i32) -> Result<OwnedFd, QuotaError> {
    File::options()
        .read(true)
        .custom_flags(flags | libc::O_CLOEXEC)
        .open(path)
        .map(OwnedFd::from)
        .map_err(|source| QuotaError::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// A mount point of this mount namespace at or below `path`, if any.
fn mount_below(path: &Path) -> Option<PathBuf> {
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|m| PathBuf::from(OsStr::from_bytes(&unescape(m))))
        .find(|m| m.starts_with(&real))
}

/// Undoes mountinfo's octal escapes (`\040` for a space, ...).
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let digits = &b[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_rejects_odd_names() {
        assert!(split(Path::new("/a/b")).is_ok());
        assert!(split(Path::new("rel/b")).is_err());
        assert!(split(Path::new("/")).is_err());
        assert!(split(Path::new("/a/..")).is_err());
        let long = format!("/a/{}", "x".repeat(sys::SUBVOL_NAME_MAX + 1));
        assert!(split(Path::new(&long)).is_err());
    }

    #[test]
    fn unescape_mountinfo() {
        assert_eq!(unescape(r"/a\040b"), b"/a b");
        assert_eq!(unescape(r"/a\\b"), br"/a\\b");
        assert_eq!(unescape(r"/x\01"), br"/x\01");
    }
}
