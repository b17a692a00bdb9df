//! The `belayer` command: a thin client of `belayerd` over the binary protocol.
//!
//! Every command takes `--socket` and `--json`. Exit codes: 0 on success, the action's own exit
//! code for `exec`, 1 for an error answered by the daemon, 2 for usage errors (clap), 3 when the
//! daemon cannot be reached.

pub mod bench;
pub mod bench_capture;
pub mod bench_load;
pub mod embedded;
pub mod output;

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use belayer_ipc::{CheckpointRequest, Client, ExecRequest, Request, Response, SandboxSpec};
use clap::{Args, Parser, Subcommand};

use crate::config::DEFAULT_SOCKET;

/// `belayer` command line.
#[derive(Debug, Parser)]
#[command(
    name = "belayer",
    version,
    about = "Fault-tolerant sandboxes for agentic RL rollouts"
)]
pub struct Cli {
    /// Socket of belayerd.
    #[arg(long, global = true, env = "BELAYER_SOCKET", default_value = DEFAULT_SOCKET)]
    pub socket: PathBuf,
    /// Print machine-readable JSON.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Daemon status.
    Status,
    /// Manage images (read-only lower layers).
    #[command(subcommand)]
    Image(ImageCmd),
    /// Manage sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Run one action in a sandbox; exits with the action's exit code.
    Exec(ExecArgs),
    /// Take a full checkpoint C_k at action boundary k.
    Checkpoint(CheckpointArgs),
    /// Restore a sandbox from its ready checkpoint into a fresh instance.
    Restore(RestoreArgs),
    /// List the published checkpoints of a sandbox, up to the ready one.
    Checkpoints {
        /// Sandbox id.
        id: String,
    },
    /// Drop checkpoints by age or rollout tag.
    Gc(GcArgs),
    /// Agentic rollouts on recorded trajectories under failure injection, with a report.
    Rollout(crate::rollout::RolloutArgs),
    /// Benchmarks (print a table; `--json` for machine output).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Run a memory server owning model weights or the KV-cache arena (needs --socket).
    MemoryServer(crate::memory::cli::MemoryServerArgs),
    /// Run the deterministic reference LLM engine (main or standby shadow worker).
    ToyEngine(crate::handover::engine::EngineArgs),
    /// Run the rollout router (and optionally supervise main + shadow workers per GPU).
    Router(crate::handover::RouterArgs),
}

/// `belayer image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Import a rootfs directory or a tar (plain, gzip, zstd) as image NAME.
    ///
    /// The source is opened by this command with your own rights and passed to belayerd as
    /// a descriptor: belayerd reads only what you can read (a directory is walked as your
    /// uid and groups). Device nodes are refused, except under the source's top-level /dev,
    /// where they are left out (every sandbox has its own /dev).
    Import {
        /// Image name.
        name: String,
        /// Directory or archive, readable by you.
        path: PathBuf,
    },
    /// List images.
    Ls,
    /// Remove an image no sandbox uses.
    Rm {
        /// Image name.
        name: String,
    },
}

/// `belayer sandbox ...`
#[derive(Debug, Subcommand)]
pub enum SandboxCmd {
    /// Create a sandbox; prints its id.
    Create(CreateArgs),
    /// List sandboxes.
    Ls,
    /// Describe a sandbox.
    Inspect {
        /// Sandbox id.
        id: String,
    },
    /// Remove a sandbox and its checkpoints.
    Rm {
        /// Sandbox id.
        id: String,
    },
}

/// Arguments of `sandbox create`.
#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Image name.
    #[arg(long)]
    pub image: String,
    /// Memory limit in bytes (suffixes K, M, G accepted).
    #[arg(long, value_parser = parse_bytes)]
    pub memory_max: Option<u64>,
    /// Maximum number of processes.
    #[arg(long)]
    pub pids_max: Option<u64>,
    /// Disk limit in bytes of the sandbox's upper layer (suffixes K, M, G, T accepted; default:
    /// the daemon's `default_disk_max_bytes`, 10 GiB unless configured).
    #[arg(long, value_parser = parse_bytes)]
    pub disk_max: Option<u64>,
    /// Environment variable of every action, K=V (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Rollout tag (for `gc --tag`).
    #[arg(long)]
    pub tag: Option<String>,
    /// CPU bandwidth limit in CPUs, e.g. 1.5 (default: the daemon's `default_cpus`).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// User namespace: `private` (default: root inside is an unprivileged host uid) or
    /// `host` (explicit opt-in: root inside is host root).
    #[arg(long, value_parser = parse_userns)]
    pub userns: Option<belayer_ipc::UsernsMode>,
}

/// Parses `--userns`.
fn parse_userns(s: &str) -> Result<belayer_ipc::UsernsMode, String> {
    match s {
        "private" => Ok(belayer_ipc::UsernsMode::Private),
        "host" => Ok(belayer_ipc::UsernsMode::Host),
        _ => Err(format!("{s:?}: expected `private` or `host`")),
    }
}

/// Arguments of `exec`.
#[derive(Debug, Args)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Timeout in seconds (fractions allowed).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Working directory inside the sandbox.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Extra environment, K=V (repeatable).
    #[arg(long = "env", value_parser = parse_env)]
    pub env: Vec<(String, String)>,
    /// Bytes of stdout and of stderr to keep.
    #[arg(long, value_parser = parse_bytes)]
    pub output_limit: Option<u64>,
    /// The command (one argument is run by `sh -c`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// Arguments of `checkpoint`.
#[derive(Debug, Args)]
pub struct CheckpointArgs {
    /// Sandbox id.
    pub id: String,
    /// Action boundary k of the trajectory prefix.
    #[arg(long)]
    pub prefix: u64,
    /// File holding the LLM context L_k (stored as opaque bytes).
    #[arg(long)]
    pub context: Option<PathBuf>,
}

/// Arguments of `restore`.
#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Sandbox id.
    pub id: String,
    /// Write the restored L_k to this file (JSON then names it as `context_file`).
    #[arg(long)]
    pub context_out: Option<PathBuf>,
    /// Check the restored upper layer and process list against the checkpoint.
    #[arg(long)]
    pub verify: bool,
}

/// Arguments of `gc`.
#[derive(Debug, Args)]
pub struct GcArgs {
    /// Drop checkpoints older than this many seconds (the ready one of a sandbox is kept).
    #[arg(long)]
    pub older_than: Option<u64>,
    /// Drop every checkpoint of the sandboxes with this rollout tag.
    #[arg(long)]
    pub tag: Option<String>,
}

/// Parses `123`, `64K`, `512M`, `2G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("unknown size suffix in {s:?}")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("invalid size {s:?}"))
}

/// Parses `K=V`.
pub fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected K=V, got {s:?}")),
    }
}

/// A daemon error answer, carried to `main` to pick the exit code.
#[derive(Debug, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct DaemonError {
    /// Code.
    pub code: belayer_ipc::ErrorCode,
    /// Message.
    pub message: String,
}

/// Sends `req`, turning an error answer into [`DaemonError`].
pub fn call(client: &mut Client, req: Request) -> Result<Response> {
    match client.call(req).context("talking to belayerd")? {
        Response::Error(e) => Err(DaemonError {
            code: e.code,
            message: e.message,
        }
        .into()),
        r => Ok(r),
    }
}

/// Imports the directory or archive at `path` as image `name`, passing it as a descriptor
/// opened here with this process's rights ([`Client::import_image`]); an error reply becomes
/// a [`DaemonError`].
pub fn import_image(client: &mut Client, name: &str, path: &std::path::Path) -> Result<Response> {
    let response = client.import_image(name, path).map_err(|e| match e {
        open @ belayer_ipc::ClientError::OpenSource { .. } => anyhow::Error::new(open),
        other => anyhow::Error::new(other).context("talking to belayerd"),
    })?;
    match response {
        Response::Error(e) => Err(DaemonError {
            code: e.code,
            message: e.message,
        }
        .into()),
        r => Ok(r),
    }
}

/// Connects to the daemon.
pub fn connect(socket: &std::path::Path) -> Result<Client> {
    Client::connect(socket).with_context(|| {
        format!(
            "cannot reach belayerd at {} (is it running? see `belayerd --help`)",
            socket.display()
        )
    })
}

/// Runs the command; returns the process exit code.
pub fn run(cli: Cli) -> Result<i32> {
    use output::Printer;
    let p = Printer { json: cli.json };
    let command = match cli.command {
        Command::Bench(cmd) => return bench::run(&cli.socket, cmd, cli.json),
        Command::Rollout(args) => return crate::rollout::run(&cli.socket, args, cli.json),
        Command::MemoryServer(args) => return crate::memory::cli::run(args, &cli.socket, cli.json),
        Command::ToyEngine(args) => return crate::handover::engine::run(args),
        Command::Router(args) => return crate::handover::run_router(args),
        other => other,
    };
    let mut c = connect(&cli.socket)?;
    match command {
        Command::Status => p.response(call(&mut c, Request::Status)?),
        Command::Image(ImageCmd::Import { name, path }) => {
            p.response(import_image(&mut c, &name, &path)?)
        }
        Command::Image(ImageCmd::Ls) => p.response(call(&mut c, Request::ListImages)?),
        Command::Image(ImageCmd::Rm { name }) => {
            p.response(call(&mut c, Request::RemoveImage { name })?)
        }
        Command::Sandbox(SandboxCmd::Create(a)) => {
            let spec = SandboxSpec {
                image: a.image,
                memory_max: a.memory_max,
                pids_max: a.pids_max,
                env: a.env,
                tag: a.tag,
                cpus: a.cpus,
                userns: a.userns,
                disk_max: a.disk_max,
            };
            match call(&mut c, Request::CreateSandbox(spec))? {
                Response::Sandbox(info) => p.created(&info),
                r => p.response(r),
            }
        }
        Command::Sandbox(SandboxCmd::Ls) => p.response(call(&mut c, Request::ListSandboxes)?),
        Command::Sandbox(SandboxCmd::Inspect { id }) => {
            p.response(call(&mut c, Request::InspectSandbox { id })?)
        }
        Command::Sandbox(SandboxCmd::Rm { id }) => {
            p.response(call(&mut c, Request::RemoveSandbox { id })?)
        }
        Command::Exec(a) => {
            if a.timeout.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
                bail!("--timeout must be a positive number of seconds");
            }
            let req = ExecRequest {
                id: a.id,
                argv: a.command,
                cwd: a.cwd,
                timeout_ms: a.timeout.map(|t| (t * 1000.0).ceil() as u64),
                env: a.env,
                output_limit: a.output_limit,
            };
            match call(&mut c, Request::Exec(req))? {
                Response::Exec(r) => return Ok(p.exec(&r)),
                r => p.response(r),
            }
        }
        Command::Checkpoint(a) => {
            let context = match &a.context {
                Some(f) => std::fs::read(f).with_context(|| format!("reading {}", f.display()))?,
                None => Vec::new(),
            };
            let req = CheckpointRequest {
                id: a.id,
                prefix: a.prefix,
                context,
                fault: None,
            };
            p.response(call(&mut c, Request::Checkpoint(req))?)
        }
        Command::Restore(a) => match call(
            &mut c,
            Request::Restore {
                id: a.id,
                verify: a.verify,
            },
        )? {
            Response::Restored(r) => p.restored(&r, a.context_out.as_deref())?,
            r => p.response(r),
        },
        Command::Checkpoints { id } => p.response(call(&mut c, Request::ListCheckpoints { id })?),
        Command::Gc(a) => p.response(call(
            &mut c,
            Request::Gc {
                older_than_s: a.older_than,
                tag: a.tag,
            },
        )?),
        Command::Bench(_)
        | Command::Rollout(_)
        | Command::MemoryServer(_)
        | Command::ToyEngine(_)
        | Command::Router(_) => {}
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("123"), Ok(123));
        assert_eq!(parse_bytes("64K"), Ok(65536));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("x").is_err());
    }

    #[test]
    fn envs() {
        assert_eq!(parse_env("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert!(parse_env("=x").is_err());
        assert!(parse_env("x").is_err());
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "belayer",
            "exec",
            "sb-1",
            "--timeout",
            "2",
            "--",
            "ls",
            "-la",
        ])
        .unwrap();
        match cli.command {
            Command::Exec(a) => assert_eq!(a.command, vec!["ls", "-la"]),
            _ => panic!("wrong command"),
        }
        let cli = Cli::try_parse_from([
            "belayer",
            "sandbox",
            "create",
            "--image",
            "py",
            "--disk-max",
            "64M",
        ])
        .unwrap();
        match cli.command {
            Command::Sandbox(SandboxCmd::Create(a)) => assert_eq!(a.disk_max, Some(64 << 20)),
            _ => panic!("wrong command"),
        }
    }
}
