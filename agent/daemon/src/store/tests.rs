//! Unit tests of the checkpoint store: publication, the ready pointer, leftovers and the
//! rewind of a restore of an earlier checkpoint.

use super::*;

fn manifest(store: &CheckpointStore, staging: &Staging, prefix: u64) -> Manifest {
    fs::write(staging.dir().join("context.bin"), b"ctx").unwrap();
    fs::write(staging.dir().join(UPPER_LAYER), b"layer").unwrap();
    let m = Manifest {
        format: FORMAT_VERSION,
        sandbox: "sb".into(),
        prefix,
        checkpoint: staging.name(),
        seq: staging.seq(),
        image: "img".into(),
        instance: 0,
        context: ContextRecord {
            record: format!("sb/k{prefix}"),
            artifact: artifact(staging.dir(), "context.bin").unwrap(),
        },
        upper: artifact(staging.dir(), UPPER_LAYER).unwrap(),
        layer: LayerSummary::default(),
        criu: vec![],
        processes: vec![],
        ns_last_pid: None,
        own_netns: false,
        image_digest: None,
        upper_snapshot: None,
        upper_bytes: None,
        timings_ms: Default::default(),
        created_unix_ms: 0,
    };
    fs::write(
        staging.dir().join(MANIFEST),
        serde_json::to_vec(&m).unwrap(),
    )
    .unwrap();
    let _ = store;
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
fn pointing_back_hides_the_later_checkpoints_at_every_step() {
    let tmp = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(tmp.path()).unwrap();
    assert_eq!(store.visible_of_prefix(1).unwrap(), None);
    let names: Vec<String> = [1, 2, 2, 3].iter().map(|k| published(&store, *k)).collect();
    // The latest checkpoint of a boundary; unknown boundaries are none.
    assert_eq!(store.visible_of_prefix(2).unwrap(), Some(names[2].clone()));
    assert_eq!(store.visible_of_prefix(7).unwrap(), None);

    // Step 1: the pointer moves back. From here on (a crash at any later step) the later
    // checkpoint is invisible and unrestorable by prefix.
    store.set_ready(&names[1]).unwrap();
    assert_eq!(prefixes(&store), [1, 2]);
    assert_eq!(store.visible_of_prefix(3).unwrap(), None);
    assert_eq!(store.visible_of_prefix(2).unwrap(), Some(names[1].clone()));
    // Step 2: it is dropped.
    assert_eq!(store.discard_after_ready().unwrap(), [2, 3]);
    assert_eq!(store.discard_after_ready().unwrap(), Vec::<u64>::new());
    assert_eq!(store.names().unwrap(), names[..2]);

    // A crash between the steps: the next checkpoint drops the hidden ones first, so its
    // sequence number neither collides with them nor makes them visible again.
    let later = published(&store, 3);
    store.set_ready(&names[0]).unwrap();
    let next = published(&store, 4);
    assert_eq!(prefixes(&store), [1, 4]);
    assert!(!store.path(&later).exists() && !store.path(&names[1]).exists());
    assert_eq!(store.ready().unwrap(), Some(next));
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
