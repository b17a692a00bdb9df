//! `Restore` of a chosen ready checkpoint (`prefix: Some(K)`) against the real daemon, kernel
//! and CRIU: the sandbox gets C_K's files and processes and L_K back, C_K becomes the ready
//! checkpoint, the checkpoints after it are dropped (from the listing and from the store), a
//! later checkpoint and restore build on C_K, an unknown prefix touches nothing, and a daemon
//! SIGKILLed at any point of such a restore leaves a ready checkpoint that restores.

use std::time::{Duration, Instant};

use belayer_ipc::{ErrorCode, Request, Response, RestoreInfo};
use belayer_tests::{busybox_rootfs, Daemon};

fn restore_to(d: &Daemon, id: &str, prefix: Option<u64>) -> Response {
    d.call(Request::Restore {
        id: id.into(),
        verify: true,
        prefix,
    })
}

fn restored(d: &Daemon, id: &str, prefix: Option<u64>) -> RestoreInfo {
    match restore_to(d, id, prefix) {
        Response::Restored(r) => r,
        r => panic!("restore to {prefix:?} failed: {r:?}\n{}", d.log_text()),
    }
}

fn listed(d: &Daemon, id: &str) -> Vec<u64> {
    match d.call(Request::ListCheckpoints { id: id.into() }) {
        Response::Checkpoints(v) => v.into_iter().map(|c| c.prefix).collect(),
        r => panic!("{r:?}"),
    }
}

/// The checkpoint directories in the store (published or not).
fn stored(d: &Daemon, id: &str) -> Vec<String> {
    let dir = d.state_dir.join("sandboxes").join(id).join("checkpoints");
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('c') || n.starts_with(".tmp-"))
        .collect();
    v.sort();
    v
}

/// Action k: appends to the log, writes its own file, and checkpoints C_k with L_k.
fn step(d: &Daemon, id: &str, k: u64) {
    d.sh(
        id,
        &format!("echo k{k} >> /root/log; echo {k} > /root/k{k}"),
    );
    d.checkpoint(id, k, format!("ctx{k}").as_bytes());
}

/// How many of the background processes the test starts (`sleep 1000`) run in the sandbox.
fn background(d: &Daemon, id: &str) -> String {
    d.sh(
        id,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '^sleep 1000'; true",
    )
}

fn log(d: &Daemon, id: &str) -> String {
    d.sh(id, "cat /root/log; ls /root | grep -c '^k'")
}

#[test]
fn a_middle_prefix_restores_its_state_and_drops_the_later_checkpoints() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    step(&d, &id, 1);
    // A process started after C_1 and alive at C_2 and later.
    d.sh(&id, "sleep 1000 >/dev/null 2>&1 & echo started");
    for k in 2..=4 {
        step(&d, &id, k);
    }
    assert_eq!(listed(&d, &id), [1, 2, 3, 4]);

    let r = restored(&d, &id, Some(2));
    assert_eq!(r.prefix, Some(2));
    assert_eq!(r.context, b"ctx2");
    assert_eq!(r.dropped_prefixes, [3, 4]);
    let v = r.validity.expect("verified");
    assert!(v.fs_matches && v.processes_match, "{v:?}");
    assert_eq!(log(&d, &id), "k1\nk2\n2");
    assert_eq!(background(&d, &id), "1");
    assert_eq!(d.inspect(&id).ready_prefix, Some(2));
    assert_eq!(listed(&d, &id), [1, 2]);
    assert_eq!(stored(&d, &id), ["c000001-k1", "c000002-k2"]);

    // A new action and checkpoint build on C_2; a failure then restores it.
    step(&d, &id, 5);
    assert_eq!(listed(&d, &id), [1, 2, 5]);
    d.fail_stop(&id);
    let r = restored(&d, &id, None);
    assert_eq!((r.prefix, r.dropped_prefixes.len()), (Some(5), 0));
    assert_eq!(log(&d, &id), "k1\nk2\nk5\n3");

    // Back to C_1: before the background process existed.
    let r = restored(&d, &id, Some(1));
    assert_eq!((r.prefix, &r.context[..]), (Some(1), &b"ctx1"[..]));
    assert_eq!(r.dropped_prefixes, [2, 5]);
    assert_eq!(log(&d, &id), "k1\n1");
    assert_eq!(background(&d, &id), "0");
    assert_eq!(listed(&d, &id), [1]);
    assert_eq!(stored(&d, &id), ["c000001-k1"]);

    // The ready checkpoint named by its prefix: a plain restore, nothing dropped.
    let r = restored(&d, &id, Some(1));
    assert_eq!((r.prefix, r.dropped_prefixes.len()), (Some(1), 0));
    assert_eq!(listed(&d, &id), [1]);
}

#[test]
fn several_checkpoints_of_one_prefix_restore_the_latest() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo first > /root/f");
    d.checkpoint(&id, 2, b"first");
    d.sh(&id, "echo second > /root/f");
    d.checkpoint(&id, 2, b"second");
    step(&d, &id, 3);
    let r = restored(&d, &id, Some(2));
    assert_eq!(r.context, b"second");
    assert_eq!(r.dropped_prefixes, [3]);
    assert_eq!(d.sh(&id, "cat /root/f"), "second");
    assert_eq!(listed(&d, &id), [2, 2]);
}

#[test]
fn an_unknown_prefix_is_not_found_and_touches_nothing() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    // No checkpoint at all.
    match restore_to(&d, &id, Some(1)) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
            assert!(e.message.contains("prefix 1"), "{}", e.message);
        }
        r => panic!("{r:?}"),
    }
    step(&d, &id, 1);
    step(&d, &id, 2);
    d.sh(&id, "echo after > /root/after");
    let before = d.inspect(&id);
    for k in [0, 3, u64::MAX] {
        match restore_to(&d, &id, Some(k)) {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
                assert!(e.message.contains(&format!("prefix {k}")), "{}", e.message);
            }
            r => panic!("restore to {k}: {r:?}"),
        }
    }
    // Still the same running instance, with its unsaved change; checkpoints untouched.
    let after = d.inspect(&id);
    assert_eq!(
        (after.instance, after.init_pid, after.ready_prefix),
        (before.instance, before.init_pid, Some(2))
    );
    assert_eq!(d.sh(&id, "cat /root/after"), "after");
    assert_eq!(listed(&d, &id), [1, 2]);
    // Another peer's view of the sandbox is unchanged too: an unknown sandbox stays unknown.
    match d.call(Request::Restore {
        id: "sb-000000000000".into(),
        verify: false,
        prefix: Some(1),
    }) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::UnknownSandbox),
        r => panic!("{r:?}"),
    }
}

#[test]
fn a_daemon_killed_during_a_rewinding_restore_leaves_a_ready_checkpoint_that_restores() {
    let mut d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    step(&d, &id, 1);
    step(&d, &id, 2);
    step(&d, &id, 3);
    // How long a rewinding restore takes here, to spread the kills over it.
    let t = Instant::now();
    restored(&d, &id, Some(1));
    let took = t.elapsed();
    let mut hit_old = 0;
    let mut hit_new = 0;
    for i in 0..8u32 {
        // Back to three checkpoints with the ready one last.
        if listed(&d, &id) == [1] {
            step(&d, &id, 2);
            step(&d, &id, 3);
        }
        assert_eq!(listed(&d, &id), [1, 2, 3]);
        // Most of them near the end, where the pointer moves and the record is written.
        let delay = took.mul_f64([0.1, 0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1][i as usize]);
        let socket = d.socket.clone();
        let id2 = id.clone();
        let restoring = std::thread::spawn(move || {
            let mut c = belayer_ipc::Client::connect(&socket).unwrap();
            let t = Instant::now();
            let r = c.call(Request::Restore {
                id: id2,
                verify: false,
                prefix: Some(1),
            });
            println!(
                "after {:?}: {:?}",
                t.elapsed(),
                r.map(|r| match r {
                    Response::Restored(r) => format!("restored {:?}", r.prefix),
                    other => format!("{other:?}"),
                })
            );
        });
        std::thread::sleep(delay);
        d.kill();
        let _ = restoring.join();
        d.restart();
        let info = d.inspect(&id);
        let list = listed(&d, &id);
        let entries = stored(&d, &id);
        match info.ready_prefix {
            // Killed before the pointer moved: nothing of the rewind happened.
            Some(3) => {
                assert_eq!(list, [1, 2, 3], "delay {delay:?}");
                hit_old += 1;
            }
            // Killed after: the later checkpoints are gone, at the latest from adoption on.
            Some(1) => {
                assert_eq!(list, [1], "delay {delay:?}");
                assert_eq!(entries, ["c000001-k1"], "delay {delay:?}");
                hit_new += 1;
            }
            other => panic!(
                "delay {delay:?}: ready {other:?}, listed {list:?}, stored {entries:?}\n{}",
                d.log_text()
            ),
        }
        // Whatever state the sandbox is in, its ready checkpoint restores and holds its files.
        let ready = info.ready_prefix.unwrap();
        if info.state != "running" || i % 2 == 0 {
            let r = restored(&d, &id, None);
            assert_eq!(r.prefix, Some(ready));
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while d.inspect(&id).state != "running" {
            assert!(Instant::now() < deadline, "not running after the restore");
            std::thread::sleep(Duration::from_millis(20));
        }
        let expected =
            (1..=ready).map(|k| format!("k{k}\n")).collect::<String>() + &ready.to_string();
        assert_eq!(log(&d, &id), expected, "delay {delay:?}");
    }
    println!("killed before the pointer moved: {hit_old}, after: {hit_new}");
}
