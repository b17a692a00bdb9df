//! Unit tests of the checkpoint store: publication, the ready pointer and its bound,
//! leftovers, and the tree a restore of an earlier checkpoint branches.

use super::*;

fn manifest(store: &CheckpointStore, staging: &Staging, prefix: u64) -> Manifest {
    let parent = store.ready().unwrap();
    fs::write(staging.dir().join("context.bin"), b"ctx").unwrap();
    fs::write(staging.dir().join(UPPER_LAYER), b"layer").unwrap();
    let m = Manifest::for_test(
        &staging.name(),
        staging.seq(),
        prefix,
        parent,
        artifact(staging.dir(), "context.bin").unwrap(),
        artifact(staging.dir(), UPPER_LAYER).unwrap(),
    );
    fs::write(
        staging.dir().join(MANIFEST),
        serde_json::to_vec(&m).unwrap(),
    )
    .unwrap();
    m
}

#[test]
fn publish_then_point_then_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    assert_eq!(store.ready().unwrap(), None);
    let mut s = store.begin(3).unwrap();
    manifest(&store, &s, 3);
    store.publish(&mut s).unwrap();
    // Published but not pointed: invisible, and dropped by the next checkpoint, which
    // takes its sequence number (it never becomes visible).
    assert!(store.list().unwrap().is_empty());
    let mut s2 = store.begin(3).unwrap();
    assert_eq!(s2.seq(), 1);
    assert!(!store.path(&s.name()).exists());
    manifest(&store, &s2, 3);
    store.publish(&mut s2).unwrap();
    store.set_ready(&s2.name()).unwrap();
    assert_eq!(store.list().unwrap().len(), 1);
    let mut s3 = store.begin(4).unwrap();
    assert_eq!(s3.seq(), 2);
    manifest(&store, &s3, 4);
    store.publish(&mut s3).unwrap();
    store.set_ready(&s3.name()).unwrap();
    assert_eq!(store.list().unwrap().len(), 2);
    let m = store.verify(&s3.name()).unwrap();
    assert_eq!(store.read_context(&m).unwrap(), b"ctx");
    // Flip one byte → corrupt.
    let p = store.path(&s3.name()).join(UPPER_LAYER);
    fs::write(&p, b"taR").unwrap();
    assert!(matches!(
        store.verify(&s3.name()),
        Err(StoreError::Corrupt { .. })
    ));
}

#[test]
fn unpublished_leftovers_are_discarded() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    let mut a = store.begin(1).unwrap();
    manifest(&store, &a, 1);
    store.publish(&mut a).unwrap();
    store.set_ready(&a.name()).unwrap();
    let staging = store.begin(3).unwrap();
    std::mem::forget(staging); // as if the daemon died
    let mut b = store.begin(2).unwrap();
    manifest(&store, &b, 2);
    store.publish(&mut b).unwrap();
    assert_eq!(store.discard_unpublished().unwrap(), 2);
    assert_eq!(store.ready().unwrap(), Some(a.name()));
    assert_eq!(store.list().unwrap().len(), 1);
}

fn published(store: &CheckpointStore, prefix: u64) -> String {
    let mut s = store.begin(prefix).unwrap();
    manifest(store, &s, prefix);
    store.publish(&mut s).unwrap();
    store.set_ready(&s.name()).unwrap();
    s.name()
}

fn prefixes(store: &CheckpointStore) -> Vec<u64> {
    store.list().unwrap().iter().map(|m| m.prefix).collect()
}

#[test]
fn pointing_back_keeps_the_later_checkpoints_as_a_branch() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    assert_eq!(store.line_of_prefix(1).unwrap(), None);
    let names: Vec<String> = [1, 2, 2, 3].iter().map(|k| published(&store, *k)).collect();
    // The latest checkpoint of a boundary on the ready line; unknown boundaries are none.
    assert_eq!(store.line_of_prefix(2).unwrap(), Some(names[2].clone()));
    assert_eq!(store.line_of_prefix(7).unwrap(), None);
    assert_eq!(store.bound().unwrap(), 4);

    // The pointer moves back to the first C_2: the bound stays, every checkpoint stays
    // listed; a prefix names the ready line's checkpoints only, a name any visible one.
    store.set_ready(&names[1]).unwrap();
    assert_eq!(store.bound().unwrap(), 4);
    assert_eq!(fs::read_to_string(tmp.path().join(BOUND)).unwrap(), "4\n");
    assert_eq!(prefixes(&store), [1, 2, 2, 3]);
    assert_eq!(store.line_of_prefix(2).unwrap(), Some(names[1].clone()));
    assert_eq!(store.line_of_prefix(3).unwrap(), None);
    assert_eq!(store.visible(&names[3]).unwrap(), Some(names[3].clone()));
    for bad in ["c000009-k9", "../c000001-k1", "c000001-k1/..", "READY"] {
        assert_eq!(store.visible(bad).unwrap(), None, "{bad}");
    }
    assert_eq!(store.discard_invisible().unwrap(), Vec::<u64>::new());

    // The next checkpoint is a child of the ready one, with the next sequence number.
    let child = published(&store, 3);
    assert_eq!(store.load(&child).unwrap().seq, 5);
    assert_eq!(store.load(&child).unwrap().parent, Some(names[1].clone()));
    let line: Vec<String> = store
        .ancestry(&child)
        .into_iter()
        .map(|m| m.checkpoint)
        .collect();
    assert_eq!(line, [child.clone(), names[1].clone(), names[0].clone()]);
    // On its line, boundary 3 is the child's; boundary 2 the first C_2.
    assert_eq!(store.line_of_prefix(3).unwrap(), Some(child.clone()));
    assert_eq!(store.line_of_prefix(2).unwrap(), Some(names[1].clone()));
    let infos = store.infos().unwrap();
    assert_eq!(infos.iter().filter(|i| i.ready).count(), 1);
    assert!(infos
        .last()
        .is_some_and(|i| i.ready && i.checkpoint == child));

    // A crash between a publication and its pointer: the checkpoint above the bound is
    // invisible and the next one drops it first.
    let mut orphan = store.begin(9).unwrap();
    manifest(&store, &orphan, 9);
    store.publish(&mut orphan).unwrap();
    assert_eq!(prefixes(&store), [1, 2, 2, 3, 3]);
    let next = published(&store, 4);
    assert!(!store.path(&orphan.name()).exists());
    assert_eq!(store.ready().unwrap(), Some(next));
}

#[test]
fn the_bound_survives_clears_and_removals_and_numbers_are_never_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    let names: Vec<String> = [1, 2, 3].iter().map(|k| published(&store, *k)).collect();
    // A store of the previous version: `READY` alone bounds, and a move forward writes
    // nothing else.
    assert!(!tmp.path().join(BOUND).exists());
    assert_eq!(store.bound().unwrap(), 3);
    store.clear_ready().unwrap();
    assert_eq!(store.ready().unwrap(), None);
    assert_eq!(store.bound().unwrap(), 3);
    assert_eq!(prefixes(&store), [1, 2, 3]);
    // Every checkpoint removed (a gc by tag): the next one still takes a new number, so a
    // crash before its pointer moves leaves it invisible, not visible under the old bound.
    for n in &names {
        store.remove(n).unwrap();
    }
    let mut s = store.begin(1).unwrap();
    assert_eq!(s.seq(), 4);
    manifest(&store, &s, 1);
    store.publish(&mut s).unwrap();
    assert!(prefixes(&store).is_empty());
    assert_eq!(store.discard_unpublished().unwrap(), 1);
    // Garbage in a pointer names and bounds nothing, and then nothing is discarded.
    let kept = published(&store, 5);
    fs::write(tmp.path().join(BOUND), "x\n").unwrap();
    assert!(matches!(store.bound(), Err(StoreError::BadPointer { .. })));
    assert!(store.discard_unpublished().is_err());
    assert!(store.path(&kept).exists());
    fs::write(tmp.path().join(BOUND), "5\n").unwrap();
    fs::write(tmp.path().join(READY), "../c000005-k5\n").unwrap();
    assert!(matches!(store.ready(), Err(StoreError::BadPointer { .. })));
    fs::write(tmp.path().join(READY), "c000009-k9\n").unwrap();
    assert!(matches!(store.ready(), Err(StoreError::DanglingReady(_))));
    assert!(store.remove("../x").is_err() && store.load("c1-k1/../..").is_err());
}

#[test]
fn ancestry_ends_at_a_parent_that_is_gone_or_not_earlier() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    let names: Vec<String> = [1, 2, 3].iter().map(|k| published(&store, *k)).collect();
    store.remove(&names[1]).unwrap();
    let line: Vec<String> = store
        .ancestry(&names[2])
        .into_iter()
        .map(|m| m.checkpoint)
        .collect();
    assert_eq!(line, [names[2].clone()]);
    // A manifest naming a later checkpoint as its parent cannot make the walk loop.
    let p = store.path(&names[0]).join(MANIFEST);
    let mut m: Manifest = serde_json::from_slice(&fs::read(&p).unwrap()).unwrap();
    m.parent = Some(names[2].clone());
    fs::write(&p, serde_json::to_vec(&m).unwrap()).unwrap();
    let mut m3 = store.load(&names[2]).unwrap();
    m3.parent = Some(names[0].clone());
    fs::write(
        store.path(&names[2]).join(MANIFEST),
        serde_json::to_vec(&m3).unwrap(),
    )
    .unwrap();
    assert_eq!(store.ancestry(&names[2]).len(), 2);
}

#[test]
fn staging_is_removed_on_drop() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    let dir = {
        let s = store.begin(1).unwrap();
        s.dir().to_path_buf()
    };
    assert!(!dir.exists());
}
