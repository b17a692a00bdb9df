//! Idmapped lower layers: the image seen through a user namespace's id map.
//!
//! A sandbox in its own user namespace maps its root to an unprivileged host uid (say
//! 1 000 000 000). The image on disk belongs to host root, which that namespace cannot see:
//! without help every file of the lower layer would show up as `nobody`, and root in the
//! sandbox could not even write `/etc/passwd` through the overlay. An **idmapped mount**
//! (Linux ≥ 5.12; as an overlay lower layer ≥ 5.19) presents the same tree with its ids
//! shifted through a user namespace's map: host uid 0 appears as 1 000 000 000, which is
//! root inside the sandbox. Nothing on disk changes and every sandbox shares one image.
//!
//! [`IdmappedTree`] is such a mount, detached (not attached anywhere in the mount tree,
//! so no other process can reach it): `open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)` of the
//! layer, then `mount_setattr(MOUNT_ATTR_IDMAP | RDONLY | NODEV | NOSUID)` with the
//! namespace's fd. Overlayfs takes it either as a file descriptor (`fsconfig(FSCONFIG_SET_FD,
//! "lowerdir+")`, Linux ≥ 6.13) or, on older kernels, attached for the duration of the mount
//! at a private path ([`IdmappedTree::attach`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::mount::{MoveMountFlags, OpenTreeFlags};

use crate::sys::{Call, SyscallError};

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
const MOUNT_ATTR_NOSUID: u64 = 0x0000_0002;
const MOUNT_ATTR_NODEV: u64 = 0x0000_0004;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const AT_EMPTY_PATH: libc::c_uint = 0x1000;
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// A detached, read-only, `nodev,nosuid` clone of a directory tree whose ids are shifted
/// through a user namespace's map. Dropping it releases the mount.
#[derive(Debug)]
pub struct IdmappedTree {
    fd: OwnedFd,
    source: PathBuf,
}

impl IdmappedTree {
    /// Clones the mount tree at `source` (recursively) and idmaps it with `userns` (an open
    /// `/proc/<pid>/ns/user` or equivalent nsfs fd).
    ///
    /// Errors: `open_tree` (e.g. `ENOENT`), `mount_setattr` (`EINVAL` when the filesystem
    /// under `source` cannot be idmapped, `EPERM` without `CAP_SYS_ADMIN`).
    pub fn new(source: &Path, userns: BorrowedFd<'_>) -> Result<IdmappedTree, SyscallError> {
        let fd = rustix::mount::open_tree(
            rustix::fs::CWD,
            source,
            OpenTreeFlags::OPEN_TREE_CLONE
                | OpenTreeFlags::OPEN_TREE_CLOEXEC
                | OpenTreeFlags::AT_RECURSIVE,
        )
        .call("open_tree")?;
        set_mount_attrs(
            fd.as_fd(),
            MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID,
            Some(userns),
            "mount_setattr(MOUNT_ATTR_IDMAP)",
        )?;
        Ok(IdmappedTree {
            fd,
            source: source.to_path_buf(),
        })
    }

    /// The tree the mount shows.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Attaches the mount at `target` (an existing empty directory) for kernels whose
    /// overlayfs cannot take layers as file descriptors; the returned guard detaches it.
    pub fn attach(&self, target: &Path) -> Result<AttachedTree, SyscallError> {
        rustix::mount::move_mount(
            self.fd.as_fd(),
            c"",
            rustix::fs::CWD,
            target,
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
        )
        .call("move_mount(idmapped layer)")?;
        Ok(AttachedTree {
            target: target.to_path_buf(),
        })
    }
}

impl AsFd for IdmappedTree {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// An [`IdmappedTree`] attached at a path; dropping it detaches it (`MNT_DETACH`). An
/// overlay mounted over it keeps its own reference to the layer.
#[derive(Debug)]
pub struct AttachedTree {
    target: PathBuf,
}

impl AttachedTree {
    /// Where it is attached.
    pub fn target(&self) -> &Path {
        &self.target
    }
}

impl Drop for AttachedTree {
    fn drop(&mut self) {
        if let Err(e) = crate::mount::points::unmount(&self.target) {
            tracing::warn!(target = %self.target.display(), error = %e, "detaching an idmapped layer failed");
        }
        let _ = std::fs::remove_dir(&self.target);
    }
}

/// Clones the mount at `source` (alone: mounts below it are not part of the clone),
/// detached, and makes it read-only, `nodev` and `nosuid` before anything can reach it;
/// attach it with `move_mount`. Errors: `open_tree`, `mount_setattr`.
pub(crate) fn read_only_clone(source: &Path) -> Result<OwnedFd, SyscallError> {
    let fd = rustix::mount::open_tree(
        rustix::fs::CWD,
        source,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )
    .call("open_tree")?;
    set_mount_attrs(
        fd.as_fd(),
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOSUID,
        None,
        "mount_setattr(MOUNT_ATTR_RDONLY)",
    )?;
    Ok(fd)
}

/// `mount_setattr(fd, "", AT_EMPTY_PATH | AT_RECURSIVE)` setting `attr_set` (with the id
/// map of `userns` for `MOUNT_ATTR_IDMAP`); `call` names the step in errors.
fn set_mount_attrs(
    fd: BorrowedFd<'_>,
    attr_set: u64,
    userns: Option<BorrowedFd<'_>>,
    call: &'static str,
) -> Result<(), SyscallError> {
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        // Read by the kernel only with MOUNT_ATTR_IDMAP.
        userns_fd: userns.map_or(0, |fd| fd.as_raw_fd() as u64),
    };
    // SAFETY: mount_setattr reads `size_of::<MountAttr>()` bytes from `&attr`, a live
    // `repr(C)` value laid out as the kernel's `struct mount_attr` (four u64 fields); the
    // path is a NUL-terminated empty string and `fd` is an open mount fd borrowed for the
    // call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            fd.as_raw_fd(),
            c"".as_ptr(),
            AT_EMPTY_PATH | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(SyscallError::new(call, std::io::Error::last_os_error()));
    }
    Ok(())
}
