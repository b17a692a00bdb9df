//! The upper snapshot of a checkpoint: `upper.snap` in the checkpoint directory, a read-only
//! btrfs snapshot of the instance volume (`inst-<n>`, holding the overlay's `upper` and
//! `work`) taken in the frozen window right after the capture of F_k, so both see the same
//! upper layer.
//!
//! The layer manifest and its blobs stay the checkpoint's portable, verified form of F_k. The
//! snapshot is what a restore on this node installs instead of materializing them: a
//! writable snapshot of `upper.snap` becomes the new instance volume in one ioctl whatever
//! the layer's size, and every file the sandbox wrote keeps its inode number, mtime and
//! ctime (DESIGN.md, "File identity"): what `make`, `git`'s index and `/proc/locks` compare.
//! A checkpoint without one (state dir without quotas, a snapshot that failed, an older
//! daemon) is restored from its manifest as before.
//!
//! The manifest records the snapshot's subvolume id ([`super::Manifest::upper_snapshot`]); a
//! restore uses `upper.snap` only when it is a read-only subvolume with that id. A checkpoint
//! directory holding one is removed with [`remove_checkpoint_dir`]: the generic remover
//! refuses to cross into another subvolume and would leave it.

use std::io;
use std::path::Path;

use crate::quota::{QuotaError, Volume};

/// Name of the snapshot in a checkpoint directory.
pub const UPPER_SNAPSHOT: &str = "upper.snap";

/// Takes the upper snapshot of instance volume `instance` into checkpoint directory `dir`
/// (which must not hold one yet). Returns the snapshot's subvolume id, for the manifest.
///
/// Errors: those of [`Volume::open`] (`instance` is not a volume: [`QuotaError::NotAVolume`])
/// and [`Volume::snapshot`].
pub fn take(instance: &Path, dir: &Path) -> Result<u64, QuotaError> {
    let vol = Volume::open(instance)?;
    let snap = vol.snapshot(&dir.join(UPPER_SNAPSHOT), true)?;
    Ok(snap.id())
}

/// Why a checkpoint's upper snapshot is not used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// `upper.snap` is missing or is not a subvolume.
    #[error("no upper snapshot")]
    Missing(#[source] QuotaError),
    /// `upper.snap` is a subvolume other than the one the manifest names.
    #[error("upper snapshot is subvolume {found}, the manifest names {expected}")]
    OtherVolume {
        /// Subvolume id the manifest records.
        expected: u64,
        /// Subvolume id found.
        found: u64,
    },
    /// `upper.snap` is writable, so it may differ from what was captured.
    #[error("upper snapshot is not read-only")]
    Writable,
    /// Its flags could not be read.
    #[error("cannot read the upper snapshot's flags")]
    Flags(#[source] QuotaError),
}

/// Opens the upper snapshot of checkpoint directory `dir`, checking that it is the read-only
/// subvolume `expected` the manifest names.
///
/// Errors: [`SnapshotError`].
pub fn open(dir: &Path, expected: u64) -> Result<Volume, SnapshotError> {
    let vol = Volume::open(&dir.join(UPPER_SNAPSHOT)).map_err(SnapshotError::Missing)?;
    if vol.id() != expected {
        return Err(SnapshotError::OtherVolume {
            expected,
            found: vol.id(),
        });
    }
    if !vol.read_only().map_err(SnapshotError::Flags)? {
        return Err(SnapshotError::Writable);
    }
    Ok(vol)
}

/// Removes checkpoint directory `dir` (published or not) with its contents: its upper
/// snapshot, if any, is deleted by the kernel first, then the rest by the hardened remover
/// ([`belayer_overlay::remove_dir_all`]). A missing `dir` is fine.
///
/// Errors: an [`io::Error`] of the remover, or of the snapshot's deletion.
pub fn remove_checkpoint_dir(dir: &Path) -> io::Result<()> {
    let snap = dir.join(UPPER_SNAPSHOT);
    if crate::quota::is_volume(&snap) {
        Volume::open(&snap)
            .and_then(Volume::delete)
            .map_err(io::Error::other)?;
    }
    match belayer_overlay::remove_dir_all(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}
