//! A sorted, depth-first, pre-order walk of a directory tree that never follows a symlink:
//! every directory is opened relative to its parent with `O_NOFOLLOW | O_DIRECTORY`, every
//! entry is examined with `statx(AT_SYMLINK_NOFOLLOW)` relative to its parent's fd.
//! Shared by capture (which archives what it visits) and digest (which hashes it).

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, Statx, StatxFlags, CWD};

use crate::sys::{sorted_names, Call, SyscallError};

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

/// How a module's error type records a failure of the walk itself.
pub(crate) trait WalkErrorSink: Sized {
    /// `path` is the walk root joined with the relative path of the entry being read.
    fn walk_error(path: PathBuf, source: SyscallError) -> Self;
}

struct Frame {
    fd: OwnedFd,
    prefix: Vec<u8>,
    names: Vec<CString>,
    next: usize,
}

/// The file type bits of a `statx` mode.
pub(crate) fn file_type(stat: &Statx) -> rustix::fs::FileType {
    rustix::fs::FileType::from_raw_mode(u32::from(stat.stx_mode))
}

/// Walks `root` (which must be a directory, not a symlink to one), calling `visit` for the
/// root and then for every entry below it in sorted pre-order. Entries whose relative path
/// is in `exclude` are skipped together with everything below them. Holds one fd per
/// directory level of the current path.
pub(crate) fn walk<E: WalkErrorSink>(
    root: &Path,
    exclude: &[Vec<u8>],
    visit: impl FnMut(&WalkEntry<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let root_fd = rustix::fs::openat(CWD, root, DIR_FLAGS, Mode::empty())
        .call("openat")
        .map_err(|e| E::walk_error(root.to_path_buf(), e))?;
    walk_fd(root_fd.as_fd(), root, exclude, visit)
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// [`walk`] of the directory open as `dir` (any open mode, `O_PATH` included: it is opened
/// again as `.` for reading, with the permissions of the calling process). `label` stands
/// for the root in error paths.
pub(crate) fn walk_fd<E: WalkErrorSink>(
    dir: BorrowedFd<'_>,
    label: &Path,
    exclude: &[Vec<u8>],
    mut visit: impl FnMut(&WalkEntry<'_>) -> Result<(), E>,
) -> Result<(), E> {
    let root = label;
    let fail = |rel: &[u8], source: SyscallError| {
        let path = if rel.is_empty() {
            root.to_path_buf()
        } else {
            root.join(OsStr::from_bytes(rel))
        };
        E::walk_error(path, source)
    };
    let dir_flags = DIR_FLAGS;
    let root_fd = rustix::fs::openat(dir, c".", dir_flags, Mode::empty())
        .call("openat")
        .map_err(|e| fail(b"", e))?;
    let stat = rustix::fs::statx(&root_fd, c"", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
        .call("statx")
        .map_err(|e| fail(b"", e))?;
    visit(&WalkEntry {
        rel: b"",
        parent: root_fd.as_fd(),
        name: c"",
        stat: &stat,
        dir: Some(root_fd.as_fd()),
    })?;
    let names = sorted_names(&root_fd).map_err(|e| fail(b"", e))?;
    let mut stack = vec![Frame {
        fd: root_fd,
        prefix: Vec::new(),
        names,
        next: 0,
    }];
    while let Some(frame) = stack.last_mut() {
        let Some(name) = frame.names.get_mut(frame.next).map(std::mem::take) else {
            stack.pop();
            continue;
        };
        frame.next += 1;
        let mut rel = Vec::with_capacity(frame.prefix.len() + 1 + name.as_bytes().len());
        if !frame.prefix.is_empty() {
            rel.extend_from_slice(&frame.prefix);
            rel.push(b'/');
        }
        rel.extend_from_slice(name.as_bytes());
        if exclude.contains(&rel) {
            continue;
        }
        let stat = rustix::fs::statx(
            &frame.fd,
            name.as_c_str(),
            AtFlags::SYMLINK_NOFOLLOW,
            StatxFlags::BASIC_STATS,
        )
        .call("statx")
        .map_err(|e| fail(&rel, e))?;
        if file_type(&stat) != rustix::fs::FileType::Directory {
            visit(&WalkEntry {
                rel: &rel,
                parent: frame.fd.as_fd(),
                name: &name,
                stat: &stat,
                dir: None,
            })?;
            continue;
        }
        let fd = rustix::fs::openat(&frame.fd, name.as_c_str(), dir_flags, Mode::empty())
            .call("openat")
            .map_err(|e| fail(&rel, e))?;
        visit(&WalkEntry {
            rel: &rel,
            parent: frame.fd.as_fd(),
            name: &name,
            stat: &stat,
            dir: Some(fd.as_fd()),
        })?;
        let names = sorted_names(&fd).map_err(|e| fail(&rel, e))?;
        stack.push(Frame {
            fd,
            prefix: rel,
            names,
            next: 0,
        });
    }
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
    struct TestError(
        #[allow(dead_code)] PathBuf,
        #[allow(dead_code)] SyscallError,
    );

    impl WalkErrorSink for TestError {
        fn walk_error(path: PathBuf, source: SyscallError) -> Self {
            TestError(path, source)
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
        walk::<TestError>(root, &normalize_excludes(&["/skip/"]), |e| {
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
        let err = walk::<TestError>(&dir.path().join("l"), &[], |_| Ok(())).unwrap_err();
        // O_NOFOLLOW | O_DIRECTORY on a symlink fails with ENOTDIR.
        assert_eq!(
            err.1.errno(),
            Some(rustix::io::Errno::NOTDIR.raw_os_error())
        );
    }
}
