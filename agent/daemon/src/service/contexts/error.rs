//! The errors of the daemon's context logs and the wire replies they become.

use std::path::PathBuf;

use belayer_ipc::{ErrorCode, ErrorReply};

use super::limits::{RECORD_CHARGE, TRAJECTORY_CHARGE};
use belayer_context::ContextLogError;

/// Why a context request failed.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// The trajectory id is not `<name>` or `<name>@<uid>` with a name of
    /// `[A-Za-z0-9._-]{1,128}` not starting with a dot. Holds at most the id's first
    /// [`ContextError::QUOTED_ID_CHARS`] characters (see [`ContextError::invalid`]).
    #[error(
        "invalid trajectory id {0:?}: expected a name of [A-Za-z0-9._-] (1 to 128, not starting \
         with a dot), optionally followed by @<uid>"
    )]
    InvalidTrajectory(String),
    /// An append to `<name>@<uid>` of another uid's namespace (refused whether or not the
    /// trajectory exists).
    #[error(
        "uid {uid} may not append to {trajectory}: only root and the owner write into another \
         uid's namespace"
    )]
    ForeignNamespace {
        /// The caller's uid.
        uid: u32,
        /// The id asked for.
        trajectory: String,
    },
    /// The context is larger than `context_max_bytes`.
    #[error("context of {bytes} bytes exceeds the limit of {max} bytes (context_max_bytes)")]
    ContextTooLarge {
        /// Its size, bytes.
        bytes: u64,
        /// The limit, bytes.
        max: u64,
    },
    /// The append would take the owner's context data past its budget.
    #[error(
        "context budget of uid {uid} exhausted: {used} of {budget} bytes in use, this append \
         needs {needed} (its record plus {RECORD_CHARGE} per record and {TRAJECTORY_CHARGE} per \
         new trajectory; context_budget_bytes)"
    )]
    BudgetExhausted {
        /// The owner of the trajectory.
        uid: u32,
        /// Bytes charged to it so far.
        used: u64,
        /// Bytes this append would add.
        needed: u64,
        /// Its budget, bytes.
        budget: u64,
    },
    /// The log failed.
    #[error(transparent)]
    Log(#[from] ContextLogError),
    /// Creating the contexts directory or an owner's directory in it (`mkdir`) failed.
    #[error("cannot create context log dir {path}")]
    CreateDir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening the contexts directory (`open`, `O_DIRECTORY | O_NOFOLLOW`) failed: `ELOOP`
    /// when it is a symlink.
    #[error("cannot open context log dir {path}")]
    OpenDir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// What lies where a log should be is not a regular file (a FIFO, a device).
    #[error("{path} is not a regular file, so not a context log")]
    NotALogFile {
        /// Its path.
        path: PathBuf,
    },
    /// Removing a log file failed: `openat2` of its owner's directory (`ENOTDIR` for a
    /// symlink in its place) or `unlinkat`.
    #[error("cannot remove context log {path}")]
    RemoveLog {
        /// The log's path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No such trajectory (or none the caller may see) to remove.
    #[error("no context log for trajectory {trajectory}")]
    UnknownTrajectory {
        /// Trajectory id as asked for.
        trajectory: String,
    },
    /// No such record (or no such trajectory the caller may see).
    #[error("no context for trajectory {trajectory} at {}", .prefix.map_or("the latest boundary".to_owned(), |k| format!("prefix {k}")))]
    NotFound {
        /// Trajectory id as asked for.
        trajectory: String,
        /// Prefix asked for.
        prefix: Option<u64>,
    },
}

impl ContextError {
    /// Characters of a refused trajectory id quoted in its error.
    pub const QUOTED_ID_CHARS: usize = 160;

    /// [`ContextError::InvalidTrajectory`] quoting at most the first
    /// [`Self::QUOTED_ID_CHARS`] characters of `id` (a client may send megabytes of it).
    pub fn invalid(id: &str) -> Self {
        let mut quoted: String = id.chars().take(Self::QUOTED_ID_CHARS).collect();
        if quoted.len() < id.len() {
            quoted.push('…');
        }
        ContextError::InvalidTrajectory(quoted)
    }
}

impl ContextError {
    /// Protocol error code: `BadRequest` for a bad id or an oversized context, `NotFound` (no
    /// such record or trajectory), `PermissionDenied` for another uid's namespace,
    /// `InvalidState` for an exhausted budget (the uid's store, not the request, is what
    /// refuses: the same append fits once space is freed or the budget raised), `Internal`
    /// for I/O.
    pub fn code(&self) -> ErrorCode {
        match self {
            ContextError::InvalidTrajectory(_) | ContextError::ContextTooLarge { .. } => {
                ErrorCode::BadRequest
            }
            ContextError::Log(ContextLogError::RecordTooLarge { .. }) => ErrorCode::BadRequest,
            ContextError::NotFound { .. } | ContextError::UnknownTrajectory { .. } => {
                ErrorCode::NotFound
            }
            ContextError::ForeignNamespace { .. } => ErrorCode::PermissionDenied,
            ContextError::BudgetExhausted { .. } => ErrorCode::InvalidState,
            ContextError::Log(_)
            | ContextError::CreateDir { .. }
            | ContextError::OpenDir { .. }
            | ContextError::RemoveLog { .. }
            | ContextError::NotALogFile { .. } => ErrorCode::Internal,
        }
    }

    /// The error as a reply (the message with its causes).
    pub fn reply(&self) -> ErrorReply {
        let mut message = self.to_string();
        let mut cur = std::error::Error::source(self);
        while let Some(s) = cur {
            message.push_str(": ");
            message.push_str(&s.to_string());
            cur = s.source();
        }
        ErrorReply {
            code: self.code(),
            message,
        }
    }
}
