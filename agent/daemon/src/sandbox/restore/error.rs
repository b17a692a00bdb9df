//! The errors of a restore and the protocol code each answers with.

use belayer_ipc::ErrorCode;

use crate::cgroup::CgroupError;
use crate::sandbox::create::CreateError;
use crate::sandbox::RecordError;
use crate::store::StoreError;
use crate::sys;

/// Errors of a restore.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The ready checkpoint failed verification; nothing was touched.
    #[error("ready checkpoint of sandbox {id} is corrupt")]
    Corrupt {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: StoreError,
    },
    /// A blob the ready checkpoint's layer refers to is missing or corrupt; nothing was
    /// touched.
    #[error("a blob of the ready checkpoint of sandbox {id} is missing or corrupt")]
    CorruptBlob {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: belayer_overlay::layer::BlobError,
    },
    /// R_k's pages files could not be rebuilt from their page packs (a missing pack, a page
    /// map that does not decode or names an unlisted pack, a full disk); nothing was touched.
    #[error("the memory images of the checkpoint of sandbox {id} cannot be assembled")]
    Pages {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: crate::store::pages::PageError,
    },
    /// The sandbox has no ready checkpoint of the requested boundary on its ready line;
    /// nothing was touched.
    #[error("sandbox {id} has no ready checkpoint of prefix {prefix}")]
    NoCheckpoint {
        /// Sandbox id.
        id: String,
        /// The requested action boundary K.
        prefix: u64,
    },
    /// The sandbox has no visible checkpoint of that name; nothing was touched.
    #[error("sandbox {id} has no checkpoint named {name:?}")]
    NoSuchCheckpoint {
        /// Sandbox id.
        id: String,
        /// The requested name (at most 80 characters of it).
        name: String,
    },
    /// The verification thread panicked.
    #[error("verifying the ready checkpoint of sandbox {id} failed unexpectedly")]
    VerifierPanicked {
        /// Sandbox id.
        id: String,
    },
    /// Tearing down the failed instance failed.
    #[error("cannot tear down the failed instance of sandbox {id}")]
    Teardown {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: CgroupError,
    },
    /// Installing F_k failed.
    #[error("cannot install the upper layer of sandbox {id}")]
    FsInstall {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: belayer_overlay::InstallError,
    },
    /// Building the fresh instance failed.
    #[error(transparent)]
    Instance(#[from] CreateError),
    /// The CRIU restore failed.
    #[error("CRIU restore of sandbox {id} failed")]
    Criu {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: Box<belayer_criu::RestoreError>,
    },
    /// A path of the checkpoint's CRIU images would make the restore (host root) create,
    /// open or remove something outside the fresh root, or cannot be checked; CRIU did not run.
    #[error("CRIU images of the ready checkpoint of sandbox {id} are refused")]
    UnsafeImages {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: belayer_criu::UnsafeImagePath,
    },
    /// The sandbox's image is now one its owner may not use (another peer's, or one whose
    /// owner cannot be read); nothing was touched.
    #[error("image {image} of sandbox {id} belongs to {} now", owner.map_or("an unknown owner".to_string(), |o| format!("uid {o}")))]
    ForeignImage {
        /// Sandbox id.
        id: String,
        /// Image name.
        image: String,
        /// Its owner, when known.
        owner: Option<u32>,
    },
    /// The sandbox's image now has another digest than the one its checkpoint (or the
    /// sandbox) was made on: its upper layer would lie over other lower layers. Nothing was
    /// touched; import the original image under that name again to restore.
    #[error("image {image} of sandbox {id} changed: the checkpoint was taken on {expected}, the image is now {found}")]
    ImageChanged {
        /// Sandbox id.
        id: String,
        /// Image name.
        image: String,
        /// Digest recorded with the checkpoint.
        expected: String,
        /// Digest of the image under that name now (`none` when it has none).
        found: String,
    },
    /// The checkpoint's ids are in another host id range than the sandbox's user namespace
    /// (a checkpoint of another sandbox placed in this one's store): its files and
    /// namespace maps would belong to someone else's range. Nothing was touched.
    #[error("checkpoint {checkpoint} of sandbox {id} holds the ids of host range {found:?}, the sandbox has {expected:?}")]
    ForeignRange {
        /// Sandbox id.
        id: String,
        /// Checkpoint name.
        checkpoint: String,
        /// The sandbox's range.
        expected: Option<crate::userns::IdRange>,
        /// The checkpoint's.
        found: crate::userns::IdRange,
    },
    /// Re-capturing the restored upper layer for the validity check failed.
    #[error("cannot re-capture the restored upper layer of sandbox {id}")]
    Verify {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: belayer_overlay::CaptureError,
    },
    /// The fresh network namespace could not be made.
    #[error("cannot make a network namespace for sandbox {id}")]
    Netns {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: sys::SyscallError,
    },
    /// A step at one of CRIU's restore stages failed, or the stage never came: readying the
    /// network namespace CRIU made (`post-setup-namespaces`; CRIU aborted the restore), or
    /// the hook itself.
    #[error("sandbox {id}: a step at a stage of the CRIU restore failed")]
    StageHook {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: Box<belayer_criu::HookedRestoreError<crate::sandbox::netns::NetnsError>>,
    },
    /// Store access failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Persisting state failed.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// Filesystem work on the instance dirs failed.
    #[error("cannot prepare {path}")]
    Dirs {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl RestoreError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            RestoreError::Corrupt { .. }
            | RestoreError::CorruptBlob { .. }
            | RestoreError::ForeignRange { .. } => ErrorCode::CorruptCheckpoint,
            RestoreError::FsInstall {
                source: belayer_overlay::InstallError::Blob { .. },
                ..
            } => ErrorCode::CorruptCheckpoint,
            RestoreError::Pages { source, .. }
                if !matches!(source, crate::store::pages::PageError::Io { .. }) =>
            {
                ErrorCode::CorruptCheckpoint
            }
            // Images that fail the path check fail it on every try: the checkpoint is unusable.
            RestoreError::UnsafeImages { source, .. } if source.is_image_fault() => {
                ErrorCode::CorruptCheckpoint
            }
            RestoreError::ForeignImage { .. } => ErrorCode::PermissionDenied,
            RestoreError::ImageChanged { .. } => ErrorCode::ImageChanged,
            RestoreError::NoCheckpoint { .. } | RestoreError::NoSuchCheckpoint { .. } => {
                ErrorCode::NotFound
            }
            RestoreError::Criu { source, .. }
                if matches!(**source, belayer_criu::RestoreError::TimedOut { .. }) =>
            {
                ErrorCode::RestoreTimedOut
            }
            _ => ErrorCode::RestoreFailed,
        }
    }
}

impl RestoreError {
    /// Whether the restore failed in a way a second try from the same checkpoint may not:
    /// - CRIU failed because a task it was restoring stopped with `SIGTRAP` ("<pid> stopped
    ///   by signal 5"): seen about one restore in ten of a tree with TCP connections holding
    ///   unsent data on a loaded host, in both network-namespace layouts, cause not found
    ///   yet; CRIU has then killed what it made;
    /// - CRIU's action script at `pre-resume` ended before the daemon's answer
    ///   ([`belayer_criu::HookedRestoreError::ScriptEnded`]): seen once in a soak of 500
    ///   restores, cause not found yet; the tree CRIU resumed dies with the fresh cgroup.
    ///
    /// Either way the ready checkpoint is untouched, so the daemon tries such a restore once
    /// more (and logs the first failure).
    pub fn is_transient(&self) -> bool {
        match self {
            RestoreError::Criu { source, .. } => matches!(&**source,
                belayer_criu::RestoreError::Restore { log, .. } if log.contains("stopped by signal 5")),
            RestoreError::StageHook { source, .. } => matches!(
                &**source,
                belayer_criu::HookedRestoreError::ScriptEnded { .. }
            ),
            _ => false,
        }
    }
}
