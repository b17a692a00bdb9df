//! `belayer-bench load`: many sandboxes under failures on one node (issue 13's load test).
//!
//! It starts its own `belayerd` (the binary next to `belayer`) on a private socket and state
//! dir, creates N sandboxes (default 64) and drives each from its own thread for S steps
//! (default 20): an action, then a checkpoint at prefix k with context `L_k`; every K-th step
//! (default 5) every process of the sandbox is `SIGKILL`ed from the host and the sandbox is
//! restored. Meanwhile `belayerd` itself is killed with `SIGKILL` and started again D times
//! (default 2), evenly spread over the run; requests cut off by that are sent again once the
//! daemon answers (every request of the run is idempotent).
//!
//! Validity is checked at every step: the action's observation (the number of step files) must
//! be k; after a restore the step files must be exactly 1..k, the background counter must not
//! have gone back (its process came back with its memory), the context must be `L_k`, and the
//! daemon's own check (upper layer digest and process list) must pass. The report gives lost
//! sandboxes, failed restores, validity errors, interrupted requests, checkpoint and restore
//! latencies, the daemon's peak RSS and threads, and zombie children left at the end; as a
//! table, or JSON with `--json`. Exit code 1 when anything was lost, failed or invalid.

pub(crate) mod daemon;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use belayer_ipc::{
    CheckpointRequest, Client, ExecRequest, ExecResult, Request, Response, RestoreInfo, SandboxSpec,
};

use daemon::{Peak, Supervised};

/// `belayer-bench load` options.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Sandboxes, each driven by its own thread.
    #[arg(long, default_value_t = 64)]
    sandboxes: usize,
    /// Steps (action + checkpoint) per sandbox.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// SIGKILL every process of a sandbox from the host and restore it after every K-th step.
    #[arg(long, default_value_t = 5)]
    kill_every: u64,
    /// Times `belayerd` is killed with SIGKILL and started again during the run.
    #[arg(long, default_value_t = 2)]
    daemon_kills: u64,
    /// Rootfs of the image the sandboxes run.
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = crate::DEFAULT_BUSYBOX_ROOTFS)]
    rootfs: PathBuf,
    /// The `belayerd` binary (default: the one next to this `belayer`).
    #[arg(long)]
    belayerd: Option<PathBuf>,
    /// Keep the run's dir (daemon log, state) instead of deleting it at the end.
    #[arg(long)]
    keep: bool,
}

/// Counts of one run, as printed and as JSON.
#[derive(Debug, Default, serde::Serialize)]
struct Report {
    sandboxes: usize,
    steps_per_sandbox: u64,
    actions: u64,
    checkpoints: u64,
    restores: u64,
    daemon_kills: u64,
    lost_sandboxes: u64,
    failed_restores: u64,
    validity_errors: u64,
    interrupted_requests: u64,
    daemon_away_s: Vec<f64>,
    checkpoint_ms_p50: f64,
    checkpoint_ms_p99: f64,
    restore_ms_p50: f64,
    restore_ms_p99: f64,
    peak_daemon_rss_mib: f64,
    peak_daemon_threads: u64,
    zombies_at_end: u64,
    wall_s: f64,
    /// The first problems seen (at most 20), for the reader.
    problems: Vec<String>,
}

/// What the driver threads share.
#[derive(Debug, Default)]
struct Shared {
    steps_done: AtomicU64,
    interrupted: AtomicU64,
    tally: Mutex<Tally>,
}

#[derive(Debug, Default)]
struct Tally {
    actions: u64,
    checkpoints: u64,
    restores: u64,
    lost: u64,
    failed_restores: u64,
    validity_errors: u64,
    checkpoint_ms: Vec<f64>,
    restore_ms: Vec<f64>,
    problems: Vec<String>,
}

impl Shared {
    fn with<T>(&self, f: impl FnOnce(&mut Tally) -> T) -> T {
        let mut t = self.tally.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut t)
    }

    fn problem(&self, counter: fn(&mut Tally) -> &mut u64, text: String) {
        tracing::warn!("{text}");
        self.with(|t| {
            *counter(t) += 1;
            if t.problems.len() < 20 {
                t.problems.push(text);
            }
        });
    }
}

/// A connection that survives daemon restarts: a call cut off by a dead daemon is sent again
/// on a new connection once the socket answers (for at most two minutes).
struct Conn {
    socket: PathBuf,
    client: Option<Client>,
    shared: Arc<Shared>,
}

impl Conn {
    fn call(&mut self, req: &Request) -> Result<Response> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if self.client.is_none() {
                self.client = Client::connect(&self.socket).ok();
            }
            if let Some(c) = self.client.as_mut() {
                match c.call(req.clone()) {
                    Ok(r) => return Ok(r),
                    Err(e) => {
                        tracing::debug!(error = %e, "request cut off; sending it again");
                        self.shared.interrupted.fetch_add(1, Ordering::Relaxed);
                        self.client = None;
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("belayerd did not answer for two minutes");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn exec(&mut self, id: &str, cmd: &str) -> Result<ExecResult> {
        let req = Request::Exec(ExecRequest {
            id: id.into(),
            argv: vec![cmd.into()],
            timeout_ms: Some(60_000),
            ..Default::default()
        });
        match self.call(&req)? {
            Response::Exec(r) => Ok(r),
            r => bail!("exec {cmd:?}: {r:?}"),
        }
    }

    /// Runs `cmd` and returns its stdout, trimmed; a non-zero exit is an error.
    fn sh(&mut self, id: &str, cmd: &str) -> Result<String> {
        let r = self.exec(id, cmd)?;
        if r.exit_code != 0 {
            bail!(
                "{cmd:?} exited {}: {}",
                r.exit_code,
                String::from_utf8_lossy(&r.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&r.stdout).trim().to_string())
    }

    fn state(&mut self, id: &str) -> Result<belayer_ipc::SandboxInfo> {
        match self.call(&Request::InspectSandbox { id: id.into() })? {
            Response::Sandbox(s) => Ok(s),
            r => bail!("inspect {id}: {r:?}"),
        }
    }
}

/// The shell loop every sandbox runs in the background: a counter in memory, written out.
const BACKGROUND: &str = "mkdir -p /work/steps; (i=0; while :; do i=$((i+1)); echo $i > /work/bg; \
                          sleep 0.2; done) >/dev/null 2>&1 &";

/// Runs the load test; returns the exit code.
pub fn run(args: &LoadArgs, json: bool) -> Result<i32> {
    if args.sandboxes == 0 || args.steps == 0 || args.kill_every == 0 {
        bail!("--sandboxes, --steps and --kill-every must be at least 1");
    }
    let binary = match &args.belayerd {
        Some(b) => b.clone(),
        None => std::env::current_exe()
            .context("locating this executable")?
            .with_file_name("belayerd"),
    };
    let dir = belayer_daemon::config::scratch_state_dir("load");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = run_in(args, &binary, &dir, json);
    if args.keep {
        eprintln!("[load] kept {}", dir.display());
    } else {
        let _ = belayer_overlay::remove_dir_all(&dir);
    }
    result
}

fn run_in(
    args: &LoadArgs,
    binary: &std::path::Path,
    dir: &std::path::Path,
    json: bool,
) -> Result<i32> {
    let started = Instant::now();
    let mut d = Supervised::start(binary, dir)?;
    eprintln!(
        "[load] belayerd {} (log {}); {} sandboxes × {} steps, restore every {}, {} daemon kills",
        d.pid().unwrap_or(0),
        d.log_path().display(),
        args.sandboxes,
        args.steps,
        args.kill_every,
        args.daemon_kills
    );
    let mut setup = Client::connect(&d.socket)?;
    match setup.import_image("load", &args.rootfs)? {
        Response::Image(_) => {}
        r => bail!("importing {}: {r:?}", args.rootfs.display()),
    }
    let shared = Arc::new(Shared::default());
    let mut ids = Vec::new();
    for i in 0..args.sandboxes {
        let spec = SandboxSpec {
            image: "load".into(),
            tag: Some(format!("load-{i}")),
            ..Default::default()
        };
        match setup.call(Request::CreateSandbox(spec))? {
            Response::Sandbox(s) => ids.push(s.id),
            r => bail!("creating sandbox {i}: {r:?}"),
        }
    }
    drop(setup);
    let total = args.sandboxes as u64 * args.steps;
    let mut peak = Peak::default();
    let mut away = Vec::new();
    std::thread::scope(|s| -> Result<()> {
        let drivers: Vec<_> = ids
            .iter()
            .map(|id| {
                let mut conn = Conn {
                    socket: d.socket.clone(),
                    client: None,
                    shared: shared.clone(),
                };
                let shared = shared.clone();
                s.spawn(move || drive(&mut conn, &shared, id, args))
            })
            .collect();
        let mut next_kill = 1;
        while drivers.iter().any(|h| !h.is_finished()) {
            if let Some(pid) = d.pid() {
                peak.sample(pid);
            }
            let progress = shared.steps_done.load(Ordering::Relaxed);
            if next_kill <= args.daemon_kills
                && progress >= total * next_kill / (args.daemon_kills + 1)
            {
                eprintln!("[load] {progress}/{total} steps: killing belayerd with SIGKILL");
                let s = d.kill_and_restart()?;
                eprintln!("[load] belayerd back after {:.2} s", s);
                away.push(s);
                next_kill += 1;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for h in drivers {
            if h.join().is_err() {
                shared.problem(|t| &mut t.lost, "a driver thread panicked".into());
            }
        }
        Ok(())
    })?;
    let zombies = d.pid().map(zombie_children).unwrap_or(0);
    let t = shared.with(std::mem::take);
    let report = Report {
        sandboxes: args.sandboxes,
        steps_per_sandbox: args.steps,
        actions: t.actions,
        checkpoints: t.checkpoints,
        restores: t.restores,
        daemon_kills: away.len() as u64,
        lost_sandboxes: t.lost,
        failed_restores: t.failed_restores,
        validity_errors: t.validity_errors,
        interrupted_requests: shared.interrupted.load(Ordering::Relaxed),
        daemon_away_s: away,
        checkpoint_ms_p50: percentile(&t.checkpoint_ms, 0.5),
        checkpoint_ms_p99: percentile(&t.checkpoint_ms, 0.99),
        restore_ms_p50: percentile(&t.restore_ms, 0.5),
        restore_ms_p99: percentile(&t.restore_ms, 0.99),
        peak_daemon_rss_mib: peak.rss_kib as f64 / 1024.0,
        peak_daemon_threads: peak.threads,
        zombies_at_end: zombies,
        wall_s: started.elapsed().as_secs_f64(),
        problems: t.problems,
    };
    drop(d);
    print_report(&report, json)?;
    let bad = report.lost_sandboxes
        + report.failed_restores
        + report.validity_errors
        + report.zombies_at_end;
    Ok(if bad == 0 { 0 } else { 1 })
}

/// Drives one sandbox through its steps; every failure is counted in `shared`.
fn drive(conn: &mut Conn, shared: &Shared, id: &str, args: &LoadArgs) {
    if let Err(e) = drive_steps(conn, shared, id, args) {
        shared.problem(|t| &mut t.lost, format!("{id}: lost: {e:#}"));
    }
}

fn drive_steps(conn: &mut Conn, shared: &Shared, id: &str, args: &LoadArgs) -> Result<()> {
    conn.sh(id, BACKGROUND)?;
    for k in 1..=args.steps {
        // The action: idempotent, so that one cut off by a daemon kill can be sent again.
        let seen = conn.sh(
            id,
            &format!("echo {k} > /work/steps/{k} && ls /work/steps | wc -l"),
        )?;
        shared.with(|t| t.actions += 1);
        if seen != k.to_string() {
            shared.problem(
                |t| &mut t.validity_errors,
                format!("{id} step {k}: the action saw {seen} step files"),
            );
        }
        // The background counter before the checkpoint: after a restore it must not be lower.
        let bg_before = if k % args.kill_every == 0 {
            counter(conn, id)?
        } else {
            0
        };
        let context = format!("L_{k} of {id}").into_bytes();
        let t0 = Instant::now();
        let req = Request::Checkpoint(CheckpointRequest {
            id: id.into(),
            prefix: k,
            context: context.clone(),
            fault: None,
        });
        match conn.call(&req)? {
            Response::Checkpoint(_) => shared.with(|t| {
                t.checkpoints += 1;
                t.checkpoint_ms.push(t0.elapsed().as_secs_f64() * 1e3);
            }),
            r => bail!("checkpoint at k={k}: {r:?}"),
        }
        if k % args.kill_every == 0 {
            fail_and_restore(conn, shared, id, k, &context, bg_before)?;
        }
        shared.steps_done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// SIGKILLs every process of the sandbox from the host, restores it and checks what came back.
fn fail_and_restore(
    conn: &mut Conn,
    shared: &Shared,
    id: &str,
    k: u64,
    context: &[u8],
    bg_before: u64,
) -> Result<()> {
    for pid in conn.state(id)?.pids {
        // SAFETY: kill(2) with a pid and a signal number; a pid that is gone answers ESRCH.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while conn.state(id)?.state != "failed" {
        if Instant::now() > deadline {
            bail!("not seen failed 30 s after SIGKILL at k={k}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let t0 = Instant::now();
    let req = Request::Restore {
        id: id.into(),
        verify: true,
        prefix: None,
    };
    let info: RestoreInfo = match conn.call(&req)? {
        Response::Restored(r) => r,
        r => {
            shared.problem(
                |t| &mut t.failed_restores,
                format!("{id}: restore at k={k}: {r:?}"),
            );
            bail!("restore failed at k={k}");
        }
    };
    shared.with(|t| {
        t.restores += 1;
        t.restore_ms.push(t0.elapsed().as_secs_f64() * 1e3);
    });
    let mut invalid = Vec::new();
    if info.prefix != Some(k) {
        invalid.push(format!("restored prefix {:?}", info.prefix));
    }
    if info.context != context {
        invalid.push("context is not L_k".to_string());
    }
    if let Some(v) = &info.validity {
        if !v.fs_matches || !v.processes_match {
            invalid.push(format!(
                "daemon check: fs {} processes {} ({:?} vs {:?})",
                v.fs_matches, v.processes_match, v.expected_processes, v.restored_processes
            ));
        }
    }
    let steps = conn.sh(id, "ls /work/steps | sort -n | tr '\\n' ' '")?;
    let want: String = (1..=k).map(|i| format!("{i} ")).collect();
    if steps.trim() != want.trim() {
        invalid.push(format!("step files {steps:?}"));
    }
    std::thread::sleep(Duration::from_millis(300));
    let bg_after = counter(conn, id)?;
    if bg_after < bg_before {
        invalid.push(format!(
            "background counter went back from {bg_before} to {bg_after}"
        ));
    }
    for why in invalid {
        shared.problem(
            |t| &mut t.validity_errors,
            format!("{id} after restore at k={k}: {why}"),
        );
    }
    Ok(())
}

/// The background counter, retrying the instant between the loop's truncation and its write.
fn counter(conn: &mut Conn, id: &str) -> Result<u64> {
    for _ in 0..50 {
        if let Ok(n) = conn.sh(id, "cat /work/bg")?.parse() {
            return Ok(n);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    bail!("/work/bg never held a number")
}

/// Zombie children of `pid` (of any of its threads).
fn zombie_children(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    let mut n = 0;
    for task in tasks.flatten() {
        let Ok(children) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        for child in children.split_whitespace() {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            // The state follows the parenthesized command name.
            if stat
                .rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
                == Some(true)
            {
                n += 1;
            }
        }
    }
    n
}

/// The `q` quantile (0..=1) of `v`, nearest rank; 0 when empty.
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

fn print_report(r: &Report, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
        return Ok(());
    }
    println!("{:<24} {:>12}", "load test", "");
    let rows: [(&str, String); 17] = [
        ("sandboxes", r.sandboxes.to_string()),
        ("steps per sandbox", r.steps_per_sandbox.to_string()),
        ("actions", r.actions.to_string()),
        ("checkpoints", r.checkpoints.to_string()),
        ("restores", r.restores.to_string()),
        ("daemon kills", r.daemon_kills.to_string()),
        ("lost sandboxes", r.lost_sandboxes.to_string()),
        ("failed restores", r.failed_restores.to_string()),
        ("validity errors", r.validity_errors.to_string()),
        ("interrupted requests", r.interrupted_requests.to_string()),
        (
            "checkpoint ms p50/p99",
            format!("{:.1}/{:.1}", r.checkpoint_ms_p50, r.checkpoint_ms_p99),
        ),
        (
            "restore ms p50/p99",
            format!("{:.1}/{:.1}", r.restore_ms_p50, r.restore_ms_p99),
        ),
        (
            "peak daemon RSS MiB",
            format!("{:.1}", r.peak_daemon_rss_mib),
        ),
        ("peak daemon threads", r.peak_daemon_threads.to_string()),
        ("zombies at end", r.zombies_at_end.to_string()),
        ("daemon away s", format!("{:?}", r.daemon_away_s)),
        ("wall s", format!("{:.1}", r.wall_s)),
    ];
    for (k, v) in rows {
        println!("{k:<24} {v:>12}");
    }
    for p in &r.problems {
        println!("problem: {p}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v, 1.0), 100.0);
    }
}
