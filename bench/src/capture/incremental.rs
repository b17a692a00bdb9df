//! The incremental part of `belayer-bench capture`: full vs delta capture of one large upper
//! layer with the overlay crate's layer capture (the file-system half of a checkpoint's frozen
//! window, without CRIU).
//!
//! The layer: `upper_mb` MiB in 50 MiB files of random bytes plus 2 000 small files. A full
//! capture (no base, empty blob store) is timed against a delta capture after a 1 MiB change
//! (one new 1 MiB file) with the previous manifest as base. Each run uses a fresh store for the
//! full capture and a new 1 MiB file for the delta.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use belayer_overlay::layer::{capture_layer, BlobStore, LayerCaptureOptions, LayerManifest};
use serde::Serialize;

use crate::median;

/// Medians of the incremental measurement (the `incremental` object of `--json`).
#[derive(Debug, Clone, Serialize)]
pub struct IncrementalResult {
    /// Data bytes of the layer.
    pub upper_bytes: u64,
    /// Bytes the delta capture read (the change).
    pub delta_bytes: u64,
    /// Full capture, frozen part (walk + reads), ms.
    pub full_capture_ms: f64,
    /// Delta capture, frozen part, ms.
    pub delta_capture_ms: f64,
    /// Full capture, after-thaw part (hashing staged files, storing blobs, fsync), ms.
    pub full_seal_ms: f64,
    /// Delta capture, after-thaw part, ms.
    pub delta_seal_ms: f64,
    /// Entries in the layer.
    pub entries: u64,
    /// Runs (medians over them).
    pub runs: usize,
}

fn write_random(path: &Path, bytes: usize, seed: u64) -> Result<()> {
    let mut f =
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    let mut state = seed | 1;
    let mut block = vec![0u8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        for chunk in block.chunks_exact_mut(8) {
            // xorshift64: incompressible bytes without a random-number dependency.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        let n = left.min(block.len());
        f.write_all(&block[..n])?;
        left -= n;
    }
    Ok(())
}

/// Builds the layer under `dir/upper`, measures, removes everything.
pub fn run(dir: &Path, upper_mb: u64, runs: usize) -> Result<IncrementalResult> {
    let _ = std::fs::remove_dir_all(dir);
    let upper = dir.join("upper");
    std::fs::create_dir_all(upper.join("small")).context("create the bench layer")?;
    let result = measure(dir, &upper, upper_mb, runs);
    let _ = std::fs::remove_dir_all(dir);
    result
}

fn measure(dir: &Path, upper: &Path, upper_mb: u64, runs: usize) -> Result<IncrementalResult> {
    let file_mb = 50u64;
    let files = upper_mb.div_ceil(file_mb).max(1);
    for i in 0..files {
        let mb = file_mb.min(upper_mb - i * file_mb);
        write_random(
            &upper.join(format!("big-{i}.bin")),
            (mb << 20) as usize,
            i + 7,
        )?;
    }
    for i in 0..2000u64 {
        std::fs::write(
            upper.join("small").join(format!("f{i}.py")),
            format!("x = {i}\n"),
        )?;
    }
    let opts = LayerCaptureOptions::default();
    let (mut full, mut full_seal, mut delta, mut delta_seal) = (vec![], vec![], vec![], vec![]);
    let (mut upper_bytes, mut delta_bytes, mut entries) = (0, 0, 0);
    for run in 0..runs {
        let store_dir = dir.join(format!("store-{run}"));
        let store = BlobStore::open(&store_dir)?;
        let t = Instant::now();
        let pending = capture_layer(upper, None, &store, &opts)?;
        full.push(ms(t));
        let t = Instant::now();
        let (base, stats): (LayerManifest, _) = pending.seal()?;
        full_seal.push(ms(t));
        upper_bytes = stats.data_bytes;
        write_random(
            &upper.join(format!("delta-{run}.bin")),
            1 << 20,
            1000 + run as u64,
        )?;
        std::thread::sleep(opts.racy_window * 2);
        let t = Instant::now();
        let pending = capture_layer(upper, Some(&base), &store, &opts)?;
        delta.push(ms(t));
        let t = Instant::now();
        let (_, stats) = pending.seal()?;
        delta_seal.push(ms(t));
        delta_bytes = stats.bytes_read;
        entries = stats.entries;
        drop(store);
        let _ = std::fs::remove_dir_all(&store_dir);
    }
    Ok(IncrementalResult {
        upper_bytes,
        delta_bytes,
        full_capture_ms: median(&mut full),
        delta_capture_ms: median(&mut delta),
        full_seal_ms: median(&mut full_seal),
        delta_seal_ms: median(&mut delta_seal),
        entries,
        runs,
    })
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
