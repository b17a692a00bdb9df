//! Rollout-worker recovery (paper: "Rollout-worker recovery"): memory servers that own model
//! weights and the KV-cache arena and hand CUDA VMM (or memfd) handles to workers, shadow
//! workers with the five-step handover, and the rollout router that resumes interrupted
//! requests from a token-level prefix.
//!
//! Programs built from this crate: `belayer-memd` (a memory server, [`memory`]),
//! `belayer-router` (the router, optionally supervising a main and a shadow worker per GPU,
//! [`handover`]) and `belayer-toy-engine` (the deterministic reference engine). `belayerd`
//! supervises configured memory servers through [`memory::supervise`] and
//! [`memory::process`].
//!
//! Dependencies and why: `belayer-ipc` (the memory protocol, its worker client and CUDA
//! backend), `belayer-context` (the router's token-level context log), `nix`/`rustix`/`libc`
//! (signals, pidfds), `serde`/`serde_json`/`toml` (the engines' HTTP JSON, layout files),
//! `blake3` (the toy engine's deterministic tokens), `clap` (the three command lines),
//! `thiserror` (typed errors), `tracing`/`tracing-subscriber` (logs), `anyhow` (binaries and
//! command entry points only); `tempfile` for tests.
#![warn(missing_docs)]

pub mod handover;
pub mod memory;

use std::path::PathBuf;

/// File name of the memory-server binary.
pub const MEMD_BIN: &str = "belayer-memd";
/// File name of the reference-engine binary.
pub const ENGINE_BIN: &str = "belayer-toy-engine";
/// File name of the router binary.
pub const ROUTER_BIN: &str = "belayer-router";

/// The directory of the running binary, where the other Belayer binaries are installed.
///
/// Errors: the running binary's path cannot be read (`/proc/self/exe`).
pub fn bin_dir() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe
        .parent()
        .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf))
}

/// Sets up logging to stderr: `BELAYER_LOG` (an `EnvFilter` directive) or `default`.
pub fn init_logs(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal (never in a file, a pipe or journald), unless NO_COLOR.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
}

/// Exits with the code `result` carries, or 1 after printing its error chain as `name: ...`.
pub fn exit_with(result: anyhow::Result<i32>, name: &str) -> ! {
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("{name}: {e:#}");
            std::process::exit(1);
        }
    }
}
