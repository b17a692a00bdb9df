//! R_k's images that did not change since the parent checkpoint, stored once (paper:
//! "Environment-state recovery", checkpoint size). Between two checkpoints of an idle or
//! slowly changing tree most of CRIU's images are byte for byte the same (mount table, file
//! descriptors, namespaces, page maps of untouched memory): each such file of a new
//! checkpoint becomes a hard link to its parent's, so the disk holds it once. Nothing is
//! trusted for it: a file is linked only when the parent's manifest records the same path,
//! size and digest *and* the parent's file, hashed now, has that digest (a damaged parent
//! file is never copied into a new checkpoint). Checkpoint directories are immutable once
//! published, and collecting the parent removes only its names.

use std::fs;
use std::path::Path;

use super::{digest_file, Artifact, CheckpointStore, Manifest};

/// Largest image compared (bytes): larger ones (ghost files) are kept as written.
const MAX_SHARED: u64 = 64 << 20;

/// Replaces each of `criu` (artifacts of the checkpoint being staged in `dir`) that equals
/// the same artifact of the parent checkpoint (its manifest, loaded from `store`) by a hard
/// link to the parent's file; returns the bytes now shared. Any failure (no parent, a file
/// that differs, a link refused) leaves that file as it was: sharing only saves space.
pub fn link_unchanged_images(
    store: &CheckpointStore,
    parent: Option<&Manifest>,
    dir: &Path,
    criu: &[Artifact],
) -> u64 {
    let Some(parent) = parent else {
        return 0;
    };
    let parent_dir = store.path(&parent.checkpoint);
    let mut shared = 0;
    for a in criu {
        if a.bytes == 0 || a.bytes > MAX_SHARED || !a.path_is_safe() {
            continue;
        }
        let same = parent
            .criu
            .iter()
            .any(|p| p.path == a.path && p.bytes == a.bytes && p.digest == a.digest);
        if !same {
            continue;
        }
        let (theirs, ours) = (parent_dir.join(&a.path), dir.join(&a.path));
        match link_if_equal(&theirs, &ours, a) {
            Ok(true) => shared += a.bytes,
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(image = %ours.display(), error = %e, "image not shared with the parent")
            }
        }
    }
    shared
}

/// Links `theirs` over `ours` when `theirs` is a regular file of `a`'s size and digest.
fn link_if_equal(theirs: &Path, ours: &Path, a: &Artifact) -> std::io::Result<bool> {
    let meta = fs::symlink_metadata(theirs)?;
    if !meta.file_type().is_file() || meta.len() != a.bytes || digest_file(theirs)? != a.digest {
        return Ok(false);
    }
    let tmp = ours.with_extension("share-tmp");
    let _ = fs::remove_file(&tmp);
    fs::hard_link(theirs, &tmp)?;
    if let Err(e) = fs::rename(&tmp, ours) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn equal_images_are_linked_and_a_damaged_parent_file_is_not() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        fs::create_dir_all(a.join("criu")).unwrap();
        fs::create_dir_all(b.join("criu")).unwrap();
        fs::write(a.join("criu/core-1.img"), b"same").unwrap();
        fs::write(b.join("criu/core-1.img"), b"same").unwrap();
        let art = super::super::artifact(&b, "criu/core-1.img").unwrap();
        assert!(
            link_if_equal(&a.join("criu/core-1.img"), &b.join("criu/core-1.img"), &art).unwrap()
        );
        let (ma, mb) = (
            fs::metadata(a.join("criu/core-1.img")).unwrap(),
            fs::metadata(b.join("criu/core-1.img")).unwrap(),
        );
        assert_eq!((ma.ino(), ma.nlink()), (mb.ino(), 2));
        // The parent's file changed on disk (its manifest would still name the old digest).
        fs::write(a.join("criu/mm-1.img"), b"damaged").unwrap();
        fs::write(b.join("criu/mm-1.img"), b"correct").unwrap();
        let art = super::super::artifact(&b, "criu/mm-1.img").unwrap();
        assert!(!link_if_equal(&a.join("criu/mm-1.img"), &b.join("criu/mm-1.img"), &art).unwrap());
        assert_eq!(fs::read(b.join("criu/mm-1.img")).unwrap(), b"correct");
        // A symlink in the parent's place is not followed.
        std::os::unix::fs::symlink(b.join("criu/mm-1.img"), a.join("criu/fs-1.img")).unwrap();
        fs::write(b.join("criu/fs-1.img"), b"correct").unwrap();
        let art = super::super::artifact(&b, "criu/fs-1.img").unwrap();
        assert!(!link_if_equal(&a.join("criu/fs-1.img"), &b.join("criu/fs-1.img"), &art).unwrap());
    }
}
