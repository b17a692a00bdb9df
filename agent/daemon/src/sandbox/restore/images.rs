//! The images dir a restore hands CRIU when R_k's memory is in page packs (checkpoint
//! format 3, [`crate::store::pages`]): in the sandbox's dir with whole packs hard-linked
//! when most pages allow it, else in a slot of the dump stage's tmpfs when it has room, else
//! in the sandbox's dir; removed once CRIU is done with it.

use std::path::PathBuf;
use std::time::Instant;

use crate::record::SandboxPaths;
use crate::runtime::Runtime;
use crate::stage::StageSlot;
use crate::store::{pages, CheckpointStore, Manifest};

/// The images dir assembled for CRIU ([`pages::assemble`]), in a slot of the dump stage or
/// the sandbox's dir; removed (and the slot's bytes given back) when the restore is done
/// with it, whatever its outcome.
pub(super) struct ImagesDir<'a> {
    pub(super) path: PathBuf,
    _stage: Option<StageSlot<'a>>,
}

impl Drop for ImagesDir<'_> {
    fn drop(&mut self) {
        if let Err(e) = belayer_overlay::remove_dir_all(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot remove a restore's images dir");
            }
        }
    }
}

/// Assembles the images of checkpoint `m` (in `store`) of sandbox `id`. When at least half
/// of R_k's pages are in pages files that are each one whole pack (a first checkpoint, or
/// memory that all changed: [`pages::linkable_bytes`]), in the sandbox's dir, on the blob
/// store's file system, with those files hard-linked to their packs: nothing is copied and
/// CRIU reads the packs' own page cache. Otherwise in the dump stage's tmpfs when it has room
/// for R_k ([`Manifest::criu_bytes`]): the packs' pages come out of the page cache and CRIU
/// reads them from memory (a copy sharing extents on the state dir's disk would be a new
/// inode, read back from the disk). A stage that fills meanwhile (another daemon shares the
/// tmpfs) costs a second assembly in the sandbox's dir.
///
/// Errors: those of [`pages::assemble`].
pub(super) fn assemble<'a>(
    rt: &'a Runtime,
    paths: &SandboxPaths,
    store: &CheckpointStore,
    m: &Manifest,
    id: &str,
) -> Result<ImagesDir<'a>, pages::PageError> {
    let t = Instant::now();
    let criu_dir = store.path(&m.checkpoint).join("criu");
    let memory = m.memory.as_ref().map_or(0, |mem| mem.bytes());
    let link = memory > 0 && pages::linkable_bytes(m, &criu_dir, &rt.blobs) * 2 >= memory;
    let mut stage = (!link)
        .then(|| rt.stage.as_ref().and_then(|s| s.reserve(m.criu_bytes())))
        .flatten();
    let mut dest = stage
        .as_ref()
        .map_or_else(|| paths.restore_images(), |s| s.dir().join("criu"));
    let mut done = pages::assemble(m, &criu_dir, &rt.blobs, &dest, link);
    if let (Err(e @ pages::PageError::Io { .. }), Some(_)) = (&done, &stage) {
        tracing::warn!(sandbox = %id, error = %e, "cannot assemble the memory images in the dump stage; assembling them in the state dir");
        let _ = belayer_overlay::remove_dir_all(&dest);
        stage = None;
        dest = paths.restore_images();
        done = pages::assemble(m, &criu_dir, &rt.blobs, &dest, false);
    }
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    tracing::debug!(sandbox = %id, ms, staged = stage.is_some(), link, stats = ?done.as_ref().ok(), "memory images assembled");
    done.map(|_| ImagesDir {
        path: dest,
        _stage: stage,
    })
}
