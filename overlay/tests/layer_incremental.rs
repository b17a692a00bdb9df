//! Incremental captures: a sequence of edits (append, truncate, delete, renames, a new
//! hardlink, chmod, xattr change, a same-size same-mtime rewrite) each captured against the
//! previous manifest. Only the changed entries are read, the change lists are exact, every
//! manifest of the sequence still materializes to the tree it was taken from, a restored
//! layer captured against its re-keyed manifest reads nothing, and blob collection keeps
//! exactly the live blobs.

mod common;
mod layer_common;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use belayer_overlay::layer::{
    capture_layer, layer_digest, BlobError, BlobStore, EntryKind, LayerCaptureOptions,
    LayerManifest, LayerStats,
};
use belayer_overlay::{tree_listing, CaptureError, InstallError, InstallLimits};
use common::set_mtime;
use layer_common::{
    capture, entry, hardlink_entries, materialize, mknod_char, no_racy_window, noise, setxattr,
};

const MIB: usize = 1 << 20;

/// Waits out the kernel's coarse clock so that a change after this point gets a ctime
/// distinct from any change before it.
fn settle() {
    std::thread::sleep(Duration::from_millis(30));
}

/// Independent oracle for what a capture against `prev` must read: walks `upper` with
/// `std::fs` and counts the entries (first names of inodes) whose inode, size, mtime or
/// ctime differ from `prev`'s entry for that inode, and the data bytes of such regular
/// files (all files here are dense).
fn changed_since(upper: &Path, prev: &LayerManifest) -> (u64, u64) {
    let by_ino: HashMap<u64, &belayer_overlay::layer::LayerEntry> = prev
        .entries
        .iter()
        .filter(|e| !matches!(e.kind, EntryKind::Hardlink { .. }))
        .map(|e| (e.key.ino, e))
        .collect();
    let mut seen = HashSet::new();
    let (mut entries, mut bytes) = (0, 0);
    let mut stack = vec![upper.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path).unwrap();
        if meta.is_dir() {
            for child in fs::read_dir(&path).unwrap() {
                stack.push(child.unwrap().path());
            }
        } else if !seen.insert(meta.ino()) {
            continue; // A later name of a hardlinked inode.
        }
        let same = by_ino.get(&meta.ino()).is_some_and(|e| {
            e.key.size == meta.size()
                && e.key.mtime == (meta.mtime(), meta.mtime_nsec() as u32)
                && e.key.ctime == (meta.ctime(), meta.ctime_nsec() as u32)
        });
        if !same {
            entries += 1;
            if meta.is_file() {
                bytes += meta.size();
            }
        }
    }
    (entries, bytes)
}

/// One capture of the sequence and what the tree looked like when it was taken.
struct Step {
    what: &'static str,
    manifest: LayerManifest,
    listing: Vec<String>,
}

struct Sequence {
    _dir: tempfile::TempDir,
    root: PathBuf,
    upper: PathBuf,
    store: BlobStore,
    steps: Vec<Step>,
}

impl Sequence {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let upper = root.join("upper");
        fs::create_dir(&upper).unwrap();
        let store = BlobStore::open(&root.join("store")).unwrap();
        Sequence {
            _dir: dir,
            root,
            upper,
            store,
            steps: Vec::new(),
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.upper.join(rel)
    }

    /// Captures against the last manifest (no racy window: edits are settled), checks the
    /// stats against the oracle, records the step.
    fn capture(&mut self, what: &'static str) -> (LayerStats, &LayerManifest) {
        settle();
        let base = self.steps.last().map(|s| &s.manifest);
        let expected = base.map(|b| changed_since(&self.upper, b));
        let (manifest, stats) = capture(&self.upper, base, &self.store, &no_racy_window())
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        assert_eq!(stats.entries, manifest.entries.len() as u64, "{what}");
        assert_eq!(stats.data_bytes, manifest.data_bytes(), "{what}");
        if let Some((changed, bytes)) = expected {
            assert_eq!(
                stats.reused,
                stats.entries - hardlink_entries(&manifest) - changed,
                "{what}: reused {stats:?}"
            );
            assert_eq!(stats.bytes_read, bytes, "{what}: bytes read {stats:?}");
        }
        assert_eq!(
            manifest.base,
            base.map(LayerManifest::content_digest),
            "{what}"
        );
        let listing = tree_listing(&self.upper, &[]).unwrap();
        assert_eq!(
            layer_digest(&self.upper, &InstallLimits::default()).unwrap(),
            manifest.content_digest(),
            "{what}"
        );
        settle();
        self.steps.push(Step {
            what,
            manifest,
            listing,
        });
        (stats, &self.steps.last().unwrap().manifest)
    }
}

fn removed(manifest: &LayerManifest) -> BTreeSet<String> {
    manifest
        .removed
        .iter()
        .map(|p| String::from_utf8(p.clone()).unwrap())
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn blob_of(manifest: &LayerManifest, path: &str) -> Option<belayer_overlay::layer::BlobId> {
    match &entry(manifest, path).kind {
        EntryKind::Regular { blob, .. } => *blob,
        other => panic!("{path}: {other:?}"),
    }
}

#[test]
fn each_capture_reads_only_what_changed() {
    let mut s = Sequence::new();
    fs::write(s.path("big"), noise(4 * MIB, 1)).unwrap();
    fs::write(s.path("log"), noise(1000, 2)).unwrap();
    fs::write(s.path("trunc"), noise(100_000, 3)).unwrap();
    fs::write(s.path("del"), b"delete me").unwrap();
    fs::write(s.path("mv_src"), noise(2000, 4)).unwrap();
    fs::create_dir(s.path("sub")).unwrap();
    fs::write(s.path("sub/keep"), b"keep").unwrap();
    fs::create_dir_all(s.path("dir_a/nested")).unwrap();
    fs::write(s.path("dir_a/inner_big"), noise(MIB, 5)).unwrap();
    fs::write(s.path("dir_a/x"), b"x").unwrap();
    fs::write(s.path("dir_a/nested/y"), b"yy").unwrap();
    fs::write(s.path("perm"), noise(3000, 6)).unwrap();
    fs::write(s.path("attr"), noise(4000, 7)).unwrap();
    fs::write(s.path("stable"), noise(5000, 8)).unwrap();
    set_mtime(&s.path("stable"), 1_600_000_000, 123_456_789);
    mknod_char(&s.path("wh"), 0, 0);
    symlink("big", s.path("sym")).unwrap();
    fs::write(s.path("hl_a"), b"linked").unwrap();
    fs::hard_link(s.path("hl_a"), s.path("hl_b")).unwrap();

    // 0: full capture.
    let (st, m) = s.capture("full");
    let data: u64 = m.data_bytes();
    assert_eq!((st.reused, st.bytes_read), (0, data));
    assert!(st.new_blobs >= 10, "{st:?}");
    assert_eq!(hardlink_entries(m), 1);

    // 1: nothing changed: nothing read, nothing new.
    let (st, m) = s.capture("unchanged");
    assert_eq!(st.reused, st.entries - 1, "{st:?}");
    assert_eq!((st.bytes_read, st.files_read, st.new_blobs), (0, 0, 0));
    assert!(m.removed.is_empty());

    // 2: append to a small file: only it is read; the 4 MiB file is not.
    let mut f = OpenOptions::new().append(true).open(s.path("log")).unwrap();
    f.write_all(&[b'+'; 500]).unwrap();
    drop(f);
    let (st, m) = s.capture("append");
    assert_eq!((st.bytes_read, st.files_read, st.new_blobs), (1500, 1, 1));
    assert_eq!(st.reused, st.entries - 2, "{st:?}");
    assert!(m.removed.is_empty());

    // 3: truncate one file, delete another.
    File::options()
        .write(true)
        .open(s.path("trunc"))
        .unwrap()
        .set_len(40_000)
        .unwrap();
    fs::remove_file(s.path("del")).unwrap();
    let (st, m) = s.capture("truncate+delete");
    assert_eq!((st.bytes_read, st.files_read, st.removed), (40_000, 1, 1));
    assert_eq!(removed(m), set(&["del"]));

    // 4: rename a file into a subdirectory and a directory with a 1 MiB file in it: the
    // children of the renamed directory are taken over under their new paths.
    let inner_blob = blob_of(m, "dir_a/inner_big");
    fs::rename(s.path("mv_src"), s.path("sub/mv_dst")).unwrap();
    fs::rename(s.path("dir_a"), s.path("dir_b")).unwrap();
    let (st, m) = s.capture("renames");
    assert!(st.bytes_read <= 2000, "{st:?}");
    assert_eq!(
        removed(m),
        set(&[
            "dir_a",
            "dir_a/inner_big",
            "dir_a/nested",
            "dir_a/nested/y",
            "dir_a/x",
            "mv_src"
        ])
    );
    assert_eq!(blob_of(m, "dir_b/inner_big"), inner_blob);
    assert_eq!(st.new_blobs, 0, "renames add no data");

    // 5: a new hardlink to the big file (the link moves the inode's ctime, so it is read
    // again; its content is already stored).
    fs::hard_link(s.path("big"), s.path("big_link")).unwrap();
    let (st, m) = s.capture("new hardlink");
    assert_eq!(
        entry(m, "big_link").kind,
        EntryKind::Hardlink {
            target: b"big".to_vec()
        }
    );
    assert_eq!((st.bytes_read, st.new_blobs), (4 * MIB as u64, 0));

    // 6: chmod (setuid) of one file.
    fs::set_permissions(s.path("perm"), fs::Permissions::from_mode(0o4711)).unwrap();
    let (st, m) = s.capture("chmod");
    assert_eq!(entry(m, "perm").mode, 0o4711);
    assert_eq!((st.bytes_read, st.files_read, st.new_blobs), (3000, 1, 0));

    // 7: an xattr change.
    setxattr(&s.path("attr"), "user.tag", b"v1");
    let (st, m) = s.capture("xattr");
    assert_eq!(
        entry(m, "attr").xattrs,
        [(b"user.tag".to_vec(), b"v1".to_vec())]
    );
    assert_eq!((st.bytes_read, st.new_blobs), (4000, 0));

    // 8: same size, same mtime, different bytes: only the ctime tells, and it is enough.
    let old_blob = blob_of(m, "stable");
    let before = fs::metadata(s.path("stable")).unwrap();
    File::options()
        .write(true)
        .open(s.path("stable"))
        .unwrap()
        .write_all_at(&noise(5000, 99), 0)
        .unwrap();
    set_mtime(&s.path("stable"), 1_600_000_000, 123_456_789);
    let after = fs::metadata(s.path("stable")).unwrap();
    assert_eq!(
        (after.len(), after.mtime(), after.mtime_nsec()),
        (before.len(), before.mtime(), before.mtime_nsec())
    );
    assert_ne!(
        (after.ctime(), after.ctime_nsec()),
        (before.ctime(), before.ctime_nsec())
    );
    let (st, m) = s.capture("same-size same-mtime rewrite");
    assert_eq!((st.bytes_read, st.files_read, st.new_blobs), (5000, 1, 1));
    assert_ne!(blob_of(m, "stable"), old_blob);

    // 9: everything at once, then nothing.
    fs::remove_dir_all(s.path("dir_b/nested")).unwrap();
    fs::write(s.path("sub/new"), b"new").unwrap();
    mknod_char(&s.path("sub/wh2"), 0, 0);
    fs::remove_file(s.path("hl_a")).unwrap();
    let (st, m) = s.capture("mixed");
    assert_eq!(removed(m), set(&["dir_b/nested", "dir_b/nested/y", "hl_a"]));
    // `hl_b` is now the only name of the former group: a plain file.
    assert!(matches!(entry(m, "hl_b").kind, EntryKind::Regular { .. }));
    assert!(st.bytes_read <= 16, "{st:?}");
    let (st, _) = s.capture("unchanged again");
    assert_eq!(st.bytes_read, 0);

    // Every manifest of the sequence still materializes to the tree it was taken from
    // (blobs are shared between them).
    for (k, step) in s.steps.iter().enumerate() {
        let target = s.root.join(format!("restore-{k}"));
        let (installed, _) = materialize(&step.manifest, &s.store, &target, k % 2 == 0)
            .unwrap_or_else(|e| panic!("{}: {e:?}", step.what));
        assert_eq!(installed.entries, step.manifest.entries.len() as u64);
        assert_eq!(
            tree_listing(&target, &[]).unwrap(),
            step.listing,
            "step {k} ({})",
            step.what
        );
        assert_eq!(
            layer_digest(&target, &InstallLimits::default()).unwrap(),
            step.manifest.content_digest(),
            "step {k} ({})",
            step.what
        );
    }
}

/// Entries changed within the racy window before the base capture are read again even
/// though their key is equal, until a base taken after the window.
#[test]
fn racy_entries_are_read_again_until_settled() {
    let window = Duration::from_millis(300);
    let opts = LayerCaptureOptions {
        racy_window: window,
        ..LayerCaptureOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let upper = dir.path().join("upper");
    fs::create_dir(&upper).unwrap();
    let store = BlobStore::open(&dir.path().join("store")).unwrap();
    fs::write(upper.join("a"), noise(1000, 1)).unwrap();
    fs::write(upper.join("b"), noise(2000, 2)).unwrap();
    std::thread::sleep(window + Duration::from_millis(100));
    let (m0, _) = capture(&upper, None, &store, &opts).unwrap();
    std::thread::sleep(Duration::from_millis(30));

    let changed_at = Instant::now();
    fs::write(upper.join("a"), noise(1000, 3)).unwrap();
    let (m1, st1) = capture(&upper, Some(&m0), &store, &opts).unwrap();
    assert_eq!(st1.bytes_read, 1000, "a changed: {st1:?}");
    let (m2, st2) = capture(&upper, Some(&m1), &store, &opts).unwrap();
    assert!(
        changed_at.elapsed() < window,
        "machine too slow for this test"
    );
    assert_eq!(st2.bytes_read, 1000, "a is racy against m1: {st2:?}");
    std::thread::sleep(window + Duration::from_millis(100));
    // m2 was taken within the window after the change too.
    let (m3, st3) = capture(&upper, Some(&m2), &store, &opts).unwrap();
    assert_eq!(st3.bytes_read, 1000, "a is racy against m2: {st3:?}");
    let (m4, st4) = capture(&upper, Some(&m3), &store, &opts).unwrap();
    assert_eq!(st4.bytes_read, 0, "settled: {st4:?}");
    assert_eq!(st4.reused, st4.entries);
    for m in [&m1, &m2, &m3] {
        assert_eq!(m.content_digest(), m4.content_digest());
    }
}

fn build_small_tree(upper: &Path) {
    fs::create_dir_all(upper.join("d/e")).unwrap();
    fs::write(upper.join("big"), noise(2 * MIB, 11)).unwrap();
    fs::write(upper.join("d/small"), b"small").unwrap();
    fs::write(upper.join("d/e/deep"), noise(10_000, 12)).unwrap();
    fs::hard_link(upper.join("d/small"), upper.join("d/e/small_link")).unwrap();
    mknod_char(&upper.join("wh"), 0, 0);
    mknod_char(&upper.join("wh2"), 0, 0);
    symlink("/etc/passwd", upper.join("passwd")).unwrap();
    setxattr(&upper.join("d"), "trusted.overlay.opaque", b"y");
    let sparse = File::create(upper.join("sparse")).unwrap();
    sparse.set_len(64 << 20).unwrap();
    sparse.write_all_at(b"tail", (64 << 20) - 4).unwrap();
}

#[test]
fn a_restored_layer_captured_against_its_rekeyed_manifest_reads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let upper = root.join("upper");
    fs::create_dir(&upper).unwrap();
    build_small_tree(&upper);
    let store = BlobStore::open(&root.join("store")).unwrap();
    let (m, _) = capture(&upper, None, &store, &LayerCaptureOptions::default()).unwrap();

    let target = root.join("target");
    let (_, rekeyed) = materialize(&m, &store, &target, true).unwrap();
    common::assert_same_tree(&upper, &target, &[]);
    assert_eq!(rekeyed.content_digest(), m.content_digest());
    assert!(rekeyed.removed.is_empty() && rekeyed.base.is_none());
    settle();

    // The original manifest does not describe the restored inodes: nothing is reused.
    let (_, st) = capture(&target, Some(&m), &store, &no_racy_window()).unwrap();
    assert_eq!(st.reused, 0, "{st:?}");
    assert_eq!(st.bytes_read, m.data_bytes());

    // Against the re-keyed manifest, everything is.
    let (again, st) = capture(&target, Some(&rekeyed), &store, &no_racy_window()).unwrap();
    assert_eq!(st.reused + hardlink_entries(&again), st.entries, "{st:?}");
    assert_eq!((st.bytes_read, st.files_read, st.new_blobs), (0, 0, 0));
    assert_eq!(again.content_digest(), m.content_digest());
    assert!(again.removed.is_empty());
    assert_eq!(again.base, Some(rekeyed.content_digest()));

    // With the default racy window, entries written in the window before the re-key are
    // read again (the re-key time is the end of the restore, whatever the wait after it).
    let (default_again, st_default) = capture(
        &target,
        Some(&rekeyed),
        &store,
        &LayerCaptureOptions::default(),
    )
    .unwrap();
    eprintln!(
        "default racy window after a restore: {} of {} entries reused, {} bytes read",
        st_default.reused, st_default.entries, st_default.bytes_read
    );
    assert_eq!(default_again.content_digest(), m.content_digest());

    // Editing the restored layer then costs only the edit.
    let mut f = OpenOptions::new()
        .append(true)
        .open(target.join("d/e/deep"))
        .unwrap();
    f.write_all(b"more").unwrap();
    drop(f);
    settle();
    let (edited, st) = capture(&target, Some(&again), &store, &no_racy_window()).unwrap();
    assert_eq!((st.bytes_read, st.files_read), (10_004, 1), "{st:?}");
    let restored2 = root.join("target2");
    materialize(&edited, &store, &restored2, true).unwrap();
    common::assert_same_tree(&target, &restored2, &[]);
}

/// A capture that is dropped instead of sealed leaves nothing in the store.
#[test]
fn an_unsealed_capture_leaves_no_staging_files() {
    let dir = tempfile::tempdir().unwrap();
    let upper = dir.path().join("upper");
    fs::create_dir(&upper).unwrap();
    build_small_tree(&upper);
    let store = BlobStore::open(&dir.path().join("store")).unwrap();
    let pending = capture_layer(&upper, None, &store, &LayerCaptureOptions::default()).unwrap();
    assert!(pending.stats().bytes_read > 2 * MIB as u64);
    assert!(
        fs::read_dir(store.dir().join(".staging"))
            .unwrap()
            .next()
            .is_some(),
        "the 2 MiB file is staged"
    );
    drop(pending);
    assert!(fs::read_dir(store.dir().join(".staging"))
        .unwrap()
        .next()
        .is_none());
    assert_eq!(store.usage().unwrap(), (0, 0));
}

fn gc_keeps_exactly_the_live_blobs(compression: Option<i32>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let store = BlobStore::open(&root.join("store"))
        .unwrap()
        .with_compression(compression);
    let shared = noise(300 << 10, 21);
    let (t1, t2) = (root.join("t1"), root.join("t2"));
    for (t, unique) in [(&t1, b"one".as_slice()), (&t2, b"two".as_slice())] {
        fs::create_dir(t).unwrap();
        fs::write(t.join("shared"), &shared).unwrap();
        fs::write(t.join("unique"), unique).unwrap();
        File::create(t.join("empty")).unwrap();
    }
    let (m1, _) = capture(&t1, None, &store, &no_racy_window()).unwrap();
    let (m2, st2) = capture(&t2, None, &store, &no_racy_window()).unwrap();
    assert_eq!(st2.new_blobs, 1, "the shared file is stored once: {st2:?}");
    let (shared_id, one, two) = (
        blob_of(&m1, "shared").unwrap(),
        blob_of(&m1, "unique").unwrap(),
        blob_of(&m2, "unique").unwrap(),
    );
    assert_eq!(blob_of(&m2, "shared"), Some(shared_id));
    assert_eq!(store.usage().unwrap().0, 3);
    if compression.is_some() {
        assert!(!store.blob_path(&shared_id).exists(), "stored compressed");
        assert!(store.contains(&shared_id));
    }

    // Both live: nothing goes, a staging leftover does.
    fs::write(store.dir().join(".staging/leftover"), b"junk").unwrap();
    let gc = store.gc([&m1, &m2]).unwrap();
    assert_eq!(
        (
            gc.live_blobs,
            gc.references,
            gc.removed_blobs,
            gc.removed_bytes
        ),
        (3, 4, 0, 4)
    );

    // Only m1 live: m2's unique blob goes, the shared one stays.
    let gc = store.gc([&m1]).unwrap();
    assert_eq!((gc.live_blobs, gc.references, gc.removed_blobs), (2, 2, 1));
    assert!(gc.removed_bytes > 0);
    assert!(store.contains(&shared_id) && store.contains(&one) && !store.contains(&two));
    for id in [shared_id, one] {
        store.verify(&id).unwrap();
    }
    assert!(matches!(store.verify(&two), Err(BlobError::Missing { blob }) if blob == two));

    // The live manifest still materializes; the dead one fails on its missing blob.
    let r1 = root.join("r1");
    materialize(&m1, &store, &r1, true).unwrap();
    common::assert_same_tree(&t1, &r1, &[]);
    match materialize(&m2, &store, &root.join("r2"), true).unwrap_err() {
        InstallError::Blob {
            path,
            source: BlobError::Missing { blob },
        } => assert_eq!((path, blob), (PathBuf::from("unique"), two)),
        other => panic!("unexpected {other:?}"),
    }

    // An incremental capture against the dead manifest takes the collected blob over
    // without reading the file, and sealing it notices.
    settle();
    let pending = capture_layer(&t2, Some(&m2), &store, &no_racy_window()).unwrap();
    assert_eq!(pending.stats().bytes_read, 0);
    match pending.seal().unwrap_err() {
        CaptureError::Blob(BlobError::Missing { blob }) => assert_eq!(blob, two),
        other => panic!("unexpected {other:?}"),
    }
    // Capturing again without a base stores it again.
    let (m2b, st) = capture(&t2, None, &store, &no_racy_window()).unwrap();
    assert_eq!(st.new_blobs, 1);
    assert_eq!(m2b.content_digest(), m2.content_digest());
    materialize(&m2, &store, &root.join("r2b"), true).unwrap();
}

#[test]
fn gc_keeps_exactly_the_live_blobs_plain() {
    gc_keeps_exactly_the_live_blobs(None);
}

#[test]
fn gc_keeps_exactly_the_live_blobs_zstd() {
    gc_keeps_exactly_the_live_blobs(Some(3));
}

/// A collection waits for every capture lease to end.
#[test]
fn gc_waits_for_leases() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(BlobStore::open(&dir.path().join("store")).unwrap());
    let lease = store.lease().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let worker = {
        let (store, done) = (store.clone(), done.clone());
        std::thread::spawn(move || {
            let stats = store.gc(std::iter::empty::<&LayerManifest>()).unwrap();
            done.store(true, Ordering::SeqCst);
            stats
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(!done.load(Ordering::SeqCst), "gc ran during a lease");
    drop(lease);
    worker.join().unwrap();
    assert!(done.load(Ordering::SeqCst));
    // Two leases at once are fine (shared).
    let (_a, _b) = (store.lease().unwrap(), store.lease().unwrap());
}

fn overlay_dirs(root: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dirs = (
        root.join(format!("{name}-upper")),
        root.join(format!("{name}-work")),
        root.join(format!("{name}-merged")),
    );
    for d in [&dirs.0, &dirs.1, &dirs.2] {
        fs::create_dir(d).unwrap();
    }
    dirs
}

/// An upper layer written by overlayfs itself (copy-ups, whiteouts, opaque directories,
/// the root's uuid), captured while mounted, twice (the second incrementally), then each
/// manifest materialized into a fresh upper directory and mounted over the same lower
/// directory: the merged views match what they were at each capture.
#[test]
fn a_real_overlay_upper_round_trips_incrementally() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let lower = root.join("lower");
    fs::create_dir_all(lower.join("olddir/sub")).unwrap();
    fs::write(lower.join("keep"), b"keep").unwrap();
    fs::write(lower.join("gone"), b"gone").unwrap();
    fs::write(lower.join("gone2"), b"gone2").unwrap();
    fs::write(lower.join("olddir/sub/c"), b"c").unwrap();
    fs::write(lower.join("big"), noise(3 * MIB, 31)).unwrap();
    let store = BlobStore::open(&root.join("store"))
        .unwrap()
        .with_compression(Some(1));

    let (upper, work, merged) = overlay_dirs(root, "live");
    let mount = belayer_overlay::OverlayMount::mount(&lower, &upper, &work, &merged).unwrap();
    fs::remove_file(merged.join("gone")).unwrap();
    fs::remove_dir_all(merged.join("olddir")).unwrap();
    fs::create_dir(merged.join("olddir")).unwrap();
    fs::write(merged.join("olddir/new"), b"new").unwrap();
    let mut f = OpenOptions::new()
        .append(true)
        .open(merged.join("big"))
        .unwrap();
    f.write_all(b"copied up").unwrap();
    drop(f);
    settle();
    let (m0, st0) = capture(&upper, None, &store, &no_racy_window()).unwrap();
    assert!(st0.bytes_read > 3 * MIB as u64, "{st0:?}");
    // overlayfs marks its upper root with a uuid; it names the instance, not content.
    if has_overlay_uuid(&upper) {
        assert!(m0.entries[0]
            .xattrs
            .iter()
            .all(|(n, _)| n != b"trusted.overlay.uuid"));
    }
    let merged0 = tree_listing(&merged, &[]).unwrap();

    fs::remove_file(merged.join("gone2")).unwrap();
    fs::write(merged.join("olddir/new2"), b"new2").unwrap();
    fs::write(merged.join("keep"), b"KEEP").unwrap();
    settle();
    let (m1, st1) = capture(&upper, Some(&m0), &store, &no_racy_window()).unwrap();
    assert!(
        st1.bytes_read < 64,
        "the copied-up 3 MiB file is not read again: {st1:?}"
    );
    let merged1 = tree_listing(&merged, &[]).unwrap();
    drop(mount);

    for (k, (m, want)) in [(&m0, &merged0), (&m1, &merged1)].into_iter().enumerate() {
        let (upper, work, merged) = overlay_dirs(root, &format!("restored{k}"));
        fs::remove_dir(&upper).unwrap();
        materialize(m, &store, &upper, true).unwrap();
        let _mount = belayer_overlay::OverlayMount::mount(&lower, &upper, &work, &merged).unwrap();
        assert_eq!(&tree_listing(&merged, &[]).unwrap(), want, "capture {k}");
        assert!(!merged.join("gone").exists());
        assert_eq!(common::names(&merged.join("olddir"))[0], "new");
    }
}

fn has_overlay_uuid(upper: &Path) -> bool {
    layer_common::getxattr(upper, "trusted.overlay.uuid").is_some()
}

#[test]
fn a_damaged_blob_is_replaced_by_the_next_capture_holding_its_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(&dir.path().join("store")).unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    for d in [&a, &b] {
        fs::create_dir(d).unwrap();
        fs::write(d.join("f"), b"the same bytes in two sandboxes").unwrap();
    }
    let (first, _) = capture(&a, None, &store, &no_racy_window()).unwrap();
    let id = first.blobs()[0];
    // Damaged at rest: one flipped byte.
    let path = store.blob_path(&id);
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    let mut bytes = fs::read(&path).unwrap();
    bytes[0] ^= 1;
    fs::write(&path, bytes).unwrap();
    assert!(store.verify(&id).is_err());
    // Another capture with the same content stores it again instead of trusting the copy.
    let (second, stats) = capture(&b, None, &store, &no_racy_window()).unwrap();
    assert_eq!(second.blobs(), [id]);
    assert_eq!(stats.new_blobs, 1);
    store.verify(&id).unwrap();
}
