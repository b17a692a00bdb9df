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
use std::io::{self, BufReader};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::sys::{self, SyscallError};
use crate::tree::{check_device, open_empty_target, ContentSource, Installer, MemberKind};
use crate::unpack::{for_each_member, Content};

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
    /// Of those, bytes placed with `copy_file_range` from a blob or an archive: on btrfs the
    /// extents are shared with the source, and a simple quota (which charges whoever
    /// allocated an extent) does not charge them to the target's volume.
    pub shared_bytes: u64,
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
    /// A device node in an image outside its top-level device directory (`/dev`, whose
    /// device nodes are dropped: every sandbox mounts its own): it would give sandboxes raw
    /// access to a host device.
    #[error("{path}: {kind} device {major}:{minor} is not allowed in an image (only under /{dir}, where device nodes are dropped)")]
    DeviceInImage {
        /// The member.
        path: PathBuf,
        /// `"character"` or `"block"`.
        kind: &'static str,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
        /// The top-level directory whose device nodes are dropped.
        dir: String,
    },
    /// An overlay whiteout (0:0 character device) in a flat image, where it means nothing
    /// but would hide a file once the image is a lower layer.
    #[error("{path}: overlay whiteout (0:0 character device) is not allowed in an image")]
    WhiteoutInImage {
        /// The member.
        path: PathBuf,
    },
    /// An extended attribute outside `user.`, `security.`, `trusted.`, the POSIX ACLs, or
    /// with an invalid name or oversized value (or an overlay attribute in an image).
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
    /// Reading a file's content from a tar stream failed.
    #[error("{path}: reading content from the archive failed")]
    ReadMember {
        /// The member.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
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
    let entries = tar.entries_with_seek().map_err(read_err)?;
    let end = for_each_member(entries, archive, Content::Seek, |mut member, _| {
        if let MemberKind::Device {
            block,
            major,
            minor,
        } = member.kind
        {
            check_device(&member.raw, block, major, minor)?;
            member.kind = MemberKind::Whiteout;
        }
        installer.install(member)
    })?;
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
