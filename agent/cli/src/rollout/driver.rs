//! One trajectory under one policy: simulated LLM waits, real actions in a sandbox, checkpoints
//! overlapped with the next LLM wait, injected fail-stops, and recovery (paper: "Environment
//! state recovery", Algorithm 1, and the evaluation of Fig. 12).
//!
//! Per step t: wait the recorded LLM time × time scale (the bubble; a checkpoint of the previous
//! boundary runs concurrently), join that checkpoint (what it overran the bubble by is its
//! visible cost), run the translated action, append L_t to the sandbox's context log in
//! `belayerd` (`ContextAppend`), then ask the daemon's policy whether to checkpoint t
//! (`MaybeCheckpoint`, the call C and Python users make; it checkpoints when the policy says so). A failure scheduled for this step attempt kills every process of
//! the sandbox from the host at its moment; recovery restores the latest ready checkpoint C_k
//! (verifying the restored tree, the process list and L_k) and regenerates from k+1, or, for the
//! `restart`/`never` baselines, starts again from step 1 in a fresh sandbox.
//!
//! The daemon's tracer says per action whether it dirtied the sandbox and whether an
//! infrastructure fault hit it; the daemon keeps what changed since the ready checkpoint. A step
//! after which nothing changed since the ready checkpoint C_k needs no checkpoint (the daemon's
//! policy skips it as `clean`, counted in the report): its prefix re-points to C_k, so a recovery restores C_k and goes on after the last such clean step. An
//! action with an infrastructure fault is withheld from the context and recovered like an
//! injected failure; the report counts faults per kind.
//!
//! When the trajectory's run is over (done or aborted), its sandbox and its context log are
//! removed (`RemoveSandbox`, `ContextRemove`): the report keeps nothing of either, and a
//! long-running daemon would otherwise keep a log per trajectory and run against the uid's
//! context budget.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use belayer_ipc::{
    Client, DecisionReason, ErrorCode, ExecRequest, MaybeCheckpointRequest, MaybeCheckpointResult,
    PolicyKind, PolicySpec, Request, Response, SandboxSpec,
};

use super::schedule::{sample_llm_s, FailureSchedule};
use super::trajectory::Trajectory;
use super::translate::Translator;
use crate::report::{EventKind, PolicyResult, TimelineEvent, TrajectoryTimeline};

/// Directories every trajectory starts with (the recordings run in `/app` and `/workspace`).
const SETUP: &str = "mkdir -p /app /workspace /root";

/// What a run of one trajectory needs to know.
#[derive(Debug, Clone)]
pub struct TrajectoryRun {
    /// Daemon socket.
    pub socket: std::path::PathBuf,
    /// Image of the sandboxes.
    pub image: String,
    /// Rollout tag of the sandboxes.
    pub tag: String,
    /// LLM time multiplier.
    pub time_scale: f64,
    /// Per-action timeout, seconds.
    pub action_timeout_s: f64,
    /// Seed (LLM times for steps without one).
    pub seed: u64,
    /// Failure injection.
    pub schedule: FailureSchedule,
    /// Policy kind.
    pub kind: PolicyKind,
    /// The policy every sandbox of the run gets (its kind is `kind`).
    pub policy: PolicySpec,
    /// The recorded LLM-time distribution (seconds, unscaled).
    pub llm_samples: Arc<Vec<f64>>,
    /// Start of the whole run (timeline origin).
    pub origin: Instant,
}

/// Counters of one trajectory: a [`PolicyResult`] whose timeline holds this trajectory only
/// (makespan fields unused).
pub type TrajectoryStats = PolicyResult;

/// Errors that abort a trajectory.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The daemon could not be reached.
    #[error("cannot reach belayerd")]
    Connect(#[source] belayer_ipc::ClientError),
    /// The daemon answered an error to a request that must succeed.
    #[error("{what} failed: {message}")]
    Daemon {
        /// The request.
        what: &'static str,
        /// The daemon's message.
        message: String,
    },
}

fn call(c: &mut Client, what: &'static str, req: Request) -> Result<Response, DriverError> {
    match c.call(req) {
        Ok(Response::Error(e)) => Err(DriverError::Daemon {
            what,
            message: e.message,
        }),
        Ok(r) => Ok(r),
        Err(e) => Err(DriverError::Daemon {
            what,
            message: e.to_string(),
        }),
    }
}

/// SIGKILLs every process of sandbox `id` from the host (a fail-stop, like a chaos tool).
pub fn kill_sandbox(c: &mut Client, id: &str) {
    if let Ok(Response::Sandbox(info)) = c.call(Request::InspectSandbox { id: id.into() }) {
        for pid in info.pids {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
    }
}

/// A `MaybeCheckpoint` in flight during the next LLM wait.
struct Pending {
    /// Yields the answer and the instant it came.
    handle: JoinHandle<(Result<MaybeCheckpointResult, String>, Instant)>,
    started: Instant,
}

/// The state of one trajectory run.
struct Run<'a> {
    cfg: &'a TrajectoryRun,
    traj: &'a Trajectory,
    client: Client,
    id: String,
    /// The trajectory's id in the daemon's context logs.
    trajectory: String,
    stats: TrajectoryStats,
    /// Messages of L_k: two per completed step.
    messages: Vec<serde_json::Value>,
    /// Translator state after each completed step (index k).
    translators: Vec<Translator>,
    /// Wall seconds of the latest execution of each step (index t).
    durations: Vec<f64>,
    /// Last step ever completed.
    max_done: u64,
    /// Prefix of the ready checkpoint (0: none).
    ready: u64,
    /// Largest step m such that every step in (ready, m] left the sandbox clean (reported
    /// `dirty: false`): the state at m is the ready checkpoint's, so prefix m re-points to it.
    clean_through: u64,
    attempts: Vec<u32>,
}

impl Run<'_> {
    fn now(&self) -> f64 {
        self.cfg.origin.elapsed().as_secs_f64()
    }

    fn event(&mut self, kind: EventKind, step: u64, start: f64, end: f64) {
        if let Some(t) = self.stats.timeline.first_mut() {
            t.events.push(TimelineEvent {
                kind,
                step,
                start_s: start,
                end_s: end,
            });
        }
    }

    fn context(&self, k: u64) -> Vec<u8> {
        serde_json::to_vec(&self.messages[..(2 * k as usize).min(self.messages.len())])
            .unwrap_or_default()
    }

    fn exec(&mut self, cmd: &str) -> Result<belayer_ipc::ExecResult, String> {
        // The set-up creates /app: it cannot run there.
        let cwd = if cmd == SETUP { "/" } else { "/app" };
        let req = ExecRequest {
            id: self.id.clone(),
            argv: vec![cmd.to_string()],
            cwd: Some(cwd.into()),
            timeout_ms: Some((self.cfg.action_timeout_s * 1000.0) as u64),
            output_limit: Some(64 << 10),
            ..Default::default()
        };
        match self.client.call(Request::Exec(req)) {
            Ok(Response::Exec(r)) => Ok(r),
            Ok(Response::Error(e)) => Err(e.message),
            Ok(r) => Err(format!("unexpected answer {r:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Waits for the policy call made after the previous step; `llm_end` is when the bubble
    /// it was hiding in ended.
    fn join_checkpoint(&mut self, pending: Option<Pending>, step: u64, llm_end: Instant) {
        let Some(p) = pending else { return };
        let (result, ended) = p
            .handle
            .join()
            .unwrap_or_else(|_| (Err("checkpoint thread panicked".into()), Instant::now()));
        let duration = ended.duration_since(p.started).as_secs_f64();
        let visible = ended.saturating_duration_since(llm_end).as_secs_f64();
        match result {
            Ok(MaybeCheckpointResult {
                checkpoint: Some(info),
                ..
            }) => {
                let start = p.started.duration_since(self.cfg.origin).as_secs_f64();
                self.event(EventKind::Checkpoint, step, start, start + duration);
                self.ready = info.prefix;
                self.clean_through = info.prefix;
                self.stats.checkpoints_taken += 1;
                self.stats.bytes_written += info.bytes;
                self.stats.checkpoint_visible_s += visible;
                self.stats.checkpoint_hidden_s += (duration - visible).max(0.0);
            }
            Ok(skip) => {
                self.stats.checkpoints_skipped += 1;
                if skip.decision.reason == DecisionReason::Clean {
                    self.stats.checkpoints_clean += 1;
                }
                // The round trip of a skip is the policy's only visible cost.
                self.stats.checkpoint_visible_s += visible;
            }
            Err(e) => {
                // A failure during the checkpoint (e.g. the injected kill): the previous one
                // stays ready.
                let start = p.started.duration_since(self.cfg.origin).as_secs_f64();
                self.event(EventKind::Checkpoint, step, start, start + duration);
                tracing::debug!(trajectory = %self.traj.name, step, error = %e, "checkpoint failed");
                self.stats.checkpoint_visible_s += visible;
            }
        }
    }

    /// Asks the daemon's policy about boundary `k` (and lets it checkpoint) on a connection of
    /// its own, so the answer can come during the next LLM wait.
    fn start_checkpoint(&self, k: u64, step_duration_s: f64, llm_s: f64) -> Pending {
        let socket = self.cfg.socket.clone();
        let regen: f64 = self.durations[(self.ready as usize + 1)..=k as usize]
            .iter()
            .sum();
        let req = MaybeCheckpointRequest {
            id: self.id.clone(),
            prefix: k,
            context: self.context(k),
            step_duration_s,
            regen_cost_s: Some(regen),
            llm_elapsed_s: 0.0,
            llm_response_s: Some(llm_s),
            policy: Some(self.cfg.policy.clone()),
        };
        let started = Instant::now();
        let handle = std::thread::spawn(move || {
            let result =
                match Client::connect(&socket).map(|mut c| c.call(Request::MaybeCheckpoint(req))) {
                    Ok(Ok(Response::MaybeCheckpoint(r))) => Ok(r),
                    Ok(Ok(Response::Error(e))) => Err(e.message),
                    Ok(Ok(r)) => Err(format!("unexpected answer {r:?}")),
                    Ok(Err(e)) | Err(e) => Err(e.to_string()),
                };
            (result, Instant::now())
        });
        Pending { handle, started }
    }

    /// Removes the trajectory's context log. A log never written (the run ended before its
    /// first step) answers `NotFound`, which is fine; any other failure is logged and leaves
    /// the log to the daemon (and the uid's budget).
    fn remove_context_log(&mut self) {
        let remove = Request::ContextRemove {
            trajectory: self.trajectory.clone(),
        };
        let failure = match self.client.call(remove) {
            Ok(Response::Done) => return,
            Ok(Response::Error(e)) if e.code == ErrorCode::NotFound => return,
            Ok(Response::Error(e)) => e.message,
            Ok(r) => format!("unexpected answer {r:?}"),
            Err(e) => e.to_string(),
        };
        tracing::warn!(
            trajectory = %self.trajectory,
            error = %failure,
            "cannot remove the trajectory's context log"
        );
    }

    /// Recovers after a fail-stop during step `t`; returns the prefix to continue from.
    fn recover(&mut self, t: u64, pending: Option<Pending>) -> Result<u64, DriverError> {
        self.join_checkpoint(pending, t, Instant::now());
        let start = self.now();
        let verify = self.cfg.kind.takes_checkpoints();
        let r = match call(
            &mut self.client,
            "restore",
            Request::Restore {
                id: self.id.clone(),
                verify,
                prefix: None,
            },
        )? {
            Response::Restored(r) => r,
            r => {
                return Err(DriverError::Daemon {
                    what: "restore",
                    message: format!("unexpected {r:?}"),
                })
            }
        };
        self.stats.restores += 1;
        let k = r.prefix.unwrap_or(0);
        if k == 0 {
            self.exec(SETUP).map_err(|message| DriverError::Daemon {
                what: "setup",
                message,
            })?;
        }
        if let Some(v) = &r.validity {
            if !v.fs_matches {
                self.stats.validity_errors.push(format!(
                    "{} k={k}: restored file tree differs from F_k",
                    self.traj.name
                ));
            }
            if !v.processes_match {
                self.stats.validity_errors.push(format!(
                    "{} k={k}: processes {:?} restored as {:?}",
                    self.traj.name, v.expected_processes, v.restored_processes
                ));
            }
        }
        if k > 0 {
            let logged = match self.client.call(Request::ContextLookup {
                trajectory: self.trajectory.clone(),
                prefix: Some(k),
            }) {
                Ok(Response::Context(entry)) => Some(entry.context),
                _ => None,
            };
            if logged.as_deref() != Some(r.context.as_slice()) || r.context != self.context(k) {
                self.stats.validity_errors.push(format!(
                    "{} k={k}: restored L_k differs from the log",
                    self.traj.name
                ));
            }
        }
        // Steps after k that changed nothing need not run again: the state restored for k is
        // theirs too (only when k is the checkpoint they were clean against).
        let resume = if k == self.ready && self.cfg.kind.takes_checkpoints() {
            self.clean_through.max(k)
        } else {
            k
        };
        self.messages.truncate(2 * resume as usize);
        self.translators.truncate(resume as usize + 1);
        self.ready = k;
        self.clean_through = resume;
        let kind = if r.prefix.is_some() {
            EventKind::Restore
        } else {
            EventKind::Restart
        };
        let end = self.now();
        self.event(kind, t, start, end);
        Ok(resume)
    }

    fn step(&mut self, t: u64, pending: &mut Option<Pending>) -> Result<bool, DriverError> {
        let traj: &Trajectory = self.traj;
        let step = &traj.steps[t as usize - 1];
        let attempt = self.attempts[t as usize];
        self.attempts[t as usize] += 1;
        let llm = step.llm_s.unwrap_or_else(|| {
            sample_llm_s(self.cfg.seed, &self.traj.name, t, &self.cfg.llm_samples)
        });
        let llm_wall = llm * self.cfg.time_scale;
        let exec_guess = step.exec_s.unwrap_or(0.5).min(self.cfg.action_timeout_s);
        let failure = self
            .cfg
            .schedule
            .failure(&self.traj.name, t, attempt)
            .map(|f| f * (llm_wall + exec_guess));

        // The LLM bubble; the checkpoint of t-1 runs meanwhile.
        let step_start = Instant::now();
        let t0 = self.now();
        if let Some(at) = failure.filter(|at| *at < llm_wall) {
            std::thread::sleep(Duration::from_secs_f64(at));
            kill_sandbox(&mut self.client, &self.id);
            let now = self.now();
            self.event(EventKind::Llm, t, t0, now);
            self.event(EventKind::Failure, t, now, now);
            self.stats.failures += 1;
            return Ok(false);
        }
        std::thread::sleep(Duration::from_secs_f64(llm_wall));
        let llm_end = Instant::now();
        self.event(EventKind::Llm, t, t0, self.now());
        self.join_checkpoint(pending.take(), t - 1, llm_end);

        // The action, with a killer armed if this attempt fails during it.
        let mut translator = self.translators.last().cloned().unwrap_or_default();
        let cmd = translator.translate(step);
        let a0 = self.now();
        let killer = failure.map(|at| {
            let delay = Duration::from_secs_f64((at - llm_wall).max(0.0));
            let socket = self.cfg.socket.clone();
            let id = self.id.clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                if let Ok(mut c) = Client::connect(&socket) {
                    kill_sandbox(&mut c, &id);
                }
            })
        });
        let result = self.exec(&cmd);
        if let Some(f) = result.as_ref().ok().and_then(|r| r.infra_fault.as_ref()) {
            *self
                .stats
                .infra_faults
                .entry(f.kind.as_str().to_string())
                .or_default() += 1;
        }
        if let Some(k) = killer {
            let _ = k.join();
            let now = self.now();
            self.event(EventKind::Action, t, a0, now);
            self.event(EventKind::Failure, t, now, now);
            self.stats.failures += 1;
            return Ok(false);
        }
        let out = match result {
            Ok(out) if out.infra_fault.is_some() => {
                // Not the task's behaviour: withhold the observation, recover.
                let now = self.now();
                self.event(EventKind::Action, t, a0, now);
                self.event(EventKind::Failure, t, now, now);
                self.stats.failures += 1;
                return Ok(false);
            }
            Ok(out) => out,
            Err(e) => {
                // Not injected: an infrastructure error; recover the same way and report it.
                self.stats
                    .validity_errors
                    .push(format!("{} step {t}: action failed: {e}", self.traj.name));
                self.stats.failures += 1;
                return Ok(false);
            }
        };
        let a1 = self.now();
        self.event(EventKind::Action, t, a0, a1);
        let duration = step_start.elapsed().as_secs_f64();

        // Boundary t: L_t, counters, then the policy.
        let mut obs = String::from_utf8_lossy(&out.stdout).into_owned();
        obs.push_str(&String::from_utf8_lossy(&out.stderr));
        obs.truncate(obs.char_indices().nth(2048).map_or(obs.len(), |(i, _)| i));
        self.messages
            .push(serde_json::json!({ "role": "assistant", "content": step.cmd }));
        self.messages.push(
            serde_json::json!({ "role": "tool", "content": obs, "exit_code": out.exit_code }),
        );
        self.translators.push(translator);
        let append = Request::ContextAppend {
            trajectory: self.trajectory.clone(),
            prefix: t,
            context: self.context(t),
        };
        call(&mut self.client, "context append", append)?;
        if self.durations.len() <= t as usize {
            self.durations.resize(t as usize + 1, 0.0);
        }
        self.durations[t as usize] = duration;
        if t <= self.max_done {
            self.stats.regenerated_steps += 1;
            self.stats.regenerated_s += duration;
        }
        self.max_done = self.max_done.max(t);
        if out.dirty == Some(false) && self.clean_through == t - 1 {
            self.clean_through = t;
        }
        let last = t as usize == self.traj.steps.len();
        if !last && self.cfg.kind.takes_checkpoints() {
            *pending = Some(self.start_checkpoint(t, duration, llm_wall));
        }
        Ok(true)
    }
}

/// Runs `traj` to completion under `cfg`; `on_step` is called after every completed step.
pub fn run_trajectory(
    cfg: &TrajectoryRun,
    traj: &Trajectory,
    trajectory: String,
    on_step: &(dyn Fn() + Sync),
) -> Result<TrajectoryStats, DriverError> {
    let mut client = Client::connect(&cfg.socket).map_err(DriverError::Connect)?;
    let spec = SandboxSpec {
        image: cfg.image.clone(),
        tag: Some(cfg.tag.clone()),
        ..Default::default()
    };
    let id = match call(&mut client, "create sandbox", Request::CreateSandbox(spec))? {
        Response::Sandbox(s) => s.id,
        r => {
            return Err(DriverError::Daemon {
                what: "create sandbox",
                message: format!("unexpected {r:?}"),
            })
        }
    };
    let n = traj.steps.len();
    let mut run = Run {
        cfg,
        traj,
        client,
        id: id.clone(),
        trajectory,
        stats: TrajectoryStats {
            timeline: vec![TrajectoryTimeline {
                trajectory: traj.name.clone(),
                events: Vec::new(),
            }],
            ..PolicyResult::empty(traj.name.clone())
        },
        messages: Vec::new(),
        translators: vec![Translator::default()],
        durations: vec![0.0; n + 1],
        max_done: 0,
        ready: 0,
        clean_through: 0,
        attempts: vec![0; n + 1],
    };
    let result = (|| {
        run.exec(SETUP).map_err(|message| DriverError::Daemon {
            what: "setup",
            message,
        })?;
        let mut k = 0u64;
        let mut pending = None;
        while (k as usize) < n {
            let t = k + 1;
            if run.step(t, &mut pending)? {
                k = t;
                on_step();
            } else {
                k = run.recover(t, pending.take())?;
            }
            if run.attempts.iter().sum::<u32>() as usize > 50 * n + 100 {
                return Err(DriverError::Daemon {
                    what: "rollout",
                    message: "too many failed attempts".into(),
                });
            }
        }
        Ok(())
    })();
    let _ = run.client.call(Request::RemoveSandbox { id });
    run.remove_context_log();
    result.map(|()| run.stats)
}
