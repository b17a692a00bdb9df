//! `remove`: kill a sandbox and delete it with all its checkpoints.

use std::fs;

use belayer_ipc::ErrorCode;

use super::instance::teardown;
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
    for n in slot.paths.instances() {
        let _ = belayer_overlay::unmount(&slot.paths.merged(n));
    }
    // Out of every other writer's way first. The removed flag, set under the record lock
    // that every `state.json` writer holds (the failure watcher's `refresh`/`fail`, `commit`),
    // means a write under way has finished and none starts again; then a rename (atomic)
    // moves the dir away, so paths of the old name fail from then on (a restore's retirement
    // of an old instance). The trash is deleted now, or by the next adoption pass.
    slot.mark_removed(true);
    let trash = trash_path(&slot.paths.dir);
    if let Err(source) = fs::rename(&slot.paths.dir, &trash) {
        slot.mark_removed(false);
        return Err(RemoveError::Delete {
            path: slot.paths.dir.clone(),
            source,
        });
    }
    delete_sandbox_dir(&trash);
    tracing::info!(sandbox = %id, "sandbox removed");
    Ok(())
}

/// Deletes a sandbox dir that nothing uses any more: its instance dirs and its checkpoints'
/// upper snapshots (volumes the kernel deletes) first, then the rest. Failures are logged;
/// the adoption pass retries trash.
pub fn delete_sandbox_dir(dir: &std::path::Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("inst-") {
                if let Err(err) = crate::quota::remove_instance_dir(&e.path()) {
                    tracing::warn!(path = %e.path().display(), error = %err, "cannot delete an instance");
                }
            }
        }
    }
    if let Ok(entries) = fs::read_dir(dir.join("checkpoints")) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                if let Err(err) = crate::store::snapshot::remove_checkpoint_dir(&e.path()) {
                    tracing::warn!(path = %e.path().display(), error = %err, "cannot delete a checkpoint");
                }
            }
        }
    }
    if let Err(e) = belayer_overlay::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %dir.display(), error = %e, "cannot delete a removed sandbox yet (the next start retries)");
        }
    }
}

/// Removes what a creation interrupted before its record was written left of sandbox `id`
/// (found at adoption: a dir without `state.json`): its cgroup (`cgroup`) killed and
/// removed with whatever init had started in it, its instance roots unmounted, the dir
/// deleted. Nothing of it was ever given to a client. A cgroup that cannot be emptied keeps
/// the dir for the next start.
pub fn remove_unrecorded(paths: &super::SandboxPaths, cgroup: &str) {
    if let Ok(cg) = crate::cgroup::SandboxCgroup::open(cgroup) {
        let emptied = cg
            .kill_all(std::time::Duration::from_secs(10))
            .and_then(|()| cg.remove());
        if let Err(e) = emptied {
            tracing::error!(path = %paths.dir.display(), error = %e, "cannot kill what an interrupted creation started");
            return;
        }
    }
    for n in paths.instances() {
        let _ = belayer_overlay::unmount(&paths.merged(n));
    }
    let trash = trash_path(&paths.dir);
    match fs::rename(&paths.dir, &trash) {
        Ok(()) => delete_sandbox_dir(&trash),
        Err(e) => {
            tracing::warn!(path = %paths.dir.display(), error = %e, "cannot move an interrupted creation's dir away")
        }
    }
    tracing::info!(path = %paths.dir.display(), "removed what an interrupted creation left");
}

/// Prefix of removed sandbox dirs awaiting deletion in `state_dir/sandboxes`.
pub const TRASH_PREFIX: &str = ".trash-";

/// `sandboxes/.trash-<id>-<random>` beside `dir`.
fn trash_path(dir: &std::path::Path) -> std::path::PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.with_file_name(format!(
        "{TRASH_PREFIX}{name}-{}",
        crate::sys::random_hex(4)
    ))
}
