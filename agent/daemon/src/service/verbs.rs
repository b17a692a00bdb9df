//! The sandbox verbs of the protocol that the metrics count: actions (`Exec`), checkpoints
//! (`Checkpoint`, `MaybeCheckpoint`) and restores (`Restore`).

use belayer_ipc::{Caller, CheckpointRequest, ErrorCode, ExecRequest, Response};

use super::{error, rollout_api, unknown, Agent};
use crate::cgroup::SandboxCgroup;
use crate::sandbox;

impl Agent {
    /// `Exec`: runs one action in the sandbox and counts its outcome.
    pub(super) fn exec_action(&self, caller: &Caller, req: &ExecRequest) -> Response {
        let Some(slot) = self.slot_for(caller, &req.id) else {
            self.metrics.action(Err(ErrorCode::UnknownSandbox));
            return unknown(&req.id);
        };
        let result = sandbox::exec::exec(&self.rt, &slot, req);
        self.metrics.action(result.as_ref().map_err(|e| e.code()));
        match result {
            Ok(r) => Response::Exec(r),
            Err(e) => error(e.code(), &e),
        }
    }

    /// `Checkpoint`: takes C_k now, publishes its event and counts it.
    pub(super) fn checkpoint_now(&self, caller: &Caller, req: &CheckpointRequest) -> Response {
        let Some(slot) = self.slot_for(caller, &req.id) else {
            self.metrics.checkpoint(Err(ErrorCode::UnknownSandbox));
            return unknown(&req.id);
        };
        let result = sandbox::checkpoint::checkpoint(&self.rt, &slot, req);
        self.metrics
            .checkpoint(result.as_ref().map_err(|e| e.code()));
        match result {
            Ok(info) => {
                self.publish(rollout_api::checkpoint_ready(&info));
                Response::Checkpoint(info)
            }
            Err(e) => error(e.code(), &e),
        }
    }

    /// `Restore` and `RestoreCheckpoint`: restores the checkpoint `choice` names into a fresh
    /// instance, once more after a failure
    /// [`sandbox::restore::RestoreError::is_transient`] names, and counts the outcome.
    pub(super) fn restore_now(
        &self,
        caller: &Caller,
        id: &str,
        verify: bool,
        choice: sandbox::restore::Choice,
    ) -> Response {
        let Some(slot) = self.slot_for(caller, id) else {
            self.metrics.restore(Err(ErrorCode::UnknownSandbox));
            return unknown(id);
        };
        let restore = || sandbox::restore::restore(&self.rt, &slot, verify, &choice);
        let mut restored = restore();
        if let Err(e) = &restored {
            if e.is_transient() {
                tracing::warn!(sandbox = %id, error = %e, "restore failed in a way seen to pass on a second try; trying once more");
                restored = restore();
            }
        }
        self.metrics
            .restore(restored.as_ref().map_err(|e| e.code()));
        match restored {
            Ok(info) => {
                if !info.dropped_prefixes.is_empty() {
                    // The dropped checkpoints' blobs may be garbage now.
                    self.collect_blobs();
                }
                Response::Restored(info)
            }
            Err(e) => error(e.code(), &e),
        }
    }

    /// Counts an image pull or OCI import by its answer and passes the answer on.
    pub(super) fn counted_pull(&self, response: Response) -> Response {
        self.store_sizes.images_changed();
        match &response {
            Response::Error(e) => self.metrics.image_pull(Err(e.code)),
            _ => self.metrics.image_pull(Ok(())),
        }
        response
    }

    /// `MaybeCheckpoint`: asks the sandbox's policy (Algorithm 1) whether to checkpoint at
    /// this action boundary, and does when it says so; a skip is counted by its reason.
    pub(super) fn maybe_checkpoint(
        &self,
        caller: &Caller,
        req: belayer_ipc::MaybeCheckpointRequest,
    ) -> Response {
        let Some(slot) = self.slot_for(caller, &req.id) else {
            return unknown(&req.id);
        };
        // Read under the op lock, so a restore or an action in flight is not half seen; a
        // sandbox that cannot checkpoint is never "clean".
        let (instance, dirty) = {
            let _op = slot.lock_op();
            let rec = slot.refresh();
            let dirty = if rec.state.can_checkpoint() && rec.init_alive() {
                match slot.changes.since_ready() {
                    // Clean up to the last action; and since, what background processes did.
                    Some(false) => match SandboxCgroup::open(&rec.cgroup) {
                        Ok(cg) => self.rt.tracer.changed_since_mark(
                            &rec,
                            &cg,
                            &slot.paths.upper(rec.instance),
                        ),
                        Err(_) => None,
                    },
                    other => other,
                }
            } else {
                None
            };
            (rec.instance, dirty)
        };
        let pending = match self.policies.decide(&req, instance, dirty) {
            Ok(p) => p,
            Err(e) => return error(ErrorCode::BadRequest, &e),
        };
        let decision = rollout_api::decision_info(&pending.decision);
        if !pending.decision.checkpoint {
            self.metrics.checkpoint_skipped(pending.decision.reason);
            return Response::MaybeCheckpoint(belayer_ipc::MaybeCheckpointResult {
                checkpointed: false,
                decision,
                checkpoint: None,
            });
        }
        let started = std::time::Instant::now();
        let creq = belayer_ipc::CheckpointRequest {
            id: req.id.clone(),
            prefix: req.prefix,
            context: req.context,
            fault: None,
        };
        let result = sandbox::checkpoint::checkpoint(&self.rt, &slot, &creq);
        self.policies
            .checkpoint_done(&pending, started.elapsed().as_secs_f64(), result.is_ok());
        self.metrics
            .checkpoint(result.as_ref().map_err(|e| e.code()));
        match result {
            Ok(info) => {
                self.publish(rollout_api::checkpoint_ready(&info));
                Response::MaybeCheckpoint(belayer_ipc::MaybeCheckpointResult {
                    checkpointed: true,
                    decision,
                    checkpoint: Some(info),
                })
            }
            Err(e) => error(e.code(), &e),
        }
    }
}
