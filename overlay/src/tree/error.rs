//! Why installing a tree failed: [`InstallError`], shared by every user of the tree builder
//! (tar archives, image streams, layer manifests), and the helpers that turn member names
//! into its fields.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::sys::SyscallError;

/// Why [`install_upper`](crate::install_upper) failed, and with it
/// [`install_image`](crate::install_image), [`install_oci_layer`](crate::install_oci_layer)
/// and [`materialize_layer`](crate::layer::materialize_layer), which share its tree builder.
/// `path` fields name the archive member or manifest entry (relative to the target) as
/// written. The target may hold a partial install afterwards; the caller discards it (it
/// was a fresh directory), nothing outside it was touched.
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
    /// A device node in an image layer (character or block, any numbers, 0:0 included:
    /// whiteouts come as `.wh.` names, never as device members).
    #[error("{path}: {kind} device {major}:{minor} is not allowed in an image layer")]
    DeviceInLayer {
        /// The member.
        path: PathBuf,
        /// `"character"` or `"block"`.
        kind: &'static str,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// A `.wh.` whiteout member of an image layer whose hidden name is not a normal name
    /// component (empty, `.`, `..`), or a `.wh.` name used as a parent directory.
    #[error("{path}: invalid whiteout ({reason})")]
    InvalidWhiteout {
        /// The member.
        path: PathBuf,
        /// Why.
        reason: &'static str,
    },
    /// An image layer holds both a member and a whiteout for one name (or a member below a
    /// whited-out name): which one wins is not defined, so neither is guessed.
    #[error("{path}: a member and a whiteout for the same name in one layer")]
    WhiteoutConflict {
        /// The later of the two members.
        path: PathBuf,
    },
    /// A non-directory member of an image layer replaces a directory that already has
    /// entries (tar replaces a name only by removing it, and removes only empty
    /// directories).
    #[error("{path}: would replace a directory that is not empty")]
    ReplacesDirectory {
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
    /// More members than [`InstallLimits::max_entries`](crate::InstallLimits::max_entries).
    #[error("{path}: more than {max} members")]
    TooManyEntries {
        /// The first member over the limit.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A file larger than [`InstallLimits::max_file_bytes`](crate::InstallLimits::max_file_bytes).
    #[error("{path}: file of {size} bytes is larger than {max}")]
    FileTooLarge {
        /// The member.
        path: PathBuf,
        /// Its size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A file whose apparent size is larger than
    /// [`InstallLimits::max_apparent_bytes`](crate::InstallLimits::max_apparent_bytes).
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
        source: crate::layer::blobs::BlobError,
    },
    /// More content than [`InstallLimits::max_total_bytes`](crate::InstallLimits::max_total_bytes).
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

/// `bytes` as text for an error field (invalid UTF-8 replaced).
pub(crate) fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A member name as a path for an error field (bytes verbatim).
pub(crate) fn path_of(raw: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(raw))
}
