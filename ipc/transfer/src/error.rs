//! [`TransferError`]: every way packing, unpacking or resolving a transfer's source or
//! destination can fail, each naming the member or path, and [`ErrorClass`], the coarse kind
//! a caller maps to its own error codes.

use std::io;

use rustix::io::Errno;

/// What kind of failure a [`TransferError`] is, for callers that map errors to codes (the
/// daemon's protocol error codes, the C ABI's status codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The archive or a path is malformed or refused by the hardening rules (a `..` member,
    /// an absolute name, a device node, a member outside the tree, a symlink where a parent
    /// directory must be).
    Refused,
    /// The source, the destination or the destination's parent does not exist.
    NotFound,
    /// The destination's file system (or the sandbox's disk quota) is full.
    NoSpace,
    /// The archive stream ended early or broke (the sender stopped or was cancelled).
    Aborted,
    /// Any other I/O failure.
    Io,
}

impl ErrorClass {
    /// `refused`, `not_found`, `no_space`, `aborted` or `io`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Refused => "refused",
            ErrorClass::NotFound => "not_found",
            ErrorClass::NoSpace => "no_space",
            ErrorClass::Aborted => "aborted",
            ErrorClass::Io => "io",
        }
    }

    /// The class named `name` by [`as_str`](Self::as_str) (`Io` for an unknown name).
    pub fn parse(name: &str) -> ErrorClass {
        match name {
            "refused" => ErrorClass::Refused,
            "not_found" => ErrorClass::NotFound,
            "no_space" => ErrorClass::NoSpace,
            "aborted" => ErrorClass::Aborted,
            _ => ErrorClass::Io,
        }
    }
}

/// Why a transfer failed. Member names and paths are shown lossily (UTF-8 with replacement).
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// A member's name is refused: absolute, with a `..` component, empty, with a NUL byte or
    /// longer than `PATH_MAX`.
    #[error("archive member {member:?} refused: {reason}")]
    BadName {
        /// The member's name as in the archive.
        member: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A member is a device node or a fifo, which are never created.
    #[error("archive member {member:?} refused: {kind} members are not extracted")]
    SpecialMember {
        /// The member's name.
        member: String,
        /// `character device`, `block device` or `fifo`.
        kind: &'static str,
    },
    /// A member has an entry type this extractor does not create (sparse files, unknown
    /// types).
    #[error("archive member {member:?} refused: unsupported entry type {entry_type:?}")]
    UnsupportedMember {
        /// The member's name.
        member: String,
        /// The raw type byte of the tar header.
        entry_type: char,
    },
    /// A member lies outside the one tree the archive must hold (its first component is not
    /// the first member's).
    #[error("archive member {member:?} refused: outside the tree {top:?}")]
    OutsideTree {
        /// The member's name.
        member: String,
        /// The tree's top-level name.
        top: String,
    },
    /// A hard link's target is not a file extracted earlier by this extraction.
    #[error("hard link {member:?} refused: its target {target:?} is not a file of this archive")]
    HardLinkTarget {
        /// The link member's name.
        member: String,
        /// Its target as in the archive.
        target: String,
    },
    /// A symlink member has no target.
    #[error("symlink {member:?} refused: no target")]
    EmptySymlink {
        /// The member's name.
        member: String,
    },
    /// A parent directory of a member cannot be used: it is a symlink (never followed), not a
    /// directory, or cannot be created.
    #[error("cannot use the parent directory of {member:?}")]
    Parent {
        /// The member's name.
        member: String,
        /// Cause (`ELOOP`: a symlink; `ENOTDIR`: not a directory; `EXDEV`: escapes).
        #[source]
        source: io::Error,
    },
    /// A directory exists where a non-directory member goes (directories are never removed).
    #[error("archive member {member:?} refused: a directory is in its place")]
    DirectoryInTheWay {
        /// The member's name.
        member: String,
    },
    /// The file system (or the sandbox's disk quota) ran out of space while a member was
    /// written.
    #[error("no space left while writing {member:?}")]
    NoSpace {
        /// The member's name.
        member: String,
        /// Cause (`ENOSPC` or `EDQUOT`).
        #[source]
        source: io::Error,
    },
    /// Creating a member or setting its metadata failed.
    #[error("{call} failed for {member:?}")]
    Create {
        /// The member's name.
        member: String,
        /// The system call.
        call: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Reading the archive failed (malformed tar, or the stream broke or ended early).
    #[error("reading the archive failed")]
    ReadArchive {
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Writing the archive failed (the receiver went away).
    #[error("writing the archive failed")]
    WriteArchive {
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The destination path ends in `/` but does not exist as a directory.
    #[error("destination {path:?} is not an existing directory")]
    DestinationNotDirectory {
        /// The destination as given.
        path: String,
    },
    /// The destination's parent directory cannot be opened.
    #[error("cannot open the parent directory of the destination {path:?}")]
    DestinationParent {
        /// The destination as given.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The destination path has no usable last component (`..`, empty).
    #[error("destination {path:?} has no name to create")]
    DestinationName {
        /// The destination as given.
        path: String,
    },
    /// The source cannot be opened.
    #[error("cannot open the source {path:?}")]
    Source {
        /// The source as given.
        path: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The source path has no last component to name the tree by (`/`, `..`).
    #[error("source {path:?} has no name: name the file or directory to copy")]
    SourceName {
        /// The source as given.
        path: String,
    },
    /// The source is a device node, fifo or socket.
    #[error("source {path:?} is a {kind}, not a file, directory or symlink")]
    SourceSpecial {
        /// The source as given.
        path: String,
        /// Its kind.
        kind: &'static str,
    },
    /// Walking the source tree failed at `path`.
    #[error("{call} failed at {path:?}")]
    Walk {
        /// The path inside the tree (archive name).
        path: String,
        /// The system call.
        call: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The source tree is deeper than [`MAX_DEPTH`](crate::MAX_DEPTH) directories.
    #[error("{path:?} is nested deeper than {max} directories")]
    TooDeep {
        /// The directory at the limit.
        path: String,
        /// The limit.
        max: usize,
    },
}

impl TransferError {
    /// The class of this error.
    pub fn class(&self) -> ErrorClass {
        use TransferError::*;
        match self {
            BadName { .. }
            | SpecialMember { .. }
            | UnsupportedMember { .. }
            | OutsideTree { .. }
            | HardLinkTarget { .. }
            | EmptySymlink { .. }
            | DirectoryInTheWay { .. }
            | DestinationName { .. }
            | SourceName { .. }
            | SourceSpecial { .. }
            | TooDeep { .. } => ErrorClass::Refused,
            NoSpace { .. } => ErrorClass::NoSpace,
            DestinationNotDirectory { .. } => ErrorClass::NotFound,
            DestinationParent { source, .. } | Source { source, .. } => {
                if source.kind() == io::ErrorKind::NotFound {
                    ErrorClass::NotFound
                } else {
                    ErrorClass::Io
                }
            }
            ReadArchive { source } if source.kind() == io::ErrorKind::UnexpectedEof => {
                ErrorClass::Aborted
            }
            Create { source, .. } | Walk { source, .. } | Parent { source, .. }
                if is_no_space(source) =>
            {
                ErrorClass::NoSpace
            }
            Parent { .. } => ErrorClass::Refused,
            ReadArchive { .. } | WriteArchive { .. } | Create { .. } | Walk { .. } => {
                ErrorClass::Io
            }
        }
    }
}

/// Whether `err` is `ENOSPC` or `EDQUOT`.
pub(crate) fn is_no_space(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(e) if e == Errno::NOSPC.raw_os_error() || e == Errno::DQUOT.raw_os_error()
    )
}

/// `bytes` as a display string (lossy UTF-8).
pub(crate) fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
