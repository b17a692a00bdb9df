//! The shape of `report.json`: policies keyed by name.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::model::{PolicyResult, RolloutReport, RunConfig, TrajectoryTimeline};

/// Version of the `report.json` layout.
pub const REPORT_FORMAT: u32 = 1;

/// `report.json`: the summary of every run keyed by policy name, and the timelines apart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportJson {
    /// [`REPORT_FORMAT`].
    pub format: u32,
    /// What was run.
    pub config: RunConfig,
    /// The failure-free run.
    pub failure_free: PolicySummary,
    /// Policy names in run order (JSON objects are unordered).
    pub policy_order: Vec<String>,
    /// Policy name → summary.
    pub policies: BTreeMap<String, PolicySummary>,
    /// Timelines of every run.
    pub timelines: TimelinesJson,
}

/// One run's numbers in `report.json` (seconds, bytes, counts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySummary {
    /// Policy name (`failure-free` for the reference run).
    pub name: String,
    /// Total rollout time, seconds.
    pub makespan_s: f64,
    /// Increase over failure-free, seconds.
    pub increase_s: f64,
    /// Increase over failure-free, percent.
    pub increase_pct: f64,
    /// Failures injected.
    pub failures: u64,
    /// Restores performed.
    pub restores: u64,
    /// Steps executed again.
    pub regenerated_steps: u64,
    /// Time spent redoing lost work, seconds.
    pub regenerated_s: f64,
    /// Checkpoints taken.
    pub checkpoints_taken: u64,
    /// Checkpoints skipped by the policy.
    pub checkpoints_skipped: u64,
    /// Of those, skipped because the steps since the ready checkpoint changed nothing.
    #[serde(default)]
    pub checkpoints_clean: u64,
    /// Infrastructure faults reported by actions, by kind.
    #[serde(default)]
    pub infra_faults: BTreeMap<String, u64>,
    /// Checkpoint time hidden in LLM bubbles, seconds.
    pub checkpoint_hidden_s: f64,
    /// Checkpoint time on the critical path, seconds.
    pub checkpoint_visible_s: f64,
    /// Checkpoint bytes written.
    pub bytes_written: u64,
    /// Number of failed validity checks.
    pub validity_errors: u64,
    /// The failed validity checks.
    pub validity_error_messages: Vec<String>,
}

/// Timelines: the failure-free run's and each policy's, by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelinesJson {
    /// The failure-free run.
    pub failure_free: Vec<TrajectoryTimeline>,
    /// Policy name → timelines.
    pub policies: BTreeMap<String, Vec<TrajectoryTimeline>>,
}

impl PolicySummary {
    fn from_result(r: &PolicyResult) -> Self {
        PolicySummary {
            name: r.name.clone(),
            makespan_s: r.makespan_s,
            increase_s: r.increase_s,
            increase_pct: r.increase_pct,
            failures: r.failures,
            restores: r.restores,
            regenerated_steps: r.regenerated_steps,
            regenerated_s: r.regenerated_s,
            checkpoints_taken: r.checkpoints_taken,
            checkpoints_skipped: r.checkpoints_skipped,
            checkpoints_clean: r.checkpoints_clean,
            infra_faults: r.infra_faults.clone(),
            checkpoint_hidden_s: r.checkpoint_hidden_s,
            checkpoint_visible_s: r.checkpoint_visible_s,
            bytes_written: r.bytes_written,
            validity_errors: r.validity_errors.len() as u64,
            validity_error_messages: r.validity_errors.clone(),
        }
    }

    fn into_result(self, timeline: Vec<TrajectoryTimeline>) -> PolicyResult {
        PolicyResult {
            name: self.name,
            makespan_s: self.makespan_s,
            increase_s: self.increase_s,
            increase_pct: self.increase_pct,
            failures: self.failures,
            restores: self.restores,
            regenerated_steps: self.regenerated_steps,
            regenerated_s: self.regenerated_s,
            checkpoints_taken: self.checkpoints_taken,
            checkpoints_skipped: self.checkpoints_skipped,
            checkpoints_clean: self.checkpoints_clean,
            infra_faults: self.infra_faults,
            checkpoint_hidden_s: self.checkpoint_hidden_s,
            checkpoint_visible_s: self.checkpoint_visible_s,
            bytes_written: self.bytes_written,
            validity_errors: self.validity_error_messages,
            timeline,
        }
    }
}

impl From<&RolloutReport> for ReportJson {
    fn from(report: &RolloutReport) -> Self {
        ReportJson {
            format: REPORT_FORMAT,
            config: report.config.clone(),
            failure_free: PolicySummary::from_result(&report.failure_free),
            policy_order: report.policies.iter().map(|p| p.name.clone()).collect(),
            policies: report
                .policies
                .iter()
                .map(|p| (p.name.clone(), PolicySummary::from_result(p)))
                .collect(),
            timelines: TimelinesJson {
                failure_free: report.failure_free.timeline.clone(),
                policies: report
                    .policies
                    .iter()
                    .map(|p| (p.name.clone(), p.timeline.clone()))
                    .collect(),
            },
        }
    }
}

impl From<ReportJson> for RolloutReport {
    /// Rebuilds the report; policies come in `policy_order`, then any others by name.
    fn from(mut json: ReportJson) -> Self {
        let mut names = json.policy_order.clone();
        names.extend(
            json.policies
                .keys()
                .filter(|k| !json.policy_order.contains(k))
                .cloned(),
        );
        let policies = names
            .into_iter()
            .filter_map(|name| {
                let summary = json.policies.remove(&name)?;
                let timeline = json.timelines.policies.remove(&name).unwrap_or_default();
                Some(summary.into_result(timeline))
            })
            .collect();
        RolloutReport {
            config: json.config,
            failure_free: json.failure_free.into_result(json.timelines.failure_free),
            policies,
        }
    }
}
