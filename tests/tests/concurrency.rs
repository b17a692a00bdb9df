//! Actions and checkpoints of one sandbox serialise; two sandboxes checkpoint concurrently.

use std::time::{Duration, Instant};

use belayer_tests::{busybox_rootfs, Daemon};

#[test]
fn exec_and_checkpoint_on_one_sandbox_serialise() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let started = Instant::now();
    std::thread::scope(|s| {
        let action = s.spawn(|| {
            // The action writes a marker at its very end.
            d.sh(&id, "sleep 1; echo done > /marker");
            started.elapsed()
        });
        std::thread::sleep(Duration::from_millis(200));
        let ckpt = s.spawn(|| {
            let c = d.checkpoint(&id, 1, b"ctx");
            (started.elapsed(), c)
        });
        let action_end = action.join().unwrap();
        let (ckpt_end, _c) = ckpt.join().unwrap();
        assert!(
            ckpt_end >= action_end,
            "checkpoint finished before the action it had to wait for"
        );
    });
    // The checkpoint was taken after the action: its tree has the marker.
    d.sh(&id, "rm /marker");
    d.fail_stop(&id);
    d.restore(&id);
    assert_eq!(d.sh(&id, "cat /marker"), "done");
}

#[test]
fn two_sandboxes_checkpoint_concurrently() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let a = d.create("busybox").id;
    let b = d.create("busybox").id;
    for id in [&a, &b] {
        d.sh(
            id,
            &format!("echo {id} > /who; while :; do sleep 0.1; done >/dev/null 2>&1 &"),
        );
    }
    std::thread::scope(|s| {
        let ha = s.spawn(|| {
            (0..3)
                .map(|k| d.checkpoint(&a, k, b"a").prefix)
                .collect::<Vec<_>>()
        });
        let hb = s.spawn(|| {
            (0..3)
                .map(|k| d.checkpoint(&b, k, b"b").prefix)
                .collect::<Vec<_>>()
        });
        assert_eq!(ha.join().unwrap(), vec![0, 1, 2]);
        assert_eq!(hb.join().unwrap(), vec![0, 1, 2]);
    });
    for id in [&a, &b] {
        d.fail_stop(id);
        let r = d.restore(id);
        assert_eq!(r.prefix, Some(2));
        assert_eq!(d.sh(id, "cat /who"), id.as_str());
    }
}

#[test]
fn action_timeout_kills_the_action_only() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let req = belayer_ipc::ExecRequest {
        id: id.clone(),
        argv: vec!["echo before; sleep 30".into()],
        timeout_ms: Some(300),
        ..Default::default()
    };
    let r = match d.call(belayer_ipc::Request::Exec(req)) {
        belayer_ipc::Response::Exec(r) => r,
        r => panic!("{r:?}"),
    };
    assert!(r.timed_out);
    assert_eq!(r.exit_code, 137);
    assert_eq!(String::from_utf8_lossy(&r.stdout), "before\n");
    assert!(r.duration_ms < 5000.0);
    // The sandbox is fine; a background process of an earlier action survives later actions.
    d.sh(&id, "sleep 1000 >/dev/null 2>&1 &");
    let n: usize = d.inspect(&id).pids.len();
    assert!(n >= 2, "init + background sleep, got {n}");
    assert_eq!(d.sh(&id, "echo ok"), "ok");
    assert!(d.inspect(&id).pids.len() >= 2);
}
