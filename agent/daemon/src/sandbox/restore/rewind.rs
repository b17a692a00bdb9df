//! Which checkpoint a restore uses, and the move of the ready pointer when that is another
//! one than the ready checkpoint (a restore with `prefix`).
//!
//! Restoring C_K of boundary K gives the sandbox C_K's state. Once the restored instance
//! runs, and before the sandbox record names it, the ready pointer moves to C_K (one atomic
//! rename, [`CheckpointStore::set_ready`]); the visibility bound does not fall, so the
//! checkpoints taken after C_K stay listed and restorable: they are another branch of the
//! sandbox's tree, and the next checkpoint is a child of C_K. A daemon killed at any step
//! leaves a ready checkpoint to restore: the old one (killed before the pointer moved: the
//! sandbox is failed and its checkpoints untouched), or C_K (killed later).

use super::RestoreError;
use crate::store::CheckpointStore;

/// Which checkpoint a restore asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// The ready one (none: the sandbox restarts from its image).
    Ready,
    /// The latest of this action boundary on the ready checkpoint's line
    /// ([`CheckpointStore::line_of_prefix`]).
    Prefix(u64),
    /// This visible checkpoint, on any branch ([`CheckpointStore::visible`]).
    Named(String),
}

impl Choice {
    /// `Prefix(k)` for `Some(k)`, else `Ready`.
    pub fn prefix(prefix: Option<u64>) -> Choice {
        prefix.map_or(Choice::Ready, Choice::Prefix)
    }
}

/// The checkpoint a restore uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// The ready checkpoint before the restore, if any.
    pub ready: Option<String>,
    /// The checkpoint to restore (`None`: none is ready; the sandbox restarts from its
    /// image).
    pub chosen: Option<String>,
}

impl Target {
    /// The checkpoint `choice` names. Errors: the store's pointer or listing cannot be read
    /// ([`RestoreError::Corrupt`]); no checkpoint of that prefix on the ready line
    /// ([`RestoreError::NoCheckpoint`]) or of that name ([`RestoreError::NoSuchCheckpoint`]).
    pub(crate) fn choose(
        store: &CheckpointStore,
        id: &str,
        choice: &Choice,
    ) -> Result<Target, RestoreError> {
        let corrupt = |source| RestoreError::Corrupt {
            id: id.to_string(),
            source,
        };
        let ready = store.ready().map_err(corrupt)?;
        let chosen = match choice {
            Choice::Ready => ready.clone(),
            Choice::Prefix(k) => {
                Some(store.line_of_prefix(*k).map_err(corrupt)?.ok_or_else(|| {
                    RestoreError::NoCheckpoint {
                        id: id.to_string(),
                        prefix: *k,
                    }
                })?)
            }
            Choice::Named(name) => {
                Some(store.visible(name).map_err(corrupt)?.ok_or_else(|| {
                    RestoreError::NoSuchCheckpoint {
                        id: id.to_string(),
                        name: name.chars().take(80).collect(),
                    }
                })?)
            }
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
}
