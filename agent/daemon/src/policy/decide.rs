//! The policy: kinds, configuration and the per-step decision (paper, Algorithm 1).

use serde::{Deserialize, Serialize};

use super::{CheckpointCost, FailureModel, PolicyError, ResponseTimes};
use super::{DEFAULT_COST_WINDOW, DEFAULT_RESPONSE_WINDOW};

/// Default cooldown after a timed-out checkpoint, seconds (paper: "typically 20 seconds").
pub const DEFAULT_COOLDOWN_S: f64 = 20.0;

/// Default checkpoint timeout, seconds: a checkpoint that takes longer starts a cooldown.
pub const DEFAULT_CHECKPOINT_TIMEOUT_S: f64 = 10.0;

/// Default checkpoint cost c_t before any checkpoint was measured, seconds.
pub const DEFAULT_INITIAL_CHECKPOINT_COST_S: f64 = 1.0;

pub use belayer_ipc::{DecisionReason, PolicyKind};

/// Parameters of a [`Policy`]; seconds throughout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyConfig {
    /// How p_t is estimated. Default: fixed p = 0.01 per step (the paper's injected rate).
    pub failure: FailureModel,
    /// c_t before any checkpoint was measured, seconds.
    pub initial_checkpoint_cost_s: f64,
    /// Number of recent checkpoint durations whose median is c_t.
    pub cost_window: usize,
    /// Number of recent LLM response times the distribution of T keeps.
    pub response_window: usize,
    /// A checkpoint longer than this, seconds, counts as timed out.
    pub checkpoint_timeout_s: f64,
    /// How long a timed-out checkpoint disables adaptive checkpointing, seconds.
    pub cooldown_s: f64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            failure: FailureModel::Fixed { p: 0.01 },
            initial_checkpoint_cost_s: DEFAULT_INITIAL_CHECKPOINT_COST_S,
            cost_window: DEFAULT_COST_WINDOW,
            response_window: DEFAULT_RESPONSE_WINDOW,
            checkpoint_timeout_s: DEFAULT_CHECKPOINT_TIMEOUT_S,
            cooldown_s: DEFAULT_COOLDOWN_S,
        }
    }
}

impl PolicyConfig {
    /// Checks every field.
    ///
    /// Errors: [`PolicyError::ValidateRate`], [`PolicyError::ValidateProbability`],
    /// [`PolicyError::ValidateSeconds`], [`PolicyError::ValidateWindow`].
    pub fn validate(&self) -> Result<(), PolicyError> {
        self.failure.validate()?;
        for (field, value) in [
            ("initial_checkpoint_cost_s", self.initial_checkpoint_cost_s),
            ("checkpoint_timeout_s", self.checkpoint_timeout_s),
            ("cooldown_s", self.cooldown_s),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(PolicyError::ValidateSeconds { field, value });
            }
        }
        for (field, value) in [
            ("cost_window", self.cost_window),
            ("response_window", self.response_window),
        ] {
            if value == 0 {
                return Err(PolicyError::ValidateWindow { field });
            }
        }
        Ok(())
    }
}

/// What the driver knows when it asks for a decision, right after action t finished.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepInput {
    /// Step t, counting from 1 (the action boundary k = t just reached).
    pub step: u64,
    /// d_t: wall-clock duration of the step, seconds (input of p_t under a failure rate).
    pub step_duration_s: f64,
    /// C_t: wall-clock LLM and action time since the last ready checkpoint (or since the start),
    /// seconds: what a failure now would force to regenerate.
    pub regen_cost_s: f64,
    /// x: how long the current (next) LLM response has already been running, seconds; usually 0
    /// right after the action.
    pub elapsed_llm_s: f64,
    /// The driver's clock, seconds (any origin, monotonic): used for the cooldown.
    pub now_s: f64,
    /// Whether the environment changed since the last ready checkpoint, when the driver knows;
    /// `Some(false)` lets the adaptive policy skip a checkpoint that would capture the same state.
    pub dirty: Option<bool>,
}

/// One decision with the inputs it was computed from (all computed for every policy kind, so
/// baselines log the same quantities).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// Step t the decision follows.
    pub step: u64,
    /// Whether to take a checkpoint now.
    pub checkpoint: bool,
    /// Why.
    pub reason: DecisionReason,
    /// p_t, probability in [0, 1].
    pub p: f64,
    /// C_t, seconds.
    pub regen_cost_s: f64,
    /// c_t, seconds.
    pub c_s: f64,
    /// x, seconds.
    pub elapsed_llm_s: f64,
    /// q(x; c_t), probability in [0, 1].
    pub q: f64,
    /// Expected benefit p_t·C_t, seconds.
    pub benefit: f64,
    /// Expected visible cost c_t·(1 − q(x; c_t)), seconds.
    pub visible_cost: f64,
}

/// A policy keeps at least this many of its most recent decisions, and at most twice as many
/// ([`Policy::decisions`]).
pub const MAX_KEPT_DECISIONS: usize = 4096;

/// How many decisions said checkpoint and how many said skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DecisionCounts {
    /// Decisions with `checkpoint == true`.
    pub checkpoint: u64,
    /// Decisions with `checkpoint == false`.
    pub skip: u64,
}

/// A checkpoint policy with its online state: the distribution of T, the estimate of c_t, the
/// cooldown, and every decision taken so far.
#[derive(Debug, Clone)]
pub struct Policy {
    kind: PolicyKind,
    config: PolicyConfig,
    responses: ResponseTimes,
    cost: CheckpointCost,
    /// End of the current cooldown on the driver's clock, seconds.
    cooldown_until_s: Option<f64>,
    decisions: Vec<Decision>,
}

impl Policy {
    /// A policy of `kind` with `config` and no response-time samples yet.
    ///
    /// Errors: those of [`PolicyConfig::validate`].
    pub fn new(kind: PolicyKind, config: PolicyConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        Ok(Policy {
            kind,
            responses: ResponseTimes::new(config.response_window),
            cost: CheckpointCost::new(config.initial_checkpoint_cost_s, config.cost_window),
            config,
            cooldown_until_s: None,
            decisions: Vec::new(),
        })
    }

    /// Warm-starts the distribution of T with response times, seconds (e.g. the first steps'
    /// times or a recorded distribution).
    pub fn warm_start(&mut self, samples_s: impl IntoIterator<Item = f64>) {
        for t in samples_s {
            self.responses.observe(t);
        }
    }

    /// The policy kind.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// The configuration.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// The distribution of LLM response times.
    pub fn responses(&self) -> &ResponseTimes {
        &self.responses
    }

    /// The current checkpoint cost estimate c_t, seconds.
    pub fn checkpoint_cost_s(&self) -> f64 {
        self.cost.estimate_s()
    }

    /// Whether adaptive checkpointing is disabled at `now_s` by a cooldown.
    pub fn in_cooldown(&self, now_s: f64) -> bool {
        self.cooldown_until_s.is_some_and(|until| now_s < until)
    }

    /// End of the current (or last) cooldown on the driver's clock, seconds.
    pub fn cooldown_until_s(&self) -> Option<f64> {
        self.cooldown_until_s
    }

    /// Decides whether to checkpoint after step `input.step`, logs the decision with its inputs
    /// (`tracing` debug) and keeps it (see [`decisions`](Self::decisions)).
    ///
    /// Adaptive order: cooldown (skip, [`DecisionReason::Cooldown`]), then `dirty == Some(false)` (skip,
    /// [`DecisionReason::Clean`]), then checkpoint iff p_t·C_t > c_t·(1 − q(x; c_t))
    /// ([`DecisionReason::Benefit`], else [`DecisionReason::Cost`]). The cooldown applies to the adaptive policy
    /// only; the baselines do what their name says.
    pub fn decide(&mut self, input: &StepInput) -> Decision {
        let regen_cost_s = non_negative(input.regen_cost_s);
        let elapsed_llm_s = non_negative(input.elapsed_llm_s);
        let p = self.config.failure.p_t(input.step_duration_s);
        let c_s = self.cost.estimate_s();
        let q = self.responses.q(elapsed_llm_s, c_s);
        let benefit = p * regen_cost_s;
        let visible_cost = c_s * (1.0 - q);

        let (checkpoint, reason) = match self.kind {
            PolicyKind::Always => (true, DecisionReason::Always),
            PolicyKind::Never => (false, DecisionReason::Never),
            PolicyKind::Restart => (false, DecisionReason::Restart),
            PolicyKind::EveryN(n) => (input.step.is_multiple_of(n.max(1)), DecisionReason::EveryN),
            PolicyKind::Adaptive => {
                if let Some(until) = self.cooldown_until_s {
                    if input.now_s >= until {
                        tracing::info!(now_s = input.now_s, "checkpoint cooldown ended");
                        self.cooldown_until_s = None;
                    }
                }
                if self.in_cooldown(input.now_s) {
                    (false, DecisionReason::Cooldown)
                } else if input.dirty == Some(false) {
                    (false, DecisionReason::Clean)
                } else if benefit > visible_cost {
                    (true, DecisionReason::Benefit)
                } else {
                    (false, DecisionReason::Cost)
                }
            }
        };
        let decision = Decision {
            step: input.step,
            checkpoint,
            reason,
            p,
            regen_cost_s,
            c_s,
            elapsed_llm_s,
            q,
            benefit,
            visible_cost,
        };
        tracing::debug!(
            policy = %self.kind,
            step = input.step,
            step_duration_s = input.step_duration_s,
            regen_cost_s,
            elapsed_llm_s,
            now_s = input.now_s,
            dirty = ?input.dirty,
            p,
            c_s,
            q,
            benefit,
            visible_cost,
            checkpoint,
            reason = ?reason,
            "checkpoint decision"
        );
        if self.decisions.len() >= 2 * MAX_KEPT_DECISIONS {
            // Bounded memory for a long-lived policy (the daemon's): keep the recent ones.
            self.decisions.drain(..MAX_KEPT_DECISIONS);
        }
        self.decisions.push(decision);
        decision
    }

    /// Feeds a finished checkpoint's duration, seconds, into c_t. If `timed_out` or the duration
    /// exceeds the configured timeout, adaptive checkpointing is disabled for the cooldown,
    /// starting at `now_s` (the driver's clock when the checkpoint ended or was abandoned).
    pub fn observe_checkpoint(&mut self, duration_s: f64, timed_out: bool, now_s: f64) {
        self.cost.observe(duration_s);
        if timed_out || duration_s > self.config.checkpoint_timeout_s {
            let until = now_s + self.config.cooldown_s;
            tracing::warn!(
                policy = %self.kind,
                duration_s,
                timeout_s = self.config.checkpoint_timeout_s,
                cooldown_until_s = until,
                "checkpoint timed out, checkpointing disabled for the cooldown"
            );
            self.cooldown_until_s = Some(self.cooldown_until_s.map_or(until, |u| u.max(until)));
        }
    }

    /// Feeds a completed LLM response time, seconds, into the distribution of T.
    pub fn observe_response(&mut self, t_s: f64) {
        self.responses.observe(t_s);
    }

    /// The recent decisions, in order (at least the last [`MAX_KEPT_DECISIONS`]).
    pub fn decisions(&self) -> &[Decision] {
        &self.decisions
    }

    /// Takes the decisions kept so far, leaving none.
    pub fn take_decisions(&mut self) -> Vec<Decision> {
        std::mem::take(&mut self.decisions)
    }

    /// Counts of the decisions kept so far.
    pub fn counts(&self) -> DecisionCounts {
        let checkpoint = self.decisions.iter().filter(|d| d.checkpoint).count() as u64;
        DecisionCounts {
            checkpoint,
            skip: self.decisions.len() as u64 - checkpoint,
        }
    }
}

fn non_negative(v: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(step: u64, regen_cost_s: f64, elapsed_llm_s: f64, now_s: f64) -> StepInput {
        StepInput {
            step,
            step_duration_s: 5.0,
            regen_cost_s,
            elapsed_llm_s,
            now_s,
            dirty: None,
        }
    }

    /// Fixed p = 0.01, c = 2 s (initial), T ~ {1, 2, ..., 10} s.
    fn adaptive() -> Policy {
        let config = PolicyConfig {
            failure: FailureModel::Fixed { p: 0.01 },
            initial_checkpoint_cost_s: 2.0,
            ..PolicyConfig::default()
        };
        let mut p = Policy::new(PolicyKind::Adaptive, config).unwrap();
        p.warm_start((1..=10).map(f64::from));
        p
    }

    #[test]
    fn adaptive_decides_on_both_sides_of_the_threshold() {
        let mut pol = adaptive();
        // x = 0: q(0; 2) = #{T >= 2}/10 = 0.9, visible = 2·(1 − 0.9) = 0.2 s.
        // C = 25 s: benefit 0.01·25 = 0.25 > 0.2 → checkpoint.
        let d = pol.decide(&input(1, 25.0, 0.0, 0.0));
        assert!(d.checkpoint);
        assert_eq!(d.reason, DecisionReason::Benefit);
        assert_eq!(d.p, 0.01);
        assert_eq!(d.c_s, 2.0);
        assert_eq!(d.q, 0.9);
        assert!((d.benefit - 0.25).abs() < 1e-12);
        assert!((d.visible_cost - 0.2).abs() < 1e-12);
        // C = 15 s: benefit 0.15 < 0.2 → skip.
        let d = pol.decide(&input(2, 15.0, 0.0, 1.0));
        assert!(!d.checkpoint);
        assert_eq!(d.reason, DecisionReason::Cost);
        // x = 8: q(8; 2) = #{T >= 10}/#{T >= 8} = 1/3, visible = 2·(2/3) = 1.333 s.
        // C = 100 s: benefit 1.0 < 1.333 → skip; C = 200 s: 2.0 > 1.333 → checkpoint.
        let d = pol.decide(&input(3, 100.0, 8.0, 2.0));
        assert_eq!((d.checkpoint, d.reason), (false, DecisionReason::Cost));
        assert!((d.q - 1.0 / 3.0).abs() < 1e-12);
        assert!((d.visible_cost - 4.0 / 3.0).abs() < 1e-12);
        let d = pol.decide(&input(4, 200.0, 8.0, 3.0));
        assert_eq!((d.checkpoint, d.reason), (true, DecisionReason::Benefit));
        // Response already longer than every sample: q = 0, fully visible cost 2 s.
        let d = pol.decide(&input(5, 150.0, 12.0, 4.0));
        assert_eq!((d.q, d.visible_cost), (0.0, 2.0));
        assert_eq!((d.checkpoint, d.reason), (false, DecisionReason::Cost));
        assert_eq!(pol.decisions().len(), 5);
        assert_eq!(
            pol.counts(),
            DecisionCounts {
                checkpoint: 2,
                skip: 3
            }
        );
    }

    #[test]
    fn rate_model_feeds_p_t() {
        let config = PolicyConfig {
            failure: FailureModel::Rate { lambda_per_s: 0.01 },
            initial_checkpoint_cost_s: 1.0,
            ..PolicyConfig::default()
        };
        let mut pol = Policy::new(PolicyKind::Adaptive, config).unwrap();
        // No samples: q = 0, visible = c = 1 s. d = 10 s: p = 1 − e^−0.1 = 0.0951626.
        // C = 10 s: benefit 0.951626 < 1 → skip; C = 11 s: 1.046789 > 1 → checkpoint.
        let mut i = input(1, 10.0, 0.0, 0.0);
        i.step_duration_s = 10.0;
        let d = pol.decide(&i);
        assert!((d.p - 0.095_162_581_964_040_4).abs() < 1e-15);
        assert_eq!((d.checkpoint, d.reason), (false, DecisionReason::Cost));
        i.regen_cost_s = 11.0;
        assert_eq!(pol.decide(&i).reason, DecisionReason::Benefit);
    }

    #[test]
    fn checkpoint_cost_follows_observed_checkpoints() {
        let mut pol = adaptive();
        pol.observe_checkpoint(0.5, false, 0.0);
        // c = 0.5: q(0; 0.5) = 10/10 = 1 → visible 0: any positive benefit checkpoints.
        let d = pol.decide(&input(1, 1.0, 0.0, 1.0));
        assert_eq!((d.c_s, d.q, d.visible_cost), (0.5, 1.0, 0.0));
        assert!(d.checkpoint);
        assert_eq!(pol.checkpoint_cost_s(), 0.5);
        pol.observe_response(30.0);
        assert_eq!(pol.responses().len(), 11);
    }

    #[test]
    fn timeout_starts_cooldown_until_it_ends() {
        let mut pol = adaptive();
        // Default timeout 10 s: a 12 s checkpoint ending at t = 100 s → cooldown until 120 s.
        pol.observe_checkpoint(12.0, false, 100.0);
        assert!(pol.in_cooldown(100.0));
        assert_eq!(pol.cooldown_until_s(), Some(120.0));
        for now in [100.0, 110.0, 119.9] {
            let d = pol.decide(&input(1, 1e6, 0.0, now));
            assert_eq!(
                (d.checkpoint, d.reason),
                (false, DecisionReason::Cooldown),
                "at {now}"
            );
        }
        let d = pol.decide(&input(2, 1e6, 0.0, 120.0));
        assert_eq!((d.checkpoint, d.reason), (true, DecisionReason::Benefit));
        assert!(!pol.in_cooldown(120.0));
        assert_eq!(pol.cooldown_until_s(), None);
        // An explicit timeout (e.g. an abandoned checkpoint) starts one regardless of duration.
        pol.observe_checkpoint(0.1, true, 200.0);
        assert_eq!(
            pol.decide(&input(3, 1e6, 0.0, 210.0)).reason,
            DecisionReason::Cooldown
        );
        assert_eq!(
            pol.decide(&input(4, 1e6, 0.0, 220.0)).reason,
            DecisionReason::Benefit
        );
    }

    #[test]
    fn clean_environment_is_not_checkpointed() {
        let mut pol = adaptive();
        let mut i = input(1, 1e6, 0.0, 0.0);
        i.dirty = Some(false);
        assert_eq!(pol.decide(&i).reason, DecisionReason::Clean);
        i.dirty = Some(true);
        assert_eq!(pol.decide(&i).reason, DecisionReason::Benefit);
    }

    #[test]
    fn baselines() {
        let config = PolicyConfig::default();
        let mut every = Policy::new(PolicyKind::EveryN(3), config.clone()).unwrap();
        let taken: Vec<u64> = (1..=7)
            .filter(|&s| every.decide(&input(s, 0.0, 0.0, 0.0)).checkpoint)
            .collect();
        assert_eq!(taken, [3, 6]);
        assert!(every
            .decisions()
            .iter()
            .all(|d| d.reason == DecisionReason::EveryN));

        let mut always = Policy::new(PolicyKind::Always, config.clone()).unwrap();
        // Baselines ignore the cooldown.
        always.observe_checkpoint(100.0, true, 0.0);
        let d = always.decide(&input(1, 0.0, 0.0, 1.0));
        assert_eq!((d.checkpoint, d.reason), (true, DecisionReason::Always));

        for (kind, reason) in [
            (PolicyKind::Never, DecisionReason::Never),
            (PolicyKind::Restart, DecisionReason::Restart),
        ] {
            let mut p = Policy::new(kind, config.clone()).unwrap();
            let d = p.decide(&input(1, 1e9, 0.0, 0.0));
            assert_eq!((d.checkpoint, d.reason), (false, reason));
            assert!(!kind.takes_checkpoints());
        }
        let mut taken = Policy::new(PolicyKind::Always, config).unwrap();
        taken.decide(&input(1, 0.0, 0.0, 0.0));
        assert_eq!(taken.take_decisions().len(), 1);
        assert!(taken.decisions().is_empty());
    }

    #[test]
    fn parse_and_display() {
        for (s, k) in [
            ("adaptive", PolicyKind::Adaptive),
            ("always", PolicyKind::Always),
            ("never", PolicyKind::Never),
            ("restart", PolicyKind::Restart),
            ("every:5", PolicyKind::EveryN(5)),
        ] {
            assert_eq!(s.parse::<PolicyKind>().unwrap(), k);
            assert_eq!(k.to_string(), s);
        }
        assert_eq!(
            "Adaptive".parse::<PolicyKind>().unwrap(),
            PolicyKind::Adaptive
        );
        use belayer_ipc::BadPolicyKind;
        for bad in ["", "sometimes", "every", "every5"] {
            assert!(
                matches!(bad.parse::<PolicyKind>(), Err(BadPolicyKind::Unknown { ref input }) if input == bad),
                "{bad}"
            );
        }
        for bad in ["every:", "every:x", "every:-1", "every:1.5", "every:0"] {
            assert!(
                matches!(
                    bad.parse::<PolicyKind>(),
                    Err(BadPolicyKind::Interval { .. })
                ),
                "{bad}"
            );
        }
        let json = serde_json::to_string(&PolicyKind::EveryN(4)).unwrap();
        assert_eq!(json, "\"every:4\"");
        assert_eq!(
            serde_json::from_str::<PolicyKind>(&json).unwrap(),
            PolicyKind::EveryN(4)
        );
        assert!(serde_json::from_str::<PolicyKind>("\"every:0\"").is_err());
    }

    #[test]
    fn config_validation_and_decision_serialization() {
        let bad = PolicyConfig {
            cooldown_s: -1.0,
            ..PolicyConfig::default()
        };
        assert_eq!(
            Policy::new(PolicyKind::Adaptive, bad).unwrap_err(),
            PolicyError::ValidateSeconds {
                field: "cooldown_s",
                value: -1.0
            }
        );
        let bad = PolicyConfig {
            response_window: 0,
            ..PolicyConfig::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(PolicyError::ValidateWindow {
                field: "response_window"
            })
        ));
        let bad = PolicyConfig {
            failure: FailureModel::Fixed { p: 2.0 },
            ..PolicyConfig::default()
        };
        assert!(bad.validate().is_err());
        let cfg: PolicyConfig =
            serde_json::from_str(r#"{"failure":{"rate":{"lambda_per_s":0.001}},"cooldown_s":5}"#)
                .unwrap();
        assert_eq!(
            cfg.failure,
            FailureModel::Rate {
                lambda_per_s: 0.001
            }
        );
        assert_eq!(cfg.cooldown_s, 5.0);
        assert!(serde_json::from_str::<PolicyConfig>(r#"{"cooldown":5}"#).is_err());

        let d = adaptive().decide(&input(1, 25.0, 0.0, 0.0));
        let v = serde_json::to_value(d).unwrap();
        assert_eq!(v["reason"], "benefit");
        assert_eq!(v["checkpoint"], true);
    }
}
