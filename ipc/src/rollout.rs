//! The messages of rollout clients beyond the sandbox verbs: one step for the sandbox's
//! checkpoint policy ([`MaybeCheckpointRequest`] → [`MaybeCheckpointResult`], paper:
//! Algorithm 1) and the records of the LLM-context logs ([`ContextEntry`]). Re-exported by
//! [`crate::message`].

use serde::{Deserialize, Serialize};

use crate::CheckpointInfo;

/// Which checkpoint policy a sandbox runs and its failure model (see
/// [`Request::MaybeCheckpoint`](crate::Request::MaybeCheckpoint)). Unset fields keep the daemon's defaults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PolicySpec {
    /// `adaptive` (default), `always`, `never`, `every:N` or `restart`.
    pub kind: Option<String>,
    /// Fixed failure probability per step, in [0, 1].
    pub failure_p: Option<f64>,
    /// Fail-stop rate per second (p_t = 1 - exp(-rate * d_t)); used when `failure_p` is unset.
    pub failure_rate_per_s: Option<f64>,
    /// A checkpoint longer than this, seconds, counts as timed out and starts the cooldown.
    pub checkpoint_timeout_s: Option<f64>,
    /// Cooldown after a timed-out checkpoint, seconds.
    pub cooldown_s: Option<f64>,
    /// c_t before the sandbox's first checkpoint was measured, seconds (default 1).
    pub initial_checkpoint_cost_s: Option<f64>,
    /// LLM response times, seconds, that seed the distribution of T before any step reported
    /// one (e.g. a recorded distribution); at most [`MAX_RESPONSE_SAMPLES`] are kept.
    pub response_samples_s: Vec<f64>,
}

/// Most response-time samples a [`PolicySpec`] may carry.
pub const MAX_RESPONSE_SAMPLES: usize = 4096;

/// One step's timing for the checkpoint policy of a sandbox, right after action `prefix`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MaybeCheckpointRequest {
    /// Sandbox id.
    pub id: String,
    /// Action boundary k just reached (step t = k).
    pub prefix: u64,
    /// The LLM context L_k, stored with the checkpoint if one is taken.
    #[serde(with = "serde_bytes")]
    pub context: Vec<u8>,
    /// d_t: wall-clock duration of the step (LLM response plus action), seconds.
    pub step_duration_s: f64,
    /// C_t: work since the last ready checkpoint that a failure would force to regenerate,
    /// seconds. `None`: the daemon sums the step durations since the last checkpoint.
    pub regen_cost_s: Option<f64>,
    /// x: how long the next LLM response has already been running, seconds (usually 0).
    pub llm_elapsed_s: f64,
    /// The completed LLM response time of this step, seconds, fed into the distribution of T.
    pub llm_response_s: Option<f64>,
    /// Policy of the sandbox; set (or replaced, when it differs) before deciding. `None`
    /// keeps the current one (default: adaptive with a fixed p = 0.01 per step).
    pub policy: Option<PolicySpec>,
}

/// A checkpoint decision with the inputs it was computed from (seconds, probabilities).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DecisionInfo {
    /// Step t.
    pub step: u64,
    /// Whether the policy said checkpoint.
    pub checkpoint: bool,
    /// Why (its text form on the wire: `benefit`, `cost`, `cooldown`, `always`, `never`,
    /// `every_n`, `restart`, `clean`).
    pub reason: crate::DecisionReason,
    /// p_t.
    pub p: f64,
    /// C_t, seconds.
    pub regen_cost_s: f64,
    /// c_t, seconds.
    pub c_s: f64,
    /// x, seconds.
    pub elapsed_llm_s: f64,
    /// q(x; c_t).
    pub q: f64,
    /// p_t * C_t, seconds.
    pub benefit: f64,
    /// c_t * (1 - q), seconds.
    pub visible_cost: f64,
}

/// Answer to [`Request::MaybeCheckpoint`](crate::Request::MaybeCheckpoint).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MaybeCheckpointResult {
    /// Whether a checkpoint was taken and published.
    pub checkpointed: bool,
    /// The decision.
    pub decision: DecisionInfo,
    /// The published checkpoint, when one was taken.
    pub checkpoint: Option<CheckpointInfo>,
}

/// One context record of a trajectory's log.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ContextEntry {
    /// Trajectory id.
    pub trajectory: String,
    /// Action boundary k.
    pub prefix: u64,
    /// The context.
    #[serde(with = "serde_bytes")]
    pub context: Vec<u8>,
    /// Record id (byte offset of the record in the log).
    pub record: u64,
    /// blake3 of the context, hex.
    pub digest: String,
}
