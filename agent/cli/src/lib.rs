//! `belayer`: the command-line client of `belayerd`, over the binary protocol only (crate
//! `belayer-ipc`), and the rollout driver with its report.
//!
//! Every command takes `--socket` and `--json`. Exit codes: 0 on success, the action's own exit
//! code for `exec`, 1 for an error answered by the daemon, 2 for usage errors (clap), 3 when the
//! daemon cannot be reached.
//!
//! Modules: [`args`] (the clap tree), [`client`] (requests and their errors), [`output`]
//! (tables and JSON), [`copy`] (`cp` between the host and a sandbox), [`embedded`] (a private
//! `belayerd` child when none answers), [`forward`]
//! (commands served by the other Belayer programs), [`rollout`] (the main job: rollouts on
//! recorded trajectories under failure injection) and [`report`] (its report).
//!
//! Dependencies and why: `belayer-ipc` (protocol and client), `belayer-transfer` (the hardened
//! tar packing and extraction of `cp`), `clap` (command line),
//! `serde`/`serde_json` (JSON output, trajectories, the report), `indicatif` (rollout progress
//! bars), `plotters` (SVG plots of the report, no system fonts needed), `blake3` (the seeded
//! failure schedule), `nix`/`libc` (signals: the injected fail-stops, SIGPIPE), `thiserror`
//! (typed errors), `tracing`/`tracing-subscriber` (logs), `anyhow` (command entry points);
//! `tempfile` for tests.

#![warn(missing_docs)]

pub mod args;
pub mod client;
pub mod copy;
pub mod embedded;
pub mod forward;
pub mod image;
pub mod output;
pub mod report;
pub mod rollout;
pub mod tree;

use anyhow::{bail, Context, Result};
use belayer_ipc::{CheckpointRequest, ExecRequest, Request, Response, SandboxSpec};

pub use args::Cli;
use args::{CheckpointAction, Command, ImageCmd, SandboxCmd};
use client::{call, connect};
use forward::Program;

/// Runs the command; returns the process exit code.
pub fn run(cli: Cli) -> Result<i32> {
    use output::Printer;
    let p = Printer { json: cli.json };
    let forwarded = match &cli.command {
        Command::Bench(f) => Some((Program::Bench, f)),
        Command::MemoryServer(f) => Some((Program::Memd, f)),
        Command::ToyEngine(f) => Some((Program::ToyEngine, f)),
        Command::Router(f) => Some((Program::Router, f)),
        _ => None,
    };
    if let Some((program, f)) = forwarded {
        return forward::exec(program, &cli.socket, cli.json, &f.args);
    }
    let command = match cli.command {
        Command::Rollout(args) => return rollout::run(&cli.socket, args, cli.json),
        other => other,
    };
    let mut c = connect(&cli.socket)?;
    match command {
        Command::Status => p.response(call(&mut c, Request::Status)?),
        Command::Image(ImageCmd::Import { name, path }) => {
            p.response(image::import(&mut c, &name, &path)?)
        }
        Command::Image(ImageCmd::Pull(args)) => p.response(image::pull(&mut c, args)?),
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
                workdir: a.workdir,
                user: a.user,
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
            let stdin = exec_stdin(a.stdin_file.as_deref(), a.stdin)?;
            let req = ExecRequest {
                id: a.id,
                argv: a.command,
                cwd: a.cwd,
                timeout_ms: a.timeout.map(|t| (t * 1000.0).ceil() as u64),
                env: a.env,
                output_limit: a.output_limit,
                stdin,
                merge_stderr: a.merge_stderr,
            };
            match call(&mut c, Request::Exec(req))? {
                Response::Exec(r) => return Ok(p.exec(&r)),
                r => p.response(r),
            }
        }
        Command::Checkpoint(cmd) => match cmd.action {
            Some(CheckpointAction::Ls { id, tree }) => {
                match call(&mut c, Request::ListCheckpoints { id })? {
                    Response::Checkpoints(list) if tree && !p.json => {
                        print!("{}", tree::render(&list));
                    }
                    r => p.response(r),
                }
            }
            None => {
                let a = cmd.take;
                let (Some(id), Some(prefix)) = (a.id, a.prefix) else {
                    bail!("checkpoint needs a sandbox id and --prefix K");
                };
                let context = match &a.context {
                    Some(f) => {
                        std::fs::read(f).with_context(|| format!("reading {}", f.display()))?
                    }
                    None => Vec::new(),
                };
                let req = CheckpointRequest {
                    id,
                    prefix,
                    context,
                    fault: None,
                };
                p.response(call(&mut c, Request::Checkpoint(req))?)
            }
        },
        Command::Restore(a) => match call(
            &mut c,
            match a.checkpoint {
                Some(checkpoint) => Request::RestoreCheckpoint {
                    id: a.id,
                    verify: a.verify,
                    checkpoint,
                },
                None => Request::Restore {
                    id: a.id,
                    verify: a.verify,
                    prefix: a.prefix,
                },
            },
        )? {
            Response::Restored(r) => p.restored(&r, a.context_out.as_deref())?,
            r => p.response(r),
        },
        Command::Fork(a) => {
            let req = belayer_ipc::ForkRequest {
                id: a.id,
                prefix: a.prefix,
                checkpoint: a.checkpoint,
                count: a.count,
                verify: a.verify,
            };
            match call(&mut c, Request::Fork(req))? {
                Response::Forked(f) => p.forked(&f, a.context_out.as_deref())?,
                r => p.response(r),
            }
        }
        Command::Checkpoints { id } => p.response(call(&mut c, Request::ListCheckpoints { id })?),
        Command::Gc(a) => p.response(call(
            &mut c,
            Request::Gc {
                older_than_s: a.older_than,
                tag: a.tag,
            },
        )?),
        Command::Cp(a) => return copy::run(&mut c, &a.src, &a.dst, a.timeout, cli.json),
        Command::Rollout(_)
        | Command::Bench(_)
        | Command::MemoryServer(_)
        | Command::ToyEngine(_)
        | Command::Router(_) => {}
    }
    Ok(0)
}

/// The most bytes `exec` reads for the action's stdin (the frame maximum of a default
/// daemon; the daemon's own bound is lower and refuses the rest with a precise error).
const STDIN_READ_MAX: u64 = 16 << 20;

/// The action's stdin for `exec`: the file at `path`, this process's stdin when `own`, else
/// nothing.
fn exec_stdin(path: Option<&std::path::Path>, own: bool) -> Result<Vec<u8>> {
    use std::io::Read;
    let (reader, what): (Box<dyn Read>, String) = match (path, own) {
        (Some(p), _) => (
            Box::new(std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?),
            p.display().to_string(),
        ),
        (None, true) => (Box::new(std::io::stdin().lock()), "stdin".to_owned()),
        (None, false) => return Ok(Vec::new()),
    };
    let mut bytes = Vec::new();
    reader
        .take(STDIN_READ_MAX + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {what}"))?;
    if bytes.len() as u64 > STDIN_READ_MAX {
        bail!("{what} holds more than {STDIN_READ_MAX} bytes, too much for an action's stdin");
    }
    Ok(bytes)
}
