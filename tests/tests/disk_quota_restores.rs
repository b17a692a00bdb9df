//! The disk limit across restores from upper snapshots (`agent/src/sandbox/restore/upper.rs`):
//! a restored instance shares the whole checkpointed layer, data and metadata, with earlier
//! volumes, so its own limit is the sandbox's minus the charge recorded with the snapshot. A
//! sandbox cannot win room by crashing, whatever it stores (file data, or directories full of
//! extended attributes, which simple quotas charge as metadata), a restore of a sandbox at its
//! limit still works, and room the sandbox freed comes back at a later restore.

use belayer_ipc::SandboxSpec;
use belayer_tests::states::python_sandbox_spec;
use belayer_tests::Daemon;

const LIMIT: u64 = 32 << 20;

/// Python that makes directories holding three 3900-byte xattrs each under `dir` until the
/// disk limit refuses one, and prints how many it made.
fn fill_metadata(dir: &str) -> String {
    format!(
        "python3 -c '
import os
v = b\"a\" * 3900
n = 0
try:
    os.makedirs(\"{dir}\", exist_ok=True)
    while n < 40000:
        p = \"{dir}/d%d\" % n
        os.mkdir(p)
        for k in range(3):
            os.setxattr(p, \"user.x%d\" % k, v)
        n += 1
except OSError as e:
    pass
print(n)'"
    )
}

/// A python sandbox with disk limit [`LIMIT`].
fn limited_sandbox(d: &Daemon) -> String {
    python_sandbox_spec(
        d,
        SandboxSpec {
            disk_max: Some(LIMIT),
            ..Default::default()
        },
    )
}

fn restore_cycle(d: &Daemon, id: &str, k: u64) -> bool {
    d.checkpoint(id, k, b"k");
    d.fail_stop(id);
    let r = d.restore(id);
    assert_eq!(r.prefix, Some(k));
    r.inodes_kept
}

/// Metadata charged to earlier volumes counts: after a sandbox filled its limit with
/// xattr-laden directories, no number of crash-and-restore cycles lets it store more.
#[test]
fn restores_do_not_grant_room_for_metadata_again() {
    let d = Daemon::start();
    let id = limited_sandbox(&d);
    let made = |dir: &str| -> u64 { d.sh(&id, &fill_metadata(dir)).trim().parse().unwrap() };
    let first = made("/m0");
    assert!(first > 1000, "only {first} directories fit under 32 MiB");
    for k in 1..=3u64 {
        let kept = restore_cycle(&d, &id, k);
        let more = made(&format!("/m{k}"));
        println!("round {k}: {more} more directories (first {first}; inodes kept: {kept})");
        assert!(
            more * 20 < first,
            "round {k}: a restore granted room again ({more} more after {first})"
        );
    }
    // What was stored is all there.
    assert_eq!(d.sh(&id, "ls /m0 | wc -l").trim(), first.to_string());
}

/// Room the sandbox freed after a restore (it deleted restored data) comes back: the charge
/// recorded with the next snapshot still counts the deleted bytes, so that restore
/// materializes F_k, which charges only what the layer holds.
#[test]
fn freed_room_comes_back_at_a_later_restore() {
    let d = Daemon::start();
    let id = limited_sandbox(&d);
    let write = |name: &str, mib: u64| -> u64 {
        d.exec(
            &id,
            &format!("dd if=/dev/urandom of=/{name} bs=1M count={mib} 2>/dev/null; sync"),
        );
        d.sh(&id, &format!("stat -c %s /{name} 2>/dev/null || echo 0"))
            .trim()
            .parse()
            .unwrap()
    };
    assert_eq!(write("a", 20), 20 << 20);
    assert!(
        restore_cycle(&d, &id, 1),
        "the first restore did not use the snapshot"
    );
    d.sh(&id, "rm /a");
    assert_eq!(write("b", 10), 10 << 20);
    let kept = restore_cycle(&d, &id, 2);
    assert!(
        !kept,
        "the restore installed a snapshot charged for deleted data"
    );
    let more = write("c", 15);
    assert_eq!(
        more,
        15 << 20,
        "the room of the deleted file did not come back"
    );
    assert_eq!(
        d.sh(&id, "ls /a 2>&1; stat -c %s /b").lines().last(),
        Some("10485760")
    );
}

/// Files deleted while open come back as CRIU ghost files, written into the restored
/// instance under its limit. A sandbox that holds more of them than its limit leaves (here
/// clones, charged once but dumped once each) gets its checkpoint refused with a typed error,
/// and the previous checkpoint stays ready and restorable.
#[test]
fn ghost_files_beyond_the_disk_limit_fail_the_checkpoint() {
    let d = Daemon::start();
    let id = limited_sandbox(&d);
    d.sh(&id, "echo one > /root/marker");
    d.checkpoint(&id, 1, b"one");
    d.sh(
        &id,
        "head -c 8M /dev/urandom > /root/big && \
         for i in 1 2 3 4 5 6; do cp --reflink=always /root/big /root/c$i; done && \
         (nohup python3 -c 'import os, time
fs = [open(p) for p in [\"/root/big\"] + [\"/root/c%d\" % i for i in range(1, 7)]]
for f in fs:
    os.unlink(f.name)
open(\"/root/held\", \"w\").write(\"1\")
time.sleep(1e9)' >/dev/null 2>&1 &) && \
         for i in $(seq 100); do [ -e /root/held ] && break; sleep 0.1; done; cat /root/held",
    );
    match d.checkpoint_raw(&id, 2, b"two", None) {
        belayer_ipc::Response::Error(e) => {
            assert_eq!(e.code, belayer_ipc::ErrorCode::CheckpointFailed, "{e:?}");
            assert!(
                e.message.contains("files deleted while open"),
                "{}",
                e.message
            );
        }
        r => panic!("56 MiB of ghosts under a 32 MiB limit were checkpointed: {r:?}"),
    }
    assert_eq!(d.inspect(&id).ready_prefix, Some(1));
    d.fail_stop(&id);
    assert_eq!(d.restore(&id).prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /root/marker").trim(), "one");
}
