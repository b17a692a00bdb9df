//! Atomic publication: a checkpoint failing at any stage (an error, or belayerd SIGKILLed
//! mid-way) leaves the previous ready checkpoint in effect, no partial checkpoint visible and
//! the sandbox thawed.

use belayer_ipc::{ErrorCode, FailPoint, Request, Response, TestFault};
use belayer_tests::{busybox_rootfs, Daemon};

const POINTS: [FailPoint; 5] = [
    FailPoint::AfterFreeze,
    FailPoint::AfterFsCapture,
    FailPoint::DuringCriuDump,
    FailPoint::BeforeRename,
    FailPoint::BeforePointerUpdate,
];

fn checkpoints(d: &Daemon, id: &str) -> Vec<u64> {
    match d.call(Request::ListCheckpoints { id: id.into() }) {
        Response::Checkpoints(v) => v.into_iter().map(|c| c.prefix).collect(),
        r => panic!("{r:?}"),
    }
}

fn store_entries(d: &Daemon, id: &str) -> Vec<String> {
    let dir = d.state_dir.join("sandboxes").join(id).join("checkpoints");
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// After a failed or interrupted checkpoint: `ready` is still the ready prefix, exactly the
/// checkpoints `listed` are there (no partial one, no staging), and the sandbox runs.
fn assert_previous_in_effect(d: &Daemon, id: &str, what: &str, ready: u64, listed: &[u64]) {
    assert_eq!(
        d.inspect(id).ready_prefix,
        Some(ready),
        "{what}: ready pointer moved"
    );
    assert_eq!(
        checkpoints(d, id),
        listed,
        "{what}: a partial checkpoint is visible"
    );
    let entries = store_entries(d, id);
    assert!(
        entries.iter().all(|e| !e.starts_with(".tmp-")),
        "{what}: staging left behind: {entries:?}"
    );
    assert_eq!(
        entries.iter().filter(|e| e.starts_with('c')).count(),
        listed.len(),
        "{what}: {entries:?}"
    );
    // Thawed: an action runs (it would hang on a frozen cgroup) and the loop still counts.
    let a = d.number(id, "/tmp/count");
    std::thread::sleep(std::time::Duration::from_millis(250));
    let b = d.number(id, "/tmp/count");
    assert!(b > a, "{what}: sandbox still frozen ({a} → {b})");
}

/// A daemon with a busybox sandbox whose background loop counts in `/tmp/count`, and its C_1
/// of `/state` = k1.
fn counting_sandbox() -> (Daemon, String) {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done >/dev/null 2>&1 &",
    );
    d.sh(&id, "echo k1 > /state");
    d.checkpoint(&id, 1, b"L1");
    (d, id)
}

#[test]
fn failing_checkpoints_keep_the_previous_one() {
    let (mut d, id) = counting_sandbox();

    fail_at_every_point(&mut d, &id, 2, 1, &[1]);
    // The previous checkpoint still restores, with its own state and context.
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!((r.prefix, r.context.as_slice()), (Some(1), &b"L1"[..]));
    assert_eq!(d.sh(&id, "cat /state"), "k1");
}

/// A checkpoint of `prefix` failed, and the daemon killed, at every fail point in turn; after
/// each, [`assert_previous_in_effect`] with `ready` and `listed`.
fn fail_at_every_point(d: &mut Daemon, id: &str, prefix: u64, ready: u64, listed: &[u64]) {
    for at in POINTS {
        for kill_daemon in [false, true] {
            let what = format!("{at:?} kill_daemon={kill_daemon}");
            d.sh(id, &format!("echo k{prefix} > /state"));
            let fault = Some(TestFault { at, kill_daemon });
            if kill_daemon {
                let r = d
                    .client()
                    .call(Request::Checkpoint(belayer_ipc::CheckpointRequest {
                        id: id.to_string(),
                        prefix,
                        context: format!("L{prefix}").into_bytes(),
                        fault,
                    }));
                assert!(
                    r.is_err(),
                    "{what}: the daemon answered instead of dying: {r:?}"
                );
                let status = d.wait_exit();
                assert!(!status.success(), "{what}");
                d.restart();
            } else {
                match d.checkpoint_raw(id, prefix, format!("L{prefix}").as_bytes(), fault) {
                    Response::Error(e) => {
                        assert_eq!(e.code, ErrorCode::CheckpointFailed, "{what}: {e:?}")
                    }
                    r => panic!("{what}: expected an error, got {r:?}"),
                }
            }
            assert_previous_in_effect(d, id, &what, ready, listed);
        }
    }
}

#[test]
fn failing_checkpoints_on_a_branch_keep_the_tree() {
    let (mut d, id) = counting_sandbox();
    d.sh(&id, "echo k2 > /state");
    d.checkpoint(&id, 2, b"L2");
    // Back to C_1: C_2 is a branch now; every failed checkpoint of a new branch from C_1
    // leaves C_1 ready and both checkpoints, and nothing of itself.
    match d.call(Request::Restore {
        id: id.clone(),
        verify: false,
        prefix: Some(1),
    }) {
        Response::Restored(r) => assert_eq!(r.prefix, Some(1)),
        r => panic!("{r:?}"),
    }
    fail_at_every_point(&mut d, &id, 3, 1, &[1, 2]);
    // A checkpoint that succeeds is a child of C_1; each node restores its own state.
    d.sh(&id, "echo k3 > /state");
    let c3 = d.checkpoint(&id, 3, b"L3");
    let list = match d.call(Request::ListCheckpoints { id: id.clone() }) {
        Response::Checkpoints(v) => v,
        r => panic!("{r:?}"),
    };
    assert_eq!(list.len(), 3);
    assert_eq!(list[2].checkpoint, c3.checkpoint);
    assert_eq!(list[2].parent.as_deref(), Some(list[0].checkpoint.as_str()));
    assert_eq!(list[1].parent.as_deref(), Some(list[0].checkpoint.as_str()));
    for (k, state) in [(2, "k2"), (3, "k3"), (1, "k1")] {
        let name = list
            .iter()
            .find(|c| c.prefix == k)
            .unwrap()
            .checkpoint
            .clone();
        match d.call(Request::RestoreCheckpoint {
            id: id.clone(),
            verify: true,
            checkpoint: name,
        }) {
            Response::Restored(r) => {
                assert_eq!(r.context, format!("L{k}").into_bytes());
                assert!(r.validity.is_some_and(|v| v.fs_matches));
            }
            r => panic!("restore C_{k}: {r:?}"),
        }
        assert_eq!(d.sh(&id, "cat /state"), state);
    }
}

#[test]
fn test_faults_are_refused_without_test_hooks() {
    let d = Daemon::start_with(false);
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let fault = Some(TestFault {
        at: FailPoint::AfterFreeze,
        kill_daemon: true,
    });
    match d.checkpoint_raw(&id, 1, b"", fault) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
        r => panic!("{r:?}"),
    }
    assert_eq!(d.inspect(&id).ready_prefix, None);
    assert_eq!(d.sh(&id, "echo alive"), "alive");
}
