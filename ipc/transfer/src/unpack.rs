//! The hardened extractor: [`unpack`] creates the members of a tar stream beneath a
//! [`Destination`] and never writes outside it, whatever the archive or the tree already there
//! hold.
//!
//! - Names: relative, normal components only ([`crate::name::components`]); with
//!   `single_tree`, every member lies under the first member's top-level name (renamed for
//!   [`Destination::Rename`]).
//! - Parents: opened one component at a time with `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` from the destination directory; a missing
//!   parent is created (`mkdirat`, 0755), a symlink where a parent must be is refused
//!   ([`TransferError::Parent`] with `ELOOP`), so a member `a/x` after a symlink member `a`
//!   never lands where `a` points.
//! - Leaves: created with `O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `linkat`
//!   (no `AT_SYMLINK_FOLLOW`) relative to the parent fd. A non-directory already at a member's
//!   name (a file, a symlink) is unlinked and replaced, never written through; a directory in
//!   the way of a non-directory is refused; directories merge.
//! - Symlink members are created as they are and never followed later (they are inert here).
//! - Hard links must name a non-directory created earlier by this same extraction.
//! - Device nodes and fifos are refused ([`TransferError::SpecialMember`]), as are sparse files
//!   and unknown types.
//! - Modes are kept without the set-user-ID and set-group-ID bits; mtimes are kept; owners are
//!   not (files belong to the extracting process: inside a sandbox, its root). Directory modes
//!   and times are applied last, deepest first.
//! - A regular member gets exactly the bytes its header announces (the tar reader bounds it).

use std::collections::HashSet;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::rc::Rc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps};
use rustix::io::Errno;
use tar::EntryType;

use crate::error::{is_no_space, lossy, TransferError};
use crate::name::components;
use crate::place::Destination;
use crate::Summary;

const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Parent directories kept open between members (the deepest path used last); deeper ones are
/// resolved again for each member.
const CHAIN_MAX: usize = 32;

/// How often a name is unlinked and created again when something keeps appearing there.
const REPLACE_TRIES: usize = 4;

/// Permission bits kept on extracted members: everything but set-user-ID and set-group-ID.
const MODE_MASK: u32 = 0o1777;

/// Extracts the tar stream `archive` beneath `dest` (see the module docs). `single_tree`:
/// every member must lie under one top-level name (always so for [`Destination::Rename`]).
/// What was created before a failure stays.
///
/// Errors: every [`TransferError`] of extraction, naming the member.
pub fn unpack<R: Read>(
    archive: R,
    dest: &Destination,
    single_tree: bool,
) -> Result<Summary, TransferError> {
    unpack_with_top(archive, dest, single_tree, None)
}

/// [`unpack`] of a single tree whose top-level name must be `top` (a download of the source
/// `…/top`): a member under any other top-level name is refused with
/// [`TransferError::OutsideTree`], so a forged stream cannot replace a neighbour of the
/// requested tree in an existing destination directory.
///
/// Errors: as [`unpack`].
pub fn unpack_tree<R: Read>(
    archive: R,
    dest: &Destination,
    top: &[u8],
) -> Result<Summary, TransferError> {
    unpack_with_top(archive, dest, true, Some(top.to_vec()))
}

fn unpack_with_top<R: Read>(
    archive: R,
    dest: &Destination,
    single_tree: bool,
    top: Option<Vec<u8>>,
) -> Result<Summary, TransferError> {
    let root = dest
        .dir()
        .try_clone_to_owned()
        .map_err(|e| TransferError::Create {
            member: ".".into(),
            call: "fcntl(F_DUPFD_CLOEXEC)",
            source: e,
        })?;
    let mut unpacker = Unpacker {
        root: Rc::new(root),
        rename: dest.rename().map(<[u8]>::to_vec),
        single: single_tree || dest.rename().is_some(),
        top,
        files: HashSet::new(),
        dirs: Vec::new(),
        chain: Vec::new(),
        buf: vec![0; 64 << 10],
        summary: Summary::default(),
    };
    let mut archive = tar::Archive::new(archive);
    let entries = archive
        .entries()
        .map_err(|source| TransferError::ReadArchive { source })?;
    for entry in entries {
        let entry = entry.map_err(|source| TransferError::ReadArchive { source })?;
        unpacker.member(entry)?;
    }
    unpacker.finish()?;
    Ok(unpacker.summary)
}

/// A directory member whose mode and mtime are applied at the end.
struct Deferred {
    path: Vec<Vec<u8>>,
    mode: u32,
    mtime: u64,
}

struct Unpacker {
    root: Rc<OwnedFd>,
    rename: Option<Vec<u8>>,
    single: bool,
    /// The first member's top-level name, as in the archive.
    top: Option<Vec<u8>>,
    /// Non-directories created so far (mapped paths): the possible hard link targets.
    files: HashSet<Vec<Vec<u8>>>,
    dirs: Vec<Deferred>,
    /// `chain[i]` is the open directory of the first `i + 1` components of the last parent.
    chain: Vec<(Vec<u8>, Rc<OwnedFd>)>,
    buf: Vec<u8>,
    summary: Summary,
}

fn times(mtime: u64) -> Timestamps {
    let t = Timespec {
        tv_sec: i64::try_from(mtime).unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

fn create_error(member: &str, call: &'static str, e: impl Into<std::io::Error>) -> TransferError {
    let source = e.into();
    if is_no_space(&source) {
        TransferError::NoSpace {
            member: member.to_owned(),
            source,
        }
    } else {
        TransferError::Create {
            member: member.to_owned(),
            call,
            source,
        }
    }
}

impl Unpacker {
    /// `raw` split and mapped onto the destination (the single tree's top checked, renamed).
    fn map(&mut self, raw: &[u8]) -> Result<Vec<Vec<u8>>, TransferError> {
        let mut parts = components(raw)?;
        if parts.is_empty() || !self.single {
            return Ok(parts);
        }
        match &self.top {
            None => self.top = Some(parts[0].clone()),
            Some(top) if *top != parts[0] => {
                return Err(TransferError::OutsideTree {
                    member: lossy(raw),
                    top: lossy(top),
                })
            }
            Some(_) => {}
        }
        if let Some(name) = &self.rename {
            parts[0] = name.clone();
        }
        Ok(parts)
    }

    fn member<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), TransferError> {
        let raw = entry.path_bytes().into_owned();
        let member = lossy(&raw);
        let header = entry.header();
        let kind = header.entry_type();
        match kind {
            EntryType::XGlobalHeader | EntryType::XHeader => return Ok(()),
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                return Err(TransferError::SpecialMember {
                    member,
                    kind: match kind {
                        EntryType::Char => "character device",
                        EntryType::Block => "block device",
                        _ => "fifo",
                    },
                })
            }
            EntryType::Regular
            | EntryType::Continuous
            | EntryType::Directory
            | EntryType::Symlink
            | EntryType::Link => {}
            other => {
                return Err(TransferError::UnsupportedMember {
                    member,
                    entry_type: char::from(other.as_byte()),
                })
            }
        }
        let mode = header.mode().unwrap_or(0o644) & MODE_MASK;
        let mtime = header.mtime().unwrap_or(0);
        let path = self.map(&raw)?;
        let Some((name, dirs)) = path.split_last() else {
            // The archive's root (`./`): the destination itself, left as it is.
            return Ok(());
        };
        let parent = self.parent(dirs, &member)?;
        match kind {
            EntryType::Directory => {
                self.make_dir(&parent, name, &member)?;
                self.dirs.push(Deferred {
                    path: path.clone(),
                    mode,
                    mtime,
                });
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| TransferError::EmptySymlink {
                        member: member.clone(),
                    })?;
                if target.contains(&0) {
                    return Err(TransferError::BadName {
                        member,
                        reason: "NUL byte in the symlink target",
                    });
                }
                self.replacing(&parent, name, &member, "symlinkat", |p| {
                    rustix::fs::symlinkat(target.as_slice(), p, name.as_slice())
                })?;
                rustix::fs::utimensat(
                    &parent,
                    name.as_slice(),
                    &times(mtime),
                    AtFlags::SYMLINK_NOFOLLOW,
                )
                .map_err(|e| create_error(&member, "utimensat", e))?;
                self.files.insert(path);
            }
            EntryType::Link => {
                let raw_target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .unwrap_or_default();
                let refused = || TransferError::HardLinkTarget {
                    member: member.clone(),
                    target: lossy(&raw_target),
                };
                let target = self.map(&raw_target).map_err(|_| refused())?;
                if !self.files.contains(&target) {
                    return Err(refused());
                }
                let (tname, tdirs) = target.split_last().ok_or_else(refused)?;
                let tparent = self.parent(tdirs, &member)?;
                self.replacing(&parent, name, &member, "linkat", |p| {
                    rustix::fs::linkat(
                        &*tparent,
                        tname.as_slice(),
                        p,
                        name.as_slice(),
                        AtFlags::empty(),
                    )
                })?;
                self.files.insert(path);
            }
            _ => {
                let fd = self.replacing(&parent, name, &member, "openat", |p| {
                    rustix::fs::openat(
                        p,
                        name.as_slice(),
                        OFlags::WRONLY
                            | OFlags::CREATE
                            | OFlags::EXCL
                            | OFlags::NOFOLLOW
                            | OFlags::NOCTTY
                            | OFlags::CLOEXEC,
                        Mode::from_raw_mode(0o600),
                    )
                })?;
                let mut file = std::fs::File::from(fd);
                // Runs of zeros become holes: a sparse file of the source (a terabyte that
                // costs its sandbox nothing) takes no more space here than it took there.
                let mut written = 0u64;
                let mut hole = false;
                loop {
                    let n = match entry.read(&mut self.buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(source) => return Err(TransferError::ReadArchive { source }),
                    };
                    let chunk = &self.buf[..n];
                    if chunk.iter().all(|b| *b == 0) {
                        file.seek(std::io::SeekFrom::Current(n as i64))
                            .map_err(|e| create_error(&member, "lseek", e))?;
                        hole = true;
                    } else {
                        file.write_all(chunk)
                            .map_err(|e| create_error(&member, "write", e))?;
                        hole = false;
                    }
                    written += n as u64;
                    self.summary.bytes += n as u64;
                }
                if hole {
                    file.set_len(written)
                        .map_err(|e| create_error(&member, "ftruncate", e))?;
                }
                rustix::fs::fchmod(&file, Mode::from_raw_mode(mode))
                    .map_err(|e| create_error(&member, "fchmod", e))?;
                rustix::fs::futimens(&file, &times(mtime))
                    .map_err(|e| create_error(&member, "futimens", e))?;
                self.files.insert(path);
            }
        }
        self.summary.files += 1;
        Ok(())
    }

    /// Runs `create` at `name` in `parent`; when something is already there, removes it (a
    /// non-directory; a directory is [`TransferError::DirectoryInTheWay`]) and tries again.
    fn replacing<T>(
        &self,
        parent: &OwnedFd,
        name: &[u8],
        member: &str,
        call: &'static str,
        mut create: impl FnMut(BorrowedFd<'_>) -> Result<T, Errno>,
    ) -> Result<T, TransferError> {
        for _ in 0..REPLACE_TRIES {
            match create(parent.as_fd()) {
                Ok(v) => return Ok(v),
                Err(Errno::EXIST) => remove_non_dir(parent, name, member)?,
                Err(e) => return Err(create_error(member, call, e)),
            }
        }
        Err(create_error(member, call, Errno::EXIST))
    }

    /// Creates the directory `name` in `parent`, or keeps the directory already there.
    fn make_dir(&self, parent: &OwnedFd, name: &[u8], member: &str) -> Result<(), TransferError> {
        for _ in 0..REPLACE_TRIES {
            match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700)) {
                Ok(()) => return Ok(()),
                Err(Errno::EXIST) => {
                    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                            return Ok(())
                        }
                        Ok(_) => remove_non_dir(parent, name, member)?,
                        Err(Errno::NOENT) => {}
                        Err(e) => return Err(create_error(member, "fstatat", e)),
                    }
                }
                Err(e) => return Err(create_error(member, "mkdirat", e)),
            }
        }
        Err(create_error(member, "mkdirat", Errno::EXIST))
    }

    /// The open parent directory `dirs` (mapped components), created where missing, never
    /// through a symlink.
    fn parent(&mut self, dirs: &[Vec<u8>], member: &str) -> Result<Rc<OwnedFd>, TransferError> {
        let common = self
            .chain
            .iter()
            .zip(dirs)
            .take_while(|((name, _), want)| name == *want)
            .count();
        self.chain.truncate(common);
        let mut cur = self
            .chain
            .last()
            .map_or_else(|| self.root.clone(), |(_, fd)| fd.clone());
        for (i, name) in dirs.iter().enumerate().skip(common) {
            let next =
                Rc::new(
                    open_or_create_dir(&cur, name).map_err(|e| TransferError::Parent {
                        member: member.to_owned(),
                        source: e.into(),
                    })?,
                );
            // The chain stays a line from the root down: element i is the i-th component.
            if self.chain.len() == i && i < CHAIN_MAX {
                self.chain.push((name.clone(), next.clone()));
            }
            cur = next;
        }
        Ok(cur)
    }

    /// Applies the deferred directory modes and times, deepest first. A directory that is gone
    /// or replaced meanwhile (by the sandbox itself) is skipped.
    fn finish(&mut self) -> Result<(), TransferError> {
        for dir in self.dirs.iter().rev() {
            let joined = dir.path.join(&b'/');
            let member = lossy(&joined);
            let fd = match rustix::fs::openat2(
                &*self.root,
                joined.as_slice(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                BENEATH,
            ) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::LOOP | Errno::NOTDIR | Errno::XDEV) => continue,
                Err(e) => return Err(create_error(&member, "openat2", e)),
            };
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(dir.mode))
                .map_err(|e| create_error(&member, "fchmod", e))?;
            rustix::fs::futimens(&fd, &times(dir.mtime))
                .map_err(|e| create_error(&member, "futimens", e))?;
        }
        Ok(())
    }
}

/// Opens the directory `name` in `dir` beneath it without following any symlink, creating it
/// (0755, less the umask) when missing.
fn open_or_create_dir(dir: &OwnedFd, name: &[u8]) -> Result<OwnedFd, Errno> {
    let open = || {
        rustix::fs::openat2(
            dir,
            name,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        )
    };
    match open() {
        Err(Errno::NOENT) => {
            match rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(e),
            }
            open()
        }
        other => other,
    }
}

/// Unlinks the non-directory `name` in `parent` (nothing there is fine).
fn remove_non_dir(parent: &OwnedFd, name: &[u8], member: &str) -> Result<(), TransferError> {
    match rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
            Err(TransferError::DirectoryInTheWay {
                member: member.to_owned(),
            })
        }
        Ok(_) => match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(create_error(member, "unlinkat", e)),
        },
        Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(create_error(member, "fstatat", e)),
    }
}
