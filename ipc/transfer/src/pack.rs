//! The packer: [`pack`] writes one tree (a [`Source`]) as a tar stream, opened once and walked
//! without following any symlink.
//!
//! - The walk is iterative (at most [`MAX_DEPTH`] directories deep) with `openat(O_NOFOLLOW)`
//!   and `fstatat(AT_SYMLINK_NOFOLLOW)` relative to the open parent; what is archived is what
//!   was opened, whatever is renamed meanwhile.
//! - Symlinks are archived as symlinks (their target text), never followed.
//! - Regular files are archived with the size `fstat` gave when they were opened, and exactly
//!   that many bytes: a file that shrinks while read is padded with zeros, one that grows is
//!   cut; both are counted in [`Summary::changed`]. The stream stays well-formed either way.
//! - A second name of a file already archived (same device and inode) is archived as a hard
//!   link to the first.
//! - Device nodes, fifos and sockets inside the tree are skipped and counted in
//!   [`Summary::skipped`] (a special file as the source itself is refused by
//!   [`crate::resolve_source`]).
//! - Owners are archived as 0 (the extractor does not restore them).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use tar::{EntryType, Header};

use crate::error::{lossy, TransferError};
use crate::place::{special_kind, Source};
use crate::Summary;

/// Deepest directory nesting archived (each level holds one open directory).
pub const MAX_DEPTH: usize = 256;

/// Writes `source` as a tar stream to `out` (see the module docs) and finishes the archive.
///
/// Errors: [`TransferError::Source`] (the source vanished), [`TransferError::Walk`],
/// [`TransferError::TooDeep`], [`TransferError::WriteArchive`].
pub fn pack<W: Write>(source: &Source, out: W) -> Result<Summary, TransferError> {
    let mut packer = Packer::new(out);
    let name = source.name.as_slice();
    let top = name.to_vec();
    let st = rustix::fs::statat(&source.parent, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| {
        TransferError::Source {
            path: lossy(name),
            source: e.into(),
        }
    })?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Directory => {
            let fd = open_dir(source.parent.as_fd(), name).map_err(|e| walk(&top, "openat", e))?;
            packer.tree(fd, top)?;
        }
        _ => {
            if !packer.entry(source.parent.as_fd(), name, &top)? {
                return Err(TransferError::Source {
                    path: lossy(name),
                    source: Errno::NOENT.into(),
                });
            }
        }
    }
    packer.finish().map(|(_, summary)| summary)
}

fn walk(path: &[u8], call: &'static str, e: impl Into<io::Error>) -> TransferError {
    TransferError::Walk {
        path: lossy(path),
        call,
        source: e.into(),
    }
}

fn open_dir(parent: BorrowedFd<'_>, name: &[u8]) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        parent,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn join(prefix: &[u8], name: &[u8]) -> Vec<u8> {
    let mut path = Vec::with_capacity(prefix.len() + 1 + name.len());
    path.extend_from_slice(prefix);
    path.push(b'/');
    path.extend_from_slice(name);
    path
}

fn header(kind: EntryType, st: &Stat) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(st.st_mode & 0o7777);
    h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
    h.set_uid(0);
    h.set_gid(0);
    h.set_size(0);
    h
}

pub(crate) struct Packer<W: Write> {
    builder: tar::Builder<W>,
    /// `(st_dev, st_ino)` of archived files with more than one name → their archive path.
    links: HashMap<(u64, u64), Vec<u8>>,
    summary: Summary,
}

impl<W: Write> Packer<W> {
    pub(crate) fn new(out: W) -> Self {
        Packer {
            builder: tar::Builder::new(out),
            links: HashMap::new(),
            summary: Summary::default(),
        }
    }

    /// Ends the archive and returns the writer.
    pub(crate) fn finish(self) -> Result<(W, Summary), TransferError> {
        let summary = self.summary;
        let mut out = self
            .builder
            .into_inner()
            .map_err(|source| TransferError::WriteArchive { source })?;
        out.flush()
            .map_err(|source| TransferError::WriteArchive { source })?;
        Ok((out, summary))
    }

    fn write_error(&self, source: io::Error) -> TransferError {
        TransferError::WriteArchive { source }
    }

    /// Archives the directory `fd` as `top` and everything beneath it.
    fn tree(&mut self, fd: OwnedFd, top: Vec<u8>) -> Result<(), TransferError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| walk(&top, "fstat", e))?;
        self.dir_header(&top, &st)?;
        let dir = Dir::new(fd).map_err(|e| walk(&top, "fdopendir", e))?;
        let mut stack: Vec<(Dir, Vec<u8>)> = vec![(dir, top)];
        while let Some((dir, prefix)) = stack.last_mut() {
            let Some(next) = dir.read() else {
                stack.pop();
                continue;
            };
            let entry = next.map_err(|e| walk(prefix, "getdents64", e))?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let name = name.to_vec();
            let path = join(prefix, &name);
            let parent = dir.fd().map_err(|e| walk(&path, "dirfd", e))?;
            let st = match rustix::fs::statat(parent, name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                // Removed since the listing.
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(walk(&path, "fstatat", e)),
            };
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                self.entry(parent, &name, &path)?;
                continue;
            }
            let fd = match open_dir(parent, &name) {
                Ok(fd) => fd,
                // Removed, or replaced by a non-directory, since the listing.
                Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => continue,
                Err(e) => return Err(walk(&path, "openat", e)),
            };
            if stack.len() >= MAX_DEPTH {
                return Err(TransferError::TooDeep {
                    path: lossy(&path),
                    max: MAX_DEPTH,
                });
            }
            let st = rustix::fs::fstat(&fd).map_err(|e| walk(&path, "fstat", e))?;
            self.dir_header(&path, &st)?;
            let dir = Dir::new(fd).map_err(|e| walk(&path, "fdopendir", e))?;
            stack.push((dir, path));
        }
        Ok(())
    }

    fn dir_header(&mut self, path: &[u8], st: &Stat) -> Result<(), TransferError> {
        let mut h = header(EntryType::Directory, st);
        let mut named = path.to_vec();
        named.push(b'/');
        self.builder
            .append_data(&mut h, Path::new(OsStr::from_bytes(&named)), io::empty())
            .map_err(|e| self.write_error(e))?;
        self.summary.files += 1;
        Ok(())
    }

    /// Archives the non-directory `name` of `parent` as `path`. Returns whether it was
    /// archived (`false`: gone, or a special file, skipped).
    fn entry(
        &mut self,
        parent: BorrowedFd<'_>,
        name: &[u8],
        path: &[u8],
    ) -> Result<bool, TransferError> {
        let archived = Path::new(OsStr::from_bytes(path));
        let st = match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(false),
            Err(e) => return Err(walk(path, "fstatat", e)),
        };
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Symlink => {
                let target = match rustix::fs::readlinkat(parent, name, Vec::new()) {
                    Ok(t) => t,
                    Err(Errno::NOENT | Errno::INVAL) => return Ok(false),
                    Err(e) => return Err(walk(path, "readlinkat", e)),
                };
                let mut h = header(EntryType::Symlink, &st);
                self.builder
                    .append_link(&mut h, archived, OsStr::from_bytes(target.as_bytes()))
                    .map_err(|e| self.write_error(e))?;
            }
            FileType::RegularFile => {
                let fd = match rustix::fs::openat(
                    parent,
                    name,
                    OFlags::RDONLY
                        | OFlags::NOFOLLOW
                        | OFlags::NOCTTY
                        | OFlags::NONBLOCK
                        | OFlags::CLOEXEC,
                    Mode::empty(),
                ) {
                    Ok(fd) => fd,
                    Err(Errno::NOENT | Errno::LOOP) => return Ok(false),
                    Err(e) => return Err(walk(path, "openat", e)),
                };
                let st = rustix::fs::fstat(&fd).map_err(|e| walk(path, "fstat", e))?;
                if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                    self.summary.skipped += 1;
                    return Ok(false);
                }
                self.file(fd, &st, path)?;
            }
            _ => {
                debug_assert!(special_kind(FileType::from_raw_mode(st.st_mode)).is_some());
                self.summary.skipped += 1;
                return Ok(false);
            }
        }
        self.summary.files += 1;
        Ok(true)
    }

    /// Archives the open regular file `fd` (status `st`) as `path`.
    pub(crate) fn file(
        &mut self,
        fd: OwnedFd,
        st: &Stat,
        path: &[u8],
    ) -> Result<(), TransferError> {
        let archived = Path::new(OsStr::from_bytes(path));
        let key = (st.st_dev, st.st_ino);
        if st.st_nlink > 1 {
            if let Some(first) = self.links.get(&key) {
                let mut h = header(EntryType::Link, st);
                let first = OsStr::from_bytes(first).to_owned();
                return self
                    .builder
                    .append_link(&mut h, archived, first)
                    .map_err(|e| self.write_error(e));
            }
            self.links.insert(key, path.to_vec());
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        let mut h = header(EntryType::Regular, st);
        h.set_size(size);
        let mut reader = Exact {
            file: std::fs::File::from(fd),
            left: size,
            padded: false,
            error: None,
        };
        if let Err(e) = self.builder.append_data(&mut h, archived, &mut reader) {
            return Err(match reader.error.take() {
                Some(source) => walk(path, "read", source),
                None => self.write_error(e),
            });
        }
        let mut probe = [0u8; 1];
        let grew = matches!(reader.file.read(&mut probe), Ok(n) if n > 0);
        if reader.padded || grew {
            self.summary.changed += 1;
        }
        self.summary.bytes += size;
        Ok(())
    }
}

/// Reads exactly `left` bytes of `file`: zeros past its end (`padded`), nothing past `left`.
/// A read error is kept in `error` (the tar builder only sees that the copy failed).
struct Exact {
    file: std::fs::File,
    left: u64,
    padded: bool,
    error: Option<io::Error>,
}

impl Read for Exact {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = usize::try_from(self.left)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        if want == 0 {
            return Ok(0);
        }
        let mut n = 0;
        while !self.padded {
            match self.file.read(&mut buf[..want]) {
                Ok(got) => {
                    n = got;
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let shown = io::Error::new(e.kind(), e.to_string());
                    self.error = Some(e);
                    return Err(shown);
                }
            }
        }
        if n == 0 {
            // The file shrank: pad with zeros to the size in the header.
            self.padded = true;
            buf[..want].fill(0);
            n = want;
        }
        self.left -= n as u64;
        Ok(n)
    }
}
