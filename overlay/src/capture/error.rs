//! Why a capture failed: [`CaptureError`], shared by the tar form
//! ([`capture_upper`](super::capture_upper), [`archive_tree`](super::archive_tree)) and the layer
//! form ([`capture_layer`](crate::layer::capture_layer)), and the path helpers both use to fill it.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::format::MAX_PATH_BYTES;
use crate::sys::SyscallError;
use crate::walk::{WalkErrorSink, WalkFailure};

/// Why [`capture_upper`](super::capture_upper) or [`archive_tree`](super::archive_tree)
/// failed (and, for the layer format, [`capture_layer`](crate::layer::capture_layer)). The
/// partial archive of `capture_upper` is removed before this is returned.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The archive file could not be created (it must not exist yet).
    #[error("creating archive {path} failed")]
    CreateArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Opening, listing or examining an entry of the upper directory failed (this includes
    /// an `upper` that is a symlink or not a directory).
    #[error("reading {path} in the upper layer failed")]
    ReadUpper {
        /// The entry (upper directory joined with its relative path).
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// An entry's path is longer than install accepts (4096 bytes); capturing it would make
    /// an archive that cannot be restored.
    #[error("path of {path} is {len} bytes, longer than {max}")]
    PathTooLong {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An entry lies deeper than [`MAX_WALK_DEPTH`](crate::MAX_WALK_DEPTH) levels below the
    /// upper directory: its path could not be restored (the walk stops there, holding a
    /// bounded number of fds).
    #[error("{path} is more than {max} directory levels deep")]
    TooDeep {
        /// The first entry below the limit (upper directory joined with its relative path).
        path: PathBuf,
        /// The limit.
        max: usize,
    },
    /// A directory the walk re-opened through `..` was not the one it had left: the tree
    /// was moved while it was captured.
    #[error("directory {path} moved during capture")]
    DirectoryMoved {
        /// The directory whose parent changed (upper directory joined with its path).
        path: PathBuf,
    },
    /// An entry carries more extended-attribute data than install accepts.
    #[error("extended attributes of {path} take {size} bytes, more than {max}")]
    XattrsTooLarge {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Bytes of names and values.
        size: usize,
        /// The limit.
        max: u64,
    },
    /// The upper layer holds more entries than
    /// [`InstallLimits::max_entries`](crate::InstallLimits::max_entries) (or one directory alone
    /// holds more names than that).
    #[error("{path}: more than {max} entries")]
    TooManyEntries {
        /// The first entry over the limit, relative to the upper directory.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A regular file is larger than
    /// [`InstallLimits::max_file_bytes`](crate::InstallLimits::max_file_bytes).
    #[error("{path}: file of {size} bytes is larger than {max}")]
    FileTooLarge {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its size in bytes (holes included).
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The files hold more than
    /// [`InstallLimits::max_total_bytes`](crate::InstallLimits::max_total_bytes) together.
    #[error("{path}: content would reach {total} bytes, more than {max}")]
    TotalBytesExceeded {
        /// The first file over the limit, relative to the upper directory.
        path: PathBuf,
        /// Content bytes including this file.
        total: u64,
        /// The limit.
        max: u64,
    },
    /// A regular file's apparent size is larger than
    /// [`InstallLimits::max_apparent_bytes`](crate::InstallLimits::max_apparent_bytes).
    #[error("{path}: file of apparent size {size} bytes is larger than {max}")]
    ApparentSizeTooLarge {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its apparent size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A sparse file with so many data runs that capturing it in at most
    /// [`MAX_EXTENTS_PER_FILE`](crate::layer::MAX_EXTENTS_PER_FILE) extents would store far
    /// more than its data (its holes as zeros).
    #[error("{path}: {data} bytes of data in too many runs: {captured} bytes would be captured")]
    TooFragmented {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Bytes of data the kernel reports.
        data: u64,
        /// Bytes the merged extents would capture.
        captured: u64,
    },
    /// A device node other than an overlay whiteout (0:0 character device): it could never
    /// be restored, and would give the sandbox raw access to a host device.
    #[error("{path}: {kind} device {major}:{minor} is not allowed in an upper layer")]
    ForbiddenDevice {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// `"character"` or `"block"`.
        kind: &'static str,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// Staging or storing blobs failed (or a blob of the base manifest was collected).
    #[error("blob store")]
    Blob(#[source] crate::layer::blobs::BlobError),
    /// The entry has a file type the kernel reported as unknown.
    #[error("{path} has an unsupported file type (mode {mode:o})")]
    UnsupportedFileType {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Its raw `st_mode`.
        mode: u32,
    },
    /// A regular file ended before the size it had when it was opened (something wrote to
    /// the upper layer during capture).
    #[error("{path} shrank during capture: {expected} bytes expected, {copied} read")]
    FileShrank {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its size when opened.
        expected: u64,
        /// Bytes read before the end of file.
        copied: u64,
    },
    /// Copying a file's content into the archive failed.
    #[error("copying {path} into the archive failed")]
    CopyContent {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Writing headers or padding to the archive failed.
    #[error("writing archive {path} failed")]
    WriteArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl CaptureError {
    /// Whether the capture stopped because the reader of its output stream went away (`EPIPE`
    /// writing to [`archive_tree`](super::archive_tree)'s output), rather than because of the tree.
    pub fn is_broken_pipe(&self) -> bool {
        let epipe = Some(rustix::io::Errno::PIPE.raw_os_error());
        match self {
            CaptureError::WriteArchive { source, .. } => source.raw_os_error() == epipe,
            CaptureError::CopyContent { source, .. } => source.errno() == epipe,
            _ => false,
        }
    }
}

impl WalkErrorSink for CaptureError {
    fn walk_error(path: PathBuf, failure: WalkFailure) -> Self {
        match failure {
            WalkFailure::Syscall(source) => CaptureError::ReadUpper { path, source },
            WalkFailure::TooDeep { max } => CaptureError::TooDeep { path, max },
            WalkFailure::TooManyEntries { max } => CaptureError::TooManyEntries { path, max },
            WalkFailure::Moved => CaptureError::DirectoryMoved { path },
        }
    }
}

/// A path relative to the upper directory, for error messages.
pub(crate) fn rel_path(rel: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsStr::from_bytes(rel))
}

/// Refuses an entry whose path is longer than a restore accepts.
pub(crate) fn check_path_len(rel: &[u8]) -> Result<(), CaptureError> {
    if rel.len() > MAX_PATH_BYTES {
        return Err(CaptureError::PathTooLong {
            path: rel_path(rel),
            len: rel.len(),
            max: MAX_PATH_BYTES,
        });
    }
    Ok(())
}
