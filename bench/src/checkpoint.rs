//! `belayer-bench checkpoint` runs, for each workload, repeated full_checkpoint + full_restore cycles
//! and prints medians of the frozen window, the checkpoint total and the restore total:
//! - `busybox-loop`: a busybox shell loop incrementing a counter file;
//! - `python3-50MB`: a python3 process holding 50 MB of memory plus 50 MB of new files in the
//!   upper layer (the hand-rolled baseline in DESIGN.md: ≈300 ms frozen, ≈280 ms restore).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use belayer_ipc::{CheckpointRequest, Client, ExecRequest, Request, Response, SandboxSpec};
use clap::Args;
use serde::Serialize;

use crate::embedded::connect_or_embed;
use crate::{median, DEFAULT_BUSYBOX_ROOTFS, DEFAULT_PYTHON_ROOTFS};
use belayer_cli::client::{call, import_image};

/// Arguments of `belayer-bench checkpoint`.
#[derive(Debug, Args)]
pub struct CheckpointBenchArgs {
    /// Checkpoint/restore cycles per workload (median reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Busybox rootfs to import if the image `bench-busybox` is missing.
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = DEFAULT_BUSYBOX_ROOTFS)]
    busybox_rootfs: PathBuf,
    /// Python rootfs to import if the image `bench-python` is missing.
    #[arg(long, env = "BELAYER_TEST_PYTHON_ROOTFS", default_value = DEFAULT_PYTHON_ROOTFS)]
    python_rootfs: PathBuf,
    /// MB of memory held and of files written in the python3 workload.
    #[arg(long, default_value_t = 50)]
    python_mb: u64,
}

/// Medians of one workload, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadResult {
    /// Workload name.
    pub name: String,
    /// Cycles measured.
    pub runs: usize,
    /// Median frozen window.
    pub frozen_ms: f64,
    /// Median freeze phase.
    pub freeze_ms: f64,
    /// Median upper-layer capture.
    pub fs_capture_ms: f64,
    /// Median upper snapshot (in the frozen window; 0 without snapshots).
    pub upper_snapshot_ms: f64,
    /// Median CRIU dump.
    pub criu_dump_ms: f64,
    /// Median checkpoint total.
    pub checkpoint_ms: f64,
    /// Median restore total.
    pub restore_ms: f64,
    /// Median install of F_k at restore (snapshot or materialize).
    pub fs_install_ms: f64,
    /// Median CRIU restore phase.
    pub criu_restore_ms: f64,
    /// Restores whose files kept their inode numbers (from the upper snapshot).
    pub inodes_kept: usize,
    /// Median checkpoint size in bytes.
    pub bytes: u64,
    /// Forks of the sandbox after the cycles (absent when not asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fork: Option<crate::fork::ForkMedians>,
    /// The checkpoint after the cycles (and after the workload dirtied 1% of its memory,
    /// where it can) against the first.
    pub second: SecondCheckpoint,
}

/// Bytes a checkpoint adds to the node (`CheckpointInfo::bytes`: new blobs, new page packs,
/// the other images) when taken after 1% of the memory was dirtied, against the sandbox's
/// first checkpoint (the goal: ≤ 5%).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SecondCheckpoint {
    /// Bytes of the sandbox's first checkpoint.
    pub first_bytes: u64,
    /// Bytes of the checkpoint taken after the dirtying (its parent: the last restored one).
    pub second_bytes: u64,
    /// `second_bytes` as a percentage of `first_bytes`.
    pub percent: f64,
    /// Whether the workload dirtied its memory on purpose (else: its own changes only).
    pub dirtied: bool,
}

pub(crate) fn ensure_image(c: &mut Client, name: &str, rootfs: &Path) -> Result<()> {
    if let Response::Images(list) = call(c, Request::ListImages)? {
        if list.iter().any(|i| i.name == name) {
            return Ok(());
        }
    }
    if !rootfs.is_dir() {
        bail!(
            "image rootfs {} missing: run scripts/setup.sh",
            rootfs.display()
        );
    }
    import_image(c, name, rootfs)?;
    Ok(())
}

fn exec(c: &mut Client, id: &str, cmd: &str) -> Result<()> {
    let req = ExecRequest {
        id: id.into(),
        argv: vec![cmd.into()],
        timeout_ms: Some(120_000),
        ..Default::default()
    };
    match call(c, Request::Exec(req))? {
        Response::Exec(r) if r.exit_code == 0 => Ok(()),
        Response::Exec(r) => bail!(
            "setup action {cmd:?} failed ({}): {}",
            r.exit_code,
            String::from_utf8_lossy(&r.stderr)
        ),
        r => bail!("unexpected answer {r:?}"),
    }
}

/// Creates a sandbox of `image`, runs `setup` in it, then `runs` checkpoint + restore cycles,
/// then (`fork_count` > 0) `runs` forks of `fork_count` children from the last checkpoint;
/// removes the sandbox whatever happens.
pub(crate) fn workload(
    c: &mut Client,
    name: &str,
    image: &str,
    setup: &[String],
    runs: usize,
    fork_count: u32,
    dirty: Option<&str>,
) -> Result<WorkloadResult> {
    let id = match call(
        c,
        Request::CreateSandbox(SandboxSpec {
            image: image.into(),
            ..Default::default()
        }),
    )? {
        Response::Sandbox(s) => s.id,
        r => bail!("unexpected answer {r:?}"),
    };
    let result = (|| {
        for cmd in setup {
            exec(c, &id, cmd)?;
        }
        let (
            mut frozen,
            mut freeze,
            mut fs,
            mut dump,
            mut total,
            mut restore,
            mut criu_restore,
            mut bytes,
            mut snap,
            mut install,
        ) = (
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
        );
        let mut kept = 0;
        for k in 1..=runs as u64 {
            let req = CheckpointRequest {
                id: id.clone(),
                prefix: k,
                context: format!("context {k}").into_bytes(),
                fault: None,
            };
            let info = match call(c, Request::Checkpoint(req))? {
                Response::Checkpoint(i) => i,
                r => bail!("unexpected answer {r:?}"),
            };
            frozen.push(info.timings_ms.frozen_total);
            freeze.push(info.timings_ms.freeze);
            fs.push(info.timings_ms.fs_capture);
            snap.push(info.timings_ms.upper_snapshot);
            dump.push(info.timings_ms.criu_dump);
            total.push(info.timings_ms.total);
            bytes.push(info.bytes as f64);
            let r = match call(
                c,
                Request::Restore {
                    id: id.clone(),
                    verify: false,
                    prefix: None,
                },
            )? {
                Response::Restored(r) => r,
                r => bail!("unexpected answer {r:?}"),
            };
            restore.push(r.timings_ms.total);
            criu_restore.push(r.timings_ms.criu_restore);
            install.push(r.timings_ms.fs_install);
            kept += usize::from(r.inodes_kept);
        }
        if let Some(cmd) = dirty {
            exec(c, &id, cmd)?;
        }
        let req = CheckpointRequest {
            id: id.clone(),
            prefix: runs as u64 + 1,
            context: b"after dirtying".to_vec(),
            fault: None,
        };
        let second_bytes = match call(c, Request::Checkpoint(req))? {
            Response::Checkpoint(i) => i.bytes,
            r => bail!("unexpected answer {r:?}"),
        };
        let first_bytes = bytes.first().copied().unwrap_or(0.0) as u64;
        let second = SecondCheckpoint {
            first_bytes,
            second_bytes,
            percent: if first_bytes > 0 {
                second_bytes as f64 * 100.0 / first_bytes as f64
            } else {
                0.0
            },
            dirtied: dirty.is_some(),
        };
        let fork = (fork_count > 0)
            .then(|| crate::fork::fork_cycles(c, &id, fork_count, runs))
            .transpose()?;
        Ok(WorkloadResult {
            name: name.into(),
            runs,
            frozen_ms: median(&mut frozen),
            freeze_ms: median(&mut freeze),
            fs_capture_ms: median(&mut fs),
            upper_snapshot_ms: median(&mut snap),
            criu_dump_ms: median(&mut dump),
            checkpoint_ms: median(&mut total),
            restore_ms: median(&mut restore),
            fs_install_ms: median(&mut install),
            criu_restore_ms: median(&mut criu_restore),
            inodes_kept: kept,
            bytes: median(&mut bytes) as u64,
            fork,
            second,
        })
    })();
    let _ = call(c, Request::RemoveSandbox { id });
    result
}

/// Runs `belayer-bench checkpoint`; returns the exit code.
pub fn run(socket: &Path, args: CheckpointBenchArgs, json: bool) -> Result<i32> {
    let CheckpointBenchArgs {
        runs,
        busybox_rootfs,
        python_rootfs,
        python_mb,
    } = args;
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    let (mut c, _embedded) = connect_or_embed(socket)?;
    ensure_image(&mut c, "bench-busybox", &busybox_rootfs).context("busybox image")?;
    ensure_image(&mut c, "bench-python", &python_rootfs).context("python image")?;
    let mut results = Vec::new();
    results.push(workload(
        &mut c,
        "busybox-loop",
        "bench-busybox",
        &[
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done >/dev/null 2>&1 &"
                .into(),
        ],
        runs,
        0,
        None,
    )?);
    results.push(workload(
        &mut c,
        &format!("python3-{python_mb}MB"),
        "bench-python",
        &[
            format!("head -c {python_mb}M /dev/urandom > /root/data.bin"),
            format!(
                "python3 -c 'import time; b = bytearray(({python_mb} << 20)); \
                 b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1e9)' >/dev/null 2>&1 &"
            ),
            "sleep 0.5".into(),
        ],
        runs,
        0,
        None,
    )?);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "workloads": results }))?
        );
    } else {
        println!(
            "{:<16} {:>5} {:>10} {:>9} {:>10} {:>9} {:>10} {:>12} {:>11} {:>10} {:>13} {:>6} {:>12}",
            "workload",
            "runs",
            "frozen_ms",
            "freeze",
            "fs_capture",
            "snapshot",
            "criu_dump",
            "checkpoint",
            "restore_ms",
            "fs_install",
            "criu_restore",
            "inodes",
            "bytes"
        );
        for r in &results {
            println!(
                "{:<16} {:>5} {:>10.1} {:>9.1} {:>10.1} {:>9.1} {:>10.1} {:>12.1} {:>11.1} {:>10.1} {:>13.1} {:>6} {:>12}",
                r.name,
                r.runs,
                r.frozen_ms,
                r.freeze_ms,
                r.fs_capture_ms,
                r.upper_snapshot_ms,
                r.criu_dump_ms,
                r.checkpoint_ms,
                r.restore_ms,
                r.fs_install_ms,
                r.criu_restore_ms,
                format!("{}/{}", r.inodes_kept, r.runs),
                r.bytes
            );
        }
        println!("(medians; checkpoint = freeze + capture + snapshot + dump + publish incl. fsync; inodes: restores that kept inode numbers)");
    }
    Ok(0)
}
