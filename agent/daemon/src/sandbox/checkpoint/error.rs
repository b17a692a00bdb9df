//! The typed errors of a checkpoint ([`super::checkpoint`]).

use belayer_ipc::{ErrorCode, FailPoint};

use crate::cgroup::CgroupError;
use crate::sandbox::RecordError;
use crate::store::StoreError;

/// Errors of a checkpoint. In every case the previous ready checkpoint stays in effect.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A task of a sandbox in its own user namespace holds inheritable capabilities outside
    /// its bounding set, which CRIU cannot restore there (see [`crate::sandbox::caps`]).
    #[error("sandbox {id}: pid {pid} has inheritable capabilities {bits:#x} outside its bounding set, which criu cannot restore in a user namespace")]
    UnrestorableCapabilities {
        /// Sandbox id.
        id: String,
        /// Host pid of the task.
        pid: i32,
        /// The capability bits concerned.
        bits: u64,
    },
    /// Test hooks are disabled in this daemon.
    #[error("test faults are disabled (start belayerd with test hooks)")]
    HooksDisabled,
    /// The sandbox is not running.
    #[error("sandbox {id} is {state}: cannot checkpoint")]
    NotRunning {
        /// Sandbox id.
        id: String,
        /// Its state.
        state: &'static str,
    },
    /// Freezing or thawing failed.
    #[error("cannot freeze sandbox {id}")]
    Freeze {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: CgroupError,
    },
    /// Capturing the upper layer failed.
    #[error("cannot capture the upper layer of sandbox {id}")]
    FsCapture {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: belayer_overlay::CaptureError,
    },
    /// CRIU could not be brought to the point of seizing the tree (its dump gate in the CRIU
    /// work dir failed, or CRIU exited or stalled before it).
    #[error("cannot start the CRIU dump of sandbox {id} ({path})")]
    DumpStart {
        /// Sandbox id.
        id: String,
        /// The gate file involved.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The CRIU dump failed.
    #[error("CRIU dump of sandbox {id} failed")]
    Dump {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: Box<belayer_criu::DumpError>,
    },
    /// The dump refers to paths a restore would have to refuse (e.g. through a symlink the
    /// sandbox planted out of its root): not published.
    #[error("checkpoint of sandbox {id} could not be restored, so it is not published")]
    Unrestorable {
        /// Sandbox id.
        id: String,
        /// Why.
        #[source]
        source: belayer_criu::UnsafeImagePath,
    },
    /// A task watches a deleted inode with inotify: CRIU would restore that watch dropped
    /// (`IN_IGNORED`, no more events), so the checkpoint is refused.
    #[error("sandbox {id}: pid {pid} watches deleted inode {ino} through inotify fd {fd}; its watch would not survive a restore")]
    DeletedWatch {
        /// Sandbox id.
        id: String,
        /// Host pid of the task holding the inotify fd.
        pid: i32,
        /// The inotify fd.
        fd: u32,
        /// The watched inode.
        ino: u64,
    },
    /// The sandbox holds a process state CRIU cannot restore
    /// ([`crate::sandbox::unrestorable`]): not published.
    #[error("sandbox {id} cannot be checkpointed")]
    Unsupported {
        /// Sandbox id.
        id: String,
        /// The state.
        #[source]
        state: crate::sandbox::unrestorable::UnsupportedState,
    },
    /// Writing an artifact failed.
    #[error("cannot write checkpoint artifact {path}")]
    Write {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// R_k's memory pages could not be content-addressed (a page pack could not be written:
    /// a full disk among the causes): not published.
    #[error("cannot store the memory pages of sandbox {id}")]
    Pages {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: crate::store::pages::PageError,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Persisting the sandbox state failed.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// An injected test fault.
    #[error("injected test fault at {0:?}")]
    Injected(FailPoint),
}

impl CheckpointError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            CheckpointError::HooksDisabled => ErrorCode::BadRequest,
            CheckpointError::NotRunning { .. } => ErrorCode::InvalidState,
            _ => ErrorCode::CheckpointFailed,
        }
    }
}
