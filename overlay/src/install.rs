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

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tar::{Entry, EntryType, Header};

use crate::format::{
    parse_mtime, parse_pax_records, xattr_name_from_key, MAX_EXTENSION_BYTES, MAX_PATH_BYTES,
};
use crate::sys::{self, SyscallError};
use crate::tree::{
    check_device, check_symlink_target, check_xattr, lossy, name_error, open_empty_target,
    parse_hardlink_target, parse_name, path_of, ContentSource, Installer, Member, MemberKind,
    RegularData,
};

/// Bounds on what one archive may install. Exceeding any is an error naming the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstallLimits {
    /// Most archive members (each directory, file, link and special file counts one).
    pub max_entries: u64,
    /// Most bytes of regular-file content, all files together.
    pub max_total_bytes: u64,
    /// Most bytes of content in a single regular file (its data: holes of a sparse file
    /// captured as sparse do not count).
    pub max_file_bytes: u64,
    /// Largest apparent size of a single regular file, holes included (a sparse file
    /// costs nothing to create, so this only has to fit the host's filesystem).
    pub max_apparent_bytes: u64,
}

impl Default for InstallLimits {
    /// 1 000 000 entries, 64 GiB in total, 16 GiB of data per file, 16 TiB apparent size
    /// per file (ext4's largest file).
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_total_bytes: 64 << 30,
            max_file_bytes: 16 << 30,
            max_apparent_bytes: 16 << 40,
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
    /// Re-reading the materialized target found an entry deeper than
    /// [`MAX_WALK_DEPTH`](crate::MAX_WALK_DEPTH) levels (something else wrote to it).
    #[error("{path} in the target is more than {max} directory levels deep")]
    TooDeep {
        /// The entry (target joined with its relative path).
        path: PathBuf,
        /// The limit.
        max: usize,
    },
    /// A directory of the target was moved while it was re-read after materializing.
    #[error("directory {path} of the target moved while it was read")]
    TargetMoved {
        /// The directory (target joined with its relative path).
        path: PathBuf,
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
    /// A file whose apparent size is larger than [`InstallLimits::max_apparent_bytes`].
    #[error("{path}: file of apparent size {size} bytes is larger than {max}")]
    ApparentSizeTooLarge {
        /// The member.
        path: PathBuf,
        /// Its apparent size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// Filling a file from the blob store failed: the blob is missing, unreadable, or its
    /// content does not hash to its name.
    #[error("{path}: filling content from the blob store failed")]
    Blob {
        /// The member.
        path: PathBuf,
        /// The cause.
        #[source]
        source: crate::layer::BlobError,
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
    let target_fd = open_empty_target(target)?;
    let mut installer = Installer::new(target_fd, ContentSource::Archive(&file), limits);
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
            data: RegularData::Archive {
                offset: entry.raw_file_position(),
            },
        },
        EntryType::Symlink => {
            let target = link();
            check_symlink_target(&raw, &target)?;
            MemberKind::Symlink { target }
        }
        EntryType::Link => MemberKind::Hardlink {
            target: parse_hardlink_target(&raw, &link())?,
        },
        EntryType::Char | EntryType::Block => {
            // dev_major and dev_minor sit at the same offsets in ustar and GNU headers.
            let device = |_| invalid("device", &header.as_bytes()[329..345]);
            let major = header.device_major().map_err(device)?;
            let minor = header.device_minor().map_err(device)?;
            let block = kind_flag == EntryType::Block;
            check_device(&raw, block, major.unwrap_or(0), minor.unwrap_or(0))?;
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
