//! `belayer rollout`: agentic rollouts on recorded trajectories with failure injection, the
//! adaptive checkpoint policy, the LLM-context log and a report (paper: evaluation of
//! environment-state recovery, Fig. 12: a rollout batch under injected fail-stops, total
//! rollout time against the restart baseline).
//!
//! A comparison runs the same trajectories, seed and failure schedule under each policy, plus a
//! failure-free run (no failures, no checkpoints: the makespan every increase is measured
//! against) and, for `adaptive`, a run without failures that measures its failure-free overhead.
//!
//! Modules: [`trajectory`] (reading recordings), [`translate`] (actions → shell),
//! [`schedule`] (seeded failure schedule), [`driver`] (one trajectory under one policy).

pub mod driver;
pub mod schedule;
pub mod trajectory;
pub mod translate;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{bail, Result};
use belayer_ipc::{PolicyKind, PolicySpec, Request, Response};
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use self::driver::{run_trajectory, TrajectoryRun, TrajectoryStats};
use self::schedule::FailureSchedule;
use self::trajectory::Trajectory;
use crate::embedded::connect_or_embed;
use crate::report::{PolicyResult, RolloutReport, RunConfig};

/// Default location of the Debian python3 image built by `scripts/setup.sh`.
pub const DEFAULT_PYTHON_ROOTFS: &str = "/var/cache/belayer/images/bookworm-python/rootfs";

/// Arguments of `belayer rollout`.
#[derive(Debug, Args)]
pub struct RolloutArgs {
    /// Trajectory files (JSONL) or directories of them; default: the built-in selection.
    pub trajectories: Vec<PathBuf>,
    /// One policy: adaptive, always, never, every:N, restart.
    #[arg(long, conflicts_with = "compare")]
    pub policy: Option<PolicyKind>,
    /// Comma-separated policies to compare (default: adaptive,always,restart).
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<PolicyKind>,
    /// Probability that a step attempt suffers a fail-stop.
    #[arg(long, default_value_t = 0.05)]
    pub failure_rate: f64,
    /// Seed of the failure schedule (identical across policies).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Multiplier of the recorded LLM waits.
    #[arg(long, default_value_t = 0.25)]
    pub time_scale: f64,
    /// Trajectories running at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Image of the sandboxes (imported from --image-rootfs when missing).
    #[arg(long, default_value = "rollout-python")]
    pub image: String,
    /// Rootfs imported as --image when the daemon does not have it.
    #[arg(long, env = "BELAYER_TEST_PYTHON_ROOTFS", default_value = DEFAULT_PYTHON_ROOTFS)]
    pub image_rootfs: PathBuf,
    /// Per-action timeout, seconds.
    #[arg(long, default_value_t = 20.0)]
    pub action_timeout: f64,
    /// Checkpoint-timeout of the policy, seconds (a slower checkpoint starts the cooldown).
    #[arg(long, default_value_t = 10.0)]
    pub checkpoint_timeout: f64,
    /// The policy's checkpoint-cost estimate before it has measured one, seconds (`belayer bench
    /// checkpoint` measures 0.1–0.3 s on these machines).
    #[arg(long, default_value_t = 0.25)]
    pub initial_checkpoint_cost: f64,
    /// Output directory for report.md, report.json and the plots (the context logs L_k are
    /// the daemon's, one per trajectory and run, removed when that run is over).
    #[arg(long, default_value = "rollout-report")]
    pub out: PathBuf,
    /// Skip the failure-free run of adaptive that measures its overhead.
    #[arg(long)]
    pub no_overhead_run: bool,
}

/// One run of the batch.
#[derive(Debug, Clone)]
struct RunSpec {
    name: String,
    kind: PolicyKind,
    inject: bool,
}

/// The policy the daemon runs for every sandbox of a `kind` run: the injected failure rate as
/// p, the checkpoint timeout and initial cost of the arguments, and the recorded LLM times
/// (scaled) as the starting distribution of T.
fn policy_for(kind: PolicyKind, args: &RolloutArgs, samples: &[f64]) -> PolicySpec {
    let step = samples
        .len()
        .div_ceil(belayer_ipc::message::MAX_RESPONSE_SAMPLES)
        .max(1);
    PolicySpec {
        kind: Some(kind.to_string()),
        failure_p: Some(args.failure_rate),
        checkpoint_timeout_s: Some(args.checkpoint_timeout),
        initial_checkpoint_cost_s: Some(args.initial_checkpoint_cost),
        response_samples_s: samples
            .iter()
            .step_by(step)
            .map(|s| s * args.time_scale)
            .collect(),
        ..PolicySpec::default()
    }
}

/// When this process started its rollout (part of every context id).
static RUN_START: std::sync::LazyLock<std::time::SystemTime> =
    std::sync::LazyLock::new(std::time::SystemTime::now);

/// The id of `trajectory`'s context log in run `run` of this process: a name the daemon
/// accepts (`[A-Za-z0-9._-]`, at most 128 bytes), unique per process and run.
fn context_id(run: &str, trajectory: &str) -> String {
    let clean = |s: &str| {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect::<String>()
    };
    // The raw names' digest keeps names that differ only in replaced characters apart; the
    // start time keeps a reused pid apart from an earlier run's logs.
    let nonce = blake3::hash(format!("{:?} {run} {trajectory}", *RUN_START).as_bytes()).to_hex();
    let id = format!(
        "rollout-{}-{}-{}-{}",
        std::process::id(),
        &nonce[..8],
        clean(run),
        clean(trajectory)
    );
    if id.len() <= 128 {
        return id;
    }
    let digest = blake3::hash(id.as_bytes()).to_hex();
    format!("{}-{}", &id[..128 - 17], &digest[..16])
}

/// Runs every trajectory under one policy; returns its result.
fn run_policy(
    socket: &Path,
    args: &RolloutArgs,
    spec: &RunSpec,
    trajectories: &[Trajectory],
    samples: &Arc<Vec<f64>>,
    bar: &ProgressBar,
) -> Result<PolicyResult> {
    let origin = Instant::now();
    let cfg = TrajectoryRun {
        socket: socket.to_path_buf(),
        image: args.image.clone(),
        tag: format!(
            "rollout-{}-{}",
            std::process::id(),
            spec.name.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
        ),
        time_scale: args.time_scale,
        action_timeout_s: args.action_timeout,
        seed: args.seed,
        schedule: FailureSchedule {
            seed: args.seed,
            p: if spec.inject { args.failure_rate } else { 0.0 },
        },
        kind: spec.kind,
        policy: policy_for(spec.kind, args, samples),
        llm_samples: samples.clone(),
        origin,
    };
    let queue = Mutex::new(trajectories.iter().collect::<VecDeque<_>>());
    let results: Mutex<Vec<(String, Result<TrajectoryStats, String>)>> = Mutex::new(Vec::new());
    let on_step = || bar.inc(1);
    std::thread::scope(|s| {
        for _ in 0..args.concurrency.max(1) {
            s.spawn(|| loop {
                let Some(traj) = queue.lock().unwrap_or_else(|p| p.into_inner()).pop_front() else {
                    break;
                };
                let id = context_id(&spec.name, &traj.name);
                let r = run_trajectory(&cfg, traj, id, &on_step).map_err(|e| format!("{e:#}"));
                results
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((traj.name.clone(), r));
            });
        }
    });
    let makespan_s = origin.elapsed().as_secs_f64();
    let mut out = PolicyResult {
        makespan_s,
        ..PolicyResult::empty(spec.name.clone())
    };
    let mut results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    results.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, r) in results {
        match r {
            Ok(st) => out.absorb(st),
            Err(e) => out
                .validity_errors
                .push(format!("{name}: trajectory aborted: {e}")),
        }
    }
    Ok(out)
}

fn ensure_image(c: &mut belayer_ipc::Client, name: &str, rootfs: &Path) -> Result<()> {
    if let Response::Images(list) = crate::client::call(c, Request::ListImages)? {
        if list.iter().any(|i| i.name == name) {
            return Ok(());
        }
    }
    if !rootfs.is_dir() {
        bail!(
            "image {name} is missing and {} does not exist: run scripts/setup.sh",
            rootfs.display()
        );
    }
    crate::client::import_image(c, name, rootfs)?;
    Ok(())
}

/// Runs `belayer rollout`; returns the exit code (1 when a validity error was found).
pub fn run(socket: &Path, args: RolloutArgs, json: bool) -> Result<i32> {
    if !(0.0..=1.0).contains(&args.failure_rate) {
        bail!("--failure-rate must be within [0, 1]");
    }
    if !(args.time_scale.is_finite() && args.time_scale >= 0.0) {
        bail!("--time-scale must be a non-negative number");
    }
    if args.concurrency == 0 || args.action_timeout <= 0.0 {
        bail!("--concurrency and --action-timeout must be positive");
    }
    if !(args.checkpoint_timeout.is_finite() && args.checkpoint_timeout > 0.0) {
        bail!("--checkpoint-timeout must be a positive number of seconds");
    }
    if !(args.initial_checkpoint_cost.is_finite() && args.initial_checkpoint_cost >= 0.0) {
        bail!("--initial-checkpoint-cost must be a non-negative number of seconds");
    }
    let trajectories = if args.trajectories.is_empty() {
        trajectory::default_selection()
    } else {
        trajectory::load(&args.trajectories)?
    };
    if trajectories.is_empty() {
        bail!("no trajectories to run");
    }
    let samples = Arc::new(trajectory::llm_samples(&trajectories));
    let (mut client, embedded) = connect_or_embed(socket, "error")?;
    let socket = embedded
        .as_ref()
        .map_or_else(|| socket.to_path_buf(), |e| e.socket.clone());
    ensure_image(&mut client, &args.image, &args.image_rootfs)?;
    drop(client);

    let kinds: Vec<PolicyKind> = match (&args.policy, args.compare.is_empty()) {
        (Some(k), _) => vec![*k],
        (None, true) => vec![
            PolicyKind::Adaptive,
            PolicyKind::Always,
            PolicyKind::Restart,
        ],
        (None, false) => args.compare.clone(),
    };
    let mut specs = vec![RunSpec {
        name: "failure-free".into(),
        kind: PolicyKind::Never,
        inject: false,
    }];
    if kinds.contains(&PolicyKind::Adaptive) && !args.no_overhead_run {
        specs.push(RunSpec {
            name: "adaptive (no failures)".into(),
            kind: PolicyKind::Adaptive,
            inject: false,
        });
    }
    specs.extend(kinds.iter().map(|k| RunSpec {
        name: k.to_string(),
        kind: *k,
        inject: true,
    }));

    let total_steps: u64 = trajectories.iter().map(|t| t.steps.len() as u64).sum();
    let multi = MultiProgress::new();
    if json {
        multi.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} steps {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let mut results = Vec::new();
    for spec in &specs {
        let bar = multi.add(ProgressBar::new(total_steps));
        bar.set_style(style.clone());
        bar.set_prefix(spec.name.clone());
        let r = run_policy(&socket, &args, spec, &trajectories, &samples, &bar)?;
        bar.finish();
        results.push(r);
    }
    let failure_free = results.remove(0);
    let mut report = RolloutReport {
        config: RunConfig {
            trajectories: trajectories.iter().map(|t| t.name.clone()).collect(),
            seed: args.seed,
            failure_rate: args.failure_rate,
            time_scale: args.time_scale,
            concurrency: args.concurrency,
            image: args.image.clone(),
        },
        failure_free,
        policies: results,
    };
    report.fill_increases();
    let files = crate::report::write_report(&args.out, &report)?;
    let errors: usize = report
        .policies
        .iter()
        .map(|p| p.validity_errors.len())
        .sum::<usize>()
        + report.failure_free.validity_errors.len();
    if json {
        let text = std::fs::read_to_string(args.out.join("report.json")).unwrap_or_default();
        println!("{text}");
    } else {
        print_summary(&report, &files);
    }
    drop(embedded);
    Ok(if errors > 0 { 1 } else { 0 })
}

fn print_summary(r: &RolloutReport, files: &[PathBuf]) {
    println!(
        "\n{} trajectories, failure rate {} per step, seed {}, time scale {}, concurrency {}",
        r.config.trajectories.len(),
        r.config.failure_rate,
        r.config.seed,
        r.config.time_scale,
        r.config.concurrency
    );
    println!(
        "{:<24} {:>9} {:>10} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>9} {:>8}",
        "policy",
        "makespan",
        "increase",
        "incr%",
        "failures",
        "restores",
        "regen",
        "ckpts",
        "skipped",
        "visible_s",
        "invalid"
    );
    for p in std::iter::once(&r.failure_free).chain(&r.policies) {
        println!(
            "{:<24} {:>8.1}s {:>9.1}s {:>7.1}% {:>8} {:>8} {:>7} {:>7} {:>8} {:>9.2} {:>8}",
            p.name,
            p.makespan_s,
            p.increase_s,
            p.increase_pct,
            p.failures,
            p.restores,
            p.regenerated_steps,
            p.checkpoints_taken,
            p.checkpoints_skipped,
            p.checkpoint_visible_s,
            p.validity_errors.len()
        );
        if p.checkpoints_clean > 0 || !p.infra_faults.is_empty() {
            let faults: Vec<String> = p
                .infra_faults
                .iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect();
            println!(
                "    skipped as clean: {}; infrastructure faults: {}",
                p.checkpoints_clean,
                if faults.is_empty() {
                    "none".to_string()
                } else {
                    faults.join(", ")
                }
            );
        }
        for e in p.validity_errors.iter().take(5) {
            println!("    ! {e}");
        }
    }
    for f in files {
        println!("wrote {}", f.display());
    }
}
