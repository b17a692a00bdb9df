//! Why a removal stopped: [`RemoveError`], and its conversion to `io::Error` for
//! [`remove_dir_all`](super::remove_dir_all).

use std::io;
use std::path::PathBuf;

use crate::sys::SyscallError;

/// Why [`remove_tree`](super::remove_tree) stopped. Paths are the removal root joined with
/// the entry's path (a flattened directory appears under its scratch name).
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// The path has no last component to remove (`/`, `..`, empty).
    #[error("{path} cannot be removed")]
    InvalidPath {
        /// The path given.
        path: PathBuf,
    },
    /// Opening the directory holding the root failed.
    #[error("opening {path}, the parent of the tree, failed")]
    OpenParent {
        /// The parent directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Examining an entry (`statx`) failed; a missing root gives `ENOENT` here.
    #[error("examining {path} failed")]
    Stat {
        /// The entry.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Opening a directory failed.
    #[error("opening directory {path} failed")]
    OpenDir {
        /// The directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Reading a directory's entries failed.
    #[error("reading directory {path} failed")]
    ReadDir {
        /// The directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Removing a non-directory failed.
    #[error("unlinking {path} failed")]
    Unlink {
        /// The entry.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Removing an emptied directory failed.
    #[error("removing directory {path} failed")]
    RemoveDir {
        /// The directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Moving a deep directory to the top of the tree failed.
    #[error("moving {path} to the top of the tree failed")]
    Flatten {
        /// The directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// A mount point or an entry of another filesystem: not descended into, not removed;
    /// it and the directories above it are left in place.
    #[error("{path} is a mount point or on another filesystem; left in place")]
    Mount {
        /// The entry.
        path: PathBuf,
    },
    /// The root is neither a directory nor a symlink.
    #[error("{path} is not a directory")]
    NotADirectory {
        /// The root.
        path: PathBuf,
    },
    /// More than [`RemoveOptions::max_entries`](super::RemoveOptions::max_entries) entries were
    /// examined.
    #[error("{path}: more than {max} entries examined, removal stopped")]
    TooManyEntries {
        /// The directory being read.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A directory still is not empty after a pass that found no entry in it.
    #[error("directory {path} is not empty but lists no entries")]
    NotEmpty {
        /// The directory.
        path: PathBuf,
    },
}

impl RemoveError {
    /// The failed call, for the variants that have one.
    pub fn syscall(&self) -> Option<&SyscallError> {
        match self {
            RemoveError::OpenParent { source, .. }
            | RemoveError::Stat { source, .. }
            | RemoveError::OpenDir { source, .. }
            | RemoveError::ReadDir { source, .. }
            | RemoveError::Unlink { source, .. }
            | RemoveError::RemoveDir { source, .. }
            | RemoveError::Flatten { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<RemoveError> for io::Error {
    /// An `io::Error` of the failed call's kind (so a missing root is
    /// [`io::ErrorKind::NotFound`], as with `std::fs::remove_dir_all`) that carries the
    /// [`RemoveError`] (`get_ref` and `downcast_ref` give it back).
    fn from(err: RemoveError) -> io::Error {
        let kind = match &err {
            RemoveError::InvalidPath { .. } => io::ErrorKind::InvalidInput,
            RemoveError::Mount { .. } => io::ErrorKind::CrossesDevices,
            RemoveError::NotADirectory { .. } => io::ErrorKind::NotADirectory,
            RemoveError::NotEmpty { .. } => io::ErrorKind::DirectoryNotEmpty,
            RemoveError::TooManyEntries { .. } => io::ErrorKind::Other,
            other => other
                .syscall()
                .map_or(io::ErrorKind::Other, |s| s.source.kind()),
        };
        io::Error::new(kind, err)
    }
}
