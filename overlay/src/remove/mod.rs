//! Removal of a directory tree that a hostile sandbox wrote: sandbox dirs, instance dirs
//! (upper, work, merged), checkpoint and CRIU work dirs.
//!
//! `std::fs::remove_dir_all` recurses once per directory level (on the calling thread's
//! stack, with one fd per level), so a sandbox that makes a 30 000-deep directory chain
//! crashes whoever removes it. [`remove_tree`] is built for such trees:
//!
//! - **Iterative**: an explicit stack of open directories, no recursion; the stack usage of
//!   the calling thread does not depend on the tree.
//! - **Bounded fds**: at most [`RemoveOptions::max_open_dirs`] directory fds (plus three
//!   transient ones). A directory met one level deeper than that is *flattened*: renamed
//!   (`renameat2(RENAME_NOREPLACE)`) into the root of the removal under a scratch name
//!   (`.belayer-rm-<n>`) and removed from there later, so a chain of any depth costs one
//!   rename per `max_open_dirs` levels and never more fds.
//! - **Bounded memory**: directories are streamed with `getdents64` (one buffer of at most
//!   about 24 KiB per open directory); names are never collected, so a directory of 10^6
//!   files costs no more memory than one of ten. A directory is read again from the start
//!   (`rewinddir`) only when it is still not empty after a pass.
//! - **Never follows a symlink**: entries are examined with
//!   `statx(AT_SYMLINK_NOFOLLOW | AT_NO_AUTOMOUNT)` and removed with `unlinkat` relative to
//!   their parent's fd; directories are opened with `O_NOFOLLOW | O_DIRECTORY` relative to
//!   their parent's fd; a symlink (to anything, `..` included) is removed as a symlink.
//! - **Never leaves the root's mount**: every entry's device and mount id (`statx`
//!   `STATX_MNT_ID`, and `STATX_ATTR_MOUNT_ROOT`) must equal the root's, checked again on
//!   the opened fd of every directory. A mount point, a bind-mounted file or a directory of
//!   another filesystem (a btrfs subvolume has its own device number) fails the removal
//!   with [`RemoveError::Mount`] naming it, before anything inside it or above it is
//!   touched; what was not yet removed stays where it is. `rmdir`/`unlink` answering
//!   `EBUSY` is reported the same way.
//! - **Copes with permissions**: as root the kernel lets the daemon read and change
//!   directories of mode 000 (overlayfs's `work/work` is one). Without those capabilities
//!   (`CAP_DAC_OVERRIDE`, `CAP_DAC_READ_SEARCH`) a directory that refuses an operation with
//!   `EACCES`/`EPERM` is made `0700` once (`fchmod` on its fd, or `chmod` of
//!   `/proc/self/fd/<O_PATH fd>` for one that cannot be opened for reading) and the
//!   operation retried.
//! - **Terminates**: every entry examined counts against [`RemoveOptions::max_entries`],
//!   so a tree that something keeps filling (a live process) ends with
//!   [`RemoveError::TooManyEntries`] rather than never.
//!
//! A mount deeper than `max_open_dirs` levels is found after its ancestor was flattened, so
//! the error names it below the scratch name of that ancestor.

use std::ffi::CString;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, CWD};

use crate::sys::Call;

mod engine;
mod error;
mod options;

use engine::{file_type, is_mount_root, open_dir, stat_at, stat_fd, MountId, Remover};
pub use error::RemoveError;
pub use options::{RemoveOptions, RemoveStats};

/// Removes the tree at `path` with [`RemoveOptions::default`] (see [`remove_tree_with`]).
///
/// Errors: [`RemoveError`].
pub fn remove_tree(path: &Path) -> Result<RemoveStats, RemoveError> {
    remove_tree_with(path, &RemoveOptions::default())
}

/// A drop-in for `std::fs::remove_dir_all` with the bounds of [`remove_tree`], for callers
/// that handle `io::Error`: the error's kind is the failed call's (`NotFound` for a missing
/// path), its inner error the [`RemoveError`].
///
/// Errors: as [`remove_tree`], converted.
pub fn remove_dir_all(path: impl AsRef<Path>) -> io::Result<()> {
    remove_tree(path.as_ref())
        .map(|_| ())
        .map_err(io::Error::from)
}

/// Removes the directory tree at `path` (the module docs list the guarantees). The parent
/// path is the caller's and resolved as usual; from the last component on nothing is
/// followed. A symlink at `path` is removed itself; another non-directory is refused.
///
/// Errors: [`RemoveError`]; a mount point or an entry of another filesystem inside the
/// tree (or `path` being one) is [`RemoveError::Mount`], and leaves it and its ancestors
/// in place.
pub fn remove_tree_with(path: &Path, opts: &RemoveOptions) -> Result<RemoveStats, RemoveError> {
    let started = Instant::now();
    let Some(name) = path.file_name() else {
        return Err(RemoveError::InvalidPath {
            path: path.to_path_buf(),
        });
    };
    let parent_path = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = CString::new(name.as_bytes()).map_err(|_| RemoveError::InvalidPath {
        path: path.to_path_buf(),
    })?;
    let parent = rustix::fs::openat(
        CWD,
        parent_path,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .call("openat")
    .map_err(|source| RemoveError::OpenParent {
        path: parent_path.to_path_buf(),
        source,
    })?;
    let stat_err = |source| RemoveError::Stat {
        path: path.to_path_buf(),
        source,
    };
    let root_stat = stat_at(parent.as_fd(), &name).map_err(stat_err)?;
    let mut stats = RemoveStats::default();
    match file_type(&root_stat) {
        FileType::Directory => {}
        FileType::Symlink => {
            rustix::fs::unlinkat(&parent, name.as_c_str(), AtFlags::empty())
                .call("unlinkat")
                .map_err(|source| RemoveError::Unlink {
                    path: path.to_path_buf(),
                    source,
                })?;
            stats.entries = 1;
            return Ok(stats);
        }
        _ => {
            return Err(RemoveError::NotADirectory {
                path: path.to_path_buf(),
            })
        }
    }
    let parent_stat = stat_fd(parent.as_fd()).map_err(|source| RemoveError::OpenParent {
        path: parent_path.to_path_buf(),
        source,
    })?;
    let mount = MountId::of(&root_stat);
    if !mount.same(&MountId::of(&parent_stat)) || is_mount_root(&root_stat) {
        return Err(RemoveError::Mount {
            path: path.to_path_buf(),
        });
    }
    let root_fd = open_dir(parent.as_fd(), &name).map_err(|source| RemoveError::OpenDir {
        path: path.to_path_buf(),
        source,
    })?;
    let root_fd_stat = stat_fd(root_fd.as_fd()).map_err(stat_err)?;
    if !mount.same(&MountId::of(&root_fd_stat)) || is_mount_root(&root_fd_stat) {
        return Err(RemoveError::Mount {
            path: path.to_path_buf(),
        });
    }
    let mut remover = Remover {
        root: path,
        opts,
        mount,
        parent,
        stack: Vec::new(),
        stats,
        examined: 0,
        scratch: 0,
    };
    remover.push(root_fd, name, root_fd_stat.stx_blocks)?;
    remover.run()?;
    let stats = remover.stats;
    tracing::debug!(
        path = %path.display(),
        entries = stats.entries,
        bytes = stats.bytes,
        flattened = stats.flattened,
        elapsed_us = started.elapsed().as_micros() as u64,
        "removed tree"
    );
    Ok(stats)
}
