//! `MaybeCheckpoint` questions with a policy whose answer shows only whether the step changed
//! the sandbox.

use belayer_ipc::{MaybeCheckpointRequest, MaybeCheckpointResult, PolicySpec, Request, Response};

use crate::Daemon;

/// Asks whether to checkpoint sandbox `id` at prefix `prefix` (L_k `context`) with a policy
/// that checkpoints whenever the step is not clean: the adaptive policy with p = 0.5 and a
/// regeneration cost (1000 s) far above any checkpoint's cost, steps of 1 s. Panics on an
/// error reply.
pub fn ask_unless_clean(
    d: &Daemon,
    id: &str,
    prefix: u64,
    context: Vec<u8>,
) -> MaybeCheckpointResult {
    let req = MaybeCheckpointRequest {
        id: id.into(),
        prefix,
        context,
        step_duration_s: 1.0,
        regen_cost_s: Some(1000.0),
        policy: Some(PolicySpec {
            kind: Some("adaptive".into()),
            failure_p: Some(0.5),
            ..Default::default()
        }),
        ..Default::default()
    };
    match d.call(Request::MaybeCheckpoint(req)) {
        Response::MaybeCheckpoint(r) => r,
        other => panic!("maybe_checkpoint {prefix}: {other:?}\n{}", d.log_text()),
    }
}
