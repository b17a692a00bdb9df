//! Rollout-worker fault tolerance (paper: "Shadow-worker preparation", the five-step
//! handover, "Fail-stop detection", "LLM context recovery"):
//!
//! - [`engine`]: `belayer-toy-engine`, a deterministic reference LM whose weights live in a
//!   weights memory server and whose KV blocks live in a KV arena, with main and standby
//!   (shadow) modes;
//! - [`router`]: the rollout router (`belayer-router`): engine registry with worker epochs,
//!   load-aware routing, streaming proxy with token-level context recovery and fencing;
//! - [`workers`]: supervision of main + shadow workers per GPU (inside the router process),
//!   detection by pidfd and heartbeat mtime, the handover, unhealthy-GPU exclusion, and the
//!   conventional baseline;
//! - [`http`]: the minimal loopback HTTP subset both speak (std TCP, no HTTP crate).
//!
//! `belayer-bench handover` measures the handover against the conventional baseline.

pub mod engine;
pub mod http;
pub mod router;
pub mod workers;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use nix::sys::signal::{SigSet, Signal};

/// Arguments of `belayer-router`.
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// Address to listen on (loopback only).
    #[arg(long, default_value = "127.0.0.1:30000")]
    pub listen: std::net::SocketAddr,
    /// Persist each response's token prefix every this many tokens.
    #[arg(long, default_value_t = belayer_context::DEFAULT_TOKEN_INTERVAL as usize)]
    pub token_interval: usize,
    /// LLM-context log file (token prefixes).
    #[arg(long)]
    pub context_log: Option<PathBuf>,
    /// Supervise this many GPUs' workers (main + shadow each, host backend); 0 = engines
    /// register themselves over `POST /register`.
    #[arg(long, default_value_t = 0)]
    pub gpus: usize,
    /// Directory for the supervised workers' files (required with --gpus).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Heartbeat timeout for hang detection, ms.
    #[arg(long, default_value_t = 500)]
    pub heartbeat_timeout_ms: u64,
    /// A second failure within this many ms of a handover marks the GPU unhealthy.
    #[arg(long, default_value_t = 60_000)]
    pub unhealthy_window_ms: u64,
    /// Engine token delay, ms.
    #[arg(long, default_value_t = 2)]
    pub token_ms: u64,
    /// Conventional recovery instead of shadow workers (health-check timeout, restart from
    /// scratch, regenerate from the start).
    #[arg(long)]
    pub conventional: bool,
    /// Conventional health-check timeout, ms (paper: 30 s).
    #[arg(long, default_value_t = 30_000)]
    pub baseline_timeout_ms: u64,
    /// Backend of the supervised memory servers and engines: `host` or `cuda:N` (GPU i of
    /// the pool is `cuda:N+i`).
    #[arg(long, default_value = "host", value_parser = crate::memory::parse_device)]
    pub device: belayer_ipc::memory::Backend,
    /// How long a request waits for an engine, ms.
    #[arg(long, default_value_t = 120_000)]
    pub wait_ms: u64,
}

/// Runs `belayer-router` until killed; prints `listening ADDR` once it accepts.
///
/// Errors: bad arguments, binding, starting the workers.
pub fn run_router(args: RouterArgs) -> Result<i32> {
    if !args.listen.ip().is_loopback() {
        anyhow::bail!("--listen must be a loopback address, got {}", args.listen);
    }
    if args.token_interval == 0 {
        anyhow::bail!("--token-interval must be positive");
    }
    // SIGTERM/SIGINT/SIGHUP are taken by the main thread (sigwait) so that the supervised
    // workers and memory servers are stopped on the way out; every thread inherits the mask.
    let mut signals = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(s);
    }
    signals
        .thread_block()
        .context("blocking termination signals")?;
    let router = router::Router::new(router::RouterConfig {
        token_interval: args.token_interval,
        resume: !args.conventional,
        wait_ms: args.wait_ms,
        context_log: args.context_log.clone(),
    })?;
    let listener =
        TcpListener::bind(args.listen).with_context(|| format!("binding {}", args.listen))?;
    let _pool = if args.gpus > 0 {
        let dir = args.state_dir.clone().context("--gpus needs --state-dir")?;
        Some(workers::Pool::start(
            &router,
            workers::PoolConfig {
                bin_dir: crate::bin_dir().context("locating the Belayer binaries")?,
                gpus: args.gpus,
                dir,
                token_ms: args.token_ms,
                shadow: !args.conventional,
                heartbeat_timeout_ms: args.heartbeat_timeout_ms,
                baseline_timeout_ms: args.baseline_timeout_ms,
                unhealthy_window_ms: args.unhealthy_window_ms,
                weights_bytes: 1 << 20,
                device: args.device,
                on_handover: Some(Arc::new(|gpu: &str| {
                    tracing::info!(
                        gpu,
                        "communication groups to be re-established before the next weight update"
                    );
                })),
            },
        )?)
    } else {
        None
    };
    println!("listening {}", listener.local_addr()?);
    use std::io::Write;
    std::io::stdout().flush()?;
    std::thread::spawn(move || router.serve(listener));
    let signal = signals.wait().context("sigwait")?;
    tracing::info!(?signal, "router stopping");
    drop(_pool);
    Ok(0)
}
