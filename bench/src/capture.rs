//! `belayer-bench capture`: checkpoint/restore of the same workloads three ways, side by side
//! (paper, evaluation of the checkpoint path against hand-rolled and container baselines):
//!
//! - `belayer`: a Belayer sandbox, checkpointed and restored through the protocol (the daemon,
//!   or an agent embedded in this process when none answers);
//! - `tar_criu`: the sandbox a user would build without Belayer: `unshare` (pid, mount, net, uts,
//!   ipc namespaces) + an overlayfs root entered with `pivot_root`, in its own cgroup; checkpoint
//!   = freeze the cgroup, GNU `tar` of the upper dir, `criu dump --leave-running`, thaw, `sync -f`;
//!   restore = kill the tree, untar into a fresh upper dir, mount a fresh overlay, `criu restore`;
//! - `runc`: an OCI bundle whose rootfs is an overlay mount of the same image; checkpoint =
//!   `runc pause`, `tar` of the upper dir, `runc checkpoint --leave-running`, `runc resume`,
//!   `sync -f`; restore = `runc delete -f`, untar into a fresh upper dir, mount, `runc restore`.
//!
//! Workloads: `busybox-loop` (a shell loop writing a counter file), `python-venv` (a venv with a
//! few packages of many small `.py` files, a 50 MB data file, a python3 process that imports the
//! packages and sleeps) and `large` (a 500 MB upper layer and a python3 process holding 1 GiB).
//! Times are medians in milliseconds: `frozen_ms` (the workload cannot run), `checkpoint_ms`
//! (the whole checkpoint, fsync included) and `restore_ms` (from the kill of the old instance to
//! the restored instance running).

mod host;
mod incremental;
mod runc;
mod tar_criu;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use crate::checkpoint::{ensure_image, workload};
use crate::embedded::connect_or_embed;
use crate::{median, DEFAULT_BUSYBOX_ROOTFS, DEFAULT_PYTHON_ROOTFS};

/// Where CRIU is looked for when it is not on `PATH`.
pub const FALLBACK_CRIU: &str = "/usr/local/sbin/criu";

/// Arguments of `belayer-bench capture`.
#[derive(Debug, Clone, Args)]
pub struct CaptureArgs {
    /// Checkpoint/restore cycles per workload and system (medians reported).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Busybox rootfs (image `bench-busybox`, and the lower dir of the baselines).
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = DEFAULT_BUSYBOX_ROOTFS)]
    pub busybox_rootfs: PathBuf,
    /// Debian python3 rootfs (image `bench-python`, and the lower dir of the baselines).
    #[arg(long, env = "BELAYER_TEST_PYTHON_ROOTFS", default_value = DEFAULT_PYTHON_ROOTFS)]
    pub python_rootfs: PathBuf,
    /// Size of the data file of the `python-venv` workload, MiB.
    #[arg(long, default_value_t = 50)]
    pub python_data_mb: u64,
    /// Bytes of new files in the upper layer of the `large` workload, MiB.
    #[arg(long, default_value_t = 500)]
    pub large_upper_mb: u64,
    /// Memory held (and touched every 4 KiB) by the python3 process of `large`, MiB.
    #[arg(long, default_value_t = 1024)]
    pub large_rss_mb: u64,
    /// Leave out the `large` workload.
    #[arg(long)]
    pub skip_large: bool,
    /// Leave out the runc column (reported as null).
    #[arg(long)]
    pub skip_runc: bool,
    /// Directory for the baselines' upper dirs, bundles and checkpoint images (a disk, not tmpfs,
    /// like Belayer's state dir).
    #[arg(long, default_value = "/var/tmp")]
    pub work_dir: PathBuf,
    /// CRIU binary for the baselines (default: `criu` on PATH, else /usr/local/sbin/criu).
    #[arg(long, env = "BELAYER_CRIU")]
    pub criu: Option<PathBuf>,
    /// Children of Belayer's fork row (`fork` of each workload's sandbox; 0 leaves it out).
    #[arg(long, default_value_t = 8)]
    pub fork_count: u32,
}

/// One workload, identical for the three systems.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Name in the table.
    pub name: String,
    /// Belayer image name.
    pub image: &'static str,
    /// Image rootfs (lower dir of the baselines).
    pub rootfs: PathBuf,
    /// Shell commands run in order inside the sandbox (one `exec` each for Belayer, one init
    /// script for the baselines). Long-lived processes are started with `&` and redirect their
    /// output to `/dev/null`.
    pub setup: Vec<String>,
    /// Longest time the setup may take, seconds.
    pub setup_timeout_s: u64,
    /// A shell command that dirties 1% of the workload's memory and returns once it is done
    /// (Belayer's second-checkpoint column); `None`: the workload's own changes only.
    pub dirty: Option<String>,
}

/// A python3 program that holds `argv[1]` MiB, filled with random bytes (`argv[2]` =
/// `random`) or touched once per page (`touch`), imports the modules `argv[4..]`, writes its
/// pid to `/tmp/.py-pid` and then `/tmp/.py-ready`; on SIGUSR1 it writes 8 random bytes into
/// every `argv[3]`-th page of its buffer and then `/tmp/.dirtied`.
const HOLDER: &str = r#"import os, signal, sys, time
mb, fill, stride = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for m in sys.argv[4:]:
    __import__(m)
b = bytearray(os.urandom(mb << 20)) if fill == "random" else bytearray(mb << 20)
if fill != "random":
    b[::4096] = b"x" * len(b[::4096])
def dirty(*_):
    for i in range(0, len(b), 4096 * stride):
        b[i:i + 8] = os.urandom(8)
    open("/tmp/.dirtied", "w").close()
signal.signal(signal.SIGUSR1, dirty)
open("/tmp/.py-pid", "w").write(str(os.getpid()))
open("/tmp/.py-ready", "w").close()
time.sleep(1e9)
"#;

/// The shell command that writes [`HOLDER`] to `/root/hold.py`.
fn write_holder() -> String {
    format!("mkdir -p /root && cat > /root/hold.py <<'EOF'\n{HOLDER}EOF")
}

/// Medians of one system on one workload, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Medians {
    /// Median time the workload could not run.
    pub frozen_ms: f64,
    /// Median checkpoint total (fsync included).
    pub checkpoint_ms: f64,
    /// Median restore total.
    pub restore_ms: f64,
}

impl Medians {
    /// Medians of per-cycle samples `(frozen, checkpoint, restore)` in milliseconds.
    pub fn of(samples: &[Sample]) -> Medians {
        let mut f: Vec<f64> = samples.iter().map(|s| s.frozen_ms).collect();
        let mut c: Vec<f64> = samples.iter().map(|s| s.checkpoint_ms).collect();
        let mut r: Vec<f64> = samples.iter().map(|s| s.restore_ms).collect();
        Medians {
            frozen_ms: median(&mut f),
            checkpoint_ms: median(&mut c),
            restore_ms: median(&mut r),
        }
    }
}

/// One checkpoint + restore cycle of a baseline, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Freeze request until thaw done.
    pub frozen_ms: f64,
    /// Whole checkpoint, fsync included.
    pub checkpoint_ms: f64,
    /// Whole restore.
    pub restore_ms: f64,
}

/// Results of one workload.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadRow {
    /// Workload name.
    pub name: String,
    /// Belayer.
    pub belayer: Medians,
    /// unshare + overlayfs + tar + CRIU.
    pub tar_criu: Medians,
    /// runc (`None` when unavailable or failing on this host; see `runc_skipped`).
    pub runc: Option<Medians>,
    /// Why the runc column is empty.
    #[serde(skip)]
    pub runc_skipped: Option<String>,
    /// Belayer's fork ×N of the workload (null with `--fork-count 0`).
    pub fork: Option<crate::fork::ForkMedians>,
    /// Belayer's bytes of a checkpoint after 1% of the memory was dirtied, against the
    /// sandbox's first checkpoint.
    pub second: crate::checkpoint::SecondCheckpoint,
}

/// `num / den`, or `None` when `den` is not positive.
pub fn ratio(num: f64, den: f64) -> Option<f64> {
    (den > 0.0).then(|| num / den)
}

/// The `--json` document: `{"workloads": [...], "incremental": ...}`.
pub fn report_json(rows: &[WorkloadRow], incremental: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({ "workloads": rows, "incremental": incremental })
}

/// Full vs delta capture of one layer (`{"upper_bytes", "delta_bytes", "full_capture_ms",
/// "delta_capture_ms"}`), or null while not measured.
fn incremental(args: &CaptureArgs) -> Result<serde_json::Value> {
    let dir = args
        .work_dir
        .join(format!("belayer-bench-incremental-{}", std::process::id()));
    let result = incremental::run(&dir, args.large_upper_mb, args.runs)?;
    Ok(serde_json::to_value(result)?)
}

/// The workloads selected by `args`.
pub fn workloads(args: &CaptureArgs) -> Vec<Workload> {
    // Waits (at most 60 s) for a marker file written by a background python3 process once it
    // holds its memory, so that the checkpoint sees the whole resident set.
    let wait_for = |marker: &str| {
        format!(
            "n=0; while [ ! -e {marker} ]; do n=$((n+1)); [ $n -lt 600 ] || exit 1; \
             sleep 0.1; done"
        )
    };
    let mut list = vec![
        Workload {
            name: "busybox-loop".into(),
            image: "bench-busybox",
            rootfs: args.busybox_rootfs.clone(),
            setup: vec![
                "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done \
                 >/dev/null 2>&1 &"
                    .into(),
            ],
            setup_timeout_s: 60,
            dirty: None,
        },
        Workload {
            name: "python-venv".into(),
            image: "bench-python",
            rootfs: args.python_rootfs.clone(),
            setup: vec![
                // No network in sandboxes, and the image has no ensurepip: a venv without pip,
                // "installed" packages copied from the stdlib under new names (≈5 MB, ≈250
                // small files, plus the __pycache__ written by the first import).
                "python3 -m venv --without-pip /root/venv".into(),
                "SP=$(echo /root/venv/lib/python3*/site-packages) && \
                 L=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"stdlib\"])') && \
                 for p in email json http xml unittest asyncio logging concurrent urllib; do \
                 cp -r \"$L/$p\" \"$SP/benchpkg_$p\"; done"
                    .into(),
                format!(
                    "head -c {}M /dev/urandom > /root/data.bin",
                    args.python_data_mb
                ),
                write_holder(),
                // The packages imported, and 20 MiB of random bytes: ≈50 MB resident.
                "/root/venv/bin/python3 /root/hold.py 20 random 40 benchpkg_asyncio \
                 benchpkg_email.message benchpkg_json benchpkg_http.client \
                 benchpkg_xml.dom.minidom benchpkg_unittest benchpkg_logging.handlers \
                 benchpkg_concurrent.futures benchpkg_urllib.request >/dev/null 2>&1 &"
                    .into(),
                wait_for("/tmp/.py-ready"),
            ],
            setup_timeout_s: 300,
            // Every 40th page of the 20 MiB: 128 pages, 1% of ≈50 MB.
            dirty: Some(dirty_cmd(&wait_for("/tmp/.dirtied"))),
        },
    ];
    if !args.skip_large {
        let mut files = String::from("mkdir -p /root/large");
        let (mut left, mut i) = (args.large_upper_mb, 0);
        while left > 0 {
            let mb = left.min(50);
            files.push_str(&format!(
                " && head -c {mb}M /dev/urandom > /root/large/f{i}"
            ));
            left -= mb;
            i += 1;
        }
        list.push(Workload {
            name: format!("large-{}MB-{}MB", args.large_upper_mb, args.large_rss_mb),
            image: "bench-python",
            rootfs: args.python_rootfs.clone(),
            setup: vec![
                files,
                write_holder(),
                format!(
                    "python3 /root/hold.py {} touch 100 >/dev/null 2>&1 &",
                    args.large_rss_mb
                ),
                wait_for("/tmp/.py-ready"),
            ],
            setup_timeout_s: 900,
            // Every 100th page: 1%.
            dirty: Some(dirty_cmd(&wait_for("/tmp/.dirtied"))),
        });
    }
    list
}

/// Signals the [`HOLDER`] to dirty its pages, then waits (`wait`) for it to be done.
fn dirty_cmd(wait: &str) -> String {
    format!("rm -f /tmp/.dirtied && kill -USR1 \"$(cat /tmp/.py-pid)\" && {wait}")
}

/// The CRIU binary: `--criu`, else `criu` on PATH, else [`FALLBACK_CRIU`].
fn criu_path(args: &CaptureArgs) -> Result<PathBuf> {
    if let Some(p) = &args.criu {
        return Ok(p.clone());
    }
    if let Some(p) = host::find_on_path("criu") {
        return Ok(p);
    }
    let p = PathBuf::from(FALLBACK_CRIU);
    if p.is_file() {
        return Ok(p);
    }
    bail!("criu not found on PATH nor at {FALLBACK_CRIU}")
}

/// Runs the benchmark; returns the exit code.
pub fn run(socket: &Path, args: &CaptureArgs, json: bool) -> Result<i32> {
    if args.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let criu = criu_path(args)?;
    let runc_bin = if args.skip_runc {
        Err("skipped (--skip-runc)".to_string())
    } else {
        host::find_on_path("runc").ok_or_else(|| {
            "runc not found on PATH (Debian package runc; scripts/setup.sh installs it)".to_string()
        })
    };
    let list = workloads(args);
    let (mut c, _embedded) = connect_or_embed(socket)?;
    ensure_image(&mut c, "bench-busybox", &args.busybox_rootfs).context("busybox image")?;
    ensure_image(&mut c, "bench-python", &args.python_rootfs).context("python image")?;
    let mut rows = Vec::new();
    for w in &list {
        tracing::info!(workload = %w.name, "belayer");
        let b = workload(
            &mut c,
            &w.name,
            w.image,
            &w.setup,
            args.runs,
            args.fork_count,
            w.dirty.as_deref(),
        )
        .with_context(|| format!("belayer on {}", w.name))?;
        let belayer = Medians {
            frozen_ms: b.frozen_ms,
            checkpoint_ms: b.checkpoint_ms,
            restore_ms: b.restore_ms,
        };
        tracing::info!(workload = %w.name, "tar_criu");
        let samples = tar_criu::bench(w, &args.work_dir, &criu, args.runs)
            .with_context(|| format!("tar_criu on {}", w.name))?;
        let tar_criu = Medians::of(&samples);
        let (runc, runc_skipped) = match &runc_bin {
            Err(why) => (None, Some(why.clone())),
            Ok(bin) => {
                tracing::info!(workload = %w.name, "runc");
                match runc::bench(w, &args.work_dir, bin, &criu, args.runs) {
                    Ok(s) => (Some(Medians::of(&s)), None),
                    Err(e) => (None, Some(format!("{:#}", anyhow::Error::from(e)))),
                }
            }
        };
        rows.push(WorkloadRow {
            name: w.name.clone(),
            belayer,
            tar_criu,
            runc,
            runc_skipped,
            fork: b.fork,
            second: b.second,
        });
    }
    let inc = incremental(args)?;
    if json {
        for why in distinct_reasons(&rows) {
            eprintln!("runc: null: {why}");
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&report_json(&rows, &inc))?
        );
    } else {
        print_table(&rows, &inc, args.runs);
    }
    Ok(0)
}

/// The reasons of empty runc columns, each once, in order.
fn distinct_reasons(rows: &[WorkloadRow]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for why in rows.iter().filter_map(|r| r.runc_skipped.as_ref()) {
        if !out.contains(why) {
            out.push(why.clone());
        }
    }
    out
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.1}x"))
}

fn print_table(rows: &[WorkloadRow], inc: &serde_json::Value, runs: usize) {
    println!(
        "{:<22} {:<9} {:>10} {:>14} {:>11} {:>9} {:>10}",
        "workload", "system", "frozen_ms", "checkpoint_ms", "restore_ms", "frozen/b", "restore/b"
    );
    for r in rows {
        let b = r.belayer;
        let line = |name: &str, system: &str, m: Option<Medians>, ratios: bool| match m {
            Some(m) => println!(
                "{:<22} {:<9} {:>10.1} {:>14.1} {:>11.1} {:>9} {:>10}",
                name,
                system,
                m.frozen_ms,
                m.checkpoint_ms,
                m.restore_ms,
                if ratios {
                    fmt_ratio(ratio(m.frozen_ms, b.frozen_ms))
                } else {
                    String::new()
                },
                if ratios {
                    fmt_ratio(ratio(m.restore_ms, b.restore_ms))
                } else {
                    String::new()
                },
            ),
            None => println!(
                "{:<22} {:<9} {:>10} {:>14} {:>11} {:>9} {:>10}",
                name, system, "null", "null", "null", "-", "-"
            ),
        };
        line(&r.name, "belayer", Some(b), false);
        line("", "tar_criu", Some(r.tar_criu), true);
        line("", "runc", r.runc, true);
        println!(
            "{:<22} 2nd checkpoint{}: {} bytes = {:.1}% of the 1st ({} bytes)",
            "",
            if r.second.dirtied {
                " after 1% memory dirtied"
            } else {
                ""
            },
            r.second.second_bytes,
            r.second.percent,
            r.second.first_bytes
        );
        if let Some(f) = r.fork {
            println!(
                "{:<22} fork x{}: all running in {:.1} ms (client {:.1} ms; each child's restore {:.1} ms)",
                "", f.count, f.total_ms, f.wall_ms, f.child_restore_ms
            );
        }
    }
    println!(
        "(medians of {runs} cycles; frozen/b and restore/b = the system's time / Belayer's time; \
         checkpoint includes fsync)"
    );
    for why in distinct_reasons(rows) {
        println!("runc: null: {why}");
    }
    if let Some(obj) = inc.as_object() {
        let fields: Vec<String> = obj.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("incremental: {}", fields.join(" "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(f: f64, c: f64, r: f64) -> Medians {
        Medians {
            frozen_ms: f,
            checkpoint_ms: c,
            restore_ms: r,
        }
    }

    #[test]
    fn medians_and_ratios() {
        let s = |f, c, r| Sample {
            frozen_ms: f,
            checkpoint_ms: c,
            restore_ms: r,
        };
        let got = Medians::of(&[s(3.0, 30.0, 7.0), s(1.0, 10.0, 9.0), s(2.0, 20.0, 8.0)]);
        assert_eq!(got, m(2.0, 20.0, 8.0));
        assert_eq!(Medians::of(&[]), m(0.0, 0.0, 0.0));
        assert_eq!(ratio(300.0, 30.0), Some(10.0));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(fmt_ratio(ratio(5.0, 2.0)), "2.5x");
    }

    #[test]
    fn json_shape() {
        let rows = vec![
            WorkloadRow {
                name: "w1".into(),
                belayer: m(1.0, 2.0, 3.0),
                tar_criu: m(4.0, 5.0, 6.0),
                runc: Some(m(7.0, 8.0, 9.0)),
                runc_skipped: None,
                fork: Some(crate::fork::ForkMedians {
                    count: 8,
                    runs: 1,
                    total_ms: 100.0,
                    wall_ms: 101.0,
                    child_restore_ms: 50.0,
                }),
                second: crate::checkpoint::SecondCheckpoint {
                    first_bytes: 1000,
                    second_bytes: 20,
                    percent: 2.0,
                    dirtied: true,
                },
            },
            WorkloadRow {
                name: "w2".into(),
                belayer: m(1.0, 2.0, 3.0),
                tar_criu: m(4.0, 5.0, 6.0),
                runc: None,
                runc_skipped: Some("runc not found".into()),
                fork: None,
                second: crate::checkpoint::SecondCheckpoint {
                    first_bytes: 1000,
                    second_bytes: 10,
                    percent: 1.0,
                    dirtied: false,
                },
            },
        ];
        let v = report_json(&rows, &serde_json::Value::Null);
        let keys = |v: &serde_json::Value| {
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        assert_eq!(keys(&v), ["incremental", "workloads"]);
        assert!(v["incremental"].is_null());
        let w = &v["workloads"];
        assert_eq!(w.as_array().unwrap().len(), 2);
        assert_eq!(
            keys(&w[0]),
            ["belayer", "fork", "name", "runc", "second", "tar_criu"]
        );
        assert_eq!(w[0]["second"]["percent"], 2.0);
        assert_eq!(w[0]["fork"]["total_ms"], 100.0);
        assert!(w[1]["fork"].is_null());
        for sys in ["belayer", "tar_criu", "runc"] {
            assert_eq!(
                keys(&w[0][sys]),
                ["checkpoint_ms", "frozen_ms", "restore_ms"]
            );
        }
        assert_eq!(w[0]["runc"]["restore_ms"], 9.0);
        assert_eq!(w[0]["name"], "w1");
        assert!(w[1]["runc"].is_null());
        assert_eq!(distinct_reasons(&rows), ["runc not found"]);
    }
}
