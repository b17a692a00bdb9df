//! Checkpoints: take one, ask the policy (`belayer_maybe_checkpoint`), restore.

use crate::status::{guard, text, writable, Failure};
use belayer_ipc::{CheckpointRequest, MaybeCheckpointRequest, PolicySpec, Request, Response};
use std::ffi::{c_char, c_int};

use crate::convert::*;
use crate::types::*;

/// Takes a full checkpoint C_k of sandbox `id` at action boundary `prefix`, storing the LLM
/// context `context[0..context_len]` with it; describes it in `*out` when `out` is not NULL
/// (free with [`belayer_checkpoint_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `context` is null (with length 0) or points at
/// `context_len` bytes; `out` is null or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint(
    client: BelayerClient,
    id: *const c_char,
    prefix: u64,
    context: *const u8,
    context_len: usize,
    out: *mut BelayerCheckpointInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, context, mut out) = unsafe {
            (
                text(id, "id")?,
                bytes_in(context, context_len, "context")?,
                out.as_mut(),
            )
        };
        // The struct has no drop glue: overwriting garbage is fine.
        if let Some(o) = out.as_deref_mut() {
            *o = BelayerCheckpointInfo::EMPTY;
        }
        let req = CheckpointRequest {
            id: id.to_owned(),
            prefix,
            context: context.to_vec(),
            fault: None,
        };
        match call(client, Request::Checkpoint(req))? {
            Response::Checkpoint(info) => {
                if let Some(out) = out {
                    *out = BelayerCheckpointInfo::from_info(info)?;
                }
                Ok(())
            }
            other => Err(unexpected("checkpoint", &other)),
        }
    })
}

/// Frees the strings of `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint_info_free(info: *mut BelayerCheckpointInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        free_string(&mut info.name);
        free_string(&mut info.context_digest);
        *info = BelayerCheckpointInfo::EMPTY;
    }
}

/// Feeds the checkpoint policy of sandbox `id` the timing of the step that reached boundary
/// `prefix`; the daemon takes a full checkpoint (with `context`) when the policy says so.
/// `policy` (NULL: keep the sandbox's current one; default adaptive with p = 0.01 per step)
/// sets or replaces the policy. Stores the decision in `*out`.
///
/// Errors: as [`belayer_checkpoint`] when a checkpoint was attempted and failed;
/// `BELAYER_E_BAD_REQUEST` for an invalid policy.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `context` is null (with length 0) or points at
/// `context_len` bytes; `step` is a valid pointer; `policy` is null or valid (its `kind` null
/// or a NUL-terminated string); `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_maybe_checkpoint(
    client: BelayerClient,
    id: *const c_char,
    prefix: u64,
    context: *const u8,
    context_len: usize,
    step: *const BelayerStep,
    policy: *const BelayerPolicy,
    out: *mut BelayerDecision,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, context, step, policy, out) = unsafe {
            (
                text(id, "id")?,
                bytes_in(context, context_len, "context")?,
                step.as_ref().ok_or_else(|| Failure::invalid("step"))?,
                policy.as_ref(),
                writable(out, "out")?,
            )
        };
        *out = BelayerDecision::default();
        let policy = match policy {
            None => None,
            Some(p) => Some(PolicySpec {
                // SAFETY: forwarded from this function's contract.
                kind: unsafe { opt_text(p.kind, "policy.kind")? }.map(str::to_owned),
                failure_p: opt_non_negative(p.failure_p),
                failure_rate_per_s: opt_non_negative(p.failure_rate_per_s),
                checkpoint_timeout_s: opt_non_negative(p.checkpoint_timeout_s),
                cooldown_s: opt_non_negative(p.cooldown_s),
                ..Default::default()
            }),
        };
        let req = MaybeCheckpointRequest {
            id: id.to_owned(),
            prefix,
            context: context.to_vec(),
            step_duration_s: step.step_duration_s,
            regen_cost_s: opt_non_negative(step.regen_cost_s),
            llm_elapsed_s: step.llm_elapsed_s.max(0.0),
            llm_response_s: opt_non_negative(step.llm_response_s),
            policy,
        };
        match call(client, Request::MaybeCheckpoint(req))? {
            Response::MaybeCheckpoint(r) => {
                let d = &r.decision;
                let mut decision = BelayerDecision {
                    checkpointed: r.checkpointed,
                    reason: reason_code(d.reason.as_str()),
                    p: d.p,
                    regen_cost_s: d.regen_cost_s,
                    c_s: d.c_s,
                    q: d.q,
                    benefit: d.benefit,
                    visible_cost: d.visible_cost,
                    ..BelayerDecision::default()
                };
                if let Some(c) = &r.checkpoint {
                    decision.checkpoint_prefix = c.prefix;
                    decision.checkpoint_bytes = c.bytes;
                    decision.checkpoint_frozen_ms = c.timings_ms.frozen_total;
                    decision.checkpoint_total_ms = c.timings_ms.total;
                }
                *out = decision;
                Ok(())
            }
            other => Err(unexpected("maybe_checkpoint", &other)),
        }
    })
}

/// Restores sandbox `id` from its ready checkpoint into a fresh instance (from its base
/// image when none is ready), checking the restored state against the checkpoint when
/// `verify`; stores k and the LLM context L_k in `*out` (free with
/// [`belayer_restore_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_restore(
    client: BelayerClient,
    id: *const c_char,
    verify: bool,
    out: *mut BelayerRestoreInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        let req = Request::Restore {
            id: id.to_owned(),
            verify,
            prefix: None,
        };
        restore(client, req, out).map(|_| ())
    })
}

/// Restores sandbox `id` from its ready checkpoint of action boundary `prefix` (the latest one
/// taken at it on the ready checkpoint's line: it and its ancestors) into a fresh instance, as
/// [`belayer_restore`] does with the ready one. That checkpoint becomes the ready one once the
/// restore succeeded; the checkpoints taken after it stay as a branch of the sandbox's tree,
/// so `*out_dropped` (when not NULL) is set to 0 (protocol 11; before, they were dropped and
/// counted there).
///
/// Errors: `BELAYER_E_NOT_FOUND` when no ready checkpoint has that prefix (nothing is
/// touched); as [`belayer_restore`] otherwise.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to; `out_dropped` is
/// NULL or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_restore_to(
    client: BelayerClient,
    id: *const c_char,
    prefix: u64,
    verify: bool,
    out: *mut BelayerRestoreInfo,
    out_dropped: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract; a plain value, no drop needed.
        let (id, out, dropped) =
            unsafe { (text(id, "id")?, writable(out, "out")?, out_dropped.as_mut()) };
        let dropped = dropped.map(|d| {
            *d = 0;
            d
        });
        let req = Request::Restore {
            id: id.to_owned(),
            verify,
            prefix: Some(prefix),
        };
        let n = restore(client, req, out)?;
        if let Some(d) = dropped {
            *d = n;
        }
        Ok(())
    })
}

/// Restores sandbox `id` from its checkpoint named `checkpoint` (`c<seq>-k<prefix>`, the
/// `name` of a [`belayer_checkpoint_list`] item, on any branch of the sandbox's tree) into a
/// fresh instance, as [`belayer_restore`] does with the ready one; it becomes the ready
/// checkpoint, and the next checkpoint is its child.
///
/// Errors: `BELAYER_E_NOT_FOUND` when the sandbox has no visible checkpoint of that name
/// (nothing is touched); as [`belayer_restore`] otherwise.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `checkpoint` are NUL-terminated strings; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_restore_checkpoint(
    client: BelayerClient,
    id: *const c_char,
    checkpoint: *const c_char,
    verify: bool,
    out: *mut BelayerRestoreInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, checkpoint, out) = unsafe {
            (
                text(id, "id")?,
                text(checkpoint, "checkpoint")?,
                writable(out, "out")?,
            )
        };
        let req = Request::RestoreCheckpoint {
            id: id.to_owned(),
            verify,
            checkpoint: checkpoint.to_owned(),
        };
        restore(client, req, out).map(|_| ())
    })
}

/// Sends the restore request `req` and fills `out` (emptied first); returns how many
/// checkpoints the restore dropped.
fn restore(
    client: BelayerClient,
    req: Request,
    out: &mut BelayerRestoreInfo,
) -> Result<u64, Failure> {
    // SAFETY: `out` is valid for writes; the old content may be garbage, so no drop.
    unsafe { std::ptr::write(out, BelayerRestoreInfo::EMPTY) };
    match call(client, req)? {
        Response::Restored(r) => {
            *out = BelayerRestoreInfo {
                has_prefix: r.prefix.is_some(),
                prefix: r.prefix.unwrap_or(0),
                init_pid: r.init_pid,
                total_ms: r.timings_ms.total,
                verified: r.validity.is_some(),
                fs_matches: r.validity.as_ref().is_some_and(|v| v.fs_matches),
                processes_match: r.validity.as_ref().is_some_and(|v| v.processes_match),
                inodes_kept: r.inodes_kept,
                context: buf(r.context),
            };
            Ok(r.dropped_prefixes.len() as u64)
        }
        other => Err(unexpected("restore", &other)),
    }
}

/// Frees the context of `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_restore_info_free(info: *mut BelayerRestoreInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        info.context.release();
        *info = BelayerRestoreInfo::EMPTY;
    }
}
