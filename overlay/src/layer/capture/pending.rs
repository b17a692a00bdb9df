//! The part of a layer capture that runs after the thaw: [`PendingLayer::seal`] hashes the
//! staged files, moves new blobs into the store (fsync'd), checks that reused blobs are still
//! there and lists what the base had that is gone.

use std::collections::HashSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::options::LayerStats;
use super::walker::remove_staged;
use crate::capture::CaptureError;
use crate::layer::blobs::{BlobBatch, BlobError, BlobStore};
use crate::layer::manifest::{BlobId, EntryKind, LayerManifest};

/// A capture whose walk is done (the frozen part) but whose new blobs are not yet in the
/// store. Dropping it removes its staging files.
#[derive(Debug)]
pub struct PendingLayer<'s> {
    pub(super) store: &'s BlobStore,
    pub(super) manifest: LayerManifest,
    pub(super) base_paths: Vec<Vec<u8>>,
    pub(super) inline: Vec<(usize, Vec<u8>)>,
    pub(super) staged: Vec<(usize, PathBuf)>,
    pub(super) reused_blobs: HashSet<BlobId>,
    pub(super) stats: LayerStats,
}

impl Drop for PendingLayer<'_> {
    fn drop(&mut self) {
        remove_staged(&mut self.staged);
    }
}

fn hash_file(path: &Path) -> std::io::Result<BlobId> {
    let mut file = fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(BlobId(*hasher.finalize().as_bytes()))
}

impl PendingLayer<'_> {
    /// What the frozen part did (new-blob counts are filled in by [`seal`](Self::seal)).
    pub fn stats(&self) -> &LayerStats {
        &self.stats
    }

    /// Completes the capture after the thaw: hashes staged files, moves new blobs into the
    /// store (each fsync'd before its rename, and its directory after), checks that every
    /// blob taken over from the base manifest is still in the store, and lists the base's
    /// paths that are gone. Hold the store's [`lease`](BlobStore::lease) from before
    /// [`capture_layer`](super::capture_layer) until the manifest is published.
    ///
    /// Errors: [`CaptureError::Blob`] (store I/O, a base blob collected meanwhile: capture
    /// again without a base).
    pub fn seal(mut self) -> Result<(LayerManifest, LayerStats), CaptureError> {
        let started = Instant::now();
        let mut batch = BlobBatch::default();
        for (index, data) in std::mem::take(&mut self.inline) {
            let EntryKind::Regular { blob: Some(id), .. } = &self.manifest.entries[index].kind
            else {
                unreachable!("inline data belongs to a regular file with a blob id");
            };
            let grew = self
                .store
                .insert_bytes(id, &data, &mut batch)
                .map_err(CaptureError::Blob)?;
            self.count_new(grew);
        }
        for (index, path) in std::mem::take(&mut self.staged) {
            let id = match hash_file(&path) {
                Ok(id) => id,
                Err(source) => {
                    let _ = fs::remove_file(&path);
                    return Err(CaptureError::Blob(BlobError::Io {
                        op: "hash",
                        path,
                        source,
                    }));
                }
            };
            let grew = self
                .store
                .insert_staged(&path, &id, &mut batch)
                .map_err(CaptureError::Blob)?;
            self.count_new(grew);
            if let EntryKind::Regular { blob, .. } = &mut self.manifest.entries[index].kind {
                *blob = Some(id);
            }
        }
        self.store.commit(batch).map_err(CaptureError::Blob)?;
        for id in &self.reused_blobs {
            if !self.store.contains(id) {
                return Err(CaptureError::Blob(BlobError::Missing { blob: *id }));
            }
        }
        let now: HashSet<&[u8]> = self
            .manifest
            .entries
            .iter()
            .map(|e| e.path.as_slice())
            .collect();
        let removed: Vec<Vec<u8>> = self
            .base_paths
            .iter()
            .filter(|p| !now.contains(p.as_slice()))
            .cloned()
            .collect();
        self.stats.removed = removed.len() as u64;
        self.manifest.removed = removed;
        self.stats.seal_us = started.elapsed().as_micros() as u64;
        Ok((std::mem::take(&mut self.manifest), self.stats))
    }

    fn count_new(&mut self, grew: u64) {
        if grew > 0 {
            self.stats.new_blobs += 1;
            self.stats.new_blob_bytes += grew;
        }
    }
}
