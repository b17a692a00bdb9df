//! Content-addressed memory images against the real daemon, kernel and CRIU: a process
//! holding 32 MiB of random memory is checkpointed, dirties 1% of its pages, is checkpointed
//! again; the second checkpoint stores a few percent of the first's bytes, and restores of
//! either checkpoint give the process back with the memory of that point (digest of its
//! whole buffer, computed by the restored process itself). The images dir a restore
//! assembles is gone afterwards, and a collection of the blob store keeps every page pack a
//! checkpoint refers to.

use std::time::{Duration, Instant};

use belayer_ipc::{Request, Response, RestoreInfo};
use belayer_tests::{python_rootfs, Daemon};

const HOLDER: &str = r#"
import os, hashlib, time
buf = bytearray(os.urandom(32 << 20))
def dig():
    with open('/tmp/d.tmp', 'w') as f:
        f.write(hashlib.sha256(buf).hexdigest())
    os.rename('/tmp/d.tmp', '/tmp/digest')
dig()
while True:
    if os.path.exists('/tmp/dirty'):
        os.remove('/tmp/dirty')
        for i in range(0, len(buf) // 4096, 100):
            buf[i * 4096] = (buf[i * 4096] + 1) % 256
        dig()
    if os.path.exists('/tmp/ask'):
        os.remove('/tmp/ask')
        dig()
    time.sleep(0.01)
"#;

/// Asks the holder for its digest (after `trigger` is created) and waits for it.
fn digest_after(d: &Daemon, id: &str, trigger: &str) -> String {
    d.sh(id, &format!("rm -f /tmp/digest; touch {trigger}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = d.sh(id, "cat /tmp/digest 2>/dev/null || true");
        if got.len() == 64 {
            return got;
        }
        assert!(Instant::now() < deadline, "no digest from the holder");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn restore_to(d: &Daemon, id: &str, prefix: u64) -> RestoreInfo {
    match d.call(Request::Restore {
        id: id.into(),
        verify: true,
        prefix: Some(prefix),
    }) {
        Response::Restored(r) => r,
        r => panic!("restore to {prefix} failed: {r:?}\n{}", d.log_text()),
    }
}

#[test]
fn a_second_checkpoint_stores_the_dirtied_pages_and_both_restore_their_memory() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let id = d.create("python").id;
    d.sh(
        &id,
        &format!(
            "cat > /tmp/holder.py <<'EOF'\n{HOLDER}\nEOF\npython3 /tmp/holder.py >/dev/null 2>&1 &"
        ),
    );
    let first = digest_after(&d, &id, "/tmp/ask");
    let c1 = d.checkpoint(&id, 1, b"one");
    let second = digest_after(&d, &id, "/tmp/dirty");
    assert_ne!(first, second);
    let c2 = d.checkpoint(&id, 2, b"two");
    eprintln!("checkpoint bytes: 1st {}, 2nd {}", c1.bytes, c2.bytes);
    assert!(c1.bytes > 32 << 20, "1st checkpoint {} bytes", c1.bytes);
    assert!(
        c2.bytes * 20 <= c1.bytes,
        "2nd checkpoint {} bytes, more than 5% of the 1st's {}",
        c2.bytes,
        c1.bytes
    );
    let sandbox_dir = d.state_dir.join("sandboxes").join(&id);

    // The 2nd checkpoint, after a fail-stop: the memory of that point.
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(2));
    assert!(
        !sandbox_dir.join("criu-images").exists(),
        "assembled images left behind"
    );
    assert_eq!(digest_after(&d, &id, "/tmp/ask"), second);

    // A collection keeps the packs of both checkpoints: the 1st still restores.
    match d.call(Request::Gc {
        older_than_s: Some(1_000_000),
        tag: None,
    }) {
        Response::Gc { .. } => {}
        other => panic!("gc: {other:?}"),
    }
    let r = restore_to(&d, &id, 1);
    assert_eq!(r.context, b"one");
    assert_eq!(digest_after(&d, &id, "/tmp/ask"), first);
    // C_2 is on another branch now: by name.
    let r = match d.call(Request::RestoreCheckpoint {
        id: id.clone(),
        verify: true,
        checkpoint: c2.checkpoint.clone(),
    }) {
        Response::Restored(r) => r,
        r => panic!("restore of {} failed: {r:?}", c2.checkpoint),
    };
    assert_eq!(r.context, b"two");
    assert_eq!(digest_after(&d, &id, "/tmp/ask"), second);
}
