//! The iterative engine of [`remove_tree`](super::remove_tree): a stack of at most
//! `max_open_dirs` open directories read with `getdents64`, entries examined and removed
//! relative to their parent's fd, deeper directories flattened into the root.

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{
    AtFlags, Dir, FileType, Mode, OFlags, RenameFlags, Statx, StatxAttributes, StatxFlags,
};
use rustix::io::Errno;

use super::error::RemoveError;
use super::options::{RemoveOptions, RemoveStats};
use crate::sys::{Call, SyscallError};

/// The filesystem and mount an entry is on.
#[derive(Debug, Clone, Copy)]
pub(super) struct MountId {
    dev: (u32, u32),
    /// `None` where the kernel does not report mount ids (before 5.8).
    mnt_id: Option<u64>,
}

impl MountId {
    pub(super) fn of(stat: &Statx) -> MountId {
        let has_mnt_id = StatxFlags::from_bits_retain(stat.stx_mask).contains(StatxFlags::MNT_ID);
        MountId {
            dev: (stat.stx_dev_major, stat.stx_dev_minor),
            mnt_id: has_mnt_id.then_some(stat.stx_mnt_id),
        }
    }

    pub(super) fn same(&self, other: &MountId) -> bool {
        self.dev == other.dev
            && match (self.mnt_id, other.mnt_id) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

/// Whether `stat` describes the root of a mount (where the kernel says so).
pub(super) fn is_mount_root(stat: &Statx) -> bool {
    stat.stx_attributes_mask
        .contains(StatxAttributes::MOUNT_ROOT)
        && stat.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
}

pub(super) fn file_type(stat: &Statx) -> FileType {
    FileType::from_raw_mode(u32::from(stat.stx_mode))
}

const STATX_WANT: StatxFlags = StatxFlags::BASIC_STATS.union(StatxFlags::MNT_ID);

pub(super) fn stat_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<Statx, SyscallError> {
    rustix::fs::statx(
        dir,
        name,
        AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        STATX_WANT,
    )
    .call("statx")
}

pub(super) fn stat_fd(fd: BorrowedFd<'_>) -> Result<Statx, SyscallError> {
    rustix::fs::statx(fd, c"", AtFlags::EMPTY_PATH, STATX_WANT).call("statx")
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Opens directory `name` in `parent` for reading without following a symlink; one that
/// refuses with `EACCES` is made `0700` through an `O_PATH` fd (never a symlink: that open
/// has `O_NOFOLLOW | O_DIRECTORY`) and opened again.
pub(super) fn open_dir(parent: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd, SyscallError> {
    match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Err(Errno::ACCESS) => {}
        other => return other.call("openat"),
    }
    let path_fd = rustix::fs::openat(
        parent,
        name,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .call("openat(O_PATH)")?;
    let proc = format!("/proc/self/fd/{}", path_fd.as_raw_fd());
    rustix::fs::chmod(proc.as_str(), Mode::from_raw_mode(0o700)).call("chmod")?;
    rustix::fs::openat(&path_fd, c".", DIR_FLAGS, Mode::empty()).call("openat")
}

/// A directory being emptied.
pub(super) struct Level {
    dir: Dir,
    /// Its name in the level above (the root's: in the root's parent).
    name: CString,
    /// Blocks it holds, counted when it is removed.
    blocks: u64,
    /// Entries met in the current pass over it.
    found: u64,
    /// Whether it was already made `0700` after an `EACCES`/`EPERM`.
    chmodded: bool,
}

impl Level {
    fn fd(&self) -> BorrowedFd<'_> {
        // rustix's `Dir::fd` never fails on Linux; the `Result` is for other platforms.
        match self.dir.fd() {
            Ok(fd) => fd,
            Err(_) => unreachable!("Dir::fd is infallible on Linux"),
        }
    }

    /// Makes the directory `0700`, once (a failure shows as the retried call's error).
    fn loosen(&mut self) {
        if !self.chmodded {
            self.chmodded = true;
            let _ = rustix::fs::fchmod(self.fd(), Mode::from_raw_mode(0o700));
        }
    }
}

/// What one attempt at an entry came to.
enum Step {
    Done,
    /// Permission refused in the current directory: loosen it and try again.
    Retry,
}

pub(super) struct Remover<'a> {
    pub(super) root: &'a Path,
    pub(super) opts: &'a RemoveOptions,
    pub(super) mount: MountId,
    /// `O_PATH` fd of the root's parent.
    pub(super) parent: OwnedFd,
    pub(super) stack: Vec<Level>,
    pub(super) stats: RemoveStats,
    pub(super) examined: u64,
    pub(super) scratch: u64,
}

impl Remover<'_> {
    /// The root joined with the names of the open levels below it and `name`.
    fn path(&self, name: Option<&CStr>) -> PathBuf {
        let mut path = self.root.to_path_buf();
        for level in self.stack.iter().skip(1) {
            path.push(OsStr::from_bytes(level.name.to_bytes()));
        }
        if let Some(name) = name {
            path.push(OsStr::from_bytes(name.to_bytes()));
        }
        path
    }

    pub(super) fn push(
        &mut self,
        fd: OwnedFd,
        name: CString,
        blocks: u64,
    ) -> Result<(), RemoveError> {
        let dir = Dir::new(fd)
            .call("fdopendir")
            .map_err(|source| RemoveError::OpenDir {
                path: self.path(Some(&name)),
                source,
            })?;
        self.stack.push(Level {
            dir,
            name,
            blocks,
            found: 0,
            chmodded: false,
        });
        Ok(())
    }

    pub(super) fn run(&mut self) -> Result<(), RemoveError> {
        while let Some(top) = self.stack.last_mut() {
            let entry = match top.dir.read() {
                None => {
                    self.finish_level()?;
                    continue;
                }
                Some(Err(errno)) => {
                    return Err(RemoveError::ReadDir {
                        path: self.path(None),
                        source: SyscallError::new("getdents64", errno),
                    })
                }
                Some(Ok(entry)) => entry,
            };
            let name = entry.file_name();
            if name == c"." || name == c".." {
                continue;
            }
            top.found += 1;
            self.examined += 1;
            if self.examined > self.opts.max_entries {
                return Err(RemoveError::TooManyEntries {
                    path: self.path(None),
                    max: self.opts.max_entries,
                });
            }
            let name = name.to_owned();
            // A retry happens once per directory: `loosen` marks it, and `entry` reports
            // a second refusal as an error.
            while let Step::Retry = self.entry(&name)? {
                if let Some(top) = self.stack.last_mut() {
                    top.loosen();
                }
            }
        }
        Ok(())
    }

    /// Whether a permission error may go away by loosening the current directory.
    fn may_retry(&self, errno: Errno) -> bool {
        matches!(errno, Errno::ACCESS | Errno::PERM)
            && self.stack.last().is_some_and(|l| !l.chmodded)
    }

    /// Removes (or descends into, or flattens) entry `name` of the top directory.
    fn entry(&mut self, name: &CStr) -> Result<Step, RemoveError> {
        let depth = self.stack.len();
        let Some(top) = self.stack.last() else {
            return Ok(Step::Done);
        };
        let dir = top.fd();
        let stat = match stat_at(dir, name) {
            Ok(stat) => stat,
            // Gone meanwhile: nothing to do.
            Err(e) if e.errno() == Some(Errno::NOENT.raw_os_error()) => return Ok(Step::Done),
            Err(e)
                if e.errno()
                    .is_some_and(|n| self.may_retry(Errno::from_raw_os_error(n))) =>
            {
                return Ok(Step::Retry)
            }
            Err(source) => {
                return Err(RemoveError::Stat {
                    path: self.path(Some(name)),
                    source,
                })
            }
        };
        if !self.mount.same(&MountId::of(&stat)) || is_mount_root(&stat) {
            return Err(RemoveError::Mount {
                path: self.path(Some(name)),
            });
        }
        if file_type(&stat) != FileType::Directory {
            return match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                Ok(()) => {
                    self.stats.entries += 1;
                    if stat.stx_nlink <= 1 {
                        self.stats.bytes += stat.stx_blocks * 512;
                    }
                    Ok(Step::Done)
                }
                // Gone, or became a directory: the next pass sees it again.
                Err(Errno::NOENT | Errno::ISDIR) => Ok(Step::Done),
                Err(Errno::BUSY) => Err(RemoveError::Mount {
                    path: self.path(Some(name)),
                }),
                Err(e) if self.may_retry(e) => Ok(Step::Retry),
                Err(e) => Err(RemoveError::Unlink {
                    path: self.path(Some(name)),
                    source: SyscallError::new("unlinkat", e),
                }),
            };
        }
        let child = match open_dir(dir, name) {
            Ok(fd) => fd,
            // Gone, or no longer a directory: the next pass sees what is there.
            Err(e)
                if e.errno().is_some_and(|n| {
                    [Errno::NOENT, Errno::NOTDIR, Errno::LOOP]
                        .contains(&Errno::from_raw_os_error(n))
                }) =>
            {
                return Ok(Step::Done)
            }
            Err(e)
                if e.errno()
                    .is_some_and(|n| self.may_retry(Errno::from_raw_os_error(n))) =>
            {
                return Ok(Step::Retry)
            }
            Err(source) => {
                return Err(RemoveError::OpenDir {
                    path: self.path(Some(name)),
                    source,
                })
            }
        };
        // Check what was opened, not what was looked up.
        let opened = stat_fd(child.as_fd()).map_err(|source| RemoveError::Stat {
            path: self.path(Some(name)),
            source,
        })?;
        if !self.mount.same(&MountId::of(&opened)) || is_mount_root(&opened) {
            return Err(RemoveError::Mount {
                path: self.path(Some(name)),
            });
        }
        if depth < self.opts.max_open_dirs.max(2) {
            self.push(child, name.to_owned(), opened.stx_blocks)?;
            return Ok(Step::Done);
        }
        self.flatten(name, child)
    }

    /// Moves directory `name` of the top level (open as `child`) into the root under a
    /// fresh scratch name; it is emptied there in a later pass over the root.
    fn flatten(&mut self, name: &CStr, child: OwnedFd) -> Result<Step, RemoveError> {
        let mut loosened_child = false;
        loop {
            let scratch = CString::new(format!(".belayer-rm-{}", self.scratch))
                .expect("no NUL in a formatted number");
            self.scratch += 1;
            let (Some(root), Some(top)) = (self.stack.first(), self.stack.last()) else {
                return Ok(Step::Done);
            };
            match rustix::fs::renameat_with(
                top.fd(),
                name,
                root.fd(),
                scratch.as_c_str(),
                RenameFlags::NOREPLACE,
            ) {
                Ok(()) => {
                    self.stats.flattened += 1;
                    return Ok(Step::Done);
                }
                // A name the tree already holds: take the next one.
                Err(Errno::EXIST) => continue,
                Err(Errno::NOENT) => return Ok(Step::Done),
                Err(Errno::BUSY) => {
                    return Err(RemoveError::Mount {
                        path: self.path(Some(name)),
                    })
                }
                // Moving a directory rewrites its `..`, which needs write access to it too.
                Err(Errno::ACCESS | Errno::PERM) if !loosened_child => {
                    loosened_child = true;
                    let _ = rustix::fs::fchmod(&child, Mode::from_raw_mode(0o700));
                    if let Some(top) = self.stack.last_mut() {
                        top.loosen();
                    }
                }
                Err(e) => {
                    return Err(RemoveError::Flatten {
                        path: self.path(Some(name)),
                        source: SyscallError::new("renameat2", e),
                    })
                }
            }
        }
    }

    /// The top directory was read to its end: remove it, or read it again if it is not
    /// empty yet (entries added or flattened into it meanwhile).
    fn finish_level(&mut self) -> Result<(), RemoveError> {
        let depth = self.stack.len();
        let mut retried = false;
        loop {
            let (above, level) = self.stack.split_at_mut(depth - 1);
            let level = &mut level[0];
            let parent = match above.last() {
                Some(up) => up.fd(),
                None => self.parent.as_fd(),
            };
            match rustix::fs::unlinkat(parent, level.name.as_c_str(), AtFlags::REMOVEDIR) {
                Ok(()) => {
                    self.stats.entries += 1;
                    self.stats.bytes += level.blocks * 512;
                    self.stack.pop();
                    return Ok(());
                }
                Err(Errno::NOENT) => {
                    self.stack.pop();
                    return Ok(());
                }
                Err(Errno::NOTEMPTY | Errno::EXIST) => {
                    if level.found == 0 {
                        return Err(RemoveError::NotEmpty {
                            path: self.path(None),
                        });
                    }
                    level.found = 0;
                    level.dir.rewind();
                    return Ok(());
                }
                Err(Errno::BUSY) => {
                    return Err(RemoveError::Mount {
                        path: self.path(None),
                    })
                }
                Err(Errno::ACCESS | Errno::PERM) if !retried && depth > 1 => {
                    retried = true;
                    above[above.len() - 1].loosen();
                }
                Err(e) => {
                    return Err(RemoveError::RemoveDir {
                        path: self.path(None),
                        source: SyscallError::new("unlinkat(AT_REMOVEDIR)", e),
                    })
                }
            }
        }
    }
}
