//! Lifecycle: belayerd re-adopts running sandboxes after its own restart and survives clients
//! that disconnect mid-request; listing, removal and garbage collection of checkpoints.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use belayer_ipc::{Request, Response, SandboxSpec};
use belayer_tests::{busybox_rootfs, Daemon};

#[test]
fn sandboxes_outlive_a_daemon_restart() {
    let mut d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done >/dev/null 2>&1 &",
    );
    d.checkpoint(&id, 1, b"L1");
    let before = d.inspect(&id);
    d.kill();
    std::thread::sleep(Duration::from_millis(300));
    d.restart();
    let info = d.inspect(&id);
    assert_eq!(info.state, "running");
    assert_eq!(info.init_pid, before.init_pid, "same instance, re-adopted");
    // The loop's shell survives (its short-lived `sleep` children come and go).
    assert!(
        info.pids.contains(&before.pids[1]),
        "{:?} vs {:?}",
        info.pids,
        before.pids
    );
    assert_eq!(info.ready_prefix, Some(1));
    let a = d.number(&id, "/tmp/count");
    d.checkpoint(&id, 2, b"L2");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(2));
    let b = d.number(&id, "/tmp/count");
    assert!(b >= a);
}

#[test]
fn a_client_disconnecting_mid_request_disturbs_nothing() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    // Send a long action, then hang up before the answer.
    {
        let req = Request::Exec(belayer_ipc::ExecRequest {
            id: id.clone(),
            argv: vec!["sleep 0.5; echo x > /after".into()],
            ..Default::default()
        });
        let frame = belayer_ipc::encode_frame(
            &belayer_ipc::Envelope { id: 1, body: req },
            belayer_ipc::DEFAULT_MAX_FRAME,
        )
        .unwrap();
        let mut s = UnixStream::connect(&d.socket).unwrap();
        s.write_all(&frame).unwrap();
        // Let the daemon start the action, then hang up mid-request.
        std::thread::sleep(Duration::from_millis(200));
        drop(s);
    }
    // The next action waits for the first (one action at a time) and sees its effect.
    assert_eq!(d.sh(&id, "cat /after"), "x");
    assert!(matches!(d.call(Request::Ping), Response::Pong { .. }));
}

#[test]
fn list_remove_and_gc() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let tagged = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            tag: Some("rollout-7".into()),
            ..Default::default()
        })
        .id;
    let other = d.create("busybox").id;
    for k in 1..=3 {
        d.checkpoint(&tagged, k, b"t");
        d.checkpoint(&other, k, b"o");
    }
    let list = |id: &str| match d.call(Request::ListCheckpoints { id: id.into() }) {
        Response::Checkpoints(v) => v.into_iter().map(|c| c.prefix).collect::<Vec<_>>(),
        r => panic!("{r:?}"),
    };
    assert_eq!(list(&tagged), vec![1, 2, 3]);
    // Age-based gc keeps the ready checkpoint.
    match d.call(Request::Gc {
        older_than_s: Some(0),
        tag: None,
    }) {
        Response::Gc { removed, bytes } => assert!(removed == 4 && bytes > 0, "{removed} {bytes}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(list(&other), vec![3]);
    // Tag gc drops everything of that rollout.
    match d.call(Request::Gc {
        older_than_s: None,
        tag: Some("rollout-7".into()),
    }) {
        Response::Gc { removed, .. } => assert_eq!(removed, 1),
        r => panic!("{r:?}"),
    }
    assert_eq!(list(&tagged), Vec::<u64>::new());
    assert_eq!(d.inspect(&tagged).ready_prefix, None);
    assert_eq!(list(&other), vec![3]);
    // Removal deletes the sandbox, its processes and checkpoints.
    let pids = d.inspect(&other).pids;
    let removed = d.call(Request::RemoveSandbox { id: other.clone() });
    assert!(matches!(removed, Response::Done), "{removed:?}");
    assert!(!d.state_dir.join("sandboxes").join(&other).exists());
    std::thread::sleep(Duration::from_millis(100));
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .map(|s| s.contains(") Z"))
                    .unwrap_or(true)
        );
    }
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => assert_eq!(v.len(), 1),
        r => panic!("{r:?}"),
    }
}

#[test]
fn limits_are_applied() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            pids_max: Some(8),
            memory_max: Some(64 << 20),
            ..Default::default()
        })
        .id;
    // More processes than pids.max cannot be created.
    let r = d.exec(
        &id,
        "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do sleep 2 & done; wait",
    );
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(
        r.exit_code != 0 || stderr.contains("fork"),
        "fork beyond pids.max must fail: {stderr:?}"
    );
    assert!(d.inspect(&id).pids.len() <= 8);
    assert_eq!(d.sh(&id, "echo still-alive"), "still-alive");
}
