//! A sorted, depth-first, pre-order walk of a directory tree that never follows a symlink:
//! every directory is opened relative to its parent with `O_NOFOLLOW | O_DIRECTORY`, every
//! entry is examined with `statx(AT_SYMLINK_NOFOLLOW)` relative to its parent's fd.
//! Shared by capture (which archives what it visits), digest (which hashes it) and the
//! re-keying walk of materialize.
//!
//! # Bounds
//!
//! The tree belongs to a hostile sandbox, so the walk is iterative and bounded:
//!
//! - **Depth**: at most [`MAX_WALK_DEPTH`] levels below the root; a deeper entry fails the
//!   walk with [`WalkFailure::TooDeep`]. Entry paths are at most 4096 bytes in every format
//!   of this crate (Linux `PATH_MAX`), and a path of `d` components has at least `2d - 1`
//!   bytes, so no tree deeper than 2048 levels could be captured, installed or restored
//!   anyway.
//! - **File descriptors**: at most [`MAX_OPEN_DIRS`] directory fds (plus two transient
//!   ones), whatever the depth. Deeper levels close the fds of shallower ones; coming back
//!   up, a closed directory is re-opened as `..` of its child and must be the same
//!   directory (device and inode), else the walk fails with [`WalkFailure::Moved`].
//! - **Memory**: one path buffer, and the sorted names of the directories on the current
//!   path; at most `max_names` names are held at once (a directory with more fails the
//!   walk with [`WalkFailure::TooManyEntries`] before they are all read).

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, Statx, StatxFlags, CWD};

use crate::sys::{sorted_names_at_most, Call, SyscallError};

/// Deepest level the walk visits: entries at most this many components below the root.
/// 2048 is the depth of the deepest path that fits in 4096 bytes (`d/d/…/d`), the longest
/// entry path capture, install and materialize accept.
pub const MAX_WALK_DEPTH: usize = 2048;

/// Most directory fds the walk holds at once (the root's included), independent of depth.
pub(crate) const MAX_OPEN_DIRS: usize = 16;

/// One visited entry.
pub(crate) struct WalkEntry<'a> {
    /// Path relative to the walk root, components joined by `/`; empty for the root.
    pub rel: &'a [u8],
    /// The directory holding the entry (the root itself for the root entry).
    pub parent: BorrowedFd<'a>,
    /// The entry's name in `parent` (empty for the root).
    pub name: &'a CStr,
    /// `statx` of the entry, not following a symlink.
    pub stat: &'a Statx,
    /// The entry opened `O_RDONLY | O_DIRECTORY` when it is a directory.
    pub dir: Option<BorrowedFd<'a>>,
}

impl WalkEntry<'_> {
    /// Whether this is the walk root.
    pub(crate) fn is_root(&self) -> bool {
        self.rel.is_empty()
    }
}

/// Why the walk itself failed (failures of the visitor are its own error type).
#[derive(Debug)]
pub(crate) enum WalkFailure {
    /// Opening, listing or examining an entry failed.
    Syscall(SyscallError),
    /// An entry lies deeper than [`MAX_WALK_DEPTH`] levels below the root.
    TooDeep {
        /// The limit.
        max: usize,
    },
    /// Listing a directory would hold more than the walk's `max_names` names at once.
    TooManyEntries {
        /// The limit.
        max: u64,
    },
    /// A directory re-opened through `..` of its child is not the one the walk left (the
    /// tree was moved during the walk).
    Moved,
}

/// How a module's error type records a failure of the walk itself.
pub(crate) trait WalkErrorSink: Sized {
    /// `path` is the walk root joined with the relative path of the entry being read.
    fn walk_error(path: PathBuf, failure: WalkFailure) -> Self;
}

/// A directory on the current path.
struct Frame {
    /// Its fd; `None` while closed to keep within [`MAX_OPEN_DIRS`] (never for the top).
    fd: Option<OwnedFd>,
    /// Device and inode, to check a re-opened fd.
    id: (u32, u32, u64),
    /// Length of its relative path in the shared path buffer.
    prefix_len: usize,
    /// Its entries, sorted; visited ones are taken out.
    names: Vec<CString>,
    next: usize,
}

/// The file type bits of a `statx` mode.
pub(crate) fn file_type(stat: &Statx) -> rustix::fs::FileType {
    rustix::fs::FileType::from_raw_mode(u32::from(stat.stx_mode))
}

fn identity(stat: &Statx) -> (u32, u32, u64) {
    (stat.stx_dev_major, stat.stx_dev_minor, stat.stx_ino)
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// Walks `root` (which must be a directory, not a symlink to one), calling `visit` for the
/// root and then for every entry below it in sorted pre-order. Entries whose relative path
/// is in `exclude` are skipped together with everything below them. At most `max_names`
/// directory entries are held in memory at once. Bounds: see the module docs.
pub(crate) fn walk<E: WalkErrorSink>(
    root: &Path,
    exclude: &[Vec<u8>],
    max_names: u64,
    visit: impl FnMut(&WalkEntry<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let root_fd = rustix::fs::openat(CWD, root, DIR_FLAGS, Mode::empty())
        .call("openat")
        .map_err(|e| E::walk_error(root.to_path_buf(), WalkFailure::Syscall(e)))?;
    walk_fd(root_fd.as_fd(), root, exclude, max_names, visit)
}

/// [`walk`] of the directory open as `dir` (any open mode, `O_PATH` included: it is opened
/// again as `.` for reading, with the permissions of the calling process). `label` stands
/// for the root in error paths.
pub(crate) fn walk_fd<E: WalkErrorSink>(
    dir: BorrowedFd<'_>,
    label: &Path,
    exclude: &[Vec<u8>],
    max_names: u64,
    mut visit: impl FnMut(&WalkEntry<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let root = label;
    let fail = |rel: &[u8], failure: WalkFailure| {
        let path = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(OsStr::from_bytes(rel))
        };
        E::walk_error(path, failure)
    };
    let syscall = |rel: &[u8], source: SyscallError| fail(rel, WalkFailure::Syscall(source));
    let root_fd = rustix::fs::openat(dir, c".", DIR_FLAGS, Mode::empty())
        .call("openat")
        .map_err(|e| syscall(b"", e))?;
    let stat = rustix::fs::statx(&root_fd, c"", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
        .call("statx")
        .map_err(|e| syscall(b"", e))?;
    visit(&WalkEntry {
        rel: b"",
        parent: root_fd.as_fd(),
        name: c"",
        stat: &stat,
        dir: Some(root_fd.as_fd()),
    })?;
    // Names listed and not yet visited, across all frames.
    let mut held = 0u64;
    let names = list(&root_fd, max_names, &mut held).map_err(|f| fail(b"", f))?;
    let mut rel: Vec<u8> = Vec::new();
    let mut stack = vec![Frame {
        fd: Some(root_fd),
        id: identity(&stat),
        prefix_len: 0,
        names,
        next: 0,
    }];
    loop {
        let depth = stack.len();
        let Some(frame) = stack.last_mut() else {
            break;
        };
        let Some(name) = frame.names.get_mut(frame.next).map(std::mem::take) else {
            rel.truncate(frame.prefix_len);
            pop(&mut stack).map_err(|f| fail(&rel, f))?;
            continue;
        };
        frame.next += 1;
        held -= 1;
        rel.truncate(frame.prefix_len);
        if !rel.is_empty() {
            rel.push(b'/');
        }
        rel.extend_from_slice(name.as_bytes());
        if exclude.contains(&rel) {
            continue;
        }
        if depth > MAX_WALK_DEPTH {
            return Err(fail(
                &rel,
                WalkFailure::TooDeep {
                    max: MAX_WALK_DEPTH,
                },
            ));
        }
        let Some(parent) = frame.fd.as_ref() else {
            // The top frame always holds its fd (`pop` re-opens it).
            return Err(fail(&rel, WalkFailure::Moved));
        };
        let stat = rustix::fs::statx(
            parent,
            name.as_c_str(),
            AtFlags::SYMLINK_NOFOLLOW,
            StatxFlags::BASIC_STATS,
        )
        .call("statx")
        .map_err(|e| syscall(&rel, e))?;
        if file_type(&stat) != rustix::fs::FileType::Directory {
            visit(&WalkEntry {
                rel: &rel,
                parent: parent.as_fd(),
                name: &name,
                stat: &stat,
                dir: None,
            })?;
            continue;
        }
        let fd = rustix::fs::openat(parent, name.as_c_str(), DIR_FLAGS, Mode::empty())
            .call("openat")
            .map_err(|e| syscall(&rel, e))?;
        visit(&WalkEntry {
            rel: &rel,
            parent: parent.as_fd(),
            name: &name,
            stat: &stat,
            dir: Some(fd.as_fd()),
        })?;
        let names = list(&fd, max_names, &mut held).map_err(|f| fail(&rel, f))?;
        stack.push(Frame {
            fd: Some(fd),
            id: identity(&stat),
            prefix_len: rel.len(),
            names,
            next: 0,
        });
        close_shallow(&mut stack);
    }
    Ok(())
}

/// The sorted names of `dir`, counted into `held` against `max`.
fn list(dir: &OwnedFd, max: u64, held: &mut u64) -> Result<Vec<CString>, WalkFailure> {
    let room = max.saturating_sub(*held);
    let names = sorted_names_at_most(dir, usize::try_from(room).unwrap_or(usize::MAX))
        .map_err(WalkFailure::Syscall)?
        .ok_or(WalkFailure::TooManyEntries { max })?;
    *held += names.len() as u64;
    Ok(names)
}

/// Closes the fd of the shallowest open frame below the root while more than
/// [`MAX_OPEN_DIRS`] are open.
fn close_shallow(stack: &mut [Frame]) {
    if stack.len() <= MAX_OPEN_DIRS {
        return;
    }
    // Frames 1..=len-MAX_OPEN_DIRS are closed, the root and the deepest ones stay open;
    // one push opens one fd, so only the frame just past that range can still hold one.
    let i = stack.len() - MAX_OPEN_DIRS;
    stack[i].fd = None;
}

/// Leaves the top directory; re-opens its parent through `..` when that was closed.
fn pop(stack: &mut Vec<Frame>) -> Result<(), WalkFailure> {
    let Some(child) = stack.pop() else {
        return Ok(());
    };
    let Some(parent) = stack.last_mut() else {
        return Ok(());
    };
    if parent.fd.is_some() {
        return Ok(());
    }
    let child_fd = child.fd.ok_or(WalkFailure::Moved)?;
    let fd = rustix::fs::openat(&child_fd, c"..", DIR_FLAGS, Mode::empty())
        .call("openat")
        .map_err(WalkFailure::Syscall)?;
    let stat = rustix::fs::statx(&fd, c"", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
        .call("statx")
        .map_err(WalkFailure::Syscall)?;
    if identity(&stat) != parent.id {
        return Err(WalkFailure::Moved);
    }
    parent.fd = Some(fd);
    Ok(())
}

/// Normalises exclusion paths: no leading `./` or `/`, no trailing `/`.
pub(crate) fn normalize_excludes(exclude: &[&str]) -> Vec<Vec<u8>> {
    exclude
        .iter()
        .map(|e| {
            let e = e.strip_prefix("./").unwrap_or(e);
            e.trim_matches('/').as_bytes().to_vec()
        })
        .filter(|e| !e.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[derive(Debug)]
    struct TestError(PathBuf, WalkFailure);

    impl WalkErrorSink for TestError {
        fn walk_error(path: PathBuf, failure: WalkFailure) -> Self {
            TestError(path, failure)
        }
    }

    #[test]
    fn walks_sorted_preorder_without_following_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("b/c")).unwrap();
        fs::write(root.join("b/c/f"), b"x").unwrap();
        fs::write(root.join("a"), b"x").unwrap();
        fs::create_dir(root.join("skip")).unwrap();
        fs::write(root.join("skip/g"), b"x").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("l")).unwrap();
        let mut seen = Vec::new();
        walk::<TestError>(root, &normalize_excludes(&["/skip/"]), 100, |e| {
            seen.push((String::from_utf8(e.rel.to_vec()).unwrap(), e.dir.is_some()));
            Ok(())
        })
        .unwrap();
        let expect = [
            ("", true),
            ("a", false),
            ("b", true),
            ("b/c", true),
            ("b/c/f", false),
            ("l", false),
        ];
        let expect: Vec<(String, bool)> = expect.iter().map(|(p, d)| (p.to_string(), *d)).collect();
        assert_eq!(seen, expect);
    }

    #[test]
    fn refuses_a_symlinked_root() {
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/etc", dir.path().join("l")).unwrap();
        let err = walk::<TestError>(&dir.path().join("l"), &[], 100, |_| Ok(())).unwrap_err();
        // O_NOFOLLOW | O_DIRECTORY on a symlink fails with ENOTDIR.
        match err.1 {
            WalkFailure::Syscall(e) => {
                assert_eq!(e.errno(), Some(rustix::io::Errno::NOTDIR.raw_os_error()))
            }
            other => panic!("{other:?}"),
        }
    }

    /// A chain of `depth` directories `d`, each holding a file `f` with its level.
    fn chain_with_files(root: &Path, depth: usize) {
        let mut path = root.to_path_buf();
        for level in 0..depth {
            path.push("d");
            fs::create_dir(&path).unwrap();
            fs::write(path.join("f"), level.to_string()).unwrap();
        }
    }

    #[test]
    fn deep_levels_reopen_their_parents_through_dotdot() {
        let dir = tempfile::tempdir().unwrap();
        let depth = MAX_OPEN_DIRS * 16;
        chain_with_files(dir.path(), depth);
        let mut files = 0;
        let mut most_open = 0;
        walk::<TestError>(dir.path(), &[], 10_000, |e| {
            if e.name.to_bytes() == b"f" {
                // `f` of level n comes after the whole chain below it, when the parent
                // had to be re-opened: the fd must be the right directory.
                let level = (e.rel.len() - 1) / 2 - 1;
                let fd =
                    rustix::fs::openat(e.parent, e.name, OFlags::RDONLY, Mode::empty()).unwrap();
                let mut buf = [0u8; 16];
                let n = rustix::io::read(&fd, &mut buf).unwrap();
                assert_eq!(&buf[..n], level.to_string().as_bytes());
                files += 1;
            }
            let open = fs::read_dir("/proc/self/fd").unwrap().count();
            most_open = most_open.max(open);
            Ok(())
        })
        .unwrap();
        assert_eq!(files, depth);
        // Other test threads open fds too (a few dozen at most); one fd per level would
        // need `depth`.
        assert!(most_open < depth / 2, "{most_open} fds open");
    }

    #[test]
    fn a_directory_moved_during_the_walk_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let depth = MAX_OPEN_DIRS * 2;
        chain_with_files(dir.path(), depth);
        let mut moved = false;
        let err = walk::<TestError>(dir.path(), &[], 100, |e| {
            if !moved && e.rel.len() == 2 * depth - 1 {
                // Deep down: move level 2 (whose parent fd is closed by now) to the root.
                fs::rename(dir.path().join("d/d"), dir.path().join("moved")).unwrap();
                moved = true;
            }
            Ok(())
        })
        .unwrap_err();
        assert!(matches!(err.1, WalkFailure::Moved), "{err:?}");
        assert_eq!(err.0, dir.path().join("d/d"));
    }

    #[test]
    fn depth_and_width_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let chain = dir.path().join("chain");
        fs::create_dir(&chain).unwrap();
        // Deeper than a path can name: built one level at a time.
        let mut fd = rustix::fs::openat(CWD, &chain, DIR_FLAGS, Mode::empty()).unwrap();
        for _ in 0..=MAX_WALK_DEPTH {
            rustix::fs::mkdirat(&fd, c"d", Mode::from_raw_mode(0o755)).unwrap();
            fd = rustix::fs::openat(&fd, c"d", DIR_FLAGS, Mode::empty()).unwrap();
        }
        let err = walk::<TestError>(&chain, &[], 100, |_| Ok(())).unwrap_err();
        assert!(matches!(
            err.1,
            WalkFailure::TooDeep {
                max: MAX_WALK_DEPTH
            }
        ));
        crate::remove_tree(&chain).unwrap();
        let wide = dir.path().join("wide");
        fs::create_dir(&wide).unwrap();
        for i in 0..20 {
            fs::write(wide.join(i.to_string()), b"").unwrap();
        }
        let err = walk::<TestError>(&wide, &[], 19, |_| Ok(())).unwrap_err();
        assert!(matches!(err.1, WalkFailure::TooManyEntries { max: 19 }));
        walk::<TestError>(&wide, &[], 20, |_| Ok(())).unwrap();
    }
}
