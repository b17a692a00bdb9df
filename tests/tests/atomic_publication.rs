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

fn assert_previous_in_effect(d: &Daemon, id: &str, what: &str) {
    assert_eq!(
        d.inspect(id).ready_prefix,
        Some(1),
        "{what}: ready pointer moved"
    );
    assert_eq!(
        checkpoints(d, id),
        vec![1],
        "{what}: a partial checkpoint is visible"
    );
    let entries = store_entries(d, id);
    assert!(
        entries.iter().all(|e| !e.starts_with(".tmp-")),
        "{what}: staging left behind: {entries:?}"
    );
    assert_eq!(
        entries.iter().filter(|e| e.starts_with('c')).count(),
        1,
        "{what}: {entries:?}"
    );
    // Thawed: an action runs (it would hang on a frozen cgroup) and the loop still counts.
    let a = d.number(id, "/tmp/count");
    std::thread::sleep(std::time::Duration::from_millis(250));
    let b = d.number(id, "/tmp/count");
    assert!(b > a, "{what}: sandbox still frozen ({a} → {b})");
}

#[test]
fn failing_checkpoints_keep_the_previous_one() {
    let mut d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done >/dev/null 2>&1 &",
    );
    d.sh(&id, "echo k1 > /state");
    d.checkpoint(&id, 1, b"L1");

    for at in POINTS {
        for kill_daemon in [false, true] {
            let what = format!("{at:?} kill_daemon={kill_daemon}");
            d.sh(&id, "echo k2 > /state");
            let fault = Some(TestFault { at, kill_daemon });
            if kill_daemon {
                let r = d
                    .client()
                    .call(Request::Checkpoint(belayer_ipc::CheckpointRequest {
                        id: id.clone(),
                        prefix: 2,
                        context: b"L2".to_vec(),
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
                match d.checkpoint_raw(&id, 2, b"L2", fault) {
                    Response::Error(e) => {
                        assert_eq!(e.code, ErrorCode::CheckpointFailed, "{what}: {e:?}")
                    }
                    r => panic!("{what}: expected an error, got {r:?}"),
                }
            }
            assert_previous_in_effect(&d, &id, &what);
        }
    }
    // The previous checkpoint still restores, with its own state and context.
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!((r.prefix, r.context.as_slice()), (Some(1), &b"L1"[..]));
    assert_eq!(d.sh(&id, "cat /state"), "k1");
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
