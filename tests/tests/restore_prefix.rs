//! `Restore` of a chosen ready checkpoint (`prefix: Some(K)`) against the real daemon, kernel
//! and CRIU: the sandbox gets C_K's files and processes and L_K back, C_K becomes the ready
//! checkpoint, the checkpoints after it stay as a branch of the sandbox's tree (listed,
//! restorable, each to its own state), later checkpoints are children of C_K, an unknown
//! prefix touches nothing, and a daemon SIGKILLed at any point of such a restore leaves a
//! ready checkpoint that restores and the whole tree.

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

/// Restores the checkpoint named `name` (any branch), which must succeed.
fn restored_named(d: &Daemon, id: &str, name: &str) -> RestoreInfo {
    match d.call(Request::RestoreCheckpoint {
        id: id.into(),
        verify: true,
        checkpoint: name.into(),
    }) {
        Response::Restored(r) => r,
        r => panic!("restore of {name} failed: {r:?}\n{}", d.log_text()),
    }
}

fn listed(d: &Daemon, id: &str) -> Vec<u64> {
    checkpoints(d, id).into_iter().map(|c| c.prefix).collect()
}

fn checkpoints(d: &Daemon, id: &str) -> Vec<belayer_ipc::CheckpointInfo> {
    match d.call(Request::ListCheckpoints { id: id.into() }) {
        Response::Checkpoints(v) => v,
        r => panic!("{r:?}"),
    }
}

/// `(prefix, parent's prefix)` of every checkpoint, in publication order, and the ready
/// one's prefix.
fn tree(d: &Daemon, id: &str) -> (Vec<(u64, Option<u64>)>, Option<u64>) {
    let list = checkpoints(d, id);
    let prefix_of = |name: &str| list.iter().find(|c| c.checkpoint == name).map(|c| c.prefix);
    let edges = list
        .iter()
        .map(|c| (c.prefix, c.parent.as_deref().and_then(prefix_of)))
        .collect();
    let ready = list.iter().find(|c| c.ready).map(|c| c.prefix);
    (edges, ready)
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
fn a_middle_prefix_restores_its_state_and_keeps_the_later_checkpoints_as_a_branch() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    step(&d, &id, 1);
    // A process started after C_1 and alive at C_2 and later.
    d.sh(&id, "sleep 1000 >/dev/null 2>&1 & echo started");
    for k in 2..=4 {
        step(&d, &id, k);
    }
    assert_eq!(
        tree(&d, &id),
        (
            vec![(1, None), (2, Some(1)), (3, Some(2)), (4, Some(3))],
            Some(4)
        )
    );

    let r = restored(&d, &id, Some(2));
    assert_eq!(r.prefix, Some(2));
    assert_eq!(r.context, b"ctx2");
    assert!(r.dropped_prefixes.is_empty(), "{:?}", r.dropped_prefixes);
    let v = r.validity.expect("verified");
    assert!(v.fs_matches && v.processes_match, "{v:?}");
    assert_eq!(log(&d, &id), "k1\nk2\n2");
    assert_eq!(background(&d, &id), "1");
    assert_eq!(d.inspect(&id).ready_prefix, Some(2));
    // Nothing dropped: C_3 and C_4 are a branch now.
    assert_eq!(listed(&d, &id), [1, 2, 3, 4]);
    assert_eq!(stored(&d, &id).len(), 4);

    // A new action and checkpoint build on C_2: a second branch; a failure then restores it.
    step(&d, &id, 5);
    assert_eq!(
        tree(&d, &id),
        (
            vec![
                (1, None),
                (2, Some(1)),
                (3, Some(2)),
                (4, Some(3)),
                (5, Some(2))
            ],
            Some(5)
        )
    );
    d.fail_stop(&id);
    let r = restored(&d, &id, None);
    assert_eq!(r.prefix, Some(5));
    assert_eq!(log(&d, &id), "k1\nk2\nk5\n3");

    // A prefix names the ready line only (C_5, C_2, C_1): C_4 of the other branch is not
    // found by it, and nothing is touched.
    match restore_to(&d, &id, Some(4)) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message),
        r => panic!("{r:?}"),
    }
    assert_eq!(tree(&d, &id).1, Some(5));
    // By name, every node restores to its own state, whichever branch it is on.
    let names: Vec<(u64, String)> = checkpoints(&d, &id)
        .into_iter()
        .map(|c| (c.prefix, c.checkpoint))
        .collect();
    for (k, expected, procs) in [
        (4, "k1\nk2\nk3\nk4\n4", "1"),
        (3, "k1\nk2\nk3\n3", "1"),
        (5, "k1\nk2\nk5\n3", "1"),
        (1, "k1\n1", "0"),
        (2, "k1\nk2\n2", "1"),
    ] {
        let name = &names.iter().find(|(p, _)| *p == k).unwrap().1;
        let r = restored_named(&d, &id, name);
        assert_eq!(
            (r.prefix, r.context.clone()),
            (Some(k), format!("ctx{k}").into_bytes())
        );
        let v = r.validity.expect("verified");
        assert!(v.fs_matches && v.processes_match, "C_{k}: {v:?}");
        assert_eq!(log(&d, &id), expected, "C_{k}");
        assert_eq!(background(&d, &id), procs, "C_{k}");
        assert_eq!(tree(&d, &id).1, Some(k));
    }
    // Names that are no visible checkpoint of the sandbox are not found.
    for bad in ["c000099-k1", "../c000001-k1", "READY", ""] {
        match d.call(Request::RestoreCheckpoint {
            id: id.clone(),
            verify: false,
            checkpoint: bad.into(),
        }) {
            Response::Error(e) => assert_eq!(e.code, ErrorCode::NotFound, "{bad}: {}", e.message),
            r => panic!("{bad}: {r:?}"),
        }
    }
    assert_eq!(tree(&d, &id).1, Some(2));

    // Back at C_1 (on the line of C_2), a third branch.
    restored(&d, &id, Some(1));
    step(&d, &id, 6);
    let (edges, ready) = tree(&d, &id);
    assert_eq!(edges.last(), Some(&(6, Some(1))));
    assert_eq!((edges.len(), ready), (6, Some(6)));
    let out = belayer_tests::cli::belayer_json(&d, &["checkpoint", "ls", &id]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json.as_array().map(Vec::len), Some(6), "{json}");
    assert!(json[5]["ready"].as_bool().unwrap(), "{json}");
    let text = std::process::Command::new(belayer_tests::bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["checkpoint", "ls", &id, "--tree"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(lines[0].starts_with("c000001-k1"), "{text}");
    assert!(
        lines[5].starts_with("└─ c000006-k6") && lines[5].ends_with("(ready)"),
        "{text}"
    );
    // The CLI restores a checkpoint of another branch by name.
    let c4 = json[3]["checkpoint"].as_str().unwrap().to_string();
    let out = belayer_tests::cli::belayer_json(&d, &["restore", &id, "--checkpoint", &c4]);
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(r["prefix"], 4, "{r}");
    assert_eq!(log(&d, &id), "k1\nk2\nk3\nk4\n4");
}

#[test]
fn several_checkpoints_of_one_prefix_restore_the_latest_of_the_line() {
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
    assert!(r.dropped_prefixes.is_empty());
    assert_eq!(d.sh(&id, "cat /root/f"), "second");
    assert_eq!(listed(&d, &id), [2, 2, 3]);
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
        // Back to C_3 ready (by name: from C_1 it is on another line): the same three
        // checkpoints, nothing dropped by any restore.
        if d.inspect(&id).ready_prefix != Some(3) {
            let c3 = checkpoints(&d, &id).pop().expect("C_3").checkpoint;
            restored_named(&d, &id, &c3);
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
            // Killed after: C_1 is ready, and C_2 and C_3 are still there as a branch.
            Some(1) => {
                assert_eq!(list, [1, 2, 3], "delay {delay:?}");
                assert_eq!(entries.len(), 3, "delay {delay:?}: {entries:?}");
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
