//! `belayer-bench tracer`: what the sandbox tracer costs and buys, printed (not asserted).
//!
//! - Detection latency: SIGKILL of a sandbox init from the host until the agent publishes
//!   `SandboxFailed` (in-process subscription), with BPF and with the pidfd/cgroup fallback.
//! - Overhead: a write-heavy action (untar of a source tree, `/usr/lib/python3*` of the python
//!   image, or a generated tree on busybox) timed with the BPF programs attached and without any
//!   BPF loaded (agents run one after the other, alternating, so the programs of one never run
//!   during the other's phase). Goal: ≤ 2 %.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use belayer_ipc::{Caller, Event, ExecRequest, Request, Response, SandboxSpec};
use clap::Args;
use serde::Serialize;

use crate::{median, DEFAULT_BUSYBOX_ROOTFS, DEFAULT_PYTHON_ROOTFS};
use belayer_daemon::config::Config;
use belayer_daemon::service::Agent;

/// Arguments of `belayer-bench tracer`.
#[derive(Debug, Args)]
pub struct TracerBenchArgs {
    /// Kills timed per tracer (median and max reported).
    #[arg(long, default_value_t = 10)]
    pub kills: usize,
    /// Untar actions timed per phase.
    #[arg(long, default_value_t = 5)]
    pub untars: usize,
    /// Phases per tracer (they alternate: fallback, BPF, fallback, BPF, ...).
    #[arg(long, default_value_t = 3)]
    pub phases: usize,
    /// Busybox rootfs (detection latency, and overhead when the python image is missing).
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = DEFAULT_BUSYBOX_ROOTFS)]
    pub busybox_rootfs: PathBuf,
    /// Python rootfs whose `/usr/lib/python3.*` is the source tree to untar.
    #[arg(long, env = "BELAYER_TEST_PYTHON_ROOTFS", default_value = DEFAULT_PYTHON_ROOTFS)]
    pub python_rootfs: PathBuf,
}

/// Results, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct TracerBench {
    /// Median kill → `SandboxFailed`, BPF.
    pub kill_to_event_bpf_ms: f64,
    /// Worst kill → `SandboxFailed`, BPF.
    pub kill_to_event_bpf_max_ms: f64,
    /// Median kill → `SandboxFailed`, fallback.
    pub kill_to_event_fallback_ms: f64,
    /// Worst kill → `SandboxFailed`, fallback.
    pub kill_to_event_fallback_max_ms: f64,
    /// What was untarred.
    pub untar_workload: String,
    /// Median untar action with the BPF programs attached.
    pub untar_bpf_ms: f64,
    /// Median untar action without BPF.
    pub untar_no_bpf_ms: f64,
    /// Fastest untar with BPF (least disturbed by other load).
    pub untar_bpf_min_ms: f64,
    /// Fastest untar without BPF.
    pub untar_no_bpf_min_ms: f64,
    /// `untar_bpf_ms / untar_no_bpf_ms - 1`, percent.
    pub overhead_pct: f64,
    /// The same on the fastest runs, percent.
    pub overhead_min_pct: f64,
}

/// An in-process agent on a private state dir; removes its sandboxes and state when dropped.
struct Bench {
    agent: Option<Arc<Agent>>,
    state_dir: PathBuf,
}

impl Bench {
    fn start(no_bpf: bool) -> Result<Bench> {
        let state_dir = belayer_daemon::config::scratch_state_dir("bench-tracer");
        std::fs::create_dir_all(&state_dir)?;
        let config = Config {
            socket: state_dir.join("unused.sock"),
            state_dir: state_dir.clone(),
            no_bpf,
            ..Config::default()
        };
        let agent = match Agent::start(config) {
            Ok(agent) => agent,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&state_dir);
                return Err(anyhow::Error::new(e).context("starting an agent"));
            }
        };
        Ok(Bench {
            agent: Some(agent),
            state_dir,
        })
    }

    fn agent(&self) -> &Agent {
        self.agent.as_deref().expect("agent running")
    }

    fn call(&self, req: Request) -> Result<Response> {
        match self.agent().dispatch(&Caller::root(), req, Vec::new()) {
            Response::Error(e) => bail!("{:?}: {}", e.code, e.message),
            r => Ok(r),
        }
    }

    fn image(&self, name: &str, rootfs: &std::path::Path) -> Result<()> {
        if !rootfs.is_dir() {
            bail!("{} missing: run scripts/setup.sh", rootfs.display());
        }
        self.call(Request::ImportImage {
            name: name.into(),
            source: rootfs.display().to_string(),
            with_fd: false,
        })?;
        Ok(())
    }

    fn create(&self, image: &str) -> Result<(String, i32)> {
        match self.call(Request::CreateSandbox(SandboxSpec {
            image: image.into(),
            ..Default::default()
        }))? {
            Response::Sandbox(s) => Ok((s.id, s.init_pid.unwrap_or(0))),
            r => bail!("unexpected {r:?}"),
        }
    }

    fn exec(&self, id: &str, cmd: &str) -> Result<f64> {
        let req = ExecRequest {
            id: id.into(),
            argv: vec![cmd.into()],
            timeout_ms: Some(600_000),
            ..Default::default()
        };
        match self.call(Request::Exec(req))? {
            Response::Exec(r) if r.exit_code == 0 => Ok(r.duration_ms),
            Response::Exec(r) => bail!(
                "{cmd:?} failed ({}): {}",
                r.exit_code,
                String::from_utf8_lossy(&r.stderr)
            ),
            r => bail!("unexpected {r:?}"),
        }
    }

    fn remove(&self, id: &str) {
        let _ = self.agent().dispatch(
            &Caller::root(),
            Request::RemoveSandbox { id: id.into() },
            Vec::new(),
        );
    }

    /// Kill → `SandboxFailed` times, milliseconds.
    fn kill_latencies(&self, n: usize) -> Result<Vec<f64>> {
        let mut out = Vec::new();
        for _ in 0..n {
            let (id, init) = self.create("bb")?;
            let events = self.agent().subscribe();
            let t = Instant::now();
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::SIGKILL)?;
            loop {
                let left = Duration::from_secs(5).saturating_sub(t.elapsed());
                match events.recv_timeout(left) {
                    Ok(Event::SandboxFailed { id: got, .. }) if got == id => break,
                    Ok(_) => continue,
                    Err(_) => bail!("no SandboxFailed for {id} within 5 s"),
                }
            }
            out.push(t.elapsed().as_secs_f64() * 1000.0);
            self.remove(&id);
        }
        Ok(out)
    }

    /// Untar timings of `archive` (made by `setup`) inside a fresh sandbox, milliseconds.
    fn untars(&self, image: &str, setup: &str, n: usize) -> Result<Vec<f64>> {
        let (id, _) = self.create(image)?;
        let result = (|| {
            self.exec(&id, setup)?;
            let mut v = Vec::new();
            for i in 0..n {
                // Flush the previous round's dirty pages first: writeback throttling would
                // otherwise charge one round's writes to the next.
                self.exec(&id, "sync")?;
                let dir = format!("/bench/x{i}");
                v.push(self.exec(
                    &id,
                    &format!("mkdir -p {dir} && tar -xf /bench/src.tar -C {dir}"),
                )?);
            }
            Ok(v)
        })();
        self.remove(&id);
        result
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.take() {
            if let Response::Sandboxes(list) =
                agent.dispatch(&Caller::root(), Request::ListSandboxes, Vec::new())
            {
                for s in list {
                    let _ = agent.dispatch(
                        &Caller::root(),
                        Request::RemoveSandbox { id: s.id },
                        Vec::new(),
                    );
                }
            }
            // The last reference: dropping it detaches the BPF programs.
            drop(agent);
        }
        let _ = belayer_overlay::remove_dir_all(&self.state_dir);
    }
}

/// Runs the benchmark and prints it; returns the exit code.
pub fn run(args: &TracerBenchArgs, json: bool) -> Result<i32> {
    let python = args.python_rootfs.join("usr/lib").is_dir();
    let (image, rootfs, setup, workload) = if python {
        (
            "py",
            args.python_rootfs.clone(),
            "mkdir -p /bench && cd /usr/lib && tar -cf /bench/src.tar python3*".to_string(),
            "untar /usr/lib/python3* (python image)".to_string(),
        )
    } else {
        (
            "bb",
            args.busybox_rootfs.clone(),
            "mkdir -p /bench/t && cd /bench/t && for d in $(seq 40); do mkdir d$d; \
             for f in $(seq 50); do head -c 4096 /dev/urandom > d$d/f$f; done; done && \
             tar -cf /bench/src.tar -C /bench t && rm -r /bench/t"
                .to_string(),
            "untar of 2000 files of 4 KiB (busybox)".to_string(),
        )
    };
    let mut kills = [Vec::new(), Vec::new()];
    let mut untars = [Vec::new(), Vec::new()];
    // Phases alternate: fallback, BPF, fallback, BPF, ...
    for phase in 0..2 * args.phases.max(1) {
        let bpf = phase % 2 == 1;
        let b = Bench::start(!bpf)?;
        let kind = b.agent().runtime().tracer.kind();
        if bpf && kind != belayer_ebpf::TracerKind::Bpf {
            bail!(
                "BPF did not load: {}",
                b.agent().runtime().tracer.describe()
            );
        }
        b.image("bb", &args.busybox_rootfs)?;
        if python {
            b.image(image, &rootfs)?;
        }
        if phase < 2 {
            kills[usize::from(bpf)].extend(b.kill_latencies(args.kills)?);
        }
        untars[usize::from(bpf)].extend(b.untars(image, &setup, args.untars)?);
    }
    let [mut kf, mut kb] = kills;
    let [mut uf, mut ub] = untars;
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (kb_max, kf_max) = (max(&kb), max(&kf));
    let (ub_min, uf_min) = (min(&ub), min(&uf));
    let pct = |with: f64, without: f64| {
        if without > 0.0 && without.is_finite() {
            100.0 * (with / without - 1.0)
        } else {
            0.0
        }
    };
    let (un, ubpf) = (median(&mut uf), median(&mut ub));
    let r = TracerBench {
        kill_to_event_bpf_ms: median(&mut kb),
        kill_to_event_bpf_max_ms: kb_max,
        kill_to_event_fallback_ms: median(&mut kf),
        kill_to_event_fallback_max_ms: kf_max,
        untar_workload: workload,
        untar_bpf_ms: ubpf,
        untar_no_bpf_ms: un,
        untar_bpf_min_ms: ub_min,
        untar_no_bpf_min_ms: uf_min,
        overhead_pct: pct(ubpf, un),
        overhead_min_pct: pct(ub_min, uf_min),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "kill -> SandboxFailed   bpf: median {:.2} ms, max {:.2} ms   fallback: median {:.2} ms, max {:.2} ms",
            r.kill_to_event_bpf_ms,
            r.kill_to_event_bpf_max_ms,
            r.kill_to_event_fallback_ms,
            r.kill_to_event_fallback_max_ms
        );
        println!(
            "{}: with BPF {:.1} ms, without {:.1} ms (medians): overhead {:+.2} %; fastest runs \
             {:.1} vs {:.1} ms: {:+.2} % (goal <= 2 %)",
            r.untar_workload,
            r.untar_bpf_ms,
            r.untar_no_bpf_ms,
            r.overhead_pct,
            r.untar_bpf_min_ms,
            r.untar_no_bpf_min_ms,
            r.overhead_min_pct
        );
    }
    Ok(0)
}
