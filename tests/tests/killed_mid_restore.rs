//! A daemon SIGKILLed while CRIU restores a sandbox (its tree already in the sandbox's
//! cgroup, CRIU still copying memory, or held at a stage of its action script): after the
//! restart the sandbox is `failed` with no process left anywhere (neither the half-restored
//! tree, which CRIU would otherwise resume once its script gave up waiting, nor CRIU), and its
//! ready checkpoint restores.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use belayer_ipc::Request;
use belayer_tests::orphans::{criu_running, settle};
use belayer_tests::{python_rootfs, unique, Daemon, DaemonOptions};

/// `cgroup.procs` of the sandbox's cgroup under `parent` in the v2 hierarchy (hybrid or not).
fn procs_file(parent: &str, id: &str) -> PathBuf {
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .iter()
        .map(|root| {
            PathBuf::from(root)
                .join(parent)
                .join(id)
                .join("cgroup.procs")
        })
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            PathBuf::from("/sys/fs/cgroup")
                .join(parent)
                .join(id)
                .join("cgroup.procs")
        })
}

fn cgroup_pids(parent: &str, id: &str) -> Vec<i32> {
    std::fs::read_to_string(procs_file(parent, id))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_daemon_killed_mid_restore_leaves_no_tree_running_and_the_checkpoint_restores() {
    let parent = format!("belayer-restore-kill-{}-{}", std::process::id(), unique());
    let mut d = Daemon::start_options(DaemonOptions {
        config: format!("cgroup_parent = \"{parent}\"\n"),
        ..DaemonOptions::default()
    });
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    // Enough memory that CRIU spends a while restoring it after the tree is in the cgroup.
    d.sh(
        &id,
        "python3 -c 'import os, time; b = bytearray(os.urandom(160 << 20)); \
         open(\"/tmp/held\", \"w\").close(); time.sleep(1e9)' >/dev/null 2>&1 & \
         n=0; while [ ! -e /tmp/held ]; do n=$((n+1)); [ $n -lt 600 ] || exit 1; sleep 0.1; done; \
         echo kept > /root/f",
    );
    d.checkpoint(&id, 1, b"L1");
    d.fail_stop(&id);
    settle("the failed tree gone", || {
        cgroup_pids(&parent, &id).is_empty()
    });

    let socket = d.socket.clone();
    let target = id.clone();
    let restoring = std::thread::spawn(move || {
        let mut c = belayer_ipc::Client::connect(&socket).unwrap();
        let _ = c.call(Request::Restore {
            id: target,
            verify: false,
            prefix: None,
        });
    });
    // The old tree was gone: the first process in the cgroup is the restore's.
    let deadline = Instant::now() + Duration::from_secs(60);
    while cgroup_pids(&parent, &id).is_empty() {
        assert!(Instant::now() < deadline, "no restored task appeared");
        std::thread::sleep(Duration::from_millis(2));
    }
    d.kill();
    let _ = restoring.join();
    d.restart();

    settle("the interrupted restore's tree killed", || {
        cgroup_pids(&parent, &id).is_empty()
    });
    settle("no CRIU left", || !criu_running(&d));
    // Its images dir (pages files hard-linked to their packs) goes with the adoption.
    let images = d.state_dir.join("sandboxes").join(&id).join("criu-images");
    assert!(!images.exists(), "{} left", images.display());
    let info = d.inspect(&id);
    assert!(
        info.state == "failed" || info.state == "running",
        "state {} after the restart",
        info.state
    );
    // Nothing comes back later either (CRIU's script bound is 120 s; a resumed tree would
    // show within a few seconds of the restart).
    std::thread::sleep(Duration::from_secs(3));
    if info.state == "failed" {
        assert!(cgroup_pids(&parent, &id).is_empty(), "a tree came back");
    }
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /root/f"), "kept");
    assert_eq!(d.inspect(&id).state, "running");
    d.assert_alive("after a restore interrupted by a kill");
}

/// The instance number in the sandbox's `state.json`.
fn recorded_instance(d: &Daemon, id: &str) -> u32 {
    let path = d.state_dir.join("sandboxes").join(id).join("state.json");
    let rec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    rec["instance"].as_u64().expect("instance") as u32
}

#[test]
fn a_restore_right_after_the_restart_never_takes_the_number_of_a_stale_instance() {
    let mut d = Daemon::start();
    d.image("busybox", &belayer_tests::busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo kept > /root/f");
    d.checkpoint(&id, 1, b"L1");
    d.kill();
    // What an interrupted restore leaves: the next instance's dir, with enough files in its
    // upper that the adoption's background deletion of it takes a while.
    let current = recorded_instance(&d, &id);
    let stale = d
        .state_dir
        .join("sandboxes")
        .join(&id)
        .join(format!("inst-{}", current + 1));
    for sub in ["work", "merged"] {
        std::fs::create_dir_all(stale.join(sub)).unwrap();
    }
    for i in 0..40 {
        let dir = stale.join("upper").join(format!("d{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        for j in 0..500 {
            std::fs::write(dir.join(format!("f{j}")), b"stale").unwrap();
        }
    }
    d.restart();
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert!(
        recorded_instance(&d, &id) > current + 1,
        "the restore took the stale instance's number"
    );
    settle("the stale instance deleted", || !stale.exists());
    assert_eq!(d.sh(&id, "cat /root/f"), "kept");
    // And again: the numbers keep going up past whatever is on disk.
    d.sh(&id, "echo again >> /root/f");
    d.checkpoint(&id, 2, b"L2");
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(2));
    assert_eq!(d.sh(&id, "cat /root/f"), "kept\nagain");
    d.assert_alive("after restores past a stale instance");
}
