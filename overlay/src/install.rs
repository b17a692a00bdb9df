//! Install: unpack an archive made by [`capture_upper`](crate::capture_upper) into a fresh,
//! empty upper directory.
//!
//! The archive is hostile input (it holds whatever the sandbox left in its upper layer, and
//! the file could have been altered on disk). Nothing is ever resolved through a symlink:
//! every parent directory is opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` relative to the target, every leaf is created
//! with an `*at` call relative to that parent fd (`O_CREAT | O_EXCL | O_NOFOLLOW`,
//! `mkdirat`, `symlinkat`, `mknodat`, `linkat`), and metadata is set through the new fd or
//! with `AT_SYMLINK_NOFOLLOW`. Names, entry types, devices, extended attributes and sizes
//! are checked before anything is created; see [`InstallError`] for every rejection.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, CWD};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};
use tar::{Entry, EntryType, Header};

use crate::format::{
    is_layer_xattr, parse_mtime, parse_pax_records, xattr_name_from_key, MAX_EXTENSION_BYTES,
    MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_XATTR_VALUE_BYTES,
};
use crate::sys::{self, Call, SyscallError, Xattr};

/// Bounds on what one archive may install. Exceeding any is an error naming the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstallLimits {
    /// Most archive members (each directory, file, link and special file counts one).
    pub max_entries: u64,
    /// Most bytes of regular-file content, all files together.
    pub max_total_bytes: u64,
    /// Most bytes of content in a single regular file.
    pub max_file_bytes: u64,
}

impl Default for InstallLimits {
    /// 1 000 000 entries, 64 GiB in total, 16 GiB per file.
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_total_bytes: 64 << 30,
            max_file_bytes: 16 << 30,
        }
    }
}

/// What [`install_upper`] created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InstallStats {
    /// Archive members installed (the root directory entry included).
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub content_bytes: u64,
}

/// Why [`install_upper`] failed. `path` fields name the archive member (relative to the
/// target) as written in the archive. The target may hold a partial install afterwards;
/// the caller discards it (it was a fresh directory), nothing outside it was touched.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The archive file could not be opened.
    #[error("opening archive {path} failed")]
    OpenArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The target directory could not be opened or listed.
    #[error("opening target directory {path} failed")]
    OpenTarget {
        /// The target path.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// The target directory is not empty.
    #[error("target directory {path} is not empty")]
    TargetNotEmpty {
        /// The target path.
        path: PathBuf,
    },
    /// The tar stream could not be read (bad checksum, bad numeric field, I/O error).
    #[error("reading archive {path} failed")]
    ReadArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The archive does not end with the two zero blocks that close a tar stream (it was
    /// cut short at a member boundary).
    #[error("archive {path} has no end-of-archive marker at offset {offset}")]
    MissingEndOfArchive {
        /// The archive path.
        path: PathBuf,
        /// Where the marker should start, in bytes.
        offset: u64,
    },
    /// A PAX or GNU long-name record block is larger than accepted.
    #[error("extension header at offset {offset} is {size} bytes, more than {max}")]
    ExtensionTooLarge {
        /// Offset of its header in the archive, in bytes.
        offset: u64,
        /// Its size in bytes.
        size: u64,
        /// The limit in bytes.
        max: u64,
    },
    /// Two extension headers of the same kind describe one member, or extension headers
    /// are not followed by a member.
    #[error("misplaced extension header at offset {offset}")]
    MisplacedExtension {
        /// Offset of the header in the archive, in bytes.
        offset: u64,
    },
    /// A PAX record block is malformed.
    #[error("malformed PAX records at offset {offset}: {reason}")]
    MalformedExtension {
        /// Offset of the PAX header in the archive, in bytes.
        offset: u64,
        /// What is wrong.
        reason: &'static str,
    },
    /// A PAX record this installer does not implement and cannot ignore safely (`size`,
    /// `GNU.sparse.*`).
    #[error("{path}: unsupported PAX record {key}")]
    UnsupportedExtension {
        /// The member.
        path: PathBuf,
        /// The record key.
        key: String,
    },
    /// A header or PAX field holds a value that is not a valid number of its kind.
    #[error("{path}: invalid {field} field {value:?}")]
    InvalidField {
        /// The member.
        path: PathBuf,
        /// Which field (`mtime`, `uid`, `gid`, `mode`, `device`).
        field: &'static str,
        /// The raw value, lossily decoded.
        value: String,
    },
    /// The member name is rejected: empty, absolute, with a `.` or `..` or empty
    /// component, with a NUL byte, or with a trailing `/` on a non-directory.
    #[error("{path}: invalid member name ({reason})")]
    InvalidName {
        /// The member name.
        path: PathBuf,
        /// Why.
        reason: &'static str,
    },
    /// The member name is longer than 4096 bytes.
    #[error("{path}: name is {len} bytes, longer than {max}")]
    NameTooLong {
        /// The member name.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A component of the member name is longer than 255 bytes.
    #[error("{path}: a name component is {len} bytes, longer than {max}")]
    ComponentTooLong {
        /// The member name.
        path: PathBuf,
        /// Length of the offending component, in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A symlink target (empty, with NUL, longer than 4096 bytes) or hardlink target
    /// (failing the member-name rules, or the root) is rejected.
    #[error("{path}: invalid link target {target:?} ({reason})")]
    InvalidLinkTarget {
        /// The member.
        path: PathBuf,
        /// The target, lossily decoded.
        target: String,
        /// Why.
        reason: &'static str,
    },
    /// A hardlink names a member that was not installed before it as a non-directory.
    #[error("{path}: hardlink target {target:?} is not an earlier member")]
    HardlinkTargetMissing {
        /// The member.
        path: PathBuf,
        /// The target, lossily decoded.
        target: String,
    },
    /// The member type is not one this installer creates (GNU sparse, global PAX header,
    /// volume labels, ...).
    #[error("{path}: unsupported member type {kind:?}")]
    UnsupportedEntry {
        /// The member.
        path: PathBuf,
        /// The type flag byte.
        kind: char,
    },
    /// A device node other than a 0:0 character device (an overlay whiteout).
    #[error("{path}: {kind} device {major}:{minor} is not allowed in an upper layer")]
    ForbiddenDevice {
        /// The member.
        path: PathBuf,
        /// `"character"` or `"block"`.
        kind: &'static str,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// An extended attribute outside `user.`, `security.`, `trusted.`, the POSIX ACLs, or
    /// with an invalid name or oversized value.
    #[error("{path}: extended attribute {name:?} rejected ({reason})")]
    ForbiddenXattr {
        /// The member.
        path: PathBuf,
        /// The attribute name, lossily decoded.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// A non-regular member carries content bytes.
    #[error("{path}: {size} bytes of content on a member that cannot have any")]
    UnexpectedData {
        /// The member.
        path: PathBuf,
        /// Its declared size in bytes.
        size: u64,
    },
    /// The root member (`./`) is not a directory.
    #[error("{path}: the root member must be a directory")]
    RootNotDirectory {
        /// The member.
        path: PathBuf,
    },
    /// The member's path was already installed.
    #[error("{path}: duplicate member")]
    DuplicateEntry {
        /// The member.
        path: PathBuf,
    },
    /// More members than [`InstallLimits::max_entries`].
    #[error("{path}: more than {max} members")]
    TooManyEntries {
        /// The first member over the limit.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A file larger than [`InstallLimits::max_file_bytes`].
    #[error("{path}: file of {size} bytes is larger than {max}")]
    FileTooLarge {
        /// The member.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// More content than [`InstallLimits::max_total_bytes`].
    #[error("{path}: content would reach {total} bytes, more than {max}")]
    TotalBytesExceeded {
        /// The first member over the limit.
        path: PathBuf,
        /// Content bytes including this member.
        total: u64,
        /// The limit.
        max: u64,
    },
    /// Opening the member's parent directory beneath the target failed: it is missing, is
    /// not a directory, or is (or passes through) a symlink (`ELOOP`) or another mount
    /// (`EXDEV`).
    #[error("{path}: resolving the parent directory failed")]
    ResolveParent {
        /// The member.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Creating the member failed.
    #[error("{path}: creating the member failed")]
    Create {
        /// The member.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Writing a file's content failed.
    #[error("{path}: writing content failed")]
    CopyContent {
        /// The member.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// The archive ends inside a file's content.
    #[error("{path}: archive ends after {copied} of {expected} content bytes")]
    ArchiveTruncated {
        /// The member.
        path: PathBuf,
        /// Declared size in bytes.
        expected: u64,
        /// Bytes present.
        copied: u64,
    },
    /// Setting owner, extended attributes, mode or times failed.
    #[error("{path}: setting metadata failed")]
    SetMetadata {
        /// The member.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
}

/// Installs `archive` (made by [`capture_upper`](crate::capture_upper)) into `target`, an
/// existing empty directory that becomes an overlay upper directory.
///
/// Recreates directories (opaque ones keep `trusted.overlay.opaque`), regular files (holes
/// are written as zeros), symlinks (targets verbatim, never followed), hardlinks (`linkat`
/// to an earlier member), whiteouts (0:0 character devices) and fifos, with owner, mode
/// (setuid/setgid/sticky included), nanosecond mtime and extended attributes. Directory
/// modes and times are applied last, children first, so read-only directories and their
/// mtimes come out right. The root member's metadata is applied to `target` itself, except
/// `trusted.overlay.uuid`: the installed layer is a new overlay instance and the kernel
/// gives it its own uuid on first mount.
///
/// Needs root (or `CAP_CHOWN`, `CAP_MKNOD`, `CAP_SYS_ADMIN` for `trusted.*`, and
/// `CAP_FOWNER`). Kernel ≥ 5.6 (`openat2`). Errors: [`InstallError`].
pub fn install_upper(
    archive: &Path,
    target: &Path,
    limits: &InstallLimits,
) -> Result<InstallStats, InstallError> {
    let started = Instant::now();
    let file = File::open(archive).map_err(|source| InstallError::OpenArchive {
        path: archive.to_path_buf(),
        source,
    })?;
    let open_target = |source| InstallError::OpenTarget {
        path: target.to_path_buf(),
        source,
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let target_fd = rustix::fs::openat(CWD, target, flags, Mode::empty())
        .call("openat")
        .map_err(open_target)?;
    if !sys::sorted_names(&target_fd)
        .map_err(open_target)?
        .is_empty()
    {
        return Err(InstallError::TargetNotEmpty {
            path: target.to_path_buf(),
        });
    }
    let mut installer = Installer {
        target: Rc::new(target_fd),
        archive: &file,
        limits,
        stats: InstallStats::default(),
        total_bytes: 0,
        installed: HashSet::new(),
        dirs: Vec::new(),
        root: None,
        chain: Vec::new(),
    };
    let read_err = |source| InstallError::ReadArchive {
        path: archive.to_path_buf(),
        source,
    };
    let mut tar = tar::Archive::new(BufReader::with_capacity(64 << 10, &file));
    let mut pending = Extensions::default();
    let mut end = 0u64;
    for entry in tar.entries_with_seek().map_err(read_err)?.raw(true) {
        let mut entry = entry.map_err(read_err)?;
        let offset = entry.raw_header_position();
        end = entry
            .raw_file_position()
            .saturating_add(entry.size().div_ceil(512).saturating_mul(512));
        match entry.header().entry_type() {
            EntryType::XHeader => {
                let data = read_extension(
                    &mut entry,
                    offset,
                    MAX_EXTENSION_BYTES,
                    pending.pax.is_some(),
                )
                .map_err(|e| e.into_install(archive))?;
                pending.pax = Some((offset, data));
            }
            EntryType::GNULongName => {
                let max = MAX_PATH_BYTES as u64 + 1;
                let data = read_extension(&mut entry, offset, max, pending.long_name.is_some())
                    .map_err(|e| e.into_install(archive))?;
                pending.long_name = Some((offset, strip_nul(data)));
            }
            EntryType::GNULongLink => {
                let max = MAX_PATH_BYTES as u64 + 1;
                let data = read_extension(&mut entry, offset, max, pending.long_link.is_some())
                    .map_err(|e| e.into_install(archive))?;
                pending.long_link = Some((offset, strip_nul(data)));
            }
            _ => {
                let member = parse_member(&entry, std::mem::take(&mut pending))?;
                installer.install(member)?;
            }
        }
    }
    if let Some(offset) = pending.first_offset() {
        return Err(InstallError::MisplacedExtension { offset });
    }
    let mut marker = [0u8; 1024];
    let n = sys::read_full_at(file.as_fd(), &mut marker, end).map_err(|e| read_err(e.source))?;
    if n < marker.len() || marker.iter().any(|b| *b != 0) {
        return Err(InstallError::MissingEndOfArchive {
            path: archive.to_path_buf(),
            offset: end,
        });
    }
    let stats = installer.finish()?;
    tracing::debug!(
        archive = %archive.display(),
        target = %target.display(),
        entries = stats.entries,
        content_bytes = stats.content_bytes,
        elapsed_us = started.elapsed().as_micros() as u64,
        "installed upper layer"
    );
    Ok(stats)
}

/// Extension headers seen since the last member, each as (header offset, payload): a PAX
/// record block, a GNU long name, a GNU long link target.
#[derive(Default)]
struct Extensions {
    pax: Option<(u64, Vec<u8>)>,
    long_name: Option<(u64, Vec<u8>)>,
    long_link: Option<(u64, Vec<u8>)>,
}

impl Extensions {
    fn first_offset(&self) -> Option<u64> {
        [&self.pax, &self.long_name, &self.long_link]
            .into_iter()
            .filter_map(|ext| ext.as_ref().map(|(offset, _)| *offset))
            .min()
    }
}

enum ExtensionError {
    TooLarge { offset: u64, size: u64, max: u64 },
    Duplicate { offset: u64 },
    Read(io::Error),
}

impl ExtensionError {
    fn into_install(self, archive: &Path) -> InstallError {
        match self {
            ExtensionError::TooLarge { offset, size, max } => {
                InstallError::ExtensionTooLarge { offset, size, max }
            }
            ExtensionError::Duplicate { offset } => InstallError::MisplacedExtension { offset },
            ExtensionError::Read(source) => InstallError::ReadArchive {
                path: archive.to_path_buf(),
                source,
            },
        }
    }
}

fn read_extension<R: Read>(
    entry: &mut Entry<'_, R>,
    offset: u64,
    max: u64,
    duplicate: bool,
) -> Result<Vec<u8>, ExtensionError> {
    if duplicate {
        return Err(ExtensionError::Duplicate { offset });
    }
    let size = entry.size();
    if size > max {
        return Err(ExtensionError::TooLarge { offset, size, max });
    }
    let mut data = Vec::with_capacity(size as usize);
    entry.read_to_end(&mut data).map_err(ExtensionError::Read)?;
    if data.len() as u64 != size {
        return Err(ExtensionError::Read(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(data)
}

fn strip_nul(mut data: Vec<u8>) -> Vec<u8> {
    if data.last() == Some(&0) {
        data.pop();
    }
    data
}

/// One archive member, decoded and checked, not yet installed.
struct Member {
    /// The name as written (for error messages).
    raw: Vec<u8>,
    /// Normalised components; empty for the root.
    components: Vec<Vec<u8>>,
    kind: MemberKind,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, u32),
    xattrs: Vec<Xattr>,
}

enum MemberKind {
    Directory,
    Regular { size: u64, offset: u64 },
    Symlink { target: Vec<u8> },
    Hardlink { target: Vec<Vec<u8>> },
    Whiteout,
    Fifo,
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn path_of(raw: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(raw))
}

/// Why a member name is rejected.
#[derive(Debug, PartialEq, Eq)]
enum NameError {
    Invalid(&'static str),
    TooLong(usize),
    ComponentTooLong(usize),
}

/// Splits a member name into components (empty for the root: `.`, `./`), rejecting
/// everything that could leave the target or is ambiguous.
fn parse_name(raw: &[u8], is_dir: bool) -> Result<Vec<Vec<u8>>, NameError> {
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

fn name_error(raw: &[u8], err: NameError) -> InstallError {
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

fn parse_member<R: Read>(entry: &Entry<'_, R>, ext: Extensions) -> Result<Member, InstallError> {
    let header: &Header = entry.header();
    let records = match &ext.pax {
        Some((pax_offset, pax)) => {
            parse_pax_records(pax).map_err(|reason| InstallError::MalformedExtension {
                offset: *pax_offset,
                reason,
            })?
        }
        None => Vec::new(),
    };
    let pax_value = |key: &[u8]| {
        records
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_vec())
    };
    let raw = pax_value(b"path")
        .or(ext.long_name.map(|(_, name)| name))
        .unwrap_or_else(|| header.path_bytes().into_owned());
    let path = || path_of(&raw);
    let invalid = |field: &'static str, value: &[u8]| InstallError::InvalidField {
        path: path_of(&raw),
        field,
        value: lossy(value),
    };

    let kind_flag = header.entry_type();
    let is_dir = kind_flag == EntryType::Directory;
    let components = parse_name(&raw, is_dir).map_err(|e| name_error(&raw, e))?;

    let old = header.as_old();
    let mut uid = header.uid().map_err(|_| invalid("uid", &old.uid))?;
    let mut gid = header.gid().map_err(|_| invalid("gid", &old.gid))?;
    let mtime_header = header.mtime().map_err(|_| invalid("mtime", &old.mtime))?;
    let mut mtime = (
        i64::try_from(mtime_header).map_err(|_| invalid("mtime", &old.mtime))?,
        0u32,
    );
    let mode = header.mode().map_err(|_| invalid("mode", &old.mode))? & 0o7777;

    let mut xattrs = Vec::new();
    for &(key, value) in &records {
        match key {
            b"path" | b"linkpath" => {}
            b"mtime" => mtime = parse_mtime(value).ok_or_else(|| invalid("mtime", value))?,
            b"uid" | b"gid" => {
                let id = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| invalid(if key == b"uid" { "uid" } else { "gid" }, value))?;
                if key == b"uid" {
                    uid = id;
                } else {
                    gid = id;
                }
            }
            b"size" => {
                return Err(InstallError::UnsupportedExtension {
                    path: path(),
                    key: lossy(key),
                })
            }
            k if k.starts_with(b"GNU.sparse.") => {
                return Err(InstallError::UnsupportedExtension {
                    path: path(),
                    key: lossy(key),
                })
            }
            k => match xattr_name_from_key(k) {
                Some(Ok(name)) => {
                    check_xattr(&raw, &name, value)?;
                    xattrs.push((name, value.to_vec()));
                }
                Some(Err(())) => {
                    return Err(InstallError::ForbiddenXattr {
                        path: path(),
                        name: lossy(k),
                        reason: "malformed hex name",
                    })
                }
                None => {
                    tracing::trace!(path = %path().display(), key = %lossy(k), "ignoring PAX record");
                }
            },
        }
    }
    let owner = |field: &'static str, id: u64| {
        // u32::MAX is -1, "leave unchanged", for chown.
        u32::try_from(id)
            .ok()
            .filter(|id| *id != u32::MAX)
            .ok_or_else(|| invalid(field, id.to_string().as_bytes()))
    };
    let uid = owner("uid", uid)?;
    let gid = owner("gid", gid)?;

    let link = || {
        pax_value(b"linkpath")
            .or_else(|| ext.long_link.as_ref().map(|(_, link)| link.clone()))
            .or_else(|| header.link_name_bytes().map(|l| l.into_owned()))
            .unwrap_or_default()
    };
    let size = entry.size();
    let kind = match kind_flag {
        EntryType::Directory => MemberKind::Directory,
        EntryType::Regular | EntryType::Continuous => MemberKind::Regular {
            size,
            offset: entry.raw_file_position(),
        },
        EntryType::Symlink => {
            let target = link();
            let reason = if target.is_empty() {
                Some("empty")
            } else if target.contains(&0) {
                Some("NUL byte")
            } else if target.len() > MAX_PATH_BYTES {
                Some("longer than 4096 bytes")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(InstallError::InvalidLinkTarget {
                    path: path(),
                    target: lossy(&target),
                    reason,
                });
            }
            MemberKind::Symlink { target }
        }
        EntryType::Link => {
            let target = link();
            let invalid_target = |reason| InstallError::InvalidLinkTarget {
                path: path_of(&raw),
                target: lossy(&target),
                reason,
            };
            let components = match parse_name(&target, false) {
                Ok(c) if c.is_empty() => return Err(invalid_target("the root")),
                Ok(c) => c,
                Err(NameError::Invalid(reason)) => return Err(invalid_target(reason)),
                Err(NameError::TooLong(_)) => return Err(invalid_target("longer than 4096 bytes")),
                Err(NameError::ComponentTooLong(_)) => {
                    return Err(invalid_target("a component longer than 255 bytes"))
                }
            };
            MemberKind::Hardlink { target: components }
        }
        EntryType::Char | EntryType::Block => {
            // dev_major and dev_minor sit at the same offsets in ustar and GNU headers.
            let device = |_| invalid("device", &header.as_bytes()[329..345]);
            let major = header.device_major().map_err(device)?;
            let minor = header.device_minor().map_err(device)?;
            let (major, minor) = (major.unwrap_or(0), minor.unwrap_or(0));
            if kind_flag == EntryType::Block || major != 0 || minor != 0 {
                return Err(InstallError::ForbiddenDevice {
                    path: path(),
                    kind: if kind_flag == EntryType::Block {
                        "block"
                    } else {
                        "character"
                    },
                    major,
                    minor,
                });
            }
            MemberKind::Whiteout
        }
        EntryType::Fifo => MemberKind::Fifo,
        other => {
            return Err(InstallError::UnsupportedEntry {
                path: path(),
                kind: char::from(other.as_byte()),
            })
        }
    };
    if size != 0 && !matches!(kind, MemberKind::Regular { .. }) {
        return Err(InstallError::UnexpectedData { path: path(), size });
    }
    if components.is_empty() && !matches!(kind, MemberKind::Directory) {
        return Err(InstallError::RootNotDirectory { path: path() });
    }
    Ok(Member {
        raw: raw.clone(),
        components,
        kind,
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    })
}

fn check_xattr(raw: &[u8], name: &[u8], value: &[u8]) -> Result<(), InstallError> {
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

/// A directory whose mode and times are applied after all members are installed.
struct DeferredDir {
    components: Vec<Vec<u8>>,
    raw: Vec<u8>,
    mode: u32,
    mtime: (i64, u32),
}

struct Installer<'a> {
    target: Rc<OwnedFd>,
    archive: &'a File,
    limits: &'a InstallLimits,
    stats: InstallStats,
    total_bytes: u64,
    /// Normalised paths of installed non-directories (hardlink targets).
    installed: HashSet<Vec<u8>>,
    dirs: Vec<DeferredDir>,
    root: Option<DeferredDir>,
    /// Open directories from the target down to the last parent used: each element is a
    /// child of the previous one. Saves an `openat2` per member in pre-order archives.
    chain: Vec<(Vec<Vec<u8>>, Rc<OwnedFd>)>,
}

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

impl Installer<'_> {
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

    fn check_limits(&mut self, member: &Member) -> Result<(), InstallError> {
        let path = || path_of(&member.raw);
        if self.stats.entries >= self.limits.max_entries {
            return Err(InstallError::TooManyEntries {
                path: path(),
                max: self.limits.max_entries,
            });
        }
        if let MemberKind::Regular { size, .. } = member.kind {
            if size > self.limits.max_file_bytes {
                return Err(InstallError::FileTooLarge {
                    path: path(),
                    size,
                    max: self.limits.max_file_bytes,
                });
            }
            let total = self.total_bytes.saturating_add(size);
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

    fn install(&mut self, member: Member) -> Result<(), InstallError> {
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
                return Ok(());
            }
            MemberKind::Regular { size, offset } => {
                let flags = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(dir, name, flags, Mode::from_raw_mode(0o600))
                    .call("openat")
                    .map_err(create_err)?;
                if *size > 0 {
                    let copied =
                        sys::copy_range(self.archive.as_fd(), *offset, fd.as_fd(), 0, *size)
                            .map_err(|source| InstallError::CopyContent {
                                path: path(),
                                source,
                            })?;
                    if copied < *size {
                        return Err(InstallError::ArchiveTruncated {
                            path: path(),
                            expected: *size,
                            copied,
                        });
                    }
                }
                set_owner_and_xattrs_fd(fd.as_fd(), &member, &member.xattrs).map_err(meta_err)?;
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(member.mode))
                    .call("fchmod")
                    .map_err(meta_err)?;
                rustix::fs::futimens(&fd, &timestamps(member.mtime))
                    .call("futimens")
                    .map_err(meta_err)?;
                self.stats.content_bytes += size;
            }
            MemberKind::Symlink { target } => {
                rustix::fs::symlinkat(target.as_slice(), dir, name)
                    .call("symlinkat")
                    .map_err(create_err)?;
                set_metadata_at(dir, name, &member, false).map_err(meta_err)?;
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
    fn finish(mut self) -> Result<InstallStats, InstallError> {
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
