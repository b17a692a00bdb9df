//! The limits of the daemon's context logs: open files, budgets, context size.

use belayer_context::MAX_CONTEXT_BYTES;

/// Log files held open at once, all trajectories together. A rollout appends to and looks up
/// one trajectory per sandbox, briefly, so 64 covers the trajectories a node drives at once
/// (a miss costs one `open`), while keeping the daemon far below its `RLIMIT_NOFILE` (1024 by
/// default), which its sockets, memfds, pidfds and CRIU's pipes share.
pub const MAX_OPEN_LOGS: usize = 64;

/// Charged to a uid's budget per trajectory, bytes: the file's inode, directory entry and
/// first block on the state disk, and the daemon's table entry and index for it (under 1 KiB).
pub const TRAJECTORY_CHARGE: u64 = 16 << 10;

/// Charged to a uid's budget per record on top of its frame, bytes: the record's share of the
/// daemon's index (≈ 100 bytes), so that tiny records cannot make the index outgrow the budget.
pub const RECORD_CHARGE: u64 = 4 << 10;

/// Default budget of a non-root uid (config `context_budget_bytes`): 1 GiB.
pub use crate::config::DEFAULT_UID_BUDGET_BYTES;

/// Limits of the context logs (from the config: `context_budget_bytes`,
/// `context_root_budget_bytes`, `context_max_bytes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextLimits {
    /// Charged bytes one non-root uid may keep; `None`: unlimited.
    pub uid_budget_bytes: Option<u64>,
    /// Charged bytes root may keep; `None`: unlimited.
    pub root_budget_bytes: Option<u64>,
    /// Largest context of one append, bytes (at most [`MAX_CONTEXT_BYTES`]).
    pub max_context_bytes: u64,
    /// Log files held open at once (at least 1).
    pub max_open_logs: usize,
}

impl Default for ContextLimits {
    fn default() -> Self {
        ContextLimits {
            uid_budget_bytes: Some(DEFAULT_UID_BUDGET_BYTES),
            root_budget_bytes: None,
            max_context_bytes: MAX_CONTEXT_BYTES,
            max_open_logs: MAX_OPEN_LOGS,
        }
    }
}

impl ContextLimits {
    /// The limits a daemon configuration sets (a budget of 0: unlimited).
    pub fn from_config(config: &crate::config::Config) -> Self {
        ContextLimits {
            uid_budget_bytes: (config.context_budget_bytes > 0)
                .then_some(config.context_budget_bytes),
            root_budget_bytes: (config.context_root_budget_bytes > 0)
                .then_some(config.context_root_budget_bytes),
            max_context_bytes: config.context_max_bytes.min(MAX_CONTEXT_BYTES),
            max_open_logs: MAX_OPEN_LOGS,
        }
    }

    /// The budget of `uid`, bytes (`None`: unlimited).
    pub(super) fn budget(&self, uid: u32) -> Option<u64> {
        match uid {
            0 => self.root_budget_bytes,
            _ => self.uid_budget_bytes,
        }
    }
}
