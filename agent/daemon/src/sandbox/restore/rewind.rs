//! Which checkpoint a restore uses, and the rewind of the ready pointer when that is an
//! earlier one than the ready checkpoint (a restore with `prefix`).
//!
//! Restoring C_K of an earlier boundary K gives the sandbox C_K's state: the checkpoints
//! published after C_K hold a future it no longer has. Once the restored instance runs, and
//! before the sandbox record names it, the ready pointer moves back to C_K (one atomic rename,
//! [`CheckpointStore::set_ready`]); from then on the later checkpoints are invisible (the
//! store lists only sequence numbers up to the ready one) and they are removed last
//! ([`CheckpointStore::discard_after_ready`]). A daemon killed at any step leaves a ready
//! checkpoint to restore: the old one (killed before the pointer moved: the sandbox is failed
//! and its checkpoints untouched), or C_K (killed later: whatever of the future is left is
//! invisible and removed at adoption or by the next checkpoint). Later work may keep such
//! futures as branches instead of dropping them.

use super::RestoreError;
use crate::store::CheckpointStore;

/// The checkpoint a restore uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Target {
    /// The ready checkpoint before the restore, if any.
    pub ready: Option<String>,
    /// The checkpoint to restore (`None`: none is ready; the sandbox restarts from its
    /// image).
    pub chosen: Option<String>,
}

impl Target {
    /// The ready checkpoint (`prefix` `None`), or the latest visible one of boundary
    /// `prefix`. Errors: the store's pointer or listing cannot be read
    /// ([`RestoreError::Corrupt`]); no ready checkpoint has that prefix
    /// ([`RestoreError::NoCheckpoint`]).
    pub(super) fn choose(
        store: &CheckpointStore,
        id: &str,
        prefix: Option<u64>,
    ) -> Result<Target, RestoreError> {
        let corrupt = |source| RestoreError::Corrupt {
            id: id.to_string(),
            source,
        };
        let ready = store.ready().map_err(corrupt)?;
        let chosen = match prefix {
            None => ready.clone(),
            Some(k) => Some(
                store
                    .visible_of_prefix(k)
                    .map_err(corrupt)?
                    .ok_or_else(|| RestoreError::NoCheckpoint {
                        id: id.to_string(),
                        prefix: k,
                    })?,
            ),
        };
        Ok(Target { ready, chosen })
    }

    /// Whether the restore moves the ready pointer back (to an earlier checkpoint).
    pub(super) fn rewinds(&self) -> bool {
        self.chosen.is_some() && self.chosen != self.ready
    }

    /// Points `READY` at the chosen checkpoint, when it is not the ready one. On an error the
    /// pointer names the old ready checkpoint (or, for [`crate::store::StoreError::PointerMoved`],
    /// the chosen one): either is restorable.
    pub(super) fn move_pointer(&self, store: &CheckpointStore) -> Result<(), RestoreError> {
        match &self.chosen {
            Some(name) if self.rewinds() => Ok(store.set_ready(name)?),
            _ => Ok(()),
        }
    }

    /// Points `READY` back at the old ready checkpoint after a restore that moved it failed
    /// later (its record could not be saved), so that nothing changed; a failure is logged
    /// (the chosen checkpoint stays ready: restorable too).
    pub(super) fn undo(&self, store: &CheckpointStore, id: &str) {
        if let (true, Some(old)) = (self.rewinds(), &self.ready) {
            if let Err(e) = store.set_ready(old) {
                tracing::warn!(sandbox = %id, error = %e, "cannot point the ready checkpoint back");
            }
        }
    }

    /// Removes the checkpoints published after the chosen one, once the restored instance is
    /// the sandbox's; returns their prefixes. A failure is logged: what is left is invisible
    /// and goes at the next checkpoint or adoption.
    pub(super) fn drop_future(&self, store: &CheckpointStore, id: &str) -> Vec<u64> {
        if !self.rewinds() {
            return Vec::new();
        }
        match store.discard_after_ready() {
            Ok(dropped) => {
                tracing::info!(sandbox = %id, ?dropped, "dropped the checkpoints after the restored one");
                dropped
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "cannot drop the checkpoints after the restored one");
                Vec::new()
            }
        }
    }
}
