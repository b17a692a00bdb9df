//! Mount points: detaching whatever is mounted at a path ([`unmount`], also used by the
//! guards of overlay mounts and idmapped layers) and asking whether a path is one
//! ([`is_mountpoint`], from `/proc/self/mountinfo`).

use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::io::Errno;
use rustix::mount::UnmountFlags;

use super::error::MountError;
use crate::sys::SyscallError;

/// Lazily unmounts whatever is mounted at `target` (`umount2(MNT_DETACH)`): `Ok(true)`
/// when something was, `Ok(false)` when `target` is not a mount point (`EINVAL`).
/// Errors: [`MountError::Unmount`] (e.g. `ENOENT`, `EPERM`).
pub fn unmount(target: &Path) -> Result<bool, MountError> {
    match rustix::mount::unmount(target, UnmountFlags::DETACH) {
        Ok(()) => {
            tracing::debug!(target = %target.display(), "unmounted");
            Ok(true)
        }
        Err(Errno::INVAL) => Ok(false),
        Err(errno) => Err(MountError::Unmount {
            target: target.to_path_buf(),
            source: SyscallError::new("umount2", errno),
        }),
    }
}

/// Whether `target` (symlinks resolved) is a mount point in this process's mount
/// namespace, from `/proc/self/mountinfo`. Errors: [`MountError::Resolve`] (e.g. missing),
/// [`MountError::ReadMountinfo`].
pub fn is_mountpoint(target: &Path) -> Result<bool, MountError> {
    let resolved = std::fs::canonicalize(target).map_err(|source| MountError::Resolve {
        path: target.to_path_buf(),
        source,
    })?;
    let info = std::fs::read("/proc/self/mountinfo")
        .map_err(|source| MountError::ReadMountinfo { source })?;
    let found = mount_points(&info).any(|point| point == resolved.as_os_str().as_bytes());
    Ok(found)
}

/// The mount point field (5th) of every mountinfo line, octal escapes decoded.
fn mount_points(info: &[u8]) -> impl Iterator<Item = Vec<u8>> + '_ {
    info.split(|b| *b == b'\n')
        .filter_map(|line| line.split(|b| *b == b' ').nth(4))
        .map(unescape_octal)
}

/// Decodes the `\ooo` escapes mountinfo uses for space, tab, newline and backslash.
fn unescape_octal(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let digits = field.get(i + 1..i + 4);
        match digits {
            Some(d) if field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)) => {
                let value = d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0'));
                out.push(value as u8);
                i += 4;
            }
            _ => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_fields_are_unescaped() {
        let info = b"22 1 8:1 / / rw - ext4 /dev/sda rw\n\
                     68 22 0:41 / /tmp/a\\040b\\134c rw - overlay overlay rw\n";
        let points: Vec<Vec<u8>> = mount_points(info).collect();
        assert_eq!(points, [b"/".to_vec(), b"/tmp/a b\\c".to_vec()]);
        assert_eq!(unescape_octal(b"x\\01"), b"x\\01");
        assert_eq!(unescape_octal(b"\\011"), b"\t");
    }

    #[test]
    fn unmount_of_a_plain_directory_is_false() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!unmount(dir.path()).unwrap());
        assert!(!is_mountpoint(dir.path()).unwrap());
        assert!(is_mountpoint(Path::new("/")).unwrap());
        assert!(matches!(
            unmount(&dir.path().join("missing")),
            Err(MountError::Unmount { .. })
        ));
    }
}
