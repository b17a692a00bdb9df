//! `belayer cp SRC DST`: copies a file or directory between the host and a sandbox, as a tar
//! stream over the protocol (crate `belayer-transfer`).
//!
//! Exactly one of SRC and DST names a sandbox path, `ID:PATH`: an argument is a sandbox path
//! when it holds a `:` whose prefix is non-empty and has no `/` (sandbox ids are `sb-` and hex
//! digits, never a `:` or a `/`); a host path with a `:` before its first `/` is written
//! `./a:b`. A host SRC or DST of `-` is a tar stream on stdin (extracted into the sandbox
//! directory DST, which must exist) or on stdout (the tar of the sandbox's SRC).
//!
//! Where the tree lands follows `docker cp`: an existing directory DST takes SRC under its own
//! name, anything else becomes DST (its parent must exist; `DST/` must be an existing
//! directory). The side that extracts decides: the sandbox for an upload, here for a download.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use belayer_ipc::{Client, TransferInfo};
use belayer_transfer::host::{self, HostError};

use crate::client::DaemonError;

/// One side of `belayer cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A host path.
    Host(PathBuf),
    /// `-`: a tar stream on stdin or stdout.
    Stream,
    /// `ID:PATH` in a sandbox.
    Sandbox {
        /// Sandbox id.
        id: String,
        /// Absolute path inside it.
        path: String,
    },
}

impl Endpoint {
    /// Parses one argument of `belayer cp` (see the module docs).
    pub fn parse(arg: &str) -> Endpoint {
        if arg == "-" {
            return Endpoint::Stream;
        }
        match arg.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') => Endpoint::Sandbox {
                id: id.to_owned(),
                path: path.to_owned(),
            },
            _ => Endpoint::Host(PathBuf::from(arg)),
        }
    }
}

/// What a copy moved, for the summary.
#[derive(Debug)]
struct Copied {
    info: TransferInfo,
    seconds: f64,
    to_stdout: bool,
}

fn host_error(err: HostError) -> anyhow::Error {
    match err {
        HostError::Daemon(reply) => DaemonError {
            code: reply.code,
            message: reply.message,
        }
        .into(),
        HostError::Client(e) => anyhow::Error::new(e).context("talking to belayerd"),
        other => anyhow::Error::new(other),
    }
}

/// A sandbox path must be absolute: a relative one is taken from the sandbox's root.
fn absolute(path: &str) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    }
}

/// Runs `belayer cp SRC DST` with `timeout` seconds for the transfer; prints the summary
/// (`--json`: `{files, bytes, skipped, changed, seconds}`) and returns the exit code.
///
/// Errors: both or neither side a sandbox path, `-` on both sides, a transfer error (the
/// daemon's as [`DaemonError`]).
pub fn run(
    client: &mut Client,
    src: &str,
    dst: &str,
    timeout: Option<f64>,
    json: bool,
) -> Result<i32> {
    if timeout.is_some_and(|t| !(t.is_finite() && t > 0.0)) {
        bail!("--timeout must be a positive number of seconds");
    }
    let timeout_ms = timeout.map(|t| (t * 1000.0).ceil() as u64);
    let started = Instant::now();
    let (info, to_stdout) = match (Endpoint::parse(src), Endpoint::parse(dst)) {
        (Endpoint::Host(from), Endpoint::Sandbox { id, path }) => (
            host::upload_path(client, &id, &from, &absolute(&path), timeout_ms)
                .map_err(host_error)
                .with_context(|| format!("copying {} to {id}:{path}", from.display()))?,
            false,
        ),
        (Endpoint::Stream, Endpoint::Sandbox { id, path }) => (
            host::upload_archive(
                client,
                &id,
                std::io::stdin().lock(),
                &absolute(&path),
                timeout_ms,
            )
            .map_err(host_error)
            .with_context(|| format!("copying the archive on stdin to {id}:{path}"))?,
            false,
        ),
        (Endpoint::Sandbox { id, path }, Endpoint::Host(to)) => (
            host::download_path(client, &id, &absolute(&path), &to, timeout_ms)
                .map_err(host_error)
                .with_context(|| format!("copying {id}:{path} to {}", to.display()))?,
            false,
        ),
        (Endpoint::Sandbox { id, path }, Endpoint::Stream) => {
            let out = std::io::stdout().lock();
            let info = host::download_archive(client, &id, &absolute(&path), out, timeout_ms)
                .map_err(host_error)
                .with_context(|| format!("copying {id}:{path} to stdout"))?;
            (info, true)
        }
        (Endpoint::Sandbox { .. }, Endpoint::Sandbox { .. }) => {
            bail!("both sides are sandbox paths: copy through the host")
        }
        _ => bail!("one side of `cp` must be a sandbox path ID:PATH (see `belayer cp --help`)"),
    };
    summary(
        &Copied {
            info,
            seconds: started.elapsed().as_secs_f64(),
            to_stdout,
        },
        json,
    );
    Ok(0)
}

/// Prints the summary: to stdout, or to stderr when stdout carries the archive.
fn summary(c: &Copied, json: bool) {
    let text = if json {
        serde_json::json!({
            "files": c.info.files,
            "bytes": c.info.bytes,
            "skipped": c.info.skipped,
            "changed": c.info.changed,
            "seconds": c.seconds,
        })
        .to_string()
    } else {
        let mut text = format!(
            "copied {} entries ({} bytes) in {:.3} s",
            c.info.files, c.info.bytes, c.seconds
        );
        if c.info.skipped > 0 {
            text.push_str(&format!("; {} special files left out", c.info.skipped));
        }
        if c.info.changed > 0 {
            text.push_str(&format!("; {} files changed while copied", c.info.changed));
        }
        text
    };
    if c.to_stdout {
        eprintln!("{text}");
    } else {
        let _ = writeln!(std::io::stdout(), "{text}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths_are_id_colon_path() {
        assert_eq!(
            Endpoint::parse("sb-12ab:/root/x"),
            Endpoint::Sandbox {
                id: "sb-12ab".into(),
                path: "/root/x".into()
            }
        );
        assert_eq!(
            Endpoint::parse("sb-1:rel:with:colons"),
            Endpoint::Sandbox {
                id: "sb-1".into(),
                path: "rel:with:colons".into()
            }
        );
        assert_eq!(Endpoint::parse("-"), Endpoint::Stream);
        for host in ["./a:b", "/tmp/a:b", ":x", "plain", "dir/file"] {
            assert_eq!(Endpoint::parse(host), Endpoint::Host(host.into()), "{host}");
        }
        assert_eq!(absolute("root/x"), "/root/x");
    }
}
