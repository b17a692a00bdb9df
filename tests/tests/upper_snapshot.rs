//! The checkpoint's upper snapshot (`upper.snap`, `agent/src/store/snapshot.rs`): a restore
//! installs it only when it is the read-only subvolume the manifest names, and otherwise
//! materializes F_k from the manifest (same content, new inode numbers); it is deleted with
//! its checkpoint, its sandbox and an unpublished staging dir; `upper_snapshots = false`
//! takes none. The state dir is on btrfs with quotas (as `scripts/setup.sh` makes it), and
//! the `btrfs` tool plays the part of whoever tampers with the store.

use std::path::{Path, PathBuf};
use std::process::Command;

use belayer_ipc::{Request, Response};
use belayer_tests::{busybox_rootfs, Daemon, DaemonOptions};

fn sandbox(d: &Daemon) -> String {
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "mkdir -p /work && echo one > /work/f");
    id
}

/// The checkpoint directory of the sandbox's ready checkpoint.
fn ready_dir(d: &Daemon, id: &str) -> PathBuf {
    let store = d.state_dir.join("sandboxes").join(id).join("checkpoints");
    let name = std::fs::read_to_string(store.join("READY")).expect("READY");
    store.join(name.trim())
}

fn btrfs(args: &[&str]) -> String {
    let out = Command::new("btrfs").args(args).output().expect("btrfs");
    assert!(out.status.success(), "btrfs {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Subvolumes of the file system whose path contains `needle`.
fn subvolumes_with(state_dir: &Path, needle: &str) -> Vec<String> {
    btrfs(&["subvolume", "list", state_dir.to_str().unwrap()])
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

fn ino(d: &Daemon, id: &str) -> String {
    d.sh(id, "stat -c %i /work/f").trim().to_string()
}

/// An `upper.snap` swapped for a writable subvolume with other content, or for a read-only
/// snapshot of another subvolume, or removed, is not installed: the restore materializes
/// F_k from the manifest (the checkpoint's content, `inodes_kept` false).
#[test]
fn a_replaced_or_missing_upper_snapshot_is_not_installed() {
    let d = Daemon::start();
    let id = sandbox(&d);
    for (k, case) in (1..).zip(["writable", "other", "missing"]) {
        d.sh(&id, "echo one > /work/f");
        d.checkpoint(&id, k, b"one");
        let dir = ready_dir(&d, &id);
        let snap = dir.join("upper.snap");
        let snap_s = snap.to_str().unwrap();
        btrfs(&["subvolume", "delete", snap_s]);
        match case {
            "writable" => {
                btrfs(&["subvolume", "create", snap_s]);
                std::fs::create_dir_all(snap.join("upper/work")).unwrap();
                std::fs::write(snap.join("upper/work/f"), "planted\n").unwrap();
            }
            "other" => {
                let other = dir.join("other");
                btrfs(&["subvolume", "create", other.to_str().unwrap()]);
                std::fs::create_dir_all(other.join("upper/work")).unwrap();
                std::fs::write(other.join("upper/work/f"), "planted\n").unwrap();
                btrfs(&[
                    "subvolume",
                    "snapshot",
                    "-r",
                    other.to_str().unwrap(),
                    snap_s,
                ]);
                btrfs(&["subvolume", "delete", other.to_str().unwrap()]);
            }
            _ => {}
        }
        d.sh(&id, "echo two > /work/f");
        d.fail_stop(&id);
        let r = d.restore(&id);
        assert_eq!(r.prefix, Some(k), "{case}");
        assert!(!r.inodes_kept, "{case}: a replaced snapshot was installed");
        assert_eq!(d.sh(&id, "cat /work/f").trim(), "one", "{case}");
        assert!(
            d.log_text().contains("upper snapshot not used"),
            "{case}: no warning"
        );
    }
    // The tampered checkpoints go with the sandbox, subvolumes and all.
    assert!(matches!(
        d.call(Request::RemoveSandbox { id: id.clone() }),
        Response::Done
    ));
    assert_eq!(subvolumes_with(&d.state_dir, &id), Vec::<String>::new());
}

/// Every subvolume of a sandbox (instances, upper snapshots of published checkpoints) is
/// gone after `sandbox rm`, and a checkpoint's snapshot after `gc`.
#[test]
fn upper_snapshots_go_with_their_checkpoints_and_sandbox() {
    let d = Daemon::start();
    let id = sandbox(&d);
    for k in 1..=3 {
        d.sh(&id, &format!("echo {k} > /work/f"));
        d.checkpoint(&id, k, b"k");
    }
    let snaps = || {
        subvolumes_with(&d.state_dir, &id)
            .into_iter()
            .filter(|l| l.ends_with("/upper.snap"))
            .count()
    };
    assert_eq!(snaps(), 3);
    match d.call(Request::Gc {
        older_than_s: Some(0),
        tag: None,
    }) {
        Response::Gc { removed, .. } => assert_eq!(removed, 2),
        r => panic!("{r:?}"),
    }
    assert_eq!(snaps(), 1, "gc left the snapshots of removed checkpoints");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert!(r.inodes_kept, "{r:?}");
    assert_eq!(d.sh(&id, "cat /work/f").trim(), "3");
    assert!(matches!(
        d.call(Request::RemoveSandbox { id: id.clone() }),
        Response::Done
    ));
    assert_eq!(subvolumes_with(&d.state_dir, &id), Vec::<String>::new());
}

/// `upper_snapshots = false`: checkpoints hold no snapshot and restores materialize F_k
/// (new inode numbers, same content).
#[test]
fn without_upper_snapshots_restores_materialize() {
    let d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: "upper_snapshots = false\n".into(),
        ..DaemonOptions::default()
    });
    let id = sandbox(&d);
    let before = ino(&d, &id);
    let ck = d.checkpoint(&id, 1, b"one");
    assert_eq!(ck.timings_ms.upper_snapshot, 0.0);
    assert!(!ready_dir(&d, &id).join("upper.snap").exists());
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert!(!r.inodes_kept, "{r:?}");
    assert_eq!(d.sh(&id, "cat /work/f").trim(), "one");
    eprintln!("st_ino {before} -> {}", ino(&d, &id));
}

/// With an upper snapshot a restore still verifies every artifact (a flipped byte of the layer
/// manifest is refused, the sandbox untouched), but reads no blob: a corrupt blob does not
/// stop it, and the restored files are the checkpoint's.
#[test]
fn a_snapshot_restore_verifies_artifacts_and_reads_no_blob() {
    let d = Daemon::start();
    let id = sandbox(&d);
    d.sh(&id, "echo v1 > /v");
    d.checkpoint(&id, 1, b"L1");
    let layer = ready_dir(&d, &id).join("upper.layer");
    let original = std::fs::read(&layer).unwrap();
    let mut bytes = original.clone();
    bytes[20] ^= 0x01;
    std::fs::write(&layer, &bytes).unwrap();
    d.sh(&id, "echo v2 > /v");
    match d.restore_raw(&id) {
        Response::Error(e) => {
            assert_eq!(e.code, belayer_ipc::ErrorCode::CorruptCheckpoint, "{e:?}");
            assert!(e.message.contains("upper.layer"), "{e:?}");
        }
        r => panic!("a corrupt layer manifest was restored: {r:?}"),
    }
    assert_eq!(d.sh(&id, "cat /v"), "v2");
    std::fs::write(&layer, original).unwrap();
    d.corrupt_blob(b"v1\n");
    let r = d.restore(&id);
    assert!(r.inodes_kept, "{r:?}");
    assert_eq!(d.sh(&id, "cat /v"), "v1");
}

/// State: a hardlinked image file one of whose names the sandbox changed (overlayfs copies it
/// up and, with `index=on`, keeps every name on the copy). After a restore from the snapshot
/// all names are still one inode with the changed content: the overlay index comes back with
/// the upper layer.
#[test]
fn a_copied_up_hardlinked_image_file_stays_one_inode() {
    let d = Daemon::start();
    d.image("python", &belayer_tests::python_rootfs());
    let id = d.create("python").id;
    // Two names of one image inode.
    let names = d.sh(
        &id,
        "f=$(find /usr/bin /usr/sbin /bin -xdev -type f -links 2 2>/dev/null | head -1); \
         find /usr /bin /sbin -xdev -inum $(stat -c %i \"$f\") 2>/dev/null | head -2",
    );
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 2, "no hardlinked image file: {names:?}");
    let (a, b) = (names[0], names[1]);
    d.sh(&id, &format!("echo CHANGED >> {a}"));
    let look = || {
        d.sh(
            &id,
            &format!("stat -c %i {a} {b}; tail -c 8 {a}; tail -c 8 {b}"),
        )
    };
    let before = look();
    let lines: Vec<&str> = before.lines().collect();
    assert_eq!(lines[0], lines[1], "not one inode before: {before}");
    assert_eq!(lines[2], "CHANGED", "{before}");
    assert_eq!(lines[3], "CHANGED", "{before}");
    d.checkpoint(&id, 1, b"one");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert!(r.inodes_kept, "{r:?}");
    assert_eq!(look(), before, "the names of {a} split at the restore");
}
