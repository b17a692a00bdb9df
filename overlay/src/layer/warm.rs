//! Warming the caches a capture's walk reads, ahead of the capture.

use std::path::Path;

use crate::capture::CaptureError;
use crate::tree::InstallLimits;
use crate::walk::{walk, WalkEntry};

/// Walks the upper directory `upper` as a capture does (no-follow, one `statx` per entry,
/// nothing opened but directories) and returns the number of entries, within `limits`. Run
/// off the critical path on a tree the page, inode and dentry caches have not seen (a volume
/// made from a btrfs snapshot), it moves their filling out of the next capture's frozen
/// window.
///
/// Errors: [`CaptureError`] (unreadable entries, depth and entry limits).
pub fn warm_layer(upper: &Path, limits: &InstallLimits) -> Result<u64, CaptureError> {
    let mut entries = 0u64;
    walk(upper, &[], limits.max_entries, |_: &WalkEntry<'_>| {
        entries += 1;
        Ok::<(), CaptureError>(())
    })?;
    Ok(entries)
}
