//! Volume churn under simple quotas against the real kernel: what short-lived sandboxes and
//! their captures do to the state file system.
//!
//! Removing the qgroup of a subvolume whose extents are still charged or freed by delayed refs
//! aborts a transaction and forces the whole file system read-only (6.18: "Transaction
//! aborted (error -2)" in `do_free_extent_accounting`); usage items lag behind those refs, so
//! reading 0 bytes proves nothing. Belayer therefore never removes a qgroup: stale qgroups of
//! volumes whose extents outlived them stay, and are only counted.

mod common;

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use belayer_daemon::quota::QuotaMode;
use common::btrfs::Btrfs;

/// Volumes the churn goes through; every other one shares an extent with a "blob" when deleted.
const VOLUMES: usize = 400;

fn writable(dir: &Path) -> Result<(), std::io::Error> {
    let mut f = File::create(dir.join("probe"))?;
    f.write_all(b"still writable")?;
    f.sync_all()
}

#[test]
fn churn_keeps_the_file_system_writable_and_stale_qgroups_stay() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let q = fs.quota();
    let done = AtomicBool::new(false);
    let start = Instant::now();
    let reads = std::thread::scope(|s| {
        // What the daemon does meanwhile: reading qgroups (usage, stale counts).
        let reader = s.spawn(|| {
            let mut reads = 0u64;
            while !done.load(Ordering::Relaxed) {
                q.stale_qgroups().expect("qgroups readable");
                reads += 1;
            }
            reads
        });
        for i in 0..VOLUMES {
            let v = q
                .create_volume(&fs.path(&format!("v{i}")), Some(64 << 20))
                .unwrap();
            // Small files, not synced: delalloc and tree blocks still pending at delete.
            for j in 0..4u8 {
                fs::write(v.path().join(format!("f{j}")), vec![j + 1; 8192]).unwrap();
            }
            if i > 0 && i % 2 == 1 {
                // What a restore does: a blob reflinked into the new instance, then changed.
                fs::copy(
                    fs.path(&format!("blob{}", i - 1)),
                    v.path().join("restored"),
                )
                .unwrap();
                fs::OpenOptions::new()
                    .append(true)
                    .open(v.path().join("restored"))
                    .and_then(|mut f| f.write_all(b"x"))
                    .unwrap();
            }
            if i % 2 == 0 {
                // What a capture does: the instance's extents shared with the blob store.
                fs::copy(v.path().join("f0"), fs.path(&format!("blob{i}"))).unwrap();
            }
            v.delete().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        reader.join().unwrap()
    });
    // Every drop ends; the qgroups of the volumes whose extents the blobs still share stay.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stale = 0;
    while Instant::now() < deadline {
        q.commit().unwrap();
        stale = q.stale_qgroups().unwrap();
        if stale == VOLUMES / 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "churn: {VOLUMES} volumes in {:.1} s, {reads} qgroup reads, {stale} stale qgroups",
        start.elapsed().as_secs_f64(),
    );
    writable(&fs.mnt).expect("the file system went read-only");
    assert_eq!(
        stale,
        VOLUMES / 2,
        "one stale qgroup per volume whose extent a blob shares"
    );
}
