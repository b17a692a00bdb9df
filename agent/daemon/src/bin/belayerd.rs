//! `belayerd`: the per-node Belayer agent.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use belayer_daemon::config::{Config, DEFAULT_CONFIG};
use belayer_daemon::metrics::http::{MetricsServer, Scrape};
use belayer_daemon::service::Agent;
use belayer_ipc::{AccessPolicy, Server, ServerConfig};
use clap::Parser;

/// Command line of `belayerd`; flags override the config file.
#[derive(Debug, Parser)]
#[command(
    name = "belayerd",
    version,
    about = "Belayer agent: sandboxes with full checkpoint and restore"
)]
struct Args {
    /// Socket path (default /run/belayer/belayer.sock).
    #[arg(long, env = "BELAYER_SOCKET")]
    socket: Option<PathBuf>,
    /// State directory (default /var/lib/belayer).
    #[arg(long, env = "BELAYER_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Configuration file (TOML).
    #[arg(long, env = "BELAYER_CONFIG")]
    config: Option<PathBuf>,
    /// Path of the criu binary.
    #[arg(long, env = "BELAYER_CRIU")]
    criu: Option<PathBuf>,
    /// Group id whose members may use the socket besides root.
    #[arg(long)]
    socket_gid: Option<u32>,
    /// Honour test-fault hooks in checkpoint requests (tests only).
    #[arg(long, hide = true)]
    test_hooks: bool,
    /// Do not load the BPF sandbox tracer; detect failures with the pidfd/cgroup fallback.
    #[arg(long, env = "BELAYER_NO_BPF")]
    no_bpf: bool,
    /// Disk limit of sandboxes whose spec sets none, bytes (K, M, G, T suffixes; 0 = none);
    /// overrides `default_disk_max_bytes`.
    #[arg(long, env = "BELAYER_DEFAULT_DISK_MAX", value_parser = belayer_ipc::parse_bytes)]
    default_disk_max: Option<u64>,
    /// Serve Prometheus metrics at `http://ADDR/metrics` (e.g. `127.0.0.1:9464`); overrides
    /// `metrics_listen`. Loopback only unless the config sets `metrics_allow_remote`.
    #[arg(long, env = "BELAYER_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Log format on stderr: `text` (ANSI colours only when stderr is a terminal and
    /// `NO_COLOR` is unset) or `json` (one object per line: timestamp, level, target,
    /// fields; for journald and log collectors).
    #[arg(long, env = "BELAYER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Installs the subscriber: `BELAYER_LOG` (an `EnvFilter` directive, default `info`) to
/// stderr in `format`.
fn init_logs(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder
            .json()
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
            .init(),
    }
}

fn main() {
    let args = Args::parse();
    init_logs(args.log_format);
    if let Err(e) = run(args) {
        tracing::error!("{e:#}");
        eprintln!("belayerd: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    // Block the shutdown signals before any thread starts, so only the waiter sees them.
    let mut signals = signal_hook_iter()?;
    let (path, required) = match &args.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(DEFAULT_CONFIG), false),
    };
    let mut config = Config::load(&path, required)?;
    if let Some(s) = args.socket {
        config.socket = s;
    }
    if let Some(s) = args.state_dir {
        config.state_dir = s;
    }
    if args.criu.is_some() {
        config.criu = args.criu;
    }
    if args.socket_gid.is_some() {
        config.socket_gid = args.socket_gid;
    }
    config.test_hooks |= args.test_hooks;
    config.no_bpf |= args.no_bpf;
    if let Some(bytes) = args.default_disk_max {
        config.default_disk_max_bytes = bytes;
    }
    if args.metrics_listen.is_some() {
        config.metrics_listen = args.metrics_listen;
    }
    let mut server_config = ServerConfig::new(&config.socket)
        .max_frame(config.max_frame_bytes)
        .limits(config.connection_limits());
    if let Some(gid) = config.socket_gid {
        server_config = server_config.group(gid).policy(AccessPolicy::group(gid));
    }
    let agent = Agent::start(config.clone()).context("starting belayerd")?;
    // The servers run as `belayer-memd`, installed next to belayerd.
    let memd = belayer_workers::bin_dir()
        .context("locating the agent binary")?
        .join(belayer_workers::MEMD_BIN);
    let _memory = belayer_workers::memory::supervise::Supervisor::start(
        &memd,
        &config.memory_servers,
        std::time::Duration::from_millis(200),
    )
    .context("starting memory servers")?;
    let server = Server::bind(server_config).context("binding the socket")?;
    let _metrics = match config.metrics_listen {
        Some(addr) => {
            let (agent, stats) = (Arc::clone(&agent), server.stats());
            let scrape: Scrape = Arc::new(move || agent.scrape(Some(&stats)));
            Some(MetricsServer::start(addr, scrape).context("starting the metrics endpoint")?)
        }
        None => None,
    };
    tracing::info!(socket = %config.socket.display(), state_dir = %config.state_dir.display(), "belayerd ready");
    let trigger = server.shutdown_trigger();
    std::thread::spawn(move || {
        if signals.next().is_some() {
            tracing::info!("shutting down (sandboxes keep running)");
            trigger.trigger();
        }
    });
    let handler: Arc<dyn belayer_ipc::Handler> = agent;
    server.serve(handler).context("serving")?;
    Ok(())
}

/// Blocks SIGTERM/SIGINT in every thread and returns an iterator that yields when one arrives.
fn signal_hook_iter() -> Result<impl Iterator<Item = i32>> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGINT);
    set.thread_block().context("blocking signals")?;
    Ok(std::iter::from_fn(move || {
        set.wait().ok().map(|s| s as i32)
    }))
}
