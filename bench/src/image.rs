//! `belayer-bench image`: OCI images from a real local registry, Belayer side by side with the
//! standard tools, in one run.
//!
//! The benchmark builds two images of the same content with `umoci` and pushes them with
//! `skopeo` into Debian's `docker-registry` on a loopback port (the test harness's
//! [`TestRegistry`] and [`OciBuilder`]):
//!
//! - **multi**: the busybox test rootfs as its first layer, then `--layers − 1` layers of
//!   incompressible files (`--total-mb` MB in all, 8 MiB per file), gzip-compressed as umoci
//!   writes them;
//! - **flat**: the same merged tree as one layer.
//!
//! Rows (each timed `--runs` times, median reported):
//!
//! - `belayer_pull`: `Request::PullImage` of multi into a `belayerd` started by the benchmark
//!   (manifest, every blob streamed, both digests checked, the hardened unpack into the layer
//!   store, `syncfs` and the atomic publication), then `image rm` (untimed) drops its layers;
//! - `skopeo_umoci` (the baseline): `skopeo copy docker://… oci:DIR` then `umoci unpack` of the
//!   same image into a bundle, and `skopeo_umoci_sync`: the same plus a `sync` so that its
//!   bytes are on disk as Belayer's are when its pull returns;
//! - `create_multi` / `create_flat`: `CreateSandbox` from the pulled multi (a stack of
//!   `--layers` overlay lower layers) and flat (one lower layer) images, `--create-runs` times
//!   each, alternating, each sandbox removed (untimed) before the next.
//!
//! MB/s is the image's uncompressed content over the row's median time.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use belayer_ipc::{Client, PullRequest, RegistryCredentials, Request, Response, SandboxSpec};
use belayer_tests::oci_build::{layer_tar, Member, OciBuilder};
use belayer_tests::registry::TestRegistry;
use clap::Args;
use serde::Serialize;

use crate::load::daemon::Supervised;
use crate::{median, DEFAULT_BUSYBOX_ROOTFS};

/// Bytes of each data file of the multi-layer image.
const FILE_BYTES: usize = 8 << 20;

/// Arguments of `belayer-bench image`.
#[derive(Debug, Args)]
pub struct ImageBenchArgs {
    /// Content of the data layers together, MB (10^6 bytes).
    #[arg(long, default_value_t = 500)]
    pub total_mb: u64,
    /// Layers of the multi-layer image (the busybox base and the data layers).
    #[arg(long, default_value_t = 20)]
    pub layers: usize,
    /// Timed pulls per row.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Timed creates per image.
    #[arg(long, default_value_t = 10)]
    pub create_runs: usize,
    /// Busybox rootfs of the base layer.
    #[arg(long, env = "BELAYER_TEST_BUSYBOX_ROOTFS", default_value = DEFAULT_BUSYBOX_ROOTFS)]
    pub busybox_rootfs: PathBuf,
    /// The `belayerd` binary (default: the one next to this executable).
    #[arg(long)]
    pub belayerd: Option<PathBuf>,
    /// Scratch directory (layouts, bundles, the daemon's state); default: a temp dir in
    /// /var/tmp.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
}

/// One timed row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// Key of the row (see the module docs).
    pub name: &'static str,
    /// Median, seconds.
    pub median_s: f64,
    /// Every run, seconds.
    pub runs_s: Vec<f64>,
    /// Uncompressed content over the median, MB/s (pull rows only).
    pub mb_per_s: Option<f64>,
    /// The row's median over the baseline's (`skopeo_umoci` for pulls, `create_flat` for
    /// creates).
    pub ratio: f64,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct ImageBench {
    /// Layers of the multi-layer image.
    pub layers: usize,
    /// Uncompressed content of the multi-layer image as Belayer stored it, bytes.
    pub content_bytes: u64,
    /// Bytes of the multi-layer image's blobs (gzip layers, config, manifest) in its layout.
    pub compressed_bytes: u64,
    /// Pull rows, then create rows.
    pub rows: Vec<Row>,
}

/// splitmix64: fast incompressible filler (not for secrets).
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed;
    for chunk in buf.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let bytes = z.to_le_bytes();
        chunk.copy_from_slice(&bytes[..chunk.len()]);
    }
}

/// The multi-layer image in `layout:multi`: busybox, then data layers of `per_layer` bytes.
fn build_multi(work: &Path, layers: usize, total: u64) -> Result<OciBuilder> {
    let mut b = OciBuilder::new(&work.join("layout"), "multi", &work.join("scratch"));
    b.busybox_layer();
    let data_layers = layers.saturating_sub(1).max(1);
    let per_layer = (total / data_layers as u64) as usize;
    let mut buf = vec![0u8; FILE_BYTES];
    for l in 0..data_layers {
        let dir = format!("data/l{l:03}");
        let names: Vec<String> = (0..per_layer.div_ceil(FILE_BYTES))
            .map(|f| format!("{dir}/f{f:03}"))
            .collect();
        let mut contents = Vec::with_capacity(names.len());
        let mut left = per_layer;
        for (f, _) in names.iter().enumerate() {
            let n = left.min(FILE_BYTES);
            fill(&mut buf[..n], (l * 1000 + f) as u64 + 1);
            contents.push(buf[..n].to_vec());
            left -= n;
        }
        let mut members = vec![Member::Dir("data"), Member::Dir(&dir)];
        for (name, bytes) in names.iter().zip(&contents) {
            members.push(Member::File(name, bytes));
        }
        b.raw_layer(&layer_tar(&members));
        eprintln!("image: layer {}/{} built", l + 2, data_layers + 1);
    }
    Ok(b)
}

/// The same merged tree as one layer, in `layout:flat`.
fn build_flat(work: &Path, multi: &OciBuilder) -> OciBuilder {
    let unpacked = multi.unpack(&work.join("multi-bundle"));
    let mut flat = OciBuilder::new(&work.join("layout"), "flat", &work.join("scratch"));
    flat.layer(|root| {
        belayer_tests::oci_build::run(
            Command::new("cp")
                .arg("-a")
                .arg(format!("{}/.", unpacked.display()))
                .arg(root),
        );
    });
    let _ = std::fs::remove_dir_all(work.join("multi-bundle"));
    flat
}

fn du_bytes(dir: &Path) -> u64 {
    walk_bytes(dir).unwrap_or(0)
}

fn walk_bytes(dir: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let meta = e.metadata()?;
        total += if meta.is_dir() {
            walk_bytes(&e.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn pull(c: &mut Client, reference: &str, name: &str) -> Result<belayer_ipc::ImageInfo> {
    let req = PullRequest {
        reference: reference.to_string(),
        name: Some(name.to_string()),
        credentials: RegistryCredentials::Anonymous,
        insecure: false,
    };
    match c.call(Request::PullImage(req))? {
        Response::Image(info) => Ok(info),
        r => bail!("pull {reference}: {r:?}"),
    }
}

fn call_ok(c: &mut Client, req: Request, what: &str) -> Result<Response> {
    match c.call(req)? {
        Response::Error(e) => bail!("{what}: {e:?}"),
        r => Ok(r),
    }
}

fn timed(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

fn sh(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn row(name: &'static str, runs: Vec<f64>, mb: Option<f64>) -> Row {
    let median_s = median(&mut runs.clone());
    Row {
        name,
        median_s,
        runs_s: runs,
        mb_per_s: mb.map(|mb| mb / median_s.max(1e-9)),
        ratio: 1.0,
    }
}

/// Runs the benchmark; returns the exit code.
pub fn run(args: &ImageBenchArgs, json: bool) -> Result<i32> {
    if args.runs == 0 || args.create_runs == 0 || args.layers < 2 {
        bail!("--runs and --create-runs must be ≥ 1 and --layers ≥ 2");
    }
    if !args.busybox_rootfs.is_dir() {
        bail!(
            "{} missing: run scripts/setup.sh",
            args.busybox_rootfs.display()
        );
    }
    std::env::set_var("BELAYER_TEST_BUSYBOX_ROOTFS", &args.busybox_rootfs);
    let scratch = tempfile::Builder::new()
        .prefix("belayer-bench-image-")
        .tempdir_in(args.work_dir.as_deref().unwrap_or(Path::new("/var/tmp")))
        .context("scratch dir")?;
    let work = scratch.path();
    let total = args.total_mb * 1_000_000;
    let multi = build_multi(work, args.layers, total)?;
    let compressed_bytes = du_bytes(&work.join("layout/blobs"));
    let flat = build_flat(work, &multi);
    let registry = TestRegistry::start();
    let multi_ref = multi.push(&registry, "bench/multi:latest");
    let flat_ref = flat.push(&registry, "bench/flat:latest");
    eprintln!("image: pushed {multi_ref} and {flat_ref}");
    let belayerd = match &args.belayerd {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("belayerd"),
    };
    // The daemon's state and the baseline's copies on the same file system (the state dir's:
    // btrfs with quotas where scripts/setup.sh made it).
    let state = belayer_daemon::config::scratch_state_dir("bench-image");
    std::fs::create_dir_all(&state).with_context(|| format!("creating {}", state.display()))?;
    let result = measure(args, &belayerd, &state, &multi_ref, &flat_ref);
    let _ = belayer_overlay::remove_dir_all(&state);
    let (content_bytes, rows) = result?;
    let report = ImageBench {
        layers: args.layers,
        content_bytes,
        compressed_bytes,
        rows,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(0)
}

/// The timed rows, against a daemon whose state is in `state` (baseline copies there too).
fn measure(
    args: &ImageBenchArgs,
    belayerd: &Path,
    state: &Path,
    multi_ref: &str,
    flat_ref: &str,
) -> Result<(u64, Vec<Row>)> {
    let work = state;
    let daemon_dir = state.join("daemon");
    std::fs::create_dir_all(&daemon_dir)?;
    let daemon = Supervised::start(belayerd, &daemon_dir)?;
    let mut c = Client::connect(&daemon.socket)?;

    let mut content_bytes = 0;
    let mut belayer_runs = Vec::new();
    let mut baseline_runs = Vec::new();
    let mut synced_runs = Vec::new();
    for r in 0..args.runs {
        let t = Instant::now();
        let info = pull(&mut c, multi_ref, "bench-multi")?;
        belayer_runs.push(t.elapsed().as_secs_f64());
        content_bytes = info.bytes;
        call_ok(
            &mut c,
            Request::RemoveImage {
                name: "bench-multi".into(),
            },
            "image rm",
        )?;
        let dir = work.join(format!("copy-{r}"));
        let bundle = work.join(format!("bundle-{r}"));
        let copy = timed(|| {
            sh(Command::new("skopeo")
                .args(["copy", "--quiet", "--src-tls-verify=false"])
                .arg(format!("docker://{multi_ref}"))
                .arg(format!("oci:{}:latest", dir.display())))?;
            sh(Command::new("umoci")
                .args(["unpack", "--image"])
                .arg(format!("{}:latest", dir.display()))
                .arg(&bundle))
        })?;
        let synced = copy + timed(|| sh(&mut Command::new("sync")))?;
        baseline_runs.push(copy);
        synced_runs.push(synced);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&bundle);
        eprintln!(
            "image: run {}: belayer {:.2} s, skopeo+umoci {copy:.2} s (+sync {synced:.2} s)",
            r + 1,
            belayer_runs[r]
        );
    }
    let mb = content_bytes as f64 / 1e6;
    let mut rows = vec![
        row("belayer_pull", belayer_runs, Some(mb)),
        row("skopeo_umoci", baseline_runs, Some(mb)),
        row("skopeo_umoci_sync", synced_runs, Some(mb)),
    ];
    let base = rows[1].median_s;
    for r in &mut rows {
        r.ratio = r.median_s / base.max(1e-9);
    }

    pull(&mut c, multi_ref, "bench-multi")?;
    pull(&mut c, flat_ref, "bench-flat")?;
    let (mut multi_runs, mut flat_runs) = (Vec::new(), Vec::new());
    for _ in 0..args.create_runs {
        for (image, runs) in [
            ("bench-multi", &mut multi_runs),
            ("bench-flat", &mut flat_runs),
        ] {
            let t = Instant::now();
            let made = call_ok(
                &mut c,
                Request::CreateSandbox(SandboxSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                "create",
            )?;
            runs.push(t.elapsed().as_secs_f64());
            let Response::Sandbox(info) = made else {
                bail!("create {image}: {made:?}");
            };
            call_ok(&mut c, Request::RemoveSandbox { id: info.id }, "remove")?;
        }
    }
    let mut creates = vec![
        row("create_multi", multi_runs, None),
        row("create_flat", flat_runs, None),
    ];
    let base = creates[1].median_s;
    for r in &mut creates {
        r.ratio = r.median_s / base.max(1e-9);
    }
    rows.extend(creates);
    drop(daemon);
    Ok((content_bytes, rows))
}

fn print_table(r: &ImageBench) {
    println!(
        "image: {} layers, {:.0} MB content, {:.0} MB of compressed blobs",
        r.layers,
        r.content_bytes as f64 / 1e6,
        r.compressed_bytes as f64 / 1e6
    );
    println!(
        "{:<20} {:>10} {:>10} {:>8}  runs (s)",
        "row", "median s", "MB/s", "ratio"
    );
    for row in &r.rows {
        let runs: Vec<String> = row.runs_s.iter().map(|s| format!("{s:.3}")).collect();
        println!(
            "{:<20} {:>10.3} {:>10} {:>8.2}  {}",
            row.name,
            row.median_s,
            row.mb_per_s
                .map(|m| format!("{m:.0}"))
                .unwrap_or_else(|| "-".into()),
            row.ratio,
            runs.join(" ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_is_incompressible_enough_and_deterministic() {
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        fill(&mut a, 7);
        fill(&mut b, 7);
        assert_eq!(a, b);
        fill(&mut b, 8);
        assert_ne!(a, b);
        let distinct: std::collections::HashSet<u8> = a.iter().copied().collect();
        assert!(distinct.len() > 200);
    }
}
