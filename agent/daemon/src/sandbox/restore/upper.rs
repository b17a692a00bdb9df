//! F_k into the fresh instance of a restore: from the checkpoint's upper snapshot where it has
//! a usable one (a writable snapshot of it becomes the instance volume: files keep their inode
//! numbers and times, see [`crate::store::snapshot`]), else materialized from the layer
//! manifest and the blob store; then the disk limit and the checks of what was installed.

use std::path::Path;

use belayer_overlay::layer::{layer_digest, LayerManifest};

use super::RestoreError;
use crate::quota::{QuotaError, QuotaFs, QuotaMode, Volume};
use crate::runtime::Runtime;
use crate::sandbox::{SandboxPaths, SandboxRecord};
use crate::store::{CheckpointStore, Manifest};

/// Makes instance `n`'s directory a writable snapshot of checkpoint `m`'s upper snapshot,
/// without a disk limit yet ([`apply_limit`]) and with its overlay work dir readied
/// ([`ready_work_dir`]). Returns `false`, having left
/// nothing behind, when there is no usable snapshot (no quotas, none recorded, a charge past
/// [`charge_slack`], or one that [`crate::store::snapshot::open`] refuses) or making the
/// instance from it fails (a warning): the caller then materializes F_k.
pub(super) fn from_snapshot(
    rt: &Runtime,
    rec: &SandboxRecord,
    paths: &SandboxPaths,
    n: u32,
    store: &CheckpointStore,
    m: Option<&Manifest>,
) -> bool {
    let (Some(quota), Some(m)) = (&rt.quota, m) else {
        return false;
    };
    let Some(expected) = m.upper_snapshot else {
        return false;
    };
    if let Err(why) = snapshot_charge_fits(quota, m, rec.spec.disk_max) {
        tracing::info!(sandbox = %rec.id, checkpoint = %m.checkpoint, "upper snapshot not used, {why}: materializing F_k (new inode numbers)");
        return false;
    }
    let dir = paths.instance(n);
    let made = (|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let snap = crate::store::snapshot::open(&store.path(&m.checkpoint), expected)?;
        crate::quota::remove_instance_dir(&dir)?;
        // No limit until `apply_limit`, once the overlay is mounted.
        snap.snapshot(&dir, false)?;
        ready_work_dir(&paths.work(n))?;
        Ok(())
    })();
    match made {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(sandbox = %rec.id, checkpoint = %m.checkpoint, error = %belayer_ipc::error_chain(&*e), "upper snapshot not used: materializing F_k (new inode numbers)");
            let _ = crate::quota::remove_instance_dir(&dir);
            false
        }
    }
}

/// Readies the overlay work dir of an instance made from a snapshot. Its `work` scratch dir
/// goes (overlayfs makes it again at every mount). The index stays: with `index=on` it is what
/// keeps the names of a hardlinked image file one inode once one of them was copied up (without
/// it, after a restore the other names would show the image's original again). Removed is
/// what names the old volume: the index dir's `trusted.overlay.upper` (the old upper root's
/// file handle, which overlayfs sets again at the mount) and the index's directory entries
/// (`nfs_export`: each names an upper directory by a file handle of the old volume; overlayfs
/// makes them again when it copies up or encodes a handle).
///
/// Errors: the [`std::io::Error`] of a removal.
fn ready_work_dir(work: &Path) -> std::io::Result<()> {
    let gone_ok = |r: std::io::Result<()>| match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    };
    gone_ok(belayer_overlay::remove_dir_all(work.join("work")))?;
    let index = work.join("index");
    if !std::fs::symlink_metadata(&index).is_ok_and(|m| m.is_dir()) {
        return Ok(());
    }
    for entry in std::fs::read_dir(&index)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            belayer_overlay::remove_dir_all(entry.path())?;
        }
    }
    match rustix::fs::removexattr(&index, "trusted.overlay.upper") {
        Ok(()) | Err(rustix::io::Errno::NODATA) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Walks the upper dir of an instance made from a snapshot on a thread of its own
/// ([`belayer_overlay::layer::warm_layer`]): the new volume's inodes are in no cache yet, and
/// the next checkpoint's capture would otherwise fill them inside its frozen window (230 ms
/// against 83 ms for 20 000 entries here). A failure (the instance removed meanwhile) only
/// costs the warming.
pub(super) fn warm_in_background(id: String, upper: std::path::PathBuf) {
    std::thread::spawn(move || {
        let t = std::time::Instant::now();
        match belayer_overlay::layer::warm_layer(&upper, &Default::default()) {
            Ok(entries) => {
                tracing::debug!(sandbox = %id, entries, ms = t.elapsed().as_secs_f64() * 1000.0, "restored upper layer walked")
            }
            Err(e) => tracing::debug!(sandbox = %id, error = %e, "restored upper layer not walked"),
        }
    });
}

/// Bytes charged for the upper layer of an instance whose volume references `referenced`
/// bytes: under simple quotas, which charge an extent to the volume that wrote it for its
/// whole life, plus what the instance inherited from earlier volumes
/// ([`SandboxRecord::inherited_bytes`]); under full qgroups `referenced` already counts every
/// extent the volume reaches.
pub(crate) fn charged_bytes(quota: &QuotaFs, rec: &SandboxRecord, referenced: u64) -> u64 {
    match quota.mode() {
        QuotaMode::Simple => referenced.saturating_add(rec.inherited_bytes),
        QuotaMode::Full => referenced,
    }
}

/// How far the charge recorded with a snapshot may exceed its layer's file data before a
/// restore materializes F_k instead (for a sandbox with disk limit `limit`): at least 16 MiB,
/// a sixteenth of the limit above 256 MiB. The charge is an upper bound (it keeps counting
/// inherited bytes the sandbox deleted since, and all of its metadata); materializing charges
/// the new volume its metadata afresh and shares only file data, which puts the bound back
/// near the layer's real size.
fn charge_slack(limit: u64) -> u64 {
    (limit / 16).max(16 << 20)
}

/// Whether a restore may install the snapshot of checkpoint `m` for a sandbox limited to
/// `limit`: its charge is known, and (with a limit, simple quotas) within [`charge_slack`] of
/// its file data.
fn snapshot_charge_fits(quota: &QuotaFs, m: &Manifest, limit: Option<u64>) -> Result<(), String> {
    let Some(limit) = limit else {
        return Ok(());
    };
    let Some(charged) = m.upper_bytes else {
        return Err("the checkpoint records no charge for it".into());
    };
    let beyond = charged.saturating_sub(m.layer.data_bytes);
    if quota.mode() == QuotaMode::Simple && beyond > charge_slack(limit) {
        return Err(format!(
            "it is charged {charged} bytes, {beyond} beyond its file data (more than {} of slack)",
            charge_slack(limit)
        ));
    }
    Ok(())
}

/// What restored instance `n` inherits ([`SandboxRecord::inherited_bytes`]): from the
/// snapshot, the charge recorded with it less the checkpoint's ghost files (deleted files
/// still open, whose extents the recorded charge holds but the new volume does not: CRIU
/// writes them into it anew, charged); materialized, the file data it shares with the blob
/// store (`shared_bytes`, placed by `copy_file_range`; its metadata and any data written out
/// are charged to the new volume), each blob counted once however many files it fills. 0
/// under full qgroups, and without a checkpoint.
pub(super) fn inherited_bytes(
    rt: &Runtime,
    m: Option<&Manifest>,
    layer: Option<&LayerManifest>,
    from_snapshot: bool,
    shared_bytes: u64,
) -> u64 {
    match (&rt.quota, m) {
        (Some(q), Some(m)) if q.mode() == QuotaMode::Simple => {
            if from_snapshot {
                m.upper_bytes
                    .unwrap_or(0)
                    .saturating_sub(ghost_bytes(&m.criu))
            } else {
                shared_bytes.min(layer.map_or(0, distinct_blob_bytes))
            }
        }
        _ => 0,
    }
}

/// Bytes of the ghost-file images (`criu/ghost-file-*.img`) among a checkpoint's CRIU
/// artifacts `criu`: what CRIU writes into the restored instance for files that were deleted
/// but open.
pub(crate) fn ghost_bytes(criu: &[crate::store::Artifact]) -> u64 {
    criu.iter()
        .filter(|a| a.path.starts_with("criu/ghost-file-"))
        .map(|a| a.bytes)
        .sum()
}

/// Data bytes of the distinct blobs `layer` refers to (a blob shared by several files, such
/// as clones, counts once).
fn distinct_blob_bytes(layer: &LayerManifest) -> u64 {
    let mut seen = std::collections::HashSet::new();
    layer
        .entries
        .iter()
        .filter_map(|e| match &e.kind {
            belayer_overlay::layer::EntryKind::Regular {
                extents,
                blob: Some(b),
                ..
            } if seen.insert(*b) => Some(extents.iter().map(|x| x.len).sum::<u64>()),
            _ => None,
        })
        .sum()
}

/// Sets the disk limit of restored instance `inst`: the sandbox's limit minus what the
/// instance inherited, at least 1 byte (0 would not be a limit). Called once the overlay is
/// mounted, before CRIU runs: only the mount (overlayfs writes its work dir and index) goes
/// without a limit, so that a sandbox at its limit can still be mounted; what CRIU writes
/// into the instance (ghost files) is charged against the limit like everything after.
///
/// Errors: those of [`Volume::open`] and [`Volume::set_limit`].
pub(super) fn apply_limit(
    rt: &Runtime,
    rec: &SandboxRecord,
    inst: &Path,
    inherited: u64,
) -> Result<(), QuotaError> {
    let (Some(_), Some(limit)) = (&rt.quota, rec.spec.disk_max) else {
        return Ok(());
    };
    if !crate::quota::is_volume(inst) {
        return Ok(());
    }
    Volume::open(inst)?.set_limit(Some(limit.saturating_sub(inherited).max(1)))
}

/// Verifies every artifact of checkpoint `m` (size and blake3) and, given the blob store the
/// restore reads F_k from (`None` for a restore from the upper snapshot, which reads no blob),
/// every blob its layer refers to (its content hashes to its name); and every page pack of
/// its memory images in `packs` (the node's blob store).
pub(super) fn verify_checkpoint(
    store: &CheckpointStore,
    m: &Manifest,
    layer: &LayerManifest,
    blobs: Option<&belayer_overlay::layer::BlobStore>,
    packs: &belayer_overlay::layer::BlobStore,
    id: &str,
) -> Result<(), RestoreError> {
    store
        .verify(&m.checkpoint)
        .map_err(|source| RestoreError::Corrupt {
            id: id.to_string(),
            source,
        })?;
    for pack in m.memory.iter().flat_map(|mem| mem.pack_ids()) {
        packs
            .verify(&pack)
            .map_err(|source| RestoreError::CorruptBlob {
                id: id.to_string(),
                source,
            })?;
    }
    let Some(blobs) = blobs else {
        return Ok(());
    };
    for blob in layer.blobs() {
        blobs
            .verify(&blob)
            .map_err(|source| RestoreError::CorruptBlob {
                id: id.to_string(),
                source,
            })?;
    }
    Ok(())
}

/// Reads the freshly installed upper layer again and compares its content digest with
/// the checkpoint's layer manifest (equal trees have equal content digests).
pub(super) fn upper_matches(
    id: &str,
    upper: &Path,
    layer: &LayerManifest,
) -> Result<bool, RestoreError> {
    let digest =
        layer_digest(upper, &Default::default()).map_err(|source| RestoreError::Verify {
            id: id.to_string(),
            source,
        })?;
    Ok(digest == layer.content_digest())
}
