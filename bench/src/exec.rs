//! `belayer-bench exec`: the round trip of one trivial action (`true` by default), Belayer side
//! by side with plain subprocesses on the same machine, in one run. Each row is timed `--runs`
//! times after `--warmup` untimed runs, the rows taking turns in blocks of `--block` calls (the
//! Rust-side rows in this process, the Python rows in one `python3`), so that other load on the
//! machine falls on all rows alike while no call runs right behind another row's (a call right
//! after a subprocess's exit is slower); the table gives the median and the 90th percentile in
//! milliseconds and the ratio of each median to the baseline's.
//!
//! - `rust_subprocess`: `/bin/sh -c CMD` forked and executed from Rust (`std::process::Command`
//!   with null stdin and piped stdout and stderr, read to their end);
//! - `python_subprocess`: `subprocess.run(CMD, shell=True, capture_output=True, text=True)`;
//! - `minisweagent_local` (the baseline): mini-swe-agent's own `LocalEnvironment.execute` (a
//!   `Popen` with `shell=True`, stdout piped, stderr merged, a new session), when its package is
//!   importable by `python3` (else `null`, and `python_subprocess` is the baseline);
//! - `belayer_rust`: `Request::Exec` through the Rust client on one connection;
//! - `belayer_daemon`: the `duration_ms` the daemon reports for those calls (from the start of
//!   the helper until it is reaped: the part of the round trip spent in the helper);
//! - `belayer_cli`: the `belayer exec ID -- CMD` process, start-up included;
//! - `belayer_python`: `belayer.Client.exec` of the Python package (over `libbelayer.so`;
//!   `null` when the package or library cannot be loaded).
//!
//! The Belayer rows run against a `belayerd` this benchmark starts on its own socket and state
//! dir (the binary next to this one unless `--belayerd`), in a busybox sandbox.

mod python;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use belayer_ipc::{Client, ExecRequest, Request, Response, SandboxSpec};
use clap::Args;
use serde::Serialize;

use crate::load::daemon::Supervised;
use crate::{median, DEFAULT_BUSYBOX_ROOTFS};

/// Arguments of `belayer-bench exec`.
#[derive(Debug, Args)]
pub struct ExecBenchArgs {
    /// Timed runs per row (median and p90 reported).
    #[arg(long, default_value_t = 50)]
    pub runs: usize,
    /// Untimed runs per row before the timed ones.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Calls of one row in a row before the next row's: the rows alternate in blocks of this
    /// many calls.
    #[arg(long, default_value_t = 10)]
    pub block: usize,
    /// The shell command timed (run by `sh -c` everywhere).
    #[arg(long, default_value = "true")]
    pub command: String,
    /// Busybox rootfs imported as the sandbox's image.
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = DEFAULT_BUSYBOX_ROOTFS)]
    pub busybox_rootfs: PathBuf,
    /// The `belayerd` binary (default: the one next to this executable).
    #[arg(long)]
    pub belayerd: Option<PathBuf>,
    /// The `belayer` CLI binary (default: the one next to this executable).
    #[arg(long)]
    pub belayer: Option<PathBuf>,
    /// `libbelayer.so` for the Python client (default: the one next to this executable).
    #[arg(long, env = "BELAYER_LIB")]
    pub lib: Option<PathBuf>,
    /// Directory holding the `belayer` Python package (put first on `PYTHONPATH`; default: the
    /// package installed for `python3`).
    #[arg(long)]
    pub python_package: Option<PathBuf>,
    /// Python interpreter of the Python rows.
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
}

/// One row: a way of running the command, milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Key of the row (see the module docs).
    pub name: &'static str,
    /// What was timed.
    pub what: &'static str,
    /// Median round trip; `None` when the row could not run.
    pub median_ms: Option<f64>,
    /// 90th percentile (nearest rank).
    pub p90_ms: Option<f64>,
    /// `median_ms` over the baseline's median.
    pub ratio: Option<f64>,
    /// Why the row could not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct ExecBench {
    /// The command timed.
    pub command: String,
    /// Timed runs per row.
    pub runs: usize,
    /// Untimed runs per row.
    pub warmup: usize,
    /// The row whose median the ratios divide by.
    pub baseline: &'static str,
    /// All rows, in table order.
    pub rows: Vec<Row>,
}

/// 90th percentile by nearest rank (0 when empty).
pub fn p90(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = (0.9 * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// `/bin/sh -c cmd` with null stdin and piped stdout and stderr, read to their end.
fn subprocess(cmd: &str) -> Result<()> {
    let out = Command::new("/bin/sh")
        .args(["-c", cmd])
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        bail!("sh -c {cmd:?}: {}", out.status);
    }
    Ok(())
}

/// One `Request::Exec` of `cmd` in sandbox `id`; returns the daemon's `duration_ms`.
fn belayer_exec(c: &mut Client, id: &str, cmd: &str) -> Result<f64> {
    let req = ExecRequest {
        id: id.into(),
        argv: vec![cmd.into()],
        ..Default::default()
    };
    match c.call(Request::Exec(req))? {
        Response::Exec(r) if r.exit_code == 0 => Ok(r.duration_ms),
        r => bail!("exec {cmd:?}: {r:?}"),
    }
}

/// One `belayer --socket SOCKET exec ID -- cmd` process.
fn belayer_cli(belayer: &Path, socket: &Path, id: &str, cmd: &str) -> Result<()> {
    let out = Command::new(belayer)
        .arg("--socket")
        .arg(socket)
        .args(["exec", id, "--", cmd])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", belayer.display()))?;
    if !out.status.success() {
        bail!(
            "belayer exec: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn row(name: &'static str, what: &'static str, sample: Result<Vec<f64>>) -> Row {
    match sample {
        Ok(mut s) => Row {
            name,
            what,
            median_ms: Some(median(&mut s.clone())),
            p90_ms: Some(p90(&mut s)),
            ratio: None,
            missing: None,
        },
        Err(e) => {
            eprintln!("{name}: null: {e:#}");
            Row {
                name,
                what,
                median_ms: None,
                p90_ms: None,
                ratio: None,
                missing: Some(format!("{e:#}")),
            }
        }
    }
}

/// A file next to this executable.
fn beside_me(name: &str) -> Result<PathBuf> {
    Ok(std::env::current_exe()
        .context("locating this executable")?
        .with_file_name(name))
}

/// Runs the benchmark; returns the exit code.
pub fn run(args: &ExecBenchArgs, json: bool) -> Result<i32> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let belayerd = match &args.belayerd {
        Some(b) => b.clone(),
        None => beside_me("belayerd")?,
    };
    let dir = belayer_daemon::config::scratch_state_dir("bench-exec");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = run_in(args, &belayerd, &dir);
    let _ = belayer_overlay::remove_dir_all(&dir);
    let report = result?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(0)
}

fn run_in(args: &ExecBenchArgs, belayerd: &Path, dir: &Path) -> Result<ExecBench> {
    let (n, w, cmd) = (args.runs, args.warmup, args.command.as_str());
    let daemon = Supervised::start(belayerd, dir)?;
    let mut c = Client::connect(&daemon.socket)?;
    match c.import_image("bench-exec", &args.busybox_rootfs)? {
        Response::Image(_) => {}
        r => bail!("importing {}: {r:?}", args.busybox_rootfs.display()),
    }
    let spec = SandboxSpec {
        image: "bench-exec".into(),
        ..Default::default()
    };
    let id = match c.call(Request::CreateSandbox(spec))? {
        Response::Sandbox(s) => s.id,
        r => bail!("creating the sandbox: {r:?}"),
    };

    let belayer = match &args.belayer {
        Some(b) => b.clone(),
        None => beside_me("belayer")?,
    };
    // The Rust-side rows in turn, a block of calls of each per round: load on the machine
    // falls on all of them alike, and no call runs right behind another row's.
    let block = args.block.max(1);
    let (mut sub, mut rust, mut daemon_ms, mut cli) = (vec![], vec![], vec![], vec![]);
    for _ in 0..w {
        subprocess(cmd).context("rust_subprocess")?;
        belayer_exec(&mut c, &id, cmd).context("belayer_rust")?;
        belayer_cli(&belayer, &daemon.socket, &id, cmd).context("belayer_cli")?;
    }
    while sub.len() < n {
        let k = block.min(n - sub.len());
        for _ in 0..k {
            let t = Instant::now();
            subprocess(cmd).context("rust_subprocess")?;
            sub.push(ms_since(t));
        }
        for _ in 0..k {
            let t = Instant::now();
            daemon_ms.push(belayer_exec(&mut c, &id, cmd).context("belayer_rust")?);
            rust.push(ms_since(t));
        }
        for _ in 0..k {
            let t = Instant::now();
            belayer_cli(&belayer, &daemon.socket, &id, cmd).context("belayer_cli")?;
            cli.push(ms_since(t));
        }
    }
    let py = python::Runner {
        python: &args.python,
        package: args.python_package.as_deref(),
        lib: args.lib.clone().or_else(|| beside_me("libbelayer.so").ok()),
        runs: n,
        warmup: w,
        block,
    };
    let mut py_rows = match py.run(&daemon.socket, &id, cmd) {
        Ok(rows) => rows,
        Err(e) => {
            let why = format!("{e:#}");
            ["python_subprocess", "minisweagent_local", "belayer_python"]
                .into_iter()
                .map(|k| (k.to_string(), Err(anyhow::anyhow!("{why}"))))
                .collect()
        }
    };
    let mut py_row = |key: &'static str, what: &'static str| {
        let sample = py_rows
            .remove(key)
            .unwrap_or_else(|| Err(anyhow::anyhow!("not timed")));
        row(key, what, sample)
    };
    let rows = vec![
        row(
            "rust_subprocess",
            "sh -c from Rust (Command, piped output)",
            Ok(sub),
        ),
        py_row(
            "python_subprocess",
            "python subprocess.run(shell=True, capture_output=True)",
        ),
        py_row(
            "minisweagent_local",
            "mini-swe-agent LocalEnvironment.execute",
        ),
        row("belayer_rust", "Belayer exec, Rust client", Ok(rust)),
        row(
            "belayer_daemon",
            "  of which in the helper (daemon's duration_ms)",
            Ok(daemon_ms),
        ),
        row(
            "belayer_cli",
            "Belayer exec, `belayer exec` process",
            Ok(cli),
        ),
        py_row("belayer_python", "Belayer exec, Python client"),
    ];
    let _ = c.call(Request::RemoveSandbox { id });
    drop(daemon);
    let mut rows = rows;

    // mini-swe-agent's own environment when it ran, else the subprocess call it makes.
    let baseline = if rows
        .iter()
        .any(|r| r.name == "minisweagent_local" && r.median_ms.is_some())
    {
        "minisweagent_local"
    } else {
        "python_subprocess"
    };
    let base = rows
        .iter()
        .find(|r| r.name == baseline)
        .and_then(|r| r.median_ms);
    for r in &mut rows {
        r.ratio = match (r.median_ms, base) {
            (Some(m), Some(b)) if b > 0.0 && r.name != "belayer_daemon" => Some(m / b),
            _ => None,
        };
    }
    Ok(ExecBench {
        command: args.command.clone(),
        runs: n,
        warmup: w,
        baseline,
        rows,
    })
}

fn print_table(report: &ExecBench) {
    println!(
        "exec round trip of {:?}: {} runs after {} warm-up, ms (ratio: median / {} median)",
        report.command, report.runs, report.warmup, report.baseline
    );
    println!(
        "{:<20} {:<56} {:>8} {:>8} {:>6}",
        "row", "what", "median", "p90", "ratio"
    );
    let num =
        |v: Option<f64>, d: usize| v.map_or_else(|| "null".to_string(), |v| format!("{v:.d$}"));
    for r in &report.rows {
        println!(
            "{:<20} {:<56} {:>8} {:>8} {:>6}",
            r.name,
            r.what,
            num(r.median_ms, 2),
            num(r.p90_ms, 2),
            r.ratio.map_or_else(String::new, |v| format!("{v:.2}x"))
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        assert_eq!(p90(&mut []), 0.0);
        assert_eq!(p90(&mut [5.0]), 5.0);
        let mut v: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        assert_eq!(p90(&mut v), 9.0);
        let mut v: Vec<f64> = (1..=50).map(f64::from).collect();
        assert_eq!(p90(&mut v), 45.0);
    }

    #[test]
    fn missing_rows_say_why() {
        let r = row("x", "y", Err(anyhow::anyhow!("no python3")));
        assert_eq!(r.median_ms, None);
        assert_eq!(r.missing.as_deref(), Some("no python3"));
        let r = row("x", "y", Ok(vec![3.0, 1.0, 2.0]));
        assert_eq!(r.median_ms, Some(2.0));
        assert_eq!(r.p90_ms, Some(3.0));
    }
}
