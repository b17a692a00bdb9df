//! The daemon's services for rollout clients (`libbelayer`, the Python package): the
//! per-sandbox checkpoint policy behind [`Request::MaybeCheckpoint`](belayer_ipc::Request)
//! and the event bus behind `Subscribe` (the context logs behind `ContextAppend`,
//! `ContextLookup` and `ContextRemove` are [`super::contexts`]).

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use belayer_ipc::{CheckpointInfo, DecisionInfo, Event, MaybeCheckpointRequest, PolicySpec};

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
    /// More response-time samples than [`belayer_ipc::message::MAX_RESPONSE_SAMPLES`].
    #[error("{got} response-time samples; at most {max} are accepted", max = belayer_ipc::message::MAX_RESPONSE_SAMPLES)]
    TooManySamples {
        /// How many the spec carried.
        got: usize,
    },
    /// A response-time sample that is negative, NaN or infinite.
    #[error("response-time sample {value} is not a finite number of seconds >= 0")]
    BadSample {
        /// The sample.
        value: f64,
    },
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
            kind = k
                .parse()
                .map_err(|e| PolicySpecError::Build(PolicyError::Kind(e)))?;
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
        if let Some(c) = spec.initial_checkpoint_cost_s {
            config.initial_checkpoint_cost_s = c;
        }
        if spec.response_samples_s.len() > belayer_ipc::message::MAX_RESPONSE_SAMPLES {
            return Err(PolicySpecError::TooManySamples {
                got: spec.response_samples_s.len(),
            });
        }
        if let Some(bad) = spec
            .response_samples_s
            .iter()
            .find(|t| !(t.is_finite() && **t >= 0.0))
        {
            return Err(PolicySpecError::BadSample { value: *bad });
        }
    }
    let mut policy = Policy::new(kind, config).map_err(PolicySpecError::Build)?;
    if let Some(spec) = spec {
        policy.warm_start(spec.response_samples_s.iter().copied());
    }
    Ok(policy)
}

/// Wire form of a decision.
pub fn decision_info(d: &Decision) -> DecisionInfo {
    DecisionInfo {
        step: d.step,
        checkpoint: d.checkpoint,
        reason: d.reason,
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

    /// Decides for `req` on sandbox instance `instance`, whose changes since its ready
    /// checkpoint are `dirty` (`Some(false)`: none, so the policy may skip as clean; `None`:
    /// unknown); sets or replaces the sandbox's policy first when the request carries a
    /// different spec.
    ///
    /// Errors: [`PolicySpecError`] for an invalid spec.
    pub fn decide(
        &self,
        req: &MaybeCheckpointRequest,
        instance: u32,
        dirty: Option<bool>,
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
                dirty,
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
        for sample in [f64::NAN, f64::INFINITY, -1.0] {
            let bad = PolicySpec {
                response_samples_s: vec![1.0, sample],
                ..Default::default()
            };
            assert!(matches!(
                policy_from_spec(Some(&bad)),
                Err(PolicySpecError::BadSample { .. })
            ));
        }
        let many = PolicySpec {
            response_samples_s: vec![1.0; belayer_ipc::message::MAX_RESPONSE_SAMPLES + 1],
            ..Default::default()
        };
        assert!(matches!(
            policy_from_spec(Some(&many)),
            Err(PolicySpecError::TooManySamples { .. })
        ));
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
        let d1 = policies.decide(&req, 0, None).unwrap();
        assert!(!d1.decision.checkpoint);
        req.prefix = 2;
        let d2 = policies.decide(&req, 0, None).unwrap();
        assert_eq!(d2.decision.regen_cost_s, 4.0);
        policies.checkpoint_done(&d2, 0.1, true);
        req.prefix = 3;
        assert_eq!(
            policies
                .decide(&req, 0, None)
                .unwrap()
                .decision
                .regen_cost_s,
            2.0
        );
        // A restore (new instance) starts over.
        assert_eq!(
            policies
                .decide(&req, 1, None)
                .unwrap()
                .decision
                .regen_cost_s,
            2.0
        );
        assert_eq!(
            decision_info(&d1.decision).reason,
            belayer_ipc::DecisionReason::Never
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
