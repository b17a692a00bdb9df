//! Resources a hostile sandbox cannot exhaust for the host or for other sandboxes: its disk
//! quota (enforced by the kernel), a full state disk (state is saved before it is committed,
//! so nothing wedges), and output that background writers produce after their action.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use belayer_ipc::{ErrorCode, Request, Response, SandboxSpec};
use belayer_tests::{busybox_rootfs, Daemon, DaemonOptions};

fn ping(d: &Daemon) {
    assert!(matches!(d.call(Request::Ping), Response::Pong { .. }));
}

#[test]
fn the_disk_quota_stops_a_sandbox_and_nobody_else() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let small = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            disk_max: Some(64 << 20),
            ..Default::default()
        })
        .id;
    let other = d.create("busybox").id;
    let r = d.exec(&small, "fallocate -l 5G /big");
    assert_ne!(r.exit_code, 0, "fallocate of 5G succeeded");
    let err = String::from_utf8_lossy(&r.stderr).to_string();
    println!("fallocate: {err}");
    assert!(err.contains("quota") || err.contains("space"), "{err}");
    let r = d.exec(
        &small,
        "dd if=/dev/zero of=/fill bs=1M count=200 2>&1; ls -l /fill",
    );
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    println!("dd: {out}");
    assert!(out.contains("quota") || out.contains("space"), "{out}");
    let size: u64 = d.sh(&small, "stat -c %s /fill").parse().unwrap();
    assert!(size <= 64 << 20, "wrote {size} bytes past a 64 MiB quota");
    // The daemon and the other sandbox carry on; the full one can still be checkpointed
    // (its layer is within its quota) and restored.
    ping(&d);
    assert_eq!(d.sh(&other, "echo fine > /x; cat /x"), "fine");
    d.checkpoint(&other, 1, b"o1");
    d.checkpoint(&small, 1, b"s1");
    d.fail_stop(&small);
    d.restore(&small);
    assert_eq!(
        d.sh(&small, "stat -c %s /fill").parse::<u64>().unwrap(),
        size
    );
    // Freeing space inside lets it write again.
    d.sh(
        &small,
        "rm /fill; dd if=/dev/zero of=/again bs=1M count=8 2>/dev/null; echo ok",
    );
    match d.call(Request::CreateSandbox(SandboxSpec {
        image: "busybox".into(),
        disk_max: Some(4096),
        ..Default::default()
    })) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message),
        r => panic!("a 4 KiB disk limit was accepted: {r:?}"),
    }
}

#[test]
fn restores_do_not_grant_the_disk_limit_again() {
    // Restored files share the checkpoint's extents: without accounting for them, a sandbox
    // that gets itself restored (by crashing) would get its whole limit again each time.
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            disk_max: Some(64 << 20),
            ..Default::default()
        })
        .id;
    let written = |name: &str| -> u64 {
        d.exec(
            &id,
            &format!("dd if=/dev/urandom of=/{name} bs=1M count=40 2>/dev/null; sync"),
        );
        d.sh(&id, &format!("stat -c %s /{name} 2>/dev/null || echo 0"))
            .parse()
            .unwrap()
    };
    let du = || -> u64 {
        d.sh(&id, "du -sk -x / 2>/dev/null | cut -f1")
            .parse::<u64>()
            .unwrap()
            * 1024
    };
    let image = du();
    assert_eq!(written("a"), 40 << 20);
    for round in 1..=3u64 {
        d.checkpoint(&id, round, b"k");
        d.fail_stop(&id);
        assert_eq!(d.restore(&id).prefix, Some(round));
        let more = written(&format!("more{round}"));
        let total = du() - image;
        println!("round {round}: wrote {more} more bytes, sandbox holds {total} bytes");
        assert!(
            more < 40 << 20,
            "round {round}: a restore granted the limit again"
        );
        assert!(
            total <= 65 << 20,
            "round {round}: {total} bytes under a 64 MiB limit"
        );
        d.sh(&id, &format!("rm -f /more{round}"));
    }
    // The restored data is still there and readable.
    assert_eq!(d.sh(&id, "stat -c %s /a"), (40u64 << 20).to_string());
    ping(&d);
}

/// A tmpfs of `bytes` mounted at `dir` (removed on drop).
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(dir: &Path, bytes: u64) -> SmallFs {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={bytes},mode=0700"),
                "tmpfs",
            ])
            .arg(dir)
            .status()
            .unwrap();
        assert!(status.success());
        SmallFs(dir.to_path_buf())
    }

    /// Fills the file system from the host until it refuses a byte.
    fn fill(&self) -> std::path::PathBuf {
        self.fill_as("filler")
    }

    /// [`Self::fill`] with a file named `name`.
    fn fill_as(&self, name: &str) -> std::path::PathBuf {
        let path = self.0.join(name);
        let mut f = std::fs::File::create(&path).unwrap();
        let chunk = vec![0xa5u8; 1 << 16];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&[1]).is_ok() {}
        path
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

#[test]
fn a_full_state_disk_fails_verbs_and_wedges_nothing() {
    let root = tempfile::tempdir_in(belayer_tests::state_root()).unwrap();
    let state = root.path().join("state");
    let fs = SmallFs::mount(&state, 96 << 20);
    let d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: "default_disk_max_bytes = 0\ndump_stage_bytes = 0\n".into(),
        state_dir: Some(state.clone()),
        ..DaemonOptions::default()
    });
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo k1 > /root/k; sleep 1000 >/dev/null 2>&1 &");
    d.checkpoint(&id, 1, b"k1");
    let filler = fs.fill();
    // A checkpoint cannot be written: a typed error, and the sandbox is running, not
    // "checkpointing"; actions go on.
    match d.checkpoint_raw(&id, 2, b"k2", None) {
        Response::Error(e) => {
            println!("checkpoint on a full disk: {:?}: {}", e.code, e.message);
            assert_eq!(e.code, ErrorCode::CheckpointFailed);
        }
        r => panic!("checkpoint on a full disk: {r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "running");
    assert_eq!(d.sh(&id, "cat /root/k"), "k1");
    assert_eq!(d.inspect(&id).ready_prefix, Some(1));
    // A fail-stop is seen although state.json cannot be written, and a restore that cannot
    // write its instance fails cleanly, leaving the sandbox failed (not "restoring"). (The
    // failed checkpoint gave its room back: fill again.)
    let filler2 = fs.fill_as("filler-2");
    d.fail_stop(&id);
    match d.restore_raw(&id) {
        Response::Error(e) => println!("restore on a full disk: {:?}: {}", e.code, e.message),
        r => panic!("restore on a full disk succeeded: {r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "failed");
    ping(&d);
    // With room again, everything that was safe is still there.
    std::fs::remove_file(filler).unwrap();
    std::fs::remove_file(filler2).unwrap();
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(r.context, b"k1".to_vec());
    assert_eq!(d.sh(&id, "cat /root/k"), "k1");
    d.checkpoint(&id, 2, b"k2");
    drop(d);
    drop(fs);
}

#[test]
fn background_output_is_bounded_by_the_sandbox() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            memory_max: Some(256 << 20),
            ..Default::default()
        })
        .id;
    // A writer the action leaves behind, writing into the action's stdout forever.
    let r = d.exec(
        &id,
        "(while :; do echo 0123456789abcdef0123456789abcdef; done) & echo started",
    );
    assert!(String::from_utf8_lossy(&r.stdout).contains("started"));
    let usage = || {
        std::fs::read_to_string(format!(
            "/sys/fs/cgroup/memory/belayer/{id}/memory.usage_in_bytes"
        ))
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    };
    // Each later verb empties what the writer produced since the previous one.
    let started = Instant::now();
    let mut peak = 0;
    while started.elapsed() < Duration::from_secs(6) {
        std::thread::sleep(Duration::from_millis(500));
        if d.inspect(&id).state != "running" {
            break;
        }
        let _ = d.exec(&id, "true");
        peak = peak.max(usage().unwrap_or(0));
    }
    println!(
        "peak memory of the sandbox with a background writer: {} MiB",
        peak >> 20
    );
    assert!(peak <= 256 << 20, "over the limit: {peak}");
    // The daemon holds none of it.
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid().unwrap())).unwrap();
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    println!("belayerd RSS: {} MiB", rss_kb >> 10);
    assert!(rss_kb < 512 << 10, "daemon RSS {rss_kb} kB");
    ping(&d);
}
