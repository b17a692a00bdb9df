//! The adaptive risk-aware checkpoint policy (paper: "Environment-state recovery", Algorithm 1)
//! and the baselines it is compared with.
//!
//! After every action t the rollout driver asks [`Policy::decide`] whether to take a full
//! checkpoint. The adaptive policy weighs the expected regeneration cost a checkpoint avoids,
//! `p_t * C_t`, against the part of its cost the current LLM-response bubble cannot hide,
//! `c_t * (1 - q(x; c_t))`, and checkpoints when the first is larger:
//!
//! - p_t: probability of a fail-stop failure during the step ([`FailureModel`]);
//! - C_t: wall-clock LLM and action time since the last ready checkpoint, seconds;
//! - c_t: checkpoint cost under current load, seconds ([`CheckpointCost`]);
//! - q(x; c) = P(T >= x + c | T >= x): probability that the LLM response, already running for x
//!   seconds, lasts at least c more ([`ResponseTimes`]).
//!
//! A checkpoint that exceeds its timeout disables checkpointing for a cooldown (20 s by default).
//! Every decision is logged (`tracing` debug, with its inputs) and kept for the report.
//! All times are seconds (f64).

mod cost;
mod decide;
mod failure;
mod response;

pub use cost::{CheckpointCost, DEFAULT_COST_WINDOW};
pub use decide::{
    Decision, DecisionCounts, DecisionReason, Policy, PolicyConfig, PolicyKind, StepInput,
    DEFAULT_CHECKPOINT_TIMEOUT_S, DEFAULT_COOLDOWN_S, DEFAULT_INITIAL_CHECKPOINT_COST_S,
};
pub use failure::FailureModel;
pub use response::{ResponseTimes, DEFAULT_RESPONSE_WINDOW};

/// Errors of the policy: parsing a policy name and validating its configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// The name is none of `adaptive`, `always`, `never`, `every:N`, `restart`.
    #[error(transparent)]
    Kind(#[from] belayer_ipc::BadPolicyKind),
    /// A failure probability outside [0, 1].
    #[error("failure probability {p} is not within [0, 1]")]
    ValidateProbability {
        /// The probability given.
        p: f64,
    },
    /// A negative or non-finite failure rate.
    #[error("failure rate {lambda_per_s}/s is not a finite non-negative number")]
    ValidateRate {
        /// The rate given, per second.
        lambda_per_s: f64,
    },
    /// A duration field that is negative or non-finite.
    #[error("{field} = {value} s is not a finite non-negative duration")]
    ValidateSeconds {
        /// Field name.
        field: &'static str,
        /// Value given, seconds.
        value: f64,
    },
    /// A window size of 0.
    #[error("{field} must be at least 1")]
    ValidateWindow {
        /// Field name.
        field: &'static str,
    },
}
