//! The contexts directory, held open: every log is listed, created and opened beneath it.
//!
//! The directory is opened once (`O_NOFOLLOW`), and every path under it is resolved from that
//! descriptor with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//! RESOLVE_NO_XDEV)`: a symlink planted in place of a log or of an owner's directory is refused
//! (`ELOOP`), never followed, and what is opened must be a regular file (`O_NONBLOCK |
//! O_NOCTTY`, so a planted FIFO or terminal neither blocks the open nor becomes the daemon's
//! terminal); it is then `flock`ed, as every writer of a log does. The listing at start never
//! follows a link either, and reads at most [`MAX_LISTED_ENTRIES`] entries. Needs Linux 5.6
//! (`openat2`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, ResolveFlags};

use super::error::ContextError;
use super::names::{self, Key};
use belayer_context::ContextLogError;

/// Directory entries the listing at start reads at most (all directories together); past it
/// the rest are skipped with a warning (such a log is taken over when its trajectory is next
/// appended to).
pub(super) const MAX_LISTED_ENTRIES: usize = 1 << 20;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

const LOG_FLAGS: OFlags = OFlags::RDWR
    .union(OFlags::CLOEXEC)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::NOCTTY);

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::CLOEXEC);

/// A log found on disk by [`ContextsDir::list`].
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Found {
    /// Its trajectory.
    pub(super) key: Key,
    /// File size, bytes.
    pub(super) bytes: u64,
}

/// The open contexts directory (`<state dir>/contexts`).
#[derive(Debug)]
pub(super) struct ContextsDir {
    path: PathBuf,
    fd: OwnedFd,
}

impl ContextsDir {
    /// Opens the directory `path` (not a symlink to one), creating it (mode 0700) first when
    /// `create`; `Ok(None)` when it does not exist and `create` is false.
    ///
    /// Errors: [`ContextError::CreateDir`], [`ContextError::OpenDir`].
    pub(super) fn open(path: &Path, create: bool) -> Result<Option<ContextsDir>, ContextError> {
        let open = || rustix::fs::open(path, DIR_FLAGS, Mode::empty());
        let fd = match open() {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) if !create => return Ok(None),
            Err(rustix::io::Errno::NOENT) => {
                match rustix::fs::mkdir(path, Mode::from_raw_mode(0o700)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => {
                        return Err(ContextError::CreateDir {
                            path: path.to_path_buf(),
                            source: e.into(),
                        })
                    }
                }
                open().map_err(|e| open_dir_err(path, e))?
            }
            Err(e) => return Err(open_dir_err(path, e)),
        };
        Ok(Some(ContextsDir {
            path: path.to_path_buf(),
            fd,
        }))
    }

    /// Opens the existing log of `key`.
    ///
    /// Errors: [`ContextLogError::Open`] (`ELOOP` for a symlink on the way),
    /// [`ContextError::NotALogFile`].
    pub(super) fn open_log(&self, key: &Key) -> Result<File, ContextError> {
        let rel = names::rel_path(key);
        let fd = rustix::fs::openat2(&self.fd, &rel, LOG_FLAGS, Mode::empty(), RESOLVE)
            .map_err(|e| self.open_err(&rel, e))?;
        self.regular(fd, &rel)
    }

    /// Creates the log file of `key` (mode 0600; and its owner's directory, mode 0700, for a
    /// non-root owner); `Ok(None)` when a file of that name exists already.
    ///
    /// Errors: [`ContextError::CreateDir`], [`ContextLogError::Open`],
    /// [`ContextError::NotALogFile`].
    pub(super) fn create_log(&self, key: &Key) -> Result<Option<File>, ContextError> {
        if key.owner != 0 {
            let sub = names::owner_dir(key.owner);
            match rustix::fs::mkdirat(&self.fd, &sub, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => {
                    return Err(ContextError::CreateDir {
                        path: self.path.join(sub),
                        source: e.into(),
                    })
                }
            }
        }
        let rel = names::rel_path(key);
        let flags = LOG_FLAGS | OFlags::CREATE | OFlags::EXCL;
        match rustix::fs::openat2(&self.fd, &rel, flags, Mode::from_raw_mode(0o600), RESOLVE) {
            Ok(fd) => self.regular(fd, &rel).map(Some),
            Err(rustix::io::Errno::EXIST) => Ok(None),
            Err(e) => Err(self.open_err(&rel, e)),
        }
    }

    /// Removes the log file of `key`: `Ok(false)` when there is none (nor its owner's
    /// directory). The owner's directory is opened beneath the directory like a log is (a
    /// symlink in its place is refused, `ENOTDIR`), and the entry is unlinked relative to it
    /// (`unlinkat`, which never follows the last component): whatever non-directory lies
    /// there goes (a symlink planted in place of the log is removed itself, its target is
    /// untouched); a directory there is refused.
    ///
    /// Errors: [`ContextError::RemoveLog`] (`openat2` of the owner's directory, `unlinkat`),
    /// [`ContextError::NotALogFile`] (a directory in place of the log).
    pub(super) fn remove_log(&self, key: &Key) -> Result<bool, ContextError> {
        let rel = names::rel_path(key);
        let remove_err = |e: rustix::io::Errno| ContextError::RemoveLog {
            path: self.path.join(&rel),
            source: e.into(),
        };
        let sub = match key.owner {
            0 => None,
            uid => {
                let sub = names::owner_dir(uid);
                match rustix::fs::openat2(&self.fd, &sub, DIR_FLAGS, Mode::empty(), RESOLVE) {
                    Ok(fd) => Some(fd),
                    Err(rustix::io::Errno::NOENT) => return Ok(false),
                    Err(e) => return Err(remove_err(e)),
                }
            }
        };
        let dir = sub.as_ref().unwrap_or(&self.fd);
        match rustix::fs::unlinkat(dir, names::file_name(key), AtFlags::empty()) {
            Ok(()) => Ok(true),
            Err(rustix::io::Errno::NOENT) => Ok(false),
            Err(rustix::io::Errno::ISDIR) => Err(ContextError::NotALogFile {
                path: self.path.join(&rel),
            }),
            Err(e) => Err(remove_err(e)),
        }
    }

    /// Every log in the directory: root's at the top, other uids' in `u<uid>/`. Entries that
    /// are not logs (another name, a symlink, a FIFO, a directory of another name) are skipped
    /// and nothing is followed.
    ///
    /// Errors: reading the directory or a `u<uid>` directory (`getdents64`, `openat`,
    /// `fstatat`).
    pub(super) fn list(&self) -> io::Result<Vec<Found>> {
        let mut found = Vec::new();
        let mut seen = 0usize;
        let mut subdirs = Vec::new();
        list_one(&self.fd, 0, &mut found, &mut seen, Some(&mut subdirs))?;
        for (uid, name) in subdirs {
            let fd = match rustix::fs::openat(&self.fd, name.as_str(), DIR_FLAGS, Mode::empty()) {
                Ok(fd) => fd,
                // Replaced by a symlink (or removed) since it was read: not a log directory.
                Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => continue,
                Err(e) => return Err(e.into()),
            };
            list_one(&fd, uid, &mut found, &mut seen, None)?;
        }
        if seen >= MAX_LISTED_ENTRIES {
            tracing::warn!(
                dir = %self.path.display(),
                max = MAX_LISTED_ENTRIES,
                "too many entries in the context log dir: the rest are not listed"
            );
        }
        Ok(found)
    }

    fn regular(&self, fd: OwnedFd, rel: &Path) -> Result<File, ContextError> {
        let stat = rustix::fs::fstat(&fd).map_err(|e| self.open_err(rel, e))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(ContextError::NotALogFile {
                path: self.path.join(rel),
            });
        }
        // One writer per log, like `ContextLog`: another process holding it is refused.
        match belayer_context::flock_exclusive(&fd) {
            Ok(()) => Ok(File::from(fd)),
            Err(rustix::io::Errno::WOULDBLOCK) => Err(ContextLogError::Locked {
                path: self.path.join(rel),
            }
            .into()),
            Err(e) => Err(ContextLogError::Lock {
                path: self.path.join(rel),
                source: e.into(),
            }
            .into()),
        }
    }

    fn open_err(&self, rel: &Path, e: rustix::io::Errno) -> ContextError {
        ContextLogError::Open {
            path: self.path.join(rel),
            source: e.into(),
        }
        .into()
    }
}

fn open_dir_err(path: &Path, e: rustix::io::Errno) -> ContextError {
    ContextError::OpenDir {
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// Lists the logs of `owner` in the directory `fd`; with `subdirs` (the top directory), also
/// collects its `u<uid>` directories.
fn list_one(
    fd: &OwnedFd,
    owner: u32,
    found: &mut Vec<Found>,
    seen: &mut usize,
    mut subdirs: Option<&mut Vec<(u32, String)>>,
) -> io::Result<()> {
    let mut dir = Dir::read_from(fd.as_fd())?;
    while *seen < MAX_LISTED_ENTRIES {
        let Some(entry) = dir.read() else { break };
        let entry = entry?;
        *seen += 1;
        let Ok(file_name) = entry.file_name().to_str() else {
            continue;
        };
        let log = names::log_name(file_name);
        let uid = subdirs.as_ref().and(names::owner_of_dir(file_name));
        if log.is_none() && uid.is_none() {
            continue;
        }
        let stat = match rustix::fs::statat(fd, file_name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(s) => s,
            Err(rustix::io::Errno::NOENT) => continue,
            Err(e) => return Err(e.into()),
        };
        match (FileType::from_raw_mode(stat.st_mode), log, uid) {
            (FileType::RegularFile, Some(name), _) => found.push(Found {
                key: Key {
                    owner,
                    name: name.to_owned(),
                },
                bytes: u64::try_from(stat.st_size).unwrap_or(0),
            }),
            (FileType::Directory, _, Some(uid)) => {
                if let Some(s) = subdirs.as_deref_mut() {
                    s.push((uid, file_name.to_owned()));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(owner: u32, name: &str) -> Key {
        Key {
            owner,
            name: name.into(),
        }
    }

    #[test]
    fn listing_finds_logs_and_skips_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("contexts");
        assert!(ContextsDir::open(&path, false).unwrap().is_none());
        let dir = ContextsDir::open(&path, true).unwrap().unwrap();
        assert!(dir.list().unwrap().is_empty());
        std::fs::create_dir_all(path.join("u5001")).unwrap();
        std::fs::create_dir_all(path.join("u0")).unwrap();
        std::fs::create_dir_all(path.join("junk")).unwrap();
        std::fs::create_dir_all(path.join("dir.ctxlog")).unwrap();
        std::fs::write(path.join("old.ctxlog"), b"12345").unwrap();
        std::fs::write(path.join("notes.txt"), b"x").unwrap();
        std::fs::write(path.join(".hidden.ctxlog"), b"x").unwrap();
        std::fs::write(path.join("u5001").join("mine.ctxlog"), b"123").unwrap();
        std::fs::write(path.join("u0").join("sneaky.ctxlog"), b"1").unwrap();
        std::fs::write(path.join("junk").join("x.ctxlog"), b"1").unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("stolen.ctxlog"), b"1").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", path.join("u5001").join("link.ctxlog")).unwrap();
        std::os::unix::fs::symlink(&outside, path.join("u5002")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path.join("fifo.ctxlog"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        let mut found = dir.list().unwrap();
        found.sort_by(|a, b| a.key.name.cmp(&b.key.name));
        assert_eq!(
            found,
            [
                Found {
                    key: key(5001, "mine"),
                    bytes: 3
                },
                Found {
                    key: key(0, "old"),
                    bytes: 5
                },
            ]
        );
    }

    #[test]
    fn logs_are_opened_beneath_the_dir_and_never_through_a_link() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("contexts");
        let dir = ContextsDir::open(&path, true).unwrap().unwrap();
        let mine = key(5001, "t");
        assert!(dir.create_log(&mine).unwrap().is_some());
        assert!(dir.create_log(&mine).unwrap().is_none(), "exists");
        dir.open_log(&mine).unwrap();
        assert!(path.join("u5001/t.ctxlog").is_file());

        // A symlinked owner dir and a symlinked log are refused, and nothing is created there.
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("t.ctxlog"), b"outside").unwrap();
        std::os::unix::fs::symlink(&outside, path.join("u5002")).unwrap();
        std::os::unix::fs::symlink(outside.join("t.ctxlog"), path.join("ln.ctxlog")).unwrap();
        for k in [key(5002, "t"), key(5002, "new"), key(0, "ln")] {
            let opened = dir.open_log(&k);
            assert!(
                matches!(&opened, Err(ContextError::Log(ContextLogError::Open { source, .. }))
                    if source.raw_os_error() == Some(libc::ELOOP)),
                "{k:?}: {opened:?}"
            );
            let created = dir.create_log(&k);
            assert!(
                matches!(
                    created,
                    Ok(None) | Err(ContextError::Log(ContextLogError::Open { .. }))
                ),
                "{k:?}: {created:?}"
            );
        }
        assert!(!outside.join("new.ctxlog").exists());
        assert_eq!(std::fs::read(outside.join("t.ctxlog")).unwrap(), b"outside");

        // A FIFO or a directory in place of a log is not a log file.
        std::fs::create_dir(path.join("d.ctxlog")).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            path.join("f.ctxlog"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        for name in ["d", "f"] {
            let opened = dir.open_log(&key(0, name));
            assert!(opened.is_err(), "{name}: {opened:?}");
        }
        assert!(matches!(
            dir.open_log(&key(0, "f")),
            Err(ContextError::NotALogFile { .. })
        ));

        // A removal unlinks beneath the dir: never through the linked owner dir, and a
        // linked log goes itself, its target stays.
        let removed = dir.remove_log(&key(5002, "t"));
        assert!(
            matches!(&removed, Err(ContextError::RemoveLog { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR))),
            "{removed:?}"
        );
        assert!(dir.remove_log(&key(0, "ln")).unwrap());
        assert!(!dir.remove_log(&key(0, "ln")).unwrap(), "gone");
        assert_eq!(std::fs::read(outside.join("t.ctxlog")).unwrap(), b"outside");
        assert!(dir.remove_log(&mine).unwrap());
        assert!(!path.join("u5001/t.ctxlog").exists());
        assert!(!dir.remove_log(&key(5003, "t")).unwrap(), "no owner dir");
        assert!(matches!(
            dir.remove_log(&key(0, "d")),
            Err(ContextError::NotALogFile { .. })
        ));

        // The dir itself must not be a symlink.
        let alias = tmp.path().join("alias");
        std::os::unix::fs::symlink(&path, &alias).unwrap();
        assert!(matches!(
            ContextsDir::open(&alias, true),
            Err(ContextError::OpenDir { .. })
        ));
    }
}
