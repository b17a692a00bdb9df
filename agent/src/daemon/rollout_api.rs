//! The daemon's services for rollout clients (`libbelayer`, the Python package): the
//! per-sandbox checkpoint policy behind [`Request::MaybeCheckpoint`](belayer_ipc::Request),
//! the per-trajectory context logs behind `ContextAppend`/`ContextLookup`, and the event bus
//! behind `Subscribe`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use belayer_ipc::{
    CheckpointInfo, ContextEntry, DecisionInfo, ErrorCode, ErrorReply, Event,
    MaybeCheckpointRequest, PolicySpec,
};

use crate::context::{record_digest, ContextLog, ContextLogError, Record};
use crate::policy::{Decision, FailureModel, Policy, PolicyConfig, PolicyError, PolicyKind};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fan-out of daemon events to the subscribers that may see them.
#[derive(Debug, Default)]
pub struct EventBus {
    /// Each subscriber with the uid whose sandboxes it sees (`None`: all).
    subscribers: Mutex<Vec<(Sender<Event>, Option<u32>)>>,
}

impl EventBus {
    /// Sends `event`, about a sandbox owned by `owner` (`None`: unknown, e.g. already
    /// removed), to every live subscriber that sees all sandboxes or that owner's;
    /// subscribers that went away are dropped.
    pub fn publish(&self, event: Event, owner: Option<u32>) {
        tracing::debug!(?event, ?owner, "event");
        lock(&self.subscribers).retain(|(tx, viewer)| match viewer {
            Some(uid) if owner != Some(*uid) => true,
            _ => tx.send(event.clone()).is_ok(),
        });
    }

    /// A new subscription: every event published from now on about the sandboxes of uid
    /// `viewer` (`None`: of every sandbox).
    pub fn subscribe(&self, viewer: Option<u32>) -> Receiver<Event> {
        let (tx, rx) = mpsc::channel();
        lock(&self.subscribers).push((tx, viewer));
        rx
    }
}

/// Why a policy could not be set up from a [`PolicySpec`].
#[derive(Debug, thiserror::Error)]
pub enum PolicySpecError {
    /// The kind or a value is invalid.
    #[error("invalid checkpoint policy")]
    Build(#[source] PolicyError),
}

/// The checkpoint policy of one sandbox and what it accumulated.
#[derive(Debug)]
pub struct PolicyEntry {
    policy: Policy,
    spec: Option<PolicySpec>,
    /// Step time since the last ready checkpoint (or restore), seconds.
    since_ready_s: f64,
    /// Sandbox instance the accumulated time belongs to (a restore starts over).
    instance: u32,
}

/// Builds the policy a spec asks for (unset fields keep the defaults: adaptive, p = 0.01).
pub fn policy_from_spec(spec: Option<&PolicySpec>) -> Result<Policy, PolicySpecError> {
    let mut config = PolicyConfig::default();
    let mut kind = PolicyKind::Adaptive;
    if let Some(spec) = spec {
        if let Some(k) = &spec.kind {
            kind = k.parse().map_err(PolicySpecError::Build)?;
        }
        if let Some(p) = spec.failure_p {
            config.failure = FailureModel::Fixed { p };
        } else if let Some(lambda_per_s) = spec.failure_rate_per_s {
            config.failure = FailureModel::Rate { lambda_per_s };
        }
        if let Some(t) = spec.checkpoint_timeout_s {
            config.checkpoint_timeout_s = t;
        }
        if let Some(c) = spec.cooldown_s {
            config.cooldown_s = c;
        }
    }
    Policy::new(kind, config).map_err(PolicySpecError::Build)
}

/// Wire form of a decision.
pub fn decision_info(d: &Decision) -> DecisionInfo {
    let reason = serde_json::to_value(d.reason)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{:?}", d.reason).to_lowercase());
    DecisionInfo {
        step: d.step,
        checkpoint: d.checkpoint,
        reason,
        p: d.p,
        regen_cost_s: d.regen_cost_s,
        c_s: d.c_s,
        elapsed_llm_s: d.elapsed_llm_s,
        q: d.q,
        benefit: d.benefit,
        visible_cost: d.visible_cost,
    }
}

/// Per-sandbox checkpoint policies on the daemon's clock.
#[derive(Debug)]
pub struct Policies {
    entries: Mutex<HashMap<String, Arc<Mutex<PolicyEntry>>>>,
    clock: Instant,
}

impl Default for Policies {
    fn default() -> Self {
        Policies {
            entries: Mutex::new(HashMap::new()),
            clock: Instant::now(),
        }
    }
}

/// What [`Policies::decide`] concluded, with the entry to report the checkpoint back to.
#[derive(Debug)]
pub struct Pending {
    entry: Arc<Mutex<PolicyEntry>>,
    /// The decision.
    pub decision: Decision,
}

impl Policies {
    /// Seconds on the daemon's clock.
    pub fn now_s(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

    /// Decides for `req` on sandbox instance `instance`; sets or replaces the sandbox's policy
    /// first when the request carries a different spec.
    ///
    /// Errors: [`PolicySpecError`] for an invalid spec.
    pub fn decide(
        &self,
        req: &MaybeCheckpointRequest,
        instance: u32,
    ) -> Result<Pending, PolicySpecError> {
        let entry = {
            let mut entries = lock(&self.entries);
            match entries.get(&req.id) {
                Some(e) => Arc::clone(e),
                None => {
                    let e = Arc::new(Mutex::new(PolicyEntry {
                        policy: policy_from_spec(req.policy.as_ref())?,
                        spec: req.policy.clone(),
                        since_ready_s: 0.0,
                        instance,
                    }));
                    entries.insert(req.id.clone(), Arc::clone(&e));
                    e
                }
            }
        };
        let decision = {
            let mut e = lock(&entry);
            if req.policy.is_some() && req.policy != e.spec {
                e.policy = policy_from_spec(req.policy.as_ref())?;
                e.spec = req.policy.clone();
            }
            if e.instance != instance {
                e.instance = instance;
                e.since_ready_s = 0.0;
            }
            if let Some(t) = req.llm_response_s.filter(|t| t.is_finite() && *t >= 0.0) {
                e.policy.observe_response(t);
            }
            if req.step_duration_s.is_finite() && req.step_duration_s > 0.0 {
                e.since_ready_s += req.step_duration_s;
            }
            let regen_cost_s = req.regen_cost_s.unwrap_or(e.since_ready_s);
            e.policy.decide(&crate::policy::StepInput {
                step: req.prefix,
                step_duration_s: req.step_duration_s,
                regen_cost_s,
                elapsed_llm_s: req.llm_elapsed_s,
                now_s: self.now_s(),
                dirty: None,
            })
        };
        Ok(Pending { entry, decision })
    }

    /// Reports the checkpoint taken after `pending`: its duration (seconds) and whether it
    /// was published; a published one resets the accumulated regeneration cost.
    pub fn checkpoint_done(&self, pending: &Pending, duration_s: f64, published: bool) {
        let now = self.now_s();
        let mut e = lock(&pending.entry);
        let timed_out = !published && duration_s > e.policy.config().checkpoint_timeout_s;
        e.policy.observe_checkpoint(duration_s, timed_out, now);
        if published {
            e.since_ready_s = 0.0;
        }
    }

    /// Drops the policies of sandboxes not in `live`.
    pub fn retain(&self, live: impl Fn(&str) -> bool) {
        lock(&self.entries).retain(|id, _| live(id));
    }
}

/// Why a context request failed.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// The trajectory id is not `[A-Za-z0-9._-]{1,128}` (or starts with a dot).
    #[error("invalid trajectory id {0:?}")]
    InvalidTrajectory(String),
    /// The log failed.
    #[error(transparent)]
    Log(#[from] ContextLogError),
    /// Creating the logs' directory failed.
    #[error("cannot create context log dir {path}")]
    CreateDir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No such record.
    #[error("no context for trajectory {trajectory} at {}", .prefix.map_or("the latest boundary".to_owned(), |k| format!("prefix {k}")))]
    NotFound {
        /// Trajectory id.
        trajectory: String,
        /// Prefix asked for.
        prefix: Option<u64>,
    },
}

impl ContextError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ContextError::InvalidTrajectory(_) => ErrorCode::BadRequest,
            ContextError::NotFound { .. } => ErrorCode::NotFound,
            ContextError::Log(ContextLogError::RecordTooLarge { .. }) => ErrorCode::BadRequest,
            _ => ErrorCode::Internal,
        }
    }

    /// The error as a reply.
    pub fn reply(&self) -> ErrorReply {
        let mut message = self.to_string();
        let mut cur = std::error::Error::source(self);
        while let Some(s) = cur {
            message.push_str(": ");
            message.push_str(&s.to_string());
            cur = s.source();
        }
        ErrorReply {
            code: self.code(),
            message,
        }
    }
}

/// The per-trajectory context logs under `<state dir>/contexts/<trajectory>.ctxlog`, opened
/// on first use and kept open (each holds its file's lock).
#[derive(Debug)]
pub struct ContextLogs {
    dir: PathBuf,
    logs: Mutex<HashMap<String, ContextLog>>,
}

fn valid_trajectory(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && !t.starts_with('.')
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl ContextLogs {
    /// Logs kept under `state_dir/contexts`.
    pub fn new(state_dir: &Path) -> Self {
        ContextLogs {
            dir: state_dir.join("contexts"),
            logs: Mutex::new(HashMap::new()),
        }
    }

    fn path(&self, trajectory: &str) -> PathBuf {
        self.dir.join(format!("{trajectory}.ctxlog"))
    }

    fn with_log<T>(
        &self,
        trajectory: &str,
        create: bool,
        f: impl FnOnce(&mut ContextLog) -> Result<T, ContextError>,
        missing: impl FnOnce() -> ContextError,
    ) -> Result<T, ContextError> {
        if !valid_trajectory(trajectory) {
            return Err(ContextError::InvalidTrajectory(trajectory.to_owned()));
        }
        let mut logs = lock(&self.logs);
        if !logs.contains_key(trajectory) {
            let path = self.path(trajectory);
            if !create && !path.exists() {
                return Err(missing());
            }
            std::fs::create_dir_all(&self.dir).map_err(|source| ContextError::CreateDir {
                path: self.dir.clone(),
                source,
            })?;
            let (log, recovery) = ContextLog::open(&path)?;
            if recovery.truncated_bytes > 0 {
                tracing::warn!(
                    trajectory,
                    truncated = recovery.truncated_bytes,
                    "context log tail cut"
                );
            }
            logs.insert(trajectory.to_owned(), log);
        }
        let log = logs
            .get_mut(trajectory)
            .ok_or_else(|| ContextError::InvalidTrajectory(trajectory.to_owned()))?;
        f(log)
    }

    /// Appends the context of `trajectory` at boundary `prefix` (durable on return).
    pub fn append(
        &self,
        trajectory: &str,
        prefix: u64,
        context: Vec<u8>,
    ) -> Result<ContextEntry, ContextError> {
        self.with_log(
            trajectory,
            true,
            |log| {
                let digest = record_digest(&context);
                let id = log.append(&Record::Boundary {
                    trajectory: trajectory.to_owned(),
                    prefix,
                    context: context.clone(),
                })?;
                Ok(ContextEntry {
                    trajectory: trajectory.to_owned(),
                    prefix,
                    context,
                    record: id.0,
                    digest,
                })
            },
            || ContextError::InvalidTrajectory(trajectory.to_owned()),
        )
    }

    /// The context of `trajectory` at `prefix` (`None`: its latest boundary).
    pub fn lookup(
        &self,
        trajectory: &str,
        prefix: Option<u64>,
    ) -> Result<ContextEntry, ContextError> {
        let not_found = || ContextError::NotFound {
            trajectory: trajectory.to_owned(),
            prefix,
        };
        self.with_log(
            trajectory,
            false,
            |log| {
                let (k, context) = match prefix {
                    Some(k) => (k, log.boundary(trajectory, k).ok_or_else(not_found)?),
                    None => log.latest_boundary(trajectory).ok_or_else(not_found)?,
                };
                let record = log.boundary_id(trajectory, k).ok_or_else(not_found)?.0;
                Ok(ContextEntry {
                    trajectory: trajectory.to_owned(),
                    prefix: k,
                    context: context.to_vec(),
                    record,
                    digest: record_digest(context),
                })
            },
            not_found,
        )
    }
}

/// The `CheckpointReady` event of a published checkpoint.
pub fn checkpoint_ready(info: &CheckpointInfo) -> Event {
    Event::CheckpointReady {
        id: info.sandbox.clone(),
        prefix: info.prefix,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_build_policies_and_bad_ones_are_refused() {
        let p = policy_from_spec(None).unwrap();
        assert_eq!(p.kind(), PolicyKind::Adaptive);
        let spec = PolicySpec {
            kind: Some("every:2".into()),
            failure_rate_per_s: Some(0.5),
            ..Default::default()
        };
        assert_eq!(
            policy_from_spec(Some(&spec)).unwrap().kind(),
            PolicyKind::EveryN(2)
        );
        let bad = PolicySpec {
            kind: Some("sometimes".into()),
            ..Default::default()
        };
        assert!(policy_from_spec(Some(&bad)).is_err());
        let bad = PolicySpec {
            failure_p: Some(2.0),
            ..Default::default()
        };
        assert!(policy_from_spec(Some(&bad)).is_err());
    }

    #[test]
    fn the_daemon_sums_step_time_until_a_checkpoint_is_published() {
        let policies = Policies::default();
        let mut req = MaybeCheckpointRequest {
            id: "sb".into(),
            prefix: 1,
            step_duration_s: 2.0,
            policy: Some(PolicySpec {
                kind: Some("never".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let d1 = policies.decide(&req, 0).unwrap();
        assert!(!d1.decision.checkpoint);
        req.prefix = 2;
        let d2 = policies.decide(&req, 0).unwrap();
        assert_eq!(d2.decision.regen_cost_s, 4.0);
        policies.checkpoint_done(&d2, 0.1, true);
        req.prefix = 3;
        assert_eq!(policies.decide(&req, 0).unwrap().decision.regen_cost_s, 2.0);
        // A restore (new instance) starts over.
        assert_eq!(policies.decide(&req, 1).unwrap().decision.regen_cost_s, 2.0);
        assert_eq!(decision_info(&d1.decision).reason, "never");
    }

    #[test]
    fn context_logs_append_and_look_up_per_trajectory() {
        let dir = tempfile::tempdir().unwrap();
        let logs = ContextLogs::new(dir.path());
        assert_eq!(
            logs.lookup("t1", None).unwrap_err().code(),
            ErrorCode::NotFound
        );
        logs.append("t1", 1, b"one".to_vec()).unwrap();
        let two = logs.append("t1", 2, b"two".to_vec()).unwrap();
        assert_eq!(logs.lookup("t1", Some(1)).unwrap().context, b"one");
        let latest = logs.lookup("t1", None).unwrap();
        assert_eq!((latest.prefix, latest.record), (2, two.record));
        assert_eq!(
            logs.lookup("t1", Some(9)).unwrap_err().code(),
            ErrorCode::NotFound
        );
        assert_eq!(
            logs.append("../x", 1, vec![]).unwrap_err().code(),
            ErrorCode::BadRequest
        );
    }

    #[test]
    fn the_bus_fans_out_and_forgets_gone_subscribers() {
        let bus = EventBus::default();
        let a = bus.subscribe(None);
        let b = bus.subscribe(None);
        let mine = bus.subscribe(Some(1000));
        drop(b);
        bus.publish(
            Event::CheckpointReady {
                id: "x".into(),
                prefix: 1,
            },
            Some(0),
        );
        assert!(matches!(
            a.try_recv(),
            Ok(Event::CheckpointReady { prefix: 1, .. })
        ));
        assert!(mine.try_recv().is_err(), "root's sandbox: not for uid 1000");
        bus.publish(
            Event::CheckpointReady {
                id: "y".into(),
                prefix: 2,
            },
            Some(1000),
        );
        assert!(matches!(
            mine.try_recv(),
            Ok(Event::CheckpointReady { prefix: 2, .. })
        ));
        assert!(a.try_recv().is_ok());
        assert_eq!(lock(&bus.subscribers).len(), 2);
    }
}
