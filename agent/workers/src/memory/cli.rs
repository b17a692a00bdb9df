//! `belayer-memd --role weights|kv --device cuda:N|host --layout FILE --socket PATH`:
//! runs a memory server in the foreground until SIGTERM, SIGINT or SIGHUP.
//!
//! Once the socket listens it prints one line to stdout, `ready role=... device=... regions=N
//! bytes=B layout=HASH socket=PATH pid=P` (or the same as JSON with `--json`), so a supervisor
//! knows when workers may attach. Exit codes: 0 after a signal, 1 when it cannot start (bad
//! layout, no CUDA driver for `--device cuda:N`, socket in use, ...).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use belayer_ipc::memory::{Backend, Layout, Role};
use belayer_ipc::AccessPolicy;
use clap::Args;
use nix::sys::signal::{SigSet, SigmaskHow, Signal};

use super::server::{MemoryServer, MemoryServerConfig};
use super::{parse_device, parse_role};

/// Arguments of `belayer-memd` (`--socket` must be given explicitly: the belayerd socket is
/// refused).
#[derive(Debug, Args)]
pub struct MemoryServerArgs {
    /// Socket the server listens on (its own, not belayerd's).
    #[arg(long)]
    pub socket: PathBuf,
    /// Print the `ready` line as JSON.
    #[arg(long)]
    pub json: bool,
    /// What the server holds: `weights` or `kv`.
    #[arg(long, value_parser = parse_role)]
    pub role: Role,
    /// Where the memory lives: `host` (memfd) or `cuda:N`.
    #[arg(long, default_value = "host", value_parser = parse_device)]
    pub device: Backend,
    /// Layout file (TOML: `[[region]]` name/size, `[kv]` block_size/block_count).
    #[arg(long)]
    pub layout: PathBuf,
    /// Group whose members may connect besides root (also the socket file's group).
    #[arg(long)]
    pub socket_gid: Option<u32>,
    /// Register worker id ID for peers of uid UID (repeatable), as `ID=UID`.
    #[arg(long = "worker", value_parser = parse_worker)]
    pub workers: Vec<(String, u32)>,
    /// Refuse attaches from unregistered worker ids.
    #[arg(long)]
    pub require_registration: bool,
}

fn parse_worker(s: &str) -> Result<(String, u32), String> {
    let (id, uid) = s
        .split_once('=')
        .ok_or_else(|| format!("expected ID=UID, got {s:?}"))?;
    let uid = uid
        .parse()
        .map_err(|_| format!("uid {uid:?} is not a number"))?;
    Ok((id.to_owned(), uid))
}

/// Runs the server on `socket` until a termination signal; returns the exit code.
pub fn run(args: MemoryServerArgs) -> Result<i32> {
    let (socket, json) = (args.socket.as_path(), args.json);
    if socket == Path::new(belayer_ipc::DEFAULT_SOCKET) {
        bail!(
            "belayer-memd needs its own --socket PATH (not the belayerd socket {})",
            belayer_ipc::DEFAULT_SOCKET
        );
    }
    let layout =
        Layout::load(&args.layout).with_context(|| format!("layout {}", args.layout.display()))?;
    let mut config = MemoryServerConfig::new(args.role, args.device, layout, socket)
        .require_registration(args.require_registration);
    if let Some(gid) = args.socket_gid {
        config = config.policy(AccessPolicy::group(gid)).socket_group(gid);
    }
    for (worker, uid) in args.workers.iter().cloned() {
        config = config.worker(worker, uid);
    }
    // Block the termination signals before any thread exists, so that only sigwait below
    // receives them.
    let mut signals = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP] {
        signals.add(signal);
    }
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&signals), None)
        .context("blocking termination signals")?;
    let server = MemoryServer::start(config).context("starting the memory server")?;
    let info = server.info();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "ready": true,
                "role": info.role.as_str(),
                "device": info.backend.to_string(),
                "regions": info.regions,
                "bytes": info.bytes,
                "layout": info.layout_hash,
                "socket": socket.display().to_string(),
                "pid": info.pid,
            })
        );
    } else {
        println!(
            "ready role={} device={} regions={} bytes={} layout={} socket={} pid={}",
            info.role,
            info.backend,
            info.regions,
            info.bytes,
            info.layout_hash,
            socket.display(),
            info.pid
        );
    }
    let signal = signals.wait().context("waiting for a termination signal")?;
    tracing::info!(?signal, "memory server stopping");
    server.shutdown();
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_parsers() {
        assert_eq!(parse_role("kv"), Ok(Role::Kv));
        assert!(parse_role("gpu").is_err());
        assert_eq!(parse_device("cuda:1"), Ok(Backend::Cuda { device: 1 }));
        assert!(parse_device("cuda").unwrap_err().contains("cuda:N"));
        assert_eq!(parse_worker("w-0=1000"), Ok(("w-0".to_owned(), 1000)));
        assert!(parse_worker("w-0").is_err());
        assert!(parse_worker("w=x").is_err());
    }

    #[test]
    fn the_example_layouts_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/examples");
        let weights = Layout::load(&dir.join("weights-layout.toml")).unwrap();
        weights.validate_for(Role::Weights).unwrap();
        let kv = Layout::load(&dir.join("kv-layout.toml")).unwrap();
        kv.validate_for(Role::Kv).unwrap();
        assert_eq!(kv.place(2 << 20).unwrap().total, 32 << 30);
    }
}
