//! `belayer-bench memory`: attach, unmap and remap timings against real memory-server
//! processes.
//!
//! For every layout size, a weights server is started as a child process (`belayer-memd`,
//! installed next to `belayer-bench`); the bench process writes a pattern at the start, middle
//! and end of every region through an exclusive attachment, then repeats: attach read-only
//! (request, descriptor receipt by `SCM_RIGHTS`, mapping), verify the pattern (first run),
//! unmap one region keeping its address, remap it, detach. With `--kv BYTES` a KV server with
//! an arena of that size is started too and its flush is timed. Medians are printed.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use belayer_ipc::memory::{AttachRequest, Backend, Layout, LeaseMode, MemClient, Role};
use clap::Args;
use serde::Serialize;

use crate::median;
use belayer_ipc::parse_bytes;
use belayer_workers::memory::process::ServerProcess;

/// Arguments of `belayer-bench memory`.
#[derive(Debug, Args)]
pub struct MemoryBenchArgs {
    /// Weights layout sizes, comma separated (suffixes K, M, G).
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes, default_value = "1G,8G,64G")]
    pub sizes: Vec<u64>,
    /// Regions per layout (the size is split evenly).
    #[arg(long, default_value_t = 1)]
    pub regions: u64,
    /// Attach/unmap/remap/detach cycles per size (medians reported).
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Where the memory lives: `host` or `cuda:N`.
    #[arg(long, default_value = "host", value_parser = belayer_workers::memory::parse_device)]
    pub device: Backend,
    /// Also start a KV server whose arena has this many bytes, and time its flush (0: none).
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub kv: u64,
}

/// Timings of one layout size, milliseconds (medians over the runs).
#[derive(Debug, Clone, Serialize)]
pub struct MemoryBenchResult {
    /// Role of the server measured.
    pub role: String,
    /// Layout size asked for, bytes.
    pub bytes: u64,
    /// Regions in the layout.
    pub regions: u64,
    /// Cycles measured.
    pub runs: usize,
    /// Server start to ready (allocation included).
    pub startup_ms: f64,
    /// Attach: request, descriptors received, every region mapped.
    pub attach_ms: f64,
    /// Unmap of one region (address kept).
    pub unmap_ms: f64,
    /// Remap of that region at the same address.
    pub remap_ms: f64,
    /// Detach (leases released, mapping dropped).
    pub detach_ms: f64,
    /// Server-side flush of the KV arena (KV rows only).
    pub flush_ms: Option<f64>,
    /// Whether every pattern read back intact.
    pub verified: bool,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// The pattern written at `offset` of region `index`: 32 bytes that name both.
fn pattern(index: usize, offset: u64) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    let text = format!("r{index}@{offset:x}");
    bytes[..text.len().min(32)].copy_from_slice(&text.as_bytes()[..text.len().min(32)]);
    bytes[31] = 0xA5;
    bytes
}

fn offsets(size: u64) -> [u64; 3] {
    [0, (size / 2) & !31, size.saturating_sub(32)]
}

fn measure(
    exe: &Path,
    dir: &Path,
    role: Role,
    args: &MemoryBenchArgs,
    bytes: u64,
) -> Result<MemoryBenchResult> {
    let (text, regions) = match role {
        Role::Weights => {
            ensure!(args.regions > 0, "--regions must be at least 1");
            let each = (bytes / args.regions).max(64);
            let text: String = (0..args.regions)
                .map(|i| format!("[[region]]\nname = \"w{i}\"\nsize = {each}\n"))
                .collect();
            (text, args.regions)
        }
        Role::Kv => {
            let block = 2u64 << 20;
            let blocks = bytes.div_ceil(block).max(1);
            (
                format!("[kv]\nblock_size = {block}\nblock_count = {blocks}\n"),
                1,
            )
        }
    };
    let layout = Layout::from_toml(&text)?;
    let layout_path = dir.join(format!("{role}-{bytes}.toml"));
    std::fs::write(&layout_path, &text)?;
    let socket = dir.join(format!("{role}-{bytes}.sock"));
    let server = ServerProcess::spawn(exe, role, args.device, &layout_path, &socket, &[])
        .with_context(|| format!("starting a {role} server of {bytes} bytes"))?;
    let startup_ms = server.startup().as_secs_f64() * 1e3;

    let mut writer = MemClient::connect(&socket)?;
    let mut mapping = writer.attach_layout("bench-writer", &layout, LeaseMode::Exclusive)?;
    let regions_desc = mapping.info().regions.clone();
    for (index, region) in regions_desc.iter().enumerate() {
        for offset in offsets(region.size) {
            mapping.write(&region.name, offset, &pattern(index, offset))?;
        }
    }
    let mut flush_ms = None;
    if role == Role::Kv {
        writer.detach(mapping)?;
        let started = Instant::now();
        writer.flush(&regions_desc[0].name)?;
        flush_ms = Some(ms(started));
        // Write the pattern again for the readers.
        let mut again = writer.attach_layout("bench-writer", &layout, LeaseMode::Exclusive)?;
        for offset in offsets(regions_desc[0].size) {
            again.write(&regions_desc[0].name, offset, &pattern(0, offset))?;
        }
        writer.detach(again)?;
    } else {
        writer.bump_version()?;
        writer.detach(mapping)?;
    }
    drop(writer);

    let mut client = MemClient::connect(&socket)?;
    let (mut attach, mut unmap, mut remap, mut detach) = (vec![], vec![], vec![], vec![]);
    let mut verified = true;
    let first = regions_desc[0].name.clone();
    for run in 0..args.runs {
        let started = Instant::now();
        let mut mapping = client.attach(AttachRequest {
            worker: "bench-reader".to_owned(),
            layout_hash: layout.hash(),
            mode: LeaseMode::Read,
            regions: Vec::new(),
        })?;
        attach.push(ms(started));
        if run == 0 {
            for (index, region) in regions_desc.iter().enumerate() {
                for offset in offsets(region.size) {
                    let mut buf = [0u8; 32];
                    mapping.read(&region.name, offset, &mut buf)?;
                    verified &= buf == pattern(index, offset);
                }
            }
        }
        let addr = mapping.addr(&first)?;
        let started = Instant::now();
        let unmapped = mapping.unmap(&first)?;
        unmap.push(ms(started));
        let started = Instant::now();
        let remapped = mapping.remap(&first)?;
        remap.push(ms(started));
        if unmapped != addr || remapped != addr {
            bail!("remap moved region {first} from {addr:#x} to {remapped:#x}");
        }
        let started = Instant::now();
        client.detach(mapping)?;
        detach.push(ms(started));
    }
    drop(client);
    server.stop()?;
    Ok(MemoryBenchResult {
        role: role.to_string(),
        bytes,
        regions,
        runs: args.runs,
        startup_ms,
        attach_ms: median(&mut attach),
        unmap_ms: median(&mut unmap),
        remap_ms: median(&mut remap),
        detach_ms: median(&mut detach),
        flush_ms,
        verified,
    })
}

/// Runs the benchmark; returns the exit code (1 when a pattern did not read back intact).
pub fn run(args: &MemoryBenchArgs, json: bool) -> Result<i32> {
    ensure!(args.runs > 0, "--runs must be at least 1");
    let exe = belayer_workers::bin_dir()
        .context("locating the Belayer binaries")?
        .join(belayer_workers::MEMD_BIN);
    let dir = tempfile_dir()?;
    let mut results = Vec::new();
    for &bytes in &args.sizes {
        results.push(measure(&exe, dir.path(), Role::Weights, args, bytes)?);
    }
    if args.kv > 0 {
        results.push(measure(&exe, dir.path(), Role::Kv, args, args.kv)?);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "device": args.device.to_string(),
                "results": results,
            }))?
        );
    } else {
        println!("device {}", args.device);
        println!(
            "{:<8} {:>14} {:>7} {:>5} {:>11} {:>10} {:>9} {:>9} {:>10} {:>9} {:>8}",
            "role",
            "bytes",
            "regions",
            "runs",
            "startup_ms",
            "attach_ms",
            "unmap_ms",
            "remap_ms",
            "detach_ms",
            "flush_ms",
            "verified"
        );
        for r in &results {
            println!(
                "{:<8} {:>14} {:>7} {:>5} {:>11.3} {:>10.3} {:>9.3} {:>9.3} {:>10.3} {:>9} {:>8}",
                r.role,
                r.bytes,
                r.regions,
                r.runs,
                r.startup_ms,
                r.attach_ms,
                r.unmap_ms,
                r.remap_ms,
                r.detach_ms,
                r.flush_ms.map_or("-".to_owned(), |f| format!("{f:.3}")),
                r.verified
            );
        }
        println!("(medians; attach = request + fd receipt + mapping of every region)");
    }
    Ok(if results.iter().all(|r| r.verified) {
        0
    } else {
        1
    })
}

/// A private temporary directory for layouts and sockets (removed on drop).
fn tempfile_dir() -> Result<TempDir> {
    let base = std::env::temp_dir().join(format!("belayer-bench-memory-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok(TempDir(base))
}

/// A directory removed on drop.
#[derive(Debug)]
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_differ_by_region_and_offset() {
        assert_ne!(pattern(0, 0), pattern(1, 0));
        assert_ne!(pattern(0, 0), pattern(0, 32));
        assert_eq!(offsets(1 << 30), [0, 1 << 29, (1 << 30) - 32]);
        assert_eq!(offsets(100), [0, 32, 68]);
    }
}
