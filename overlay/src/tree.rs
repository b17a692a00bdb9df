//! The hardened tree builder shared by [`install_upper`](crate::install_upper) (tar
//! archives) and [`materialize_layer`](crate::layer::materialize_layer) (layer manifests
//! and blobs): it creates checked members in a fresh upper directory and never writes
//! outside it.
//!
//! Nothing is ever resolved through a symlink: every parent directory is opened with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)`
//! relative to the target, every leaf is created with an `*at` call relative to that parent
//! fd (`O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `mknodat`, `linkat`), and
//! metadata is set through the new fd or with `AT_SYMLINK_NOFOLLOW`. Names, entry types,
//! devices, extended attributes and sizes are checked by the callers with
//! [`parse_name`] and [`check_xattr`] before anything is created.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::rc::Rc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use crate::format::{is_layer_xattr, MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_XATTR_VALUE_BYTES};
use crate::install::{InstallError, InstallLimits, InstallStats};
use crate::layer::{BlobId, BlobStore, Extent};
use crate::sys::{self, Call, SyscallError, Xattr};

/// One member (archive member or manifest entry), decoded and checked, not yet installed.
pub(crate) struct Member {
    /// The name as written (for error messages).
    pub raw: Vec<u8>,
    /// Normalised components; empty for the root.
    pub components: Vec<Vec<u8>>,
    pub kind: MemberKind,
    /// Permission and setuid/setgid/sticky bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time: seconds and nanoseconds.
    pub mtime: (i64, u32),
    pub xattrs: Vec<Xattr>,
}

/// What a member is.
pub(crate) enum MemberKind {
    Directory,
    /// A regular file of `size` bytes (apparent size, holes included).
    Regular {
        size: u64,
        data: RegularData,
    },
    Symlink {
        target: Vec<u8>,
    },
    Hardlink {
        target: Vec<Vec<u8>>,
    },
    Whiteout,
    Fifo,
    /// A character or block device node as read from an archive, before the caller's rules
    /// (whiteout, refused, dropped) decided about it; never created.
    Device {
        block: bool,
        major: u32,
        minor: u32,
    },
}

/// Where a regular file's content comes from.
pub(crate) enum RegularData {
    /// `size` bytes at `offset` of the tar archive being installed.
    Archive { offset: u64 },
    /// The data extents of the file, filled from one blob of the store (the extents'
    /// bytes concatenated); the rest of the file is holes.
    Blob {
        blob: Option<BlobId>,
        extents: Vec<Extent>,
    },
    /// `size` bytes read from the member's reader in a tar stream.
    Stream,
}

impl RegularData {
    /// Bytes of data the file holds (holes excluded), given its apparent size.
    fn data_bytes(&self, size: u64) -> u64 {
        match self {
            RegularData::Archive { .. } | RegularData::Stream => size,
            RegularData::Blob { extents, .. } => extents.iter().map(|e| e.len).sum(),
        }
    }
}

/// Where the builder reads regular-file content from.
pub(crate) enum ContentSource<'a> {
    /// The tar archive file (members carry [`RegularData::Archive`]).
    Archive(&'a File),
    /// The blob store (members carry [`RegularData::Blob`]); `verify` re-hashes every
    /// blob while copying it.
    Blobs { store: &'a BlobStore, verify: bool },
    /// A tar stream (members carry [`RegularData::Stream`]; the content reader comes with
    /// each member, see [`Installer::install_from`]).
    Stream,
}

pub(crate) fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub(crate) fn path_of(raw: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(raw))
}

/// Why a member name is rejected.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NameError {
    Invalid(&'static str),
    TooLong(usize),
    ComponentTooLong(usize),
}

/// Splits a member name into components (empty for the root: `.`, `./`), rejecting
/// everything that could leave the target or is ambiguous.
pub(crate) fn parse_name(raw: &[u8], is_dir: bool) -> Result<Vec<Vec<u8>>, NameError> {
    if raw.is_empty() {
        return Err(NameError::Invalid("empty name"));
    }
    if raw.len() > MAX_PATH_BYTES {
        return Err(NameError::TooLong(raw.len()));
    }
    if raw.contains(&0) {
        return Err(NameError::Invalid("NUL byte"));
    }
    if raw[0] == b'/' {
        return Err(NameError::Invalid("absolute path"));
    }
    let mut name = raw;
    if name == b"." {
        name = b"";
    } else if let Some(rest) = name.strip_prefix(b"./") {
        name = rest;
    }
    if let Some(rest) = name.strip_suffix(b"/") {
        if !is_dir {
            return Err(NameError::Invalid("trailing slash on a non-directory"));
        }
        name = rest;
    }
    if name.is_empty() {
        return Ok(Vec::new());
    }
    name.split(|b| *b == b'/')
        .map(|component| match component {
            b"" => Err(NameError::Invalid("empty component")),
            b"." => Err(NameError::Invalid("`.` component")),
            b".." => Err(NameError::Invalid("`..` component")),
            c if c.len() > MAX_NAME_BYTES => Err(NameError::ComponentTooLong(c.len())),
            c => Ok(c.to_vec()),
        })
        .collect()
}

pub(crate) fn name_error(raw: &[u8], err: NameError) -> InstallError {
    let path = path_of(raw);
    match err {
        NameError::Invalid(reason) => InstallError::InvalidName { path, reason },
        NameError::TooLong(len) => InstallError::NameTooLong {
            path,
            len,
            max: MAX_PATH_BYTES,
        },
        NameError::ComponentTooLong(len) => InstallError::ComponentTooLong {
            path,
            len,
            max: MAX_NAME_BYTES,
        },
    }
}

pub(crate) fn check_xattr(raw: &[u8], name: &[u8], value: &[u8]) -> Result<(), InstallError> {
    let reason = if name.is_empty() || name.len() > MAX_NAME_BYTES || name.contains(&0) {
        Some("invalid name")
    } else if !is_layer_xattr(name) {
        Some("namespace not allowed")
    } else if value.len() > MAX_XATTR_VALUE_BYTES {
        Some("value larger than 64 KiB")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(InstallError::ForbiddenXattr {
            path: path_of(raw),
            name: lossy(name),
            reason,
        }),
        None => Ok(()),
    }
}

/// Opens `target`, which must be an existing, empty directory (not a symlink to one).
pub(crate) fn open_empty_target(target: &std::path::Path) -> Result<OwnedFd, InstallError> {
    let open_target = |source| InstallError::OpenTarget {
        path: target.to_path_buf(),
        source,
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(rustix::fs::CWD, target, flags, Mode::empty())
        .call("openat")
        .map_err(open_target)?;
    if !sys::sorted_names(&fd).map_err(open_target)?.is_empty() {
        return Err(InstallError::TargetNotEmpty {
            path: target.to_path_buf(),
        });
    }
    Ok(fd)
}

/// Checks a symlink target: not empty, no NUL, at most 4096 bytes. The target itself is
/// never resolved, so any other content is allowed (absolute, `..`, dangling).
pub(crate) fn check_symlink_target(raw: &[u8], target: &[u8]) -> Result<(), InstallError> {
    let reason = if target.is_empty() {
        "empty"
    } else if target.contains(&0) {
        "NUL byte"
    } else if target.len() > MAX_PATH_BYTES {
        "longer than 4096 bytes"
    } else {
        return Ok(());
    };
    Err(InstallError::InvalidLinkTarget {
        path: path_of(raw),
        target: lossy(target),
        reason,
    })
}

/// Parses a hardlink target with the member-name rules; the root is not a valid target.
pub(crate) fn parse_hardlink_target(
    raw: &[u8],
    target: &[u8],
) -> Result<Vec<Vec<u8>>, InstallError> {
    let invalid = |reason| InstallError::InvalidLinkTarget {
        path: path_of(raw),
        target: lossy(target),
        reason,
    };
    match parse_name(target, false) {
        Ok(c) if c.is_empty() => Err(invalid("the root")),
        Ok(c) => Ok(c),
        Err(NameError::Invalid(reason)) => Err(invalid(reason)),
        Err(NameError::TooLong(_)) => Err(invalid("longer than 4096 bytes")),
        Err(NameError::ComponentTooLong(_)) => Err(invalid("a component longer than 255 bytes")),
    }
}

/// Accepts only overlay whiteouts: 0:0 character devices.
pub(crate) fn check_device(
    raw: &[u8],
    block: bool,
    major: u32,
    minor: u32,
) -> Result<(), InstallError> {
    if block || major != 0 || minor != 0 {
        return Err(InstallError::ForbiddenDevice {
            path: path_of(raw),
            kind: if block { "block" } else { "character" },
            major,
            minor,
        });
    }
    Ok(())
}

/// A directory whose mode and times are applied after all members are installed.
struct DeferredDir {
    components: Vec<Vec<u8>>,
    raw: Vec<u8>,
    mode: u32,
    mtime: (i64, u32),
}

/// Creates members, in pre-order, beneath one target directory.
pub(crate) struct Installer<'a> {
    target: Rc<OwnedFd>,
    content: ContentSource<'a>,
    limits: &'a InstallLimits,
    stats: InstallStats,
    total_bytes: u64,
    /// Normalised paths of installed non-directories (hardlink targets).
    installed: HashSet<Vec<u8>>,
    dirs: Vec<DeferredDir>,
    root: Option<DeferredDir>,
    /// Open directories down to the last parent used: each element is a child of the
    /// previous one, at most [`CHAIN_MAX`] of them (the deepest; shallower parents are
    /// resolved again). Saves an `openat2` per member in pre-order archives.
    chain: Vec<(Vec<Vec<u8>>, Rc<OwnedFd>)>,
    /// Copy buffer for streamed content (allocated on first use).
    buf: Vec<u8>,
}

/// Most directory fds the installer's chain holds, whatever the depth of the layer (a
/// 2048-deep layer would otherwise hold 2048 fds of the daemon while it is materialized).
const CHAIN_MAX: usize = 16;
/// Bytes copied per read from a streamed member.
const STREAM_CHUNK: usize = 256 << 10;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

fn join(components: &[Vec<u8>]) -> Vec<u8> {
    components.join(&b'/')
}

fn timestamps((sec, nsec): (i64, u32)) -> Timestamps {
    let time = Timespec {
        tv_sec: sec,
        tv_nsec: i64::from(nsec),
    };
    Timestamps {
        last_access: time,
        last_modification: time,
    }
}

impl<'a> Installer<'a> {
    /// A builder for `target` (an open, empty directory).
    pub(crate) fn new(
        target: OwnedFd,
        content: ContentSource<'a>,
        limits: &'a InstallLimits,
    ) -> Self {
        Installer {
            target: Rc::new(target),
            content,
            limits,
            stats: InstallStats::default(),
            total_bytes: 0,
            installed: HashSet::new(),
            dirs: Vec::new(),
            root: None,
            chain: Vec::new(),
            buf: Vec::new(),
        }
    }

    /// Opens `components` (a directory path relative to the target) beneath the target.
    fn open_beneath(&self, components: &[Vec<u8>], flags: OFlags) -> Result<OwnedFd, SyscallError> {
        let path = join(components);
        rustix::fs::openat2(
            &*self.target,
            path.as_slice(),
            // RESOLVE_NO_SYMLINKS covers the last component too (ELOOP); O_NOFOLLOW would
            // turn that into a less telling ENOTDIR.
            flags | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .call("openat2")
    }

    /// The open parent directory `parent` (relative to the target), from the chain or
    /// resolved beneath the target.
    fn parent(&mut self, parent: &[Vec<u8>], raw: &[u8]) -> Result<Rc<OwnedFd>, InstallError> {
        while let Some((path, _)) = self.chain.last() {
            if parent.starts_with(path) {
                break;
            }
            self.chain.pop();
        }
        if parent.is_empty() {
            return Ok(self.target.clone());
        }
        if let Some((path, fd)) = self.chain.last() {
            if path.as_slice() == parent {
                return Ok(fd.clone());
            }
        }
        let fd = self.open_beneath(parent, OFlags::PATH).map_err(|source| {
            InstallError::ResolveParent {
                path: path_of(raw),
                source,
            }
        })?;
        let fd = Rc::new(fd);
        // The chain must stay a line from the target down; restart it from here.
        self.chain.clear();
        self.chain.push((parent.to_vec(), fd.clone()));
        Ok(fd)
    }

    /// Writes the content of a new regular file of `size` bytes; returns the data bytes
    /// written (holes are left as holes) and, of those, the bytes placed with
    /// `copy_file_range` (extents possibly shared with the source).
    fn fill(
        &mut self,
        fd: BorrowedFd<'_>,
        raw: &[u8],
        size: u64,
        data: &RegularData,
        reader: Option<&mut dyn Read>,
    ) -> Result<(u64, u64), InstallError> {
        match (data, &self.content) {
            (RegularData::Stream, ContentSource::Stream) => match reader {
                Some(reader) => self.fill_from_stream(fd, raw, size, reader).map(|n| (n, 0)),
                None => Err(InstallError::UnsupportedEntry {
                    path: path_of(raw),
                    kind: '0',
                }),
            },
            (RegularData::Archive { offset }, ContentSource::Archive(archive)) => {
                if size == 0 {
                    return Ok((0, 0));
                }
                let copied =
                    sys::copy_range(archive.as_fd(), *offset, fd, 0, size).map_err(|source| {
                        InstallError::CopyContent {
                            path: path_of(raw),
                            source,
                        }
                    })?;
                if copied < size {
                    return Err(InstallError::ArchiveTruncated {
                        path: path_of(raw),
                        expected: size,
                        copied,
                    });
                }
                Ok((size, size))
            }
            (RegularData::Blob { blob, extents }, ContentSource::Blobs { store, verify }) => {
                let covered = extents.last().map_or(0, |e| e.offset + e.len);
                if covered < size {
                    // Trailing hole: the file gets its apparent size without data.
                    rustix::fs::ftruncate(fd, size)
                        .call("ftruncate")
                        .map_err(|source| InstallError::CopyContent {
                            path: path_of(raw),
                            source,
                        })?;
                }
                match blob {
                    Some(blob) => {
                        store
                            .write_extents(blob, extents, fd, *verify)
                            .map_err(|source| InstallError::Blob {
                                path: path_of(raw),
                                source,
                            })
                    }
                    None => Ok((0, 0)),
                }
            }
            _ => Err(InstallError::UnsupportedEntry {
                path: path_of(raw),
                kind: '0',
            }),
        }
    }

    /// Copies exactly `size` bytes from `reader` into the new file `fd`.
    fn fill_from_stream(
        &mut self,
        fd: BorrowedFd<'_>,
        raw: &[u8],
        size: u64,
        reader: &mut dyn Read,
    ) -> Result<u64, InstallError> {
        if self.buf.is_empty() {
            self.buf = vec![0; STREAM_CHUNK];
        }
        let mut copied = 0u64;
        while copied < size {
            let want = (size - copied).min(self.buf.len() as u64) as usize;
            let n = match reader.read(&mut self.buf[..want]) {
                Ok(0) => {
                    return Err(InstallError::ArchiveTruncated {
                        path: path_of(raw),
                        expected: size,
                        copied,
                    })
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(InstallError::ReadMember {
                        path: path_of(raw),
                        source,
                    })
                }
            };
            sys::write_all_at(fd, &self.buf[..n], copied).map_err(|source| {
                InstallError::CopyContent {
                    path: path_of(raw),
                    source,
                }
            })?;
            copied += n as u64;
        }
        Ok(size)
    }

    fn check_limits(&mut self, member: &Member) -> Result<(), InstallError> {
        let path = || path_of(&member.raw);
        if self.stats.entries >= self.limits.max_entries {
            return Err(InstallError::TooManyEntries {
                path: path(),
                max: self.limits.max_entries,
            });
        }
        if let MemberKind::Regular { size, data } = &member.kind {
            if *size > self.limits.max_apparent_bytes {
                return Err(InstallError::ApparentSizeTooLarge {
                    path: path(),
                    size: *size,
                    max: self.limits.max_apparent_bytes,
                });
            }
            let bytes = data.data_bytes(*size);
            if bytes > self.limits.max_file_bytes {
                return Err(InstallError::FileTooLarge {
                    path: path(),
                    size: bytes,
                    max: self.limits.max_file_bytes,
                });
            }
            let total = self.total_bytes.saturating_add(bytes);
            if total > self.limits.max_total_bytes {
                return Err(InstallError::TotalBytesExceeded {
                    path: path(),
                    total,
                    max: self.limits.max_total_bytes,
                });
            }
            self.total_bytes = total;
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// Creates one member (parents must already exist).
    pub(crate) fn install(&mut self, member: Member) -> Result<(), InstallError> {
        self.install_from(member, None)
    }

    /// Creates one member whose content (for [`RegularData::Stream`]) is read from `reader`.
    pub(crate) fn install_from(
        &mut self,
        member: Member,
        reader: Option<&mut dyn Read>,
    ) -> Result<(), InstallError> {
        if let MemberKind::Device {
            block,
            major,
            minor,
        } = member.kind
        {
            // The caller's rules turn 0:0 into a whiteout or refuse the member; a device
            // that reaches this point is never created.
            check_device(&member.raw, block, major, minor)?;
            return Err(InstallError::UnsupportedEntry {
                path: path_of(&member.raw),
                kind: '3',
            });
        }
        self.check_limits(&member)?;
        let raw = member.raw.as_slice();
        let path = || path_of(raw);
        let create_err = |source: SyscallError| {
            if source.errno() == Some(Errno::EXIST.raw_os_error()) {
                InstallError::DuplicateEntry { path: path_of(raw) }
            } else {
                InstallError::Create {
                    path: path_of(raw),
                    source,
                }
            }
        };
        let meta_err = |source| InstallError::SetMetadata {
            path: path_of(raw),
            source,
        };

        let Some((name, parent)) = member.components.split_last() else {
            // The root member: metadata for the target itself.
            if self.root.is_some() {
                return Err(InstallError::DuplicateEntry { path: path() });
            }
            let xattrs: Vec<Xattr> = member
                .xattrs
                .iter()
                .filter(|(n, _)| n.as_slice() != b"trusted.overlay.uuid")
                .cloned()
                .collect();
            set_owner_and_xattrs_fd(self.target.as_fd(), &member, &xattrs).map_err(meta_err)?;
            self.root = Some(DeferredDir {
                components: Vec::new(),
                raw: member.raw.clone(),
                mode: member.mode,
                mtime: member.mtime,
            });
            return Ok(());
        };
        let parent_fd = self.parent(parent, raw)?;
        let dir = parent_fd.as_fd();
        let name = name.as_slice();
        let full = join(&member.components);

        match &member.kind {
            MemberKind::Directory => {
                rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                    .call("mkdirat")
                    .map_err(create_err)?;
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(dir, name, flags, Mode::empty())
                    .call("openat")
                    .map_err(create_err)?;
                set_owner_and_xattrs_fd(fd.as_fd(), &member, &member.xattrs).map_err(meta_err)?;
                self.dirs.push(DeferredDir {
                    components: member.components.clone(),
                    raw: member.raw.clone(),
                    mode: member.mode,
                    mtime: member.mtime,
                });
                // `self.parent` left the chain ending at this directory's parent.
                self.chain.push((member.components.clone(), Rc::new(fd)));
                if self.chain.len() > CHAIN_MAX {
                    self.chain.remove(0);
                }
                return Ok(());
            }
            MemberKind::Regular { size, data } => {
                let flags = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(dir, name, flags, Mode::from_raw_mode(0o600))
                    .call("openat")
                    .map_err(create_err)?;
                let (written, shared) = self.fill(fd.as_fd(), raw, *size, data, reader)?;
                self.stats.content_bytes += written;
                self.stats.shared_bytes += shared;
                set_owner_and_xattrs_fd(fd.as_fd(), &member, &member.xattrs).map_err(meta_err)?;
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(member.mode))
                    .call("fchmod")
                    .map_err(meta_err)?;
                rustix::fs::futimens(&fd, &timestamps(member.mtime))
                    .call("futimens")
                    .map_err(meta_err)?;
            }
            MemberKind::Symlink { target } => {
                rustix::fs::symlinkat(target.as_slice(), dir, name)
                    .call("symlinkat")
                    .map_err(create_err)?;
                set_metadata_at(dir, name, &member, false).map_err(meta_err)?;
            }
            MemberKind::Device { .. } => {
                return Err(InstallError::UnsupportedEntry {
                    path: path(),
                    kind: '3',
                })
            }
            MemberKind::Whiteout | MemberKind::Fifo => {
                let file_type = if matches!(member.kind, MemberKind::Fifo) {
                    FileType::Fifo
                } else {
                    FileType::CharacterDevice
                };
                rustix::fs::mknodat(dir, name, file_type, Mode::from_raw_mode(0o600), 0)
                    .call("mknodat")
                    .map_err(create_err)?;
                set_metadata_at(dir, name, &member, true).map_err(meta_err)?;
            }
            MemberKind::Hardlink { target } => {
                let target_path = join(target);
                if !self.installed.contains(&target_path) {
                    return Err(InstallError::HardlinkTargetMissing {
                        path: path(),
                        target: lossy(&target_path),
                    });
                }
                let (target_name, target_parent) = target
                    .split_last()
                    .expect("hardlink targets are never the root");
                let target_dir = if target_parent.is_empty() {
                    None
                } else {
                    Some(
                        self.open_beneath(target_parent, OFlags::PATH)
                            .map_err(|source| InstallError::ResolveParent {
                                path: path(),
                                source,
                            })?,
                    )
                };
                let target_dir = match &target_dir {
                    Some(fd) => fd.as_fd(),
                    None => self.target.as_fd(),
                };
                rustix::fs::linkat(
                    target_dir,
                    target_name.as_slice(),
                    dir,
                    name,
                    AtFlags::empty(),
                )
                .call("linkat")
                .map_err(create_err)?;
            }
        }
        self.installed.insert(full);
        Ok(())
    }

    /// Applies directory modes and times, deepest first, then the root's.
    /// Applies the deferred directory metadata; returns what was installed.
    pub(crate) fn finish(mut self) -> Result<InstallStats, InstallError> {
        self.chain.clear();
        for dir in self.dirs.iter().rev() {
            let meta_err = |source| InstallError::SetMetadata {
                path: path_of(&dir.raw),
                source,
            };
            let fd = self
                .open_beneath(&dir.components, OFlags::RDONLY)
                .map_err(meta_err)?;
            finish_dir(fd.as_fd(), dir).map_err(meta_err)?;
        }
        if let Some(root) = &self.root {
            finish_dir(self.target.as_fd(), root).map_err(|source| InstallError::SetMetadata {
                path: path_of(&root.raw),
                source,
            })?;
        }
        Ok(self.stats)
    }
}

fn finish_dir(fd: BorrowedFd<'_>, dir: &DeferredDir) -> Result<(), SyscallError> {
    rustix::fs::fchmod(fd, Mode::from_raw_mode(dir.mode)).call("fchmod")?;
    rustix::fs::futimens(fd, &timestamps(dir.mtime)).call("futimens")
}

/// Owner, then extended attributes (a chown clears `security.capability`), through `fd`.
fn set_owner_and_xattrs_fd(
    fd: BorrowedFd<'_>,
    member: &Member,
    xattrs: &[Xattr],
) -> Result<(), SyscallError> {
    rustix::fs::fchown(
        fd,
        Some(Uid::from_raw(member.uid)),
        Some(Gid::from_raw(member.gid)),
    )
    .call("fchown")?;
    for (name, value) in xattrs {
        sys::set_xattr_fd(fd, name, value)?;
    }
    Ok(())
}

/// Owner, extended attributes, mode (unless a symlink) and times of `name` in `dir`,
/// never following `name` if it is a symlink.
fn set_metadata_at(
    dir: BorrowedFd<'_>,
    name: &[u8],
    member: &Member,
    chmod: bool,
) -> Result<(), SyscallError> {
    rustix::fs::chownat(
        dir,
        name,
        Some(Uid::from_raw(member.uid)),
        Some(Gid::from_raw(member.gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .call("fchownat")?;
    if !member.xattrs.is_empty() {
        let path = sys::proc_fd_path(dir, name);
        for (xname, value) in &member.xattrs {
            sys::set_xattr_path(&path, xname, value)?;
        }
    }
    if chmod {
        // `name` was just created by mknodat in a directory only this installer writes.
        rustix::fs::chmodat(
            dir,
            name,
            Mode::from_raw_mode(member.mode),
            AtFlags::empty(),
        )
        .call("fchmodat")?;
    }
    rustix::fs::utimensat(
        dir,
        name,
        &timestamps(member.mtime),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .call("utimensat")
}
#[cfg(test)]
mod tests {
    use super::*;

    fn parts(name: &str, is_dir: bool) -> Result<Vec<String>, NameError> {
        parse_name(name.as_bytes(), is_dir).map(|c| {
            c.into_iter()
                .map(|c| String::from_utf8(c).unwrap())
                .collect()
        })
    }

    #[test]
    fn names_are_normalised() {
        assert_eq!(parts("./", true).unwrap(), Vec::<String>::new());
        assert_eq!(parts(".", true).unwrap(), Vec::<String>::new());
        assert_eq!(parts("a/b/", true).unwrap(), ["a", "b"]);
        assert_eq!(parts("./a/b", false).unwrap(), ["a", "b"]);
        assert_eq!(parts("a..b/..c", false).unwrap(), ["a..b", "..c"]);
    }

    #[test]
    fn hostile_names_are_rejected() {
        let invalid = |name: &str, is_dir| match parts(name, is_dir) {
            Err(NameError::Invalid(reason)) => reason,
            other => panic!("{name:?}: {other:?}"),
        };
        assert_eq!(invalid("", false), "empty name");
        assert_eq!(invalid("/etc/passwd", false), "absolute path");
        assert_eq!(invalid("../escape", false), "`..` component");
        assert_eq!(invalid("a/../../b", false), "`..` component");
        assert_eq!(invalid("a/..", true), "`..` component");
        assert_eq!(invalid("a//b", false), "empty component");
        assert_eq!(invalid(".//b", false), "empty component");
        assert_eq!(invalid("a/./b", false), "`.` component");
        assert_eq!(invalid("a\0b", false), "NUL byte");
        assert_eq!(invalid("file/", false), "trailing slash on a non-directory");
        let long = "x".repeat(256);
        assert_eq!(parts(&long, false), Err(NameError::ComponentTooLong(256)));
        let deep = ["y"; 2100].join("/");
        assert_eq!(parts(&deep, false), Err(NameError::TooLong(4199)));
    }
}
