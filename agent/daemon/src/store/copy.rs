//! Copying a checkpoint into another sandbox's store: what a fork gives each child (paper
//! §"Environment-state recovery", forks of C_K).
//!
//! The copy is a new root checkpoint of the child (no parent), published and made ready
//! with the store's usual protocol ([`CheckpointStore::begin`], `publish`, `set_ready`), so
//! the child restores from it like from any checkpoint of its own, and again after a failure.
//! It shares everything it can with the original: the CRIU images and L_k are hard links
//! (copied when the store sits on another file system), F_k's file data are the blobs of the
//! node's blob store. It differs where the child differs:
//! - the host ids (the child's user namespace maps to its own range): F_k's owners, ACLs
//!   and capability roots are moved to the child's range
//!   ([`belayer_overlay::layer::LayerManifest::shift_ids`]) and R_k's user-namespace images
//!   rewritten ([`belayer_criu::rebase_userns_images`]), each as a new file (a hard link
//!   would change the original);
//! - the manifest: the child's id and range, `forked_from`, no parent, no upper snapshot
//!   (the original's snapshot holds the source's ids; the child materializes F_k).

use std::fs;
use std::path::Path;

use belayer_overlay::layer::{IdShift, LayerManifest};

use super::{artifact, io, Artifact, CheckpointStore, Manifest, StoreError, MANIFEST};
use crate::sys;
use crate::userns::IdRange;

/// The sandbox a copy is for.
#[derive(Debug, Clone)]
pub struct CopyTarget<'a> {
    /// Its id.
    pub sandbox: &'a str,
    /// Its user namespace's host range (`None`: the host's).
    pub userns: Option<IdRange>,
}

/// The move of ids from range `from` to range `to`, if they differ. Errors: one range
/// without the other, or ranges of different sizes ([`StoreError::BadManifest`]).
fn id_shift(
    m: &Manifest,
    from: Option<IdRange>,
    to: Option<IdRange>,
) -> Result<Option<IdShift>, StoreError> {
    match (from, to) {
        (None, None) => Ok(None),
        (Some(f), Some(t)) if f == t => Ok(None),
        (Some(f), Some(t)) if f.size == t.size => Ok(Some(IdShift {
            from: f.host_base,
            to: t.host_base,
            count: f.size,
        })),
        (f, t) => Err(StoreError::BadManifest {
            checkpoint: m.checkpoint.clone(),
            reason: format!("its user namespace {f:?} cannot be moved to {t:?}"),
        }),
    }
}

/// Links `src` at `dst`, or copies it where a link cannot be made (another file system, a
/// quota boundary); the copy is fsync'd.
pub(crate) fn link_or_copy(src: &Path, dst: &Path) -> std::io::Result<()> {
    match fs::hard_link(src, dst) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EXDEV | libc::EPERM | libc::EMLINK)
            ) =>
        {
            fs::copy(src, dst)?;
            fs::File::open(dst)?.sync_all()
        }
        Err(e) => Err(e),
    }
}

impl CheckpointStore {
    /// Copies checkpoint `m` of `src` (whose layer manifest is `layer`, and whose ids are in
    /// range `m.userns`, else `src_range`) into this store for `target`, publishes it and
    /// makes it the ready checkpoint. Returns the copy's manifest.
    ///
    /// A crash at any point leaves either no visible checkpoint in this store or the whole
    /// copy (the store's atomic publication); the original is never changed.
    ///
    /// Errors: [`StoreError::Io`] (reading the original, writing the copy: nothing of it stays
    /// visible), [`StoreError::BadManifest`] (an artifact path that leaves the checkpoint, an
    /// id outside the original's range, ranges that do not match).
    pub fn import_copy(
        &self,
        src: &CheckpointStore,
        m: &Manifest,
        layer: &LayerManifest,
        src_range: Option<IdRange>,
        target: &CopyTarget<'_>,
    ) -> Result<Manifest, StoreError> {
        let bad = |reason: String| StoreError::BadManifest {
            checkpoint: m.checkpoint.clone(),
            reason,
        };
        let shift = id_shift(m, m.userns.or(src_range), target.userns)?;
        let from = src.path(&m.checkpoint);
        let mut staging = self.begin(m.prefix)?;
        let to = staging.dir().to_path_buf();
        let mut copy = m.clone();
        // Everything but F_k's manifest, which is written anew when ids move.
        for a in m.artifacts() {
            if !a.path_is_safe() {
                return Err(bad(format!(
                    "artifact path {:?} leaves the checkpoint",
                    a.path
                )));
            }
            if shift.is_some() && a.path == m.upper.path {
                continue;
            }
            let dst = to.join(&a.path);
            if let Some(parent) = dst.parent().filter(|p| !p.exists()) {
                fs::create_dir_all(parent).map_err(io("mkdir", parent))?;
            }
            link_or_copy(&from.join(&a.path), &dst).map_err(io("link", &dst))?;
        }
        if let Some(shift) = shift {
            let mut moved = layer.clone();
            moved
                .shift_ids(&shift)
                .map_err(|e| bad(format!("F_k cannot move to the new range: {e}")))?;
            let p = to.join(&m.upper.path);
            fs::write(&p, moved.encode()).map_err(io("write", &p))?;
            copy.upper = artifact(&to, &m.upper.path).map_err(io("fsync", &p))?;
            let images = to.join("criu");
            if images.is_dir() {
                let (f, t) = (m.userns.or(src_range), target.userns);
                if let (Some(f), Some(t)) = (f, t) {
                    let extent = belayer_criu::IdExtent {
                        first: 0,
                        lower_first: f.host_base,
                        count: f.size,
                    };
                    belayer_criu::rebase_userns_images(&images, extent, t.host_base)
                        .map_err(|e| bad(format!("R_k cannot move to the new range: {e}")))?;
                }
                copy.criu = m
                    .criu
                    .iter()
                    .map(|a| rehash_if_rewritten(&to, a))
                    .collect::<Result<_, _>>()?;
            }
        }
        copy.sandbox = target.sandbox.to_string();
        copy.checkpoint = staging.name();
        copy.seq = staging.seq();
        copy.parent = None;
        // No parent: nothing is shared with one (the copy's files are links to the original's).
        copy.shared_image_bytes = 0;
        // Nothing was added to the blob store: the copy refers to the original's blobs and
        // packs.
        copy.layer.new_blobs = 0;
        copy.layer.new_blob_bytes = 0;
        if let Some(mem) = copy.memory.as_mut() {
            mem.new_pages = 0;
            mem.new_bytes = 0;
        }
        copy.instance = 0;
        copy.context.record = format!("{}/k{}", target.sandbox, m.prefix);
        copy.upper_snapshot = None;
        copy.upper_bytes = None;
        copy.userns = target.userns;
        copy.forked_from = Some(format!("{}/{}", m.sandbox, m.checkpoint));
        copy.created_unix_ms = sys::now_unix_ms();
        let manifest = to.join(MANIFEST);
        let json = serde_json::to_vec_pretty(&copy).unwrap_or_default();
        fs::write(&manifest, json).map_err(io("write", &manifest))?;
        for p in [manifest.as_path(), to.join("criu").as_path(), to.as_path()] {
            if p.exists() {
                sys::fsync_path(p).map_err(|e| io("fsync", p)(e.source))?;
            }
        }
        self.publish(&mut staging)?;
        self.set_ready(&copy.checkpoint)?;
        Ok(copy)
    }
}

/// `a` described again when its file is a user-namespace image (rewritten by the rebase),
/// else as it was.
fn rehash_if_rewritten(dir: &Path, a: &Artifact) -> Result<Artifact, StoreError> {
    let name = Path::new(&a.path)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name.starts_with("userns-") && name.ends_with(".img") {
        let p = dir.join(&a.path);
        artifact(dir, &a.path).map_err(io("fsync", &p))
    } else {
        Ok(a.clone())
    }
}
