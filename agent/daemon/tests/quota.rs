//! Disk quotas against the real kernel: each test makes its own sparse btrfs image, loop-mounts
//! it under a unique directory in /var/tmp and removes both at the end. Needs root and
//! `mkfs.btrfs` (btrfs-progs, installed by scripts/setup.sh) for making the test images only.

mod common;

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use belayer_daemon::quota::{self, QuotaError, QuotaFs, QuotaMode, Volume};
use common::btrfs::{write_bytes, Btrfs, MIB};

fn is_edquot(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EDQUOT)
}

/// Waits until qgroup `id` is gone (removed by the kernel at the end of its drop).
fn wait_qgroup_gone(q: &QuotaFs, id: u64) -> bool {
    wait_until(q, |q| qgroup(q, id).is_none())
}

fn limit_cycle(mode: QuotaMode) {
    let fs = Btrfs::new(Some(mode));
    let q = fs.quota();
    let vol = Volume::create(&fs.path("inst-0"), Some(64 * MIB)).unwrap();
    assert_eq!(vol.usage().unwrap().limit, Some(64 * MIB));

    // 100 MiB into a 64 MiB volume: EDQUOT, at most the limit written.
    let (written, err) = write_bytes(&vol.path().join("big"), 100 * MIB);
    let err = err.expect("write past the limit must fail");
    assert!(is_edquot(&err), "{mode:?}: {err}");
    assert!(written <= 64 * MIB, "{mode:?}: wrote {written}");
    // fallocate(1) as a sandbox would run it.
    let out = Command::new("fallocate")
        .args(["-l", "200M"])
        .arg(vol.path().join("falloc"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "{mode:?}: fallocate past the limit");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Disk quota exceeded"),
        "{mode:?}: {out:?}"
    );

    // Deleting files gives the quota back (the kernel commits on EDQUOT and retries).
    fs::remove_file(vol.path().join("big")).unwrap();
    let _ = fs::remove_file(vol.path().join("falloc"));
    let (_, err) = write_bytes(&vol.path().join("again"), 48 * MIB);
    assert!(err.is_none(), "{mode:?}: after freeing: {err:?}");
    q.commit().unwrap();
    let u = vol.usage().unwrap();
    assert!(
        (48 * MIB..=50 * MIB).contains(&u.referenced),
        "{mode:?}: {u:?}"
    );

    // Raising the limit lets more in; lowering it below usage stops the next write.
    vol.set_limit(Some(128 * MIB)).unwrap();
    let (_, err) = write_bytes(&vol.path().join("more"), 64 * MIB);
    assert!(err.is_none(), "{mode:?}: after raising: {err:?}");
    vol.set_limit(Some(16 * MIB)).unwrap();
    let (_, err) = write_bytes(&vol.path().join("over"), 4 * MIB);
    assert!(err.as_ref().is_some_and(is_edquot), "{mode:?}: {err:?}");
    vol.set_limit(None).unwrap();
    assert_eq!(vol.usage().unwrap().limit, None);
    let (_, err) = write_bytes(&vol.path().join("free"), 8 * MIB);
    assert!(err.is_none(), "{mode:?}: unlimited: {err:?}");

    // Deleting the volume removes its qgroup.
    let id = vol.id();
    vol.delete().unwrap();
    assert!(!fs.path("inst-0").exists());
    assert!(wait_qgroup_gone(&q, id), "{mode:?}: qgroup 0/{id} left");
}

#[test]
fn limit_is_enforced_with_simple_quotas() {
    limit_cycle(QuotaMode::Simple);
}

#[test]
fn limit_is_enforced_with_full_qgroups() {
    limit_cycle(QuotaMode::Full);
}

#[test]
fn usage_reports_referenced_bytes() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let q = fs.quota();
    let vol = q.create_volume(&fs.path("v"), Some(1 << 30)).unwrap();
    let fresh = vol.usage().unwrap();
    assert!(fresh.referenced < MIB, "{fresh:?}");
    assert_eq!(fresh.limit, Some(1 << 30));
    write_bytes(&vol.path().join("a"), 10 * MIB);
    fs::create_dir_all(vol.path().join("upper/d")).unwrap();
    write_bytes(&vol.path().join("upper/d/b"), 5 * MIB);
    q.commit().unwrap();
    let u = vol.usage().unwrap();
    assert!((15 * MIB..16 * MIB).contains(&u.referenced), "{u:?}");
    assert_eq!(u.referenced, u.exclusive, "simple quotas: rfer = excl");
    let listed = q.qgroups().unwrap();
    let g = listed.iter().find(|g| g.id == vol.id()).unwrap();
    assert_eq!(g.referenced, u.referenced);
    assert_eq!(g.max_referenced, Some(1 << 30));
    // Reopening by path finds the same subvolume.
    assert_eq!(Volume::open(vol.path()).unwrap().id(), vol.id());
    vol.delete().unwrap();
}

#[test]
fn probe_says_no_quota_on_ext4() {
    let dir = Path::new("/var/tmp");
    for r in [QuotaFs::probe(dir), QuotaFs::enable(dir)] {
        match r {
            Err(e @ QuotaError::NotBtrfs { .. }) => {
                assert!(e.to_string().contains("not on btrfs"), "{e}")
            }
            other => panic!("expected NotBtrfs, got {other:?}"),
        }
    }
    assert!(matches!(
        Volume::create(Path::new("/var/tmp/belayer-quota-not-here"), Some(MIB)),
        Err(QuotaError::Create { .. })
    ));
    assert!(!Path::new("/var/tmp/belayer-quota-not-here").exists());
}

#[test]
fn probe_enables_quotas_on_btrfs() {
    let fs = Btrfs::new(None);
    assert!(matches!(
        QuotaFs::probe(&fs.mnt),
        Err(QuotaError::Disabled { .. })
    ));
    // A volume made while quotas are off cannot get a limit: it is removed again.
    let err = Volume::create(&fs.path("early"), Some(64 * MIB)).unwrap_err();
    assert!(matches!(err, QuotaError::SetLimit { .. }), "{err:?}");
    assert!(!fs.path("early").exists());
    let q = QuotaFs::enable(&fs.mnt).unwrap();
    assert_eq!(q.mode(), QuotaMode::Simple);
    assert!(!q.inconsistent());
    // Enabling again keeps the mode.
    assert_eq!(QuotaFs::enable(&fs.mnt).unwrap().mode(), QuotaMode::Simple);
    let v = q.create_volume(&fs.path("v"), Some(8 * MIB)).unwrap();
    let (_, err) = write_bytes(&v.path().join("f"), 16 * MIB);
    assert!(err.as_ref().is_some_and(is_edquot), "{err:?}");
    v.delete().unwrap();
}

#[test]
fn volumes_in_parallel() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let q = fs.quota();
    let ids: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let path = fs.path(&format!("inst-{i}"));
                s.spawn(move || {
                    let mut ids = Vec::new();
                    for round in 0..3 {
                        let v = Volume::create(&path, Some(16 * MIB)).unwrap();
                        let (_, err) = write_bytes(&v.path().join("ok"), 8 * MIB);
                        assert!(err.is_none(), "{i}/{round}: {err:?}");
                        let (_, err) = write_bytes(&v.path().join("over"), 16 * MIB);
                        assert!(err.as_ref().is_some_and(is_edquot), "{i}/{round}: {err:?}");
                        ids.push(v.id());
                        v.delete().unwrap();
                    }
                    ids
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    assert_eq!(ids.len(), 24);
    let unique: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), 24);
    for id in ids {
        assert!(wait_qgroup_gone(&q, id), "qgroup 0/{id} left");
    }
}

/// Reflinks (`copy_file_range` on btrfs): who is charged, and the stale qgroup a deleted
/// volume leaves while another subvolume still shares its extents.
#[test]
fn reflinked_extents_and_stale_qgroups() {
    for mode in [QuotaMode::Simple, QuotaMode::Full] {
        let fs = Btrfs::new(Some(mode));
        let q = fs.quota();
        // A "blob" written outside the volume, reflinked in (what materialize does).
        write_bytes(&fs.path("blob"), 40 * MIB);
        let v = q.create_volume(&fs.path("v"), Some(32 * MIB)).unwrap();
        let copied = copy_file_range(&fs.path("blob"), &v.path().join("restored"));
        assert_eq!(
            copied.as_ref().ok(),
            Some(&(40 * MIB)),
            "{mode:?}: {copied:?}"
        );
        q.commit().unwrap();
        let u = v.usage().unwrap();
        match mode {
            // Charged to the writer of the extent (the top level), not to the volume.
            QuotaMode::Simple => assert!(u.referenced < MIB, "{mode:?}: {u:?}"),
            // Referenced by the volume: counted in full, exclusive stays ~0.
            QuotaMode::Full => {
                assert!(u.referenced >= 40 * MIB, "{mode:?}: {u:?}");
                assert!(u.exclusive < MIB, "{mode:?}: {u:?}");
            }
        }
        // Data written inside the volume and reflinked out (what a capture's staging does).
        fs::remove_file(v.path().join("restored")).unwrap();
        write_bytes(&v.path().join("own"), 8 * MIB);
        copy_file_range(&v.path().join("own"), &fs.path("staged")).unwrap();
        let id = v.id();
        v.delete().unwrap();
        match mode {
            // Charged to the volume for the extents' whole life: its qgroup outlives the drop,
            // with those bytes; Belayer never removes it (that could abort a transaction, see
            // `stale_qgroups`).
            QuotaMode::Simple => {
                assert!(
                    wait_until(&q, |q| q.stale_qgroups().unwrap() == 1),
                    "the drop of 0/{id} did not end"
                );
                assert!(qgroup(&q, id).is_some_and(|g| g.exclusive >= 8 * MIB));
                fs::remove_file(fs.path("staged")).unwrap();
                // At 0 bytes it stays, or the kernel removes it (it sometimes does, when the
                // free that empties it runs where its own clean-up looks).
                assert!(
                    wait_until(&q, |q| qgroup(q, id).is_none_or(|g| g.exclusive == 0)),
                    "the stale qgroup 0/{id} still charged: {:?}",
                    qgroup(&q, id)
                );
            }
            // Nothing of the shared extents is referenced from the volume once it is dropped:
            // the kernel removes the qgroup at the end of the drop.
            QuotaMode::Full => assert!(wait_qgroup_gone(&q, id), "qgroup 0/{id} left"),
        }
    }
}

fn qgroup(q: &QuotaFs, id: u64) -> Option<quota::Qgroup> {
    q.qgroups().unwrap().into_iter().find(|g| g.id == id)
}

/// Commits every 50 ms until `done` holds (the cleaner runs after commits); false after 20 s.
fn wait_until(q: &QuotaFs, done: impl Fn(&QuotaFs) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        q.commit().unwrap();
        if done(q) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn copy_file_range(from: &Path, to: &Path) -> io::Result<u64> {
    let src = File::open(from)?;
    let dst = File::create(to)?;
    let mut total = 0;
    loop {
        let n = rustix::fs::copy_file_range(&src, None, &dst, None, 1 << 30)?;
        if n == 0 {
            return Ok(total);
        }
        total += n as u64;
    }
}

#[test]
fn delete_refuses_a_volume_with_a_mount_inside() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let v = Volume::create(&fs.path("inst-0"), Some(16 * MIB)).unwrap();
    let merged = v.path().join("merged");
    fs::create_dir(&merged).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "none"])
        .arg(&merged)
        .status()
        .unwrap();
    assert!(status.success());
    let err = Volume::open(v.path()).unwrap().delete().unwrap_err();
    assert!(matches!(err, QuotaError::Busy { .. }), "{err:?}");
    assert!(v.path().exists());
    assert!(Command::new("umount")
        .arg(&merged)
        .status()
        .unwrap()
        .success());
    v.delete().unwrap();
}

/// A volume holding a tree no user-space walk would enjoy is deleted at once; the same tree in
/// a plain directory goes through `remove_contents`.
#[test]
fn hostile_tree_is_deleted_without_a_walk() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let quota_fs = fs.quota();
    let fill = |inst: &Path| {
        let mut deep = inst.join("upper");
        fs::create_dir(&deep).unwrap();
        for _ in 0..2000 {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        for i in 0..5000 {
            File::create(inst.join(format!("upper/f{i}"))).unwrap();
        }
        std::os::unix::fs::symlink("/etc", inst.join("upper/etc")).unwrap();
    };
    let inst = fs.path("inst-0");
    let made = quota::make_instance_dir(Some(&quota_fs), &inst, Some(256 * MIB)).unwrap();
    assert!(matches!(made, quota::InstanceDir::Volume(_)));
    assert!(quota::is_volume(&inst));
    fill(&inst);
    let plain = fs.path("plain-0");
    assert!(matches!(
        quota::make_instance_dir(None, &plain, None).unwrap(),
        quota::InstanceDir::Plain
    ));
    assert!(!quota::is_volume(&plain));
    fill(&plain);
    quota_fs.commit().unwrap();
    let start = Instant::now();
    quota::remove_instance_dir(&inst).unwrap();
    let volume_took = start.elapsed();
    let start = Instant::now();
    quota::remove_instance_dir(&plain).unwrap();
    let plain_took = start.elapsed();
    eprintln!(
        "removing 7000 entries, depth 2000: volume {volume_took:?}, plain directory {plain_took:?}"
    );
    assert!(!inst.exists() && !plain.exists());
    assert!(Path::new("/etc/passwd").exists());
    // Missing is fine.
    quota::remove_instance_dir(&inst).unwrap();
}

/// The premise of the design: an overlay whose upper and work dirs are in a volume passes
/// `EDQUOT` up to the writer, for writes, `fallocate` and copy-ups alike, while a second volume
/// (another sandbox) keeps working.
#[test]
fn overlay_upper_in_a_volume_hits_the_limit() {
    let fs = Btrfs::new(Some(QuotaMode::Simple));
    let lower = fs.path("image");
    fs::create_dir(&lower).unwrap();
    write_bytes(&lower.join("big-lower"), 24 * MIB);
    let mut mounts = Vec::new();
    let mut vols = Vec::new();
    for name in ["inst-a", "inst-b"] {
        let v = Volume::create(&fs.path(name), Some(32 * MIB)).unwrap();
        for d in ["upper", "work", "merged"] {
            fs::create_dir(v.path().join(d)).unwrap();
        }
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            v.path().join("upper").display(),
            v.path().join("work").display()
        );
        let merged = v.path().join("merged");
        let out = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &opts])
            .arg(&merged)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount overlay: {out:?}");
        mounts.push(merged);
        vols.push(v);
    }
    let merged = &mounts[0];
    // Copy-up of a 24 MiB lower file (reflinked on btrfs), then writes past the limit.
    let mut f = File::options()
        .append(true)
        .open(merged.join("big-lower"))
        .unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    let (written, err) = write_bytes(&merged.join("fill"), 100 * MIB);
    assert!(err.as_ref().is_some_and(is_edquot), "{err:?}");
    assert!(written <= 32 * MIB, "{written}");
    let out = Command::new("fallocate")
        .args(["-l", "200M"])
        .arg(merged.join("falloc"))
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Disk quota exceeded"),
        "{out:?}"
    );
    // The other sandbox is unaffected.
    let (_, err) = write_bytes(&mounts[1].join("ok"), 16 * MIB);
    assert!(err.is_none(), "{err:?}");
    for m in &mounts {
        assert!(Command::new("umount").arg(m).status().unwrap().success());
    }
    for v in vols {
        v.delete().unwrap();
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Cost of what a sandbox create / restore adds: create + limit, a limit change, delete.
#[test]
fn cost_of_create_limit_delete() {
    for mode in [QuotaMode::Simple, QuotaMode::Full] {
        let fs = Btrfs::new(Some(mode));
        let (mut create, mut limit, mut delete, mut mkdir) = (vec![], vec![], vec![], vec![]);
        for i in 0..50 {
            let path = fs.path(&format!("inst-{i}"));
            let t = Instant::now();
            let v = Volume::create(&path, Some(10 << 30)).unwrap();
            create.push(t.elapsed());
            let t = Instant::now();
            v.set_limit(Some(5 << 30)).unwrap();
            limit.push(t.elapsed());
            fs::create_dir(path.join("upper")).unwrap();
            fs::write(path.join("upper/f"), b"x").unwrap();
            let t = Instant::now();
            v.delete().unwrap();
            delete.push(t.elapsed());
            let plain = fs.path(&format!("plain-{i}"));
            let t = Instant::now();
            fs::create_dir(&plain).unwrap();
            mkdir.push(t.elapsed());
        }
        let (c, l, d, m) = (median(create), median(limit), median(delete), median(mkdir));
        eprintln!(
            "{mode:?}: median of 50: create+limit {c:?}, set_limit {l:?}, delete {d:?} \
             (plain mkdir {m:?})"
        );
        // Loose bound (debug build, shared machine): a few ms is the budget per sandbox.
        assert!(c + d < Duration::from_millis(50), "{mode:?}: {c:?} + {d:?}");
    }
}

/// What accounting costs where full qgroups and simple quotas differ: dropping volumes whose
/// extents are shared (restores reflink blobs, captures reflink upper files into the blob
/// store). Full qgroups walk every shared extent's backrefs when the cleaner drops a tree.
/// Printed for the record (quotas off, simple, full); 96 volumes made it 0.7-1.6 s, 3-5 s and
/// 39-43 s here.
#[test]
fn cost_of_dropping_volumes_that_share_extents() {
    for mode in [None, Some(QuotaMode::Simple), Some(QuotaMode::Full)] {
        let fs = Btrfs::new(mode);
        let top = File::open(&fs.mnt).unwrap();
        // A 64 MiB "blob" of 256 separately allocated extents.
        {
            let mut f = File::create(fs.path("blob")).unwrap();
            let chunk = vec![7u8; 256 << 10];
            for _ in 0..256 {
                f.write_all(&chunk).unwrap();
                f.sync_data().unwrap();
            }
        }
        let n = 24;
        for i in 0..n {
            let name = format!("v{i}");
            match mode {
                None => quota::sys::subvol_create(top.as_fd(), name.as_bytes()).unwrap(),
                Some(_) => drop(Volume::create(&fs.path(&name), Some(4 << 30)).unwrap()),
            }
            copy_file_range(&fs.path("blob"), &fs.path(&name).join("r")).unwrap();
        }
        quota::sys::sync(top.as_fd()).unwrap();
        let t = Instant::now();
        for i in 0..n {
            quota::sys::snap_destroy(top.as_fd(), format!("v{i}").as_bytes()).unwrap();
        }
        quota::sys::sync(top.as_fd()).unwrap();
        let out = Command::new("btrfs")
            .args(["subvolume", "sync"])
            .arg(&fs.mnt)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        quota::sys::sync(top.as_fd()).unwrap();
        eprintln!(
            "quotas {mode:?}: delete {n} volumes sharing a 64 MiB file of 256 extents, until \
             dropped: {:?}",
            t.elapsed()
        );
    }
}
