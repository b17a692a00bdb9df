//! Incremental capture of an upper layer into a [`LayerManifest`] plus blobs.
//!
//! [`capture_layer`] runs inside the frozen window and does only what must see the frozen tree: one
//! sorted no-follow walk with a `statx` per entry; entries whose [`StatKey`](crate::layer::StatKey)
//! equals the base manifest's are taken over from it without opening them; changed files are read
//! (small ones into memory and hashed; large ones copied by the kernel into a staging file, extents
//! only). [`PendingLayer::seal`] runs after the thaw: it hashes the staged files, moves new blobs
//! into the store (fsync'd) and lists what was removed.
//!
//! Files: `walker` (the frozen part), `pending` (sealing after the thaw), `options` (the
//! options and stats types).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use crate::capture::CaptureError;
use crate::layer::blobs::BlobStore;
use crate::layer::manifest::{BlobId, EntryKind, LayerManifest};
use crate::tree::InstallLimits;
use crate::walk::walk;

mod options;
mod pending;
mod walker;

pub use options::{LayerCaptureOptions, LayerStats, INLINE_MAX_BYTES};
pub use pending::PendingLayer;
pub(crate) use walker::key_of;
use walker::{Sink, Walker};

fn now() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

fn minus((sec, nsec): (i64, u32), d: Duration) -> (i64, u32) {
    let total = i128::from(sec) * 1_000_000_000 + i128::from(nsec) - d.as_nanos() as i128;
    (
        total.div_euclid(1_000_000_000) as i64,
        total.rem_euclid(1_000_000_000) as u32,
    )
}

/// Captures the upper directory `upper` against `base` (the manifest of the previous ready
/// checkpoint of this same directory, or `None` for a full capture). Call it with the
/// sandbox frozen, then [`PendingLayer::seal`] after the thaw.
///
/// Never follows a symlink (the walk opens every directory with `O_NOFOLLOW` relative to
/// its parent and examines entries with `statx(AT_SYMLINK_NOFOLLOW)`). Sparse files are
/// captured as their data extents. Sockets are skipped and counted. Device nodes other
/// than 0:0 character devices (overlay whiteouts) are refused: they could never be
/// restored.
///
/// Errors: [`CaptureError`] (unreadable entries, limits, forbidden devices, staging I/O);
/// staging files of a failed capture are removed.
pub fn capture_layer<'s>(
    upper: &Path,
    base: Option<&LayerManifest>,
    store: &'s BlobStore,
    opts: &LayerCaptureOptions,
) -> Result<PendingLayer<'s>, CaptureError> {
    capture_layer_rereading(upper, base, store, opts, &HashSet::new())
}

/// [`capture_layer`], reading the files whose inode numbers are in `reread` even when their
/// key is unchanged: files mapped shared and writable by a process of the sandbox, whose
/// writes through the mapping change neither mtime nor ctime while the page stays dirty.
///
/// Errors: as [`capture_layer`].
pub fn capture_layer_rereading<'s>(
    upper: &Path,
    base: Option<&LayerManifest>,
    store: &'s BlobStore,
    opts: &LayerCaptureOptions,
    reread: &HashSet<u64>,
) -> Result<PendingLayer<'s>, CaptureError> {
    let (manifest, base_paths, mut walker) = run(upper, base, Sink::Store(store), opts, reread)?;
    Ok(PendingLayer {
        store,
        manifest,
        base_paths,
        inline: std::mem::take(&mut walker.inline),
        staged: std::mem::take(&mut walker.staged),
        reused_blobs: std::mem::take(&mut walker.reused_blobs),
        stats: walker.stats,
    })
}

/// The [`LayerManifest::content_digest`] of the tree at `upper`, computed by reading every
/// file (nothing is stored). Used to check that a restored upper layer equals its
/// checkpoint.
///
/// Errors: [`CaptureError`].
pub fn layer_digest(upper: &Path, limits: &InstallLimits) -> Result<BlobId, CaptureError> {
    let opts = LayerCaptureOptions {
        limits: *limits,
        ..LayerCaptureOptions::default()
    };
    let (manifest, _, _) = run(upper, None, Sink::HashOnly, &opts, &HashSet::new())?;
    Ok(manifest.content_digest())
}

fn run<'a, 's>(
    upper: &Path,
    base: Option<&'a LayerManifest>,
    sink: Sink<'s>,
    opts: &'a LayerCaptureOptions,
    reread: &'a HashSet<u64>,
) -> Result<(LayerManifest, Vec<Vec<u8>>, Walker<'a, 's>), CaptureError> {
    let started = Instant::now();
    let captured_at = now();
    let mut walker = Walker {
        sink,
        opts,
        base: HashMap::new(),
        reread,
        racy_cutoff: (i64::MIN, 0),
        links: HashMap::new(),
        entries: Vec::new(),
        inline: Vec::new(),
        inline_bytes: 0,
        staged: Vec::new(),
        reused_blobs: HashSet::new(),
        stats: LayerStats::default(),
    };
    let mut base_paths = Vec::new();
    if let Some(base) = base {
        walker.racy_cutoff = minus(base.captured_at, opts.racy_window);
        for e in &base.entries {
            base_paths.push(e.path.clone());
            if !matches!(e.kind, EntryKind::Hardlink { .. }) {
                walker.base.insert(e.key.ino, e);
            }
        }
    }
    walk(upper, &[], opts.limits.max_entries, |entry| {
        walker.add(entry)
    })?;
    walker.stats.entries = walker.entries.len() as u64;
    walker.stats.capture_us = started.elapsed().as_micros() as u64;
    let manifest = LayerManifest {
        captured_at,
        entries: std::mem::take(&mut walker.entries),
        removed: Vec::new(),
        base: base.map(LayerManifest::content_digest),
    };
    tracing::debug!(
        upper = %upper.display(),
        entries = walker.stats.entries,
        reused = walker.stats.reused,
        bytes_read = walker.stats.bytes_read,
        elapsed_us = walker.stats.capture_us,
        "captured upper layer (frozen part)"
    );
    Ok((manifest, base_paths, walker))
}
