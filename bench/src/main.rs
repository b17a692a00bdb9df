//! `belayer-bench`: every benchmark of Belayer with its baselines, printed as a table (or JSON
//! with `--json`). Speed is measured here, not asserted in tests.
//!
//! - `checkpoint` ([`checkpoint`]): full checkpoint + restore cycles of a busybox loop and a
//!   python3 sandbox;
//! - `capture` ([`capture`]): the same workloads side by side with a hand-rolled
//!   unshare + overlayfs + tar + CRIU sandbox and with runc;
//! - `load` ([`load`]): many sandboxes under host SIGKILLs and `belayerd` crashes;
//! - `memory` ([`memory`]): memory-server attach, unmap, remap and KV flush;
//! - `tracer` ([`tracer`]): fail-stop detection latency and the BPF overhead;
//! - `handover` ([`handover`]): shadow-worker handover against the conventional baseline;
//! - `exec` ([`exec`]): the round trip of a trivial action against plain subprocesses;
//! - `image` ([`image`]): registry pull + unpack against skopeo + umoci, and sandbox create
//!   from a many-layer image against a flattened one.
//!
//! The benchmarks that need a daemon use the one at `--socket`, or start an agent inside this
//! process ([`embedded`]). `belayer bench ARGS...` runs this program.
//!
//! Dependencies and why: `belayer-daemon` (the embedded agent, its config and syscall helpers),
//! `belayer-workers` (memory servers, router, engines), `belayer-cli` (the client's request
//! helpers), `belayer-ipc`, `belayer-overlay`/`belayer-ebpf` (the hand-rolled
//! baseline and the tracer's costs), `clap`, `serde`/`serde_json` (JSON output), `nix`/
//! `rustix`/`libc` (processes of the baselines), `thiserror`, `tracing`/`tracing-subscriber`,
//! `anyhow`, `tempfile` (scratch dirs), `belayer-tests` (the real registry and the umoci
//! image builder of the test harness, for `image`).

mod capture;
mod checkpoint;
mod embedded;
mod exec;
mod fork;
mod handover;
mod image;
mod load;
mod memory;
mod tracer;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Default location of the busybox test image built by `scripts/setup.sh`.
pub const DEFAULT_BUSYBOX_ROOTFS: &str = "/var/cache/belayer/images/busybox/rootfs";
/// Default location of the Debian python3 image built by `scripts/setup.sh`.
pub const DEFAULT_PYTHON_ROOTFS: &str = "/var/cache/belayer/images/bookworm-python/rootfs";

/// `belayer-bench` command line.
#[derive(Debug, Parser)]
#[command(
    name = "belayer-bench",
    version,
    about = "Belayer benchmarks with their baselines"
)]
struct Cli {
    /// Socket of belayerd (an agent is started inside this process when none answers).
    #[arg(long, global = true, env = "BELAYER_SOCKET", default_value = belayer_ipc::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    json: bool,
    /// Which benchmark.
    #[command(subcommand)]
    command: BenchCmd,
}

/// `belayer-bench ...`
#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// Checkpoint and restore timings for a busybox loop and a python3 sandbox.
    Checkpoint(crate::checkpoint::CheckpointBenchArgs),
    /// Memory servers: attach, unmap, remap (and KV flush) timings for 1, 8, 64 GiB layouts.
    Memory(crate::memory::MemoryBenchArgs),
    /// Sandbox tracer: kill → SandboxFailed latency (BPF, fallback) and the BPF overhead on a
    /// write-heavy action.
    Tracer(crate::tracer::TracerBenchArgs),
    /// Worker handover: kill -9 of the main worker under streaming load, Belayer vs the
    /// conventional baseline.
    Handover(crate::handover::HandoverBenchArgs),
    /// Checkpoint/restore side by side on the same workloads: Belayer, a hand-rolled
    /// unshare + overlayfs + tar + CRIU sandbox, and runc.
    Capture(crate::capture::CaptureArgs),
    /// Load under failures: 64 sandboxes × 20 steps with a checkpoint after each, a host
    /// SIGKILL + restore every 5th step and `belayerd` killed -9 twice (its own daemon).
    Load(crate::load::LoadArgs),
    /// OCI images from a local registry: pull + unpack throughput against skopeo + umoci,
    /// and sandbox create time from a 20-layer image against a flattened one.
    Image(crate::image::ImageBenchArgs),
    /// Exec round trip of a trivial command (`true`): Belayer's Rust client, CLI and Python
    /// client side by side with subprocess baselines (Rust, Python, mini-swe-agent).
    Exec(crate::exec::ExecBenchArgs),
}

/// Median of a sample (0 when empty).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs a benchmark; returns the exit code.
fn run(cli: Cli) -> Result<i32> {
    let (socket, json) = (cli.socket.as_path(), cli.json);
    match cli.command {
        BenchCmd::Checkpoint(args) => checkpoint::run(socket, args, json),
        BenchCmd::Memory(args) => memory::run(&args, json),
        BenchCmd::Tracer(args) => tracer::run(&args, json),
        BenchCmd::Handover(args) => handover::run(&args, json),
        BenchCmd::Capture(args) => capture::run(socket, &args, json),
        BenchCmd::Load(args) => load::run(&args, json),
        BenchCmd::Exec(args) => exec::run(&args, json),
        BenchCmd::Image(args) => image::run(&args, json),
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
