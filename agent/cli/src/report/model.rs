//! The data the rollout driver fills in: one result per policy plus the failure-free run.

use serde::{Deserialize, Serialize};

/// A comparison run: its configuration, the failure-free reference and one result per policy
/// (paper: the environment-recovery evaluation, Figure 12).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutReport {
    /// What was run.
    pub config: RunConfig,
    /// The same trajectories with no failure injected (its `increase_*` are 0).
    pub failure_free: PolicyResult,
    /// One result per policy, in the order they ran.
    pub policies: Vec<PolicyResult>,
}

impl RolloutReport {
    /// Sets every policy's `increase_s` and `increase_pct` from its makespan and the failure-free
    /// makespan (and the failure-free run's own to 0).
    pub fn fill_increases(&mut self) {
        let base = self.failure_free.makespan_s;
        self.failure_free.set_increase(base);
        for p in &mut self.policies {
            p.set_increase(base);
        }
    }
}

/// Configuration of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Trajectory ids (or files) in the batch.
    pub trajectories: Vec<String>,
    /// Seed of the failure schedule (identical across policies).
    pub seed: u64,
    /// Injected fail-stop probability per step, in [0, 1].
    pub failure_rate: f64,
    /// Factor applied to recorded LLM times (1.0 = real time).
    pub time_scale: f64,
    /// Trajectories run at once.
    pub concurrency: usize,
    /// Sandbox image name.
    pub image: String,
}

/// What one policy (or the failure-free run) did; seconds and bytes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PolicyResult {
    /// Policy name as given on the command line (`adaptive`, `every:5`, ...), or `failure-free`.
    pub name: String,
    /// Total rollout time of the batch (first start to last trajectory done), seconds.
    pub makespan_s: f64,
    /// `makespan_s` minus the failure-free makespan, seconds.
    pub increase_s: f64,
    /// `increase_s` as a percentage of the failure-free makespan (0 when that is 0).
    pub increase_pct: f64,
    /// Failures injected.
    pub failures: u64,
    /// Restores performed (checkpoint restores; restarts count under `Restart` events).
    pub restores: u64,
    /// Steps executed again after failures.
    pub regenerated_steps: u64,
    /// Wall-clock LLM and action time spent redoing lost work, seconds.
    pub regenerated_s: f64,
    /// Checkpoints taken (ready ones).
    pub checkpoints_taken: u64,
    /// Steps after which the policy decided not to checkpoint.
    pub checkpoints_skipped: u64,
    /// Of those, the steps skipped because nothing changed since the ready checkpoint (the
    /// prefix re-points to that checkpoint's state).
    #[serde(default)]
    pub checkpoints_clean: u64,
    /// Infrastructure faults reported by actions, by kind (`external_kill`, `oom`,
    /// `sandbox_lost`).
    #[serde(default)]
    pub infra_faults: std::collections::BTreeMap<String, u64>,
    /// Checkpoint time that overlapped the following LLM wait, seconds.
    pub checkpoint_hidden_s: f64,
    /// Checkpoint time that delayed the next action, seconds.
    pub checkpoint_visible_s: f64,
    /// Checkpoint bytes written.
    pub bytes_written: u64,
    /// Failed validity checks after restores (file tree, process list or L_k mismatch).
    pub validity_errors: Vec<String>,
    /// Per-trajectory timelines.
    pub timeline: Vec<TrajectoryTimeline>,
}

impl PolicyResult {
    /// An empty result (all counters zero) named `name`.
    pub fn empty(name: impl Into<String>) -> Self {
        PolicyResult {
            name: name.into(),
            makespan_s: 0.0,
            increase_s: 0.0,
            increase_pct: 0.0,
            failures: 0,
            restores: 0,
            regenerated_steps: 0,
            regenerated_s: 0.0,
            checkpoints_taken: 0,
            checkpoints_skipped: 0,
            checkpoints_clean: 0,
            infra_faults: Default::default(),
            checkpoint_hidden_s: 0.0,
            checkpoint_visible_s: 0.0,
            bytes_written: 0,
            validity_errors: Vec::new(),
            timeline: Vec::new(),
        }
    }

    /// Adds the counters, errors and timelines of `other` (e.g. one trajectory's) to `self`;
    /// makespans and increases are left alone.
    pub fn absorb(&mut self, other: PolicyResult) {
        self.failures += other.failures;
        self.restores += other.restores;
        self.regenerated_steps += other.regenerated_steps;
        self.regenerated_s += other.regenerated_s;
        self.checkpoints_taken += other.checkpoints_taken;
        self.checkpoints_skipped += other.checkpoints_skipped;
        self.checkpoints_clean += other.checkpoints_clean;
        for (kind, n) in other.infra_faults {
            *self.infra_faults.entry(kind).or_default() += n;
        }
        self.checkpoint_hidden_s += other.checkpoint_hidden_s;
        self.checkpoint_visible_s += other.checkpoint_visible_s;
        self.bytes_written += other.bytes_written;
        self.validity_errors.extend(other.validity_errors);
        self.timeline.extend(other.timeline);
    }

    /// Sets `increase_s` and `increase_pct` against a failure-free makespan, seconds.
    pub fn set_increase(&mut self, failure_free_makespan_s: f64) {
        self.increase_s = self.makespan_s - failure_free_makespan_s;
        self.increase_pct = if failure_free_makespan_s > 0.0 {
            100.0 * self.increase_s / failure_free_makespan_s
        } else {
            0.0
        };
    }
}

/// The events of one trajectory under one policy.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrajectoryTimeline {
    /// Trajectory id.
    pub trajectory: String,
    /// Events in time order.
    pub events: Vec<TimelineEvent>,
}

/// A span (or, with `start_s == end_s`, an instant) of a trajectory's timeline; times in seconds
/// since the start of the policy's run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimelineEvent {
    /// What happened.
    pub kind: EventKind,
    /// Step t the event belongs to.
    pub step: u64,
    /// Start, seconds.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
}

/// Kinds of timeline events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// Waiting for the (simulated) LLM response: the bubble.
    Llm,
    /// Executing the action in the sandbox.
    Action,
    /// Taking a checkpoint.
    Checkpoint,
    /// An injected failure (usually an instant).
    Failure,
    /// Restoring the latest ready checkpoint.
    Restore,
    /// Restarting the trajectory from the base image (baseline).
    Restart,
}

impl EventKind {
    /// Every kind, in legend order.
    pub const ALL: [EventKind; 6] = [
        EventKind::Llm,
        EventKind::Action,
        EventKind::Checkpoint,
        EventKind::Failure,
        EventKind::Restore,
        EventKind::Restart,
    ];

    /// Lowercase name, as in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Llm => "llm",
            EventKind::Action => "action",
            EventKind::Checkpoint => "checkpoint",
            EventKind::Failure => "failure",
            EventKind::Restore => "restore",
            EventKind::Restart => "restart",
        }
    }
}
