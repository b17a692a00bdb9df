//! `remove`: kill a sandbox and delete it with all its checkpoints.

use std::fs;

use belayer_ipc::ErrorCode;

use super::restore::{retire_instance, teardown};
use super::SandboxSlot;
use crate::cgroup::CgroupError;

/// Errors of a removal.
#[derive(Debug, thiserror::Error)]
pub enum RemoveError {
    /// Killing the processes failed.
    #[error("cannot stop sandbox {id}")]
    Teardown {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: CgroupError,
    },
    /// Deleting its directory failed.
    #[error("cannot delete {path}")]
    Delete {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl RemoveError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        ErrorCode::Internal
    }
}

/// Removes the sandbox in `slot` (instances, cgroup, checkpoints, state).
pub fn remove(slot: &SandboxSlot) -> Result<(), RemoveError> {
    let id = slot.record().id.clone();
    // Kill first, without the verb lock: an action that never ends (or a stuck checkpoint)
    // holds that lock, and removal must not wait for it.
    let cgroup = slot.record().cgroup.clone();
    if let Ok(cg) = crate::cgroup::SandboxCgroup::open(&cgroup) {
        if let Err(e) = cg.kill_all(std::time::Duration::from_secs(10)) {
            tracing::warn!(sandbox = %id, error = %e, "cannot kill sandbox before removal");
        }
    }
    let _op = slot.lock_op();
    teardown(slot).map_err(|source| RemoveError::Teardown {
        id: id.clone(),
        source,
    })?;
    // Every instance root still mounted (the current one, or one left by an interrupted
    // restore).
    if let Ok(entries) = fs::read_dir(&slot.paths.dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(n) = name.strip_prefix("inst-").and_then(|n| n.parse().ok()) {
                retire_instance(&slot.paths, n);
            }
        }
    }
    belayer_overlay::remove_dir_all(&slot.paths.dir).map_err(|source| RemoveError::Delete {
        path: slot.paths.dir.clone(),
        source,
    })?;
    tracing::info!(sandbox = %id, "sandbox removed");
    Ok(())
}
