//! Disk quotas against the real kernel: each test makes its own sparse btrfs image, loop-mounts
//! it under a unique directory in /var/tmp and removes both at the end. Needs root and
//! `mkfs.btrfs` (btrfs-progs, installed by scripts/setup.sh) for making the test images only.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use belayer_agent::quota::{self, QuotaError, QuotaFs, QuotaMode, Volume};

const MIB: u64 = 1 << 20;

/// A loop-mounted btrfs image; unmounted and deleted on drop.
struct Btrfs {
    dir: PathBuf,
    mnt: PathBuf,
}

impl Btrfs {
    /// A fresh file system with quotas in `mode` (`None`: quotas off).
    fn new(mode: Option<QuotaMode>) -> Btrfs {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = PathBuf::from(format!(
            "/var/tmp/belayer-quota-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let img = dir.join("fs.img");
        let mnt = dir.join("mnt");
        fs::create_dir(&mnt).unwrap();
        File::create(&img).unwrap().set_len(4 << 30).unwrap();
        let out = Command::new("mkfs.btrfs")
            .args(["-q", "-f"])
            .arg(&img)
            .output()
            .expect("mkfs.btrfs missing: run scripts/setup.sh (btrfs-progs)");
        assert!(out.status.success(), "mkfs.btrfs: {out:?}");
        let out = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&mnt)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount -o loop: {out:?}");
        let fs = Btrfs { dir, mnt };
        match mode {
            None => {}
            Some(QuotaMode::Simple) => {
                assert_eq!(QuotaFs::enable(&fs.mnt).unwrap().mode(), QuotaMode::Simple)
            }
            Some(QuotaMode::Full) => {
                let d = File::open(&fs.mnt).unwrap();
                quota::sys::quota_ctl(d.as_fd(), quota::sys::QUOTA_CTL_ENABLE).unwrap();
                assert_eq!(QuotaFs::probe(&fs.mnt).unwrap().mode(), QuotaMode::Full);
            }
        }
        fs
    }

    fn quota(&self) -> QuotaFs {
        QuotaFs::probe(&self.mnt).unwrap()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.mnt.join(name)
    }
}

impl Drop for Btrfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// Writes `bytes` of non-zero data to `path`; returns the bytes written and the error, if any.
fn write_bytes(path: &Path, bytes: u64) -> (u64, Option<io::Error>) {
    let mut f = match File::create(path) {
        Ok(f) => f,
        Err(e) => return (0, Some(e)),
    };
    let chunk = vec![0x5au8; MIB as usize];
    let mut done = 0;
    while done < bytes {
        let n = chunk.len().min((bytes - done) as usize);
        if let Err(e) = f.write_all(&chunk[..n]) {
            return (done, Some(e));
        }
        done += n as u64;
    }
    match f.sync_all() {
        Ok(()) => (done, None),
        Err(e) => (done, Some(e)),
    }
}

fn is_edquot(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EDQUOT)
}

/// Waits until qgroup `id` is gone, committing (the cleaner runs after commits) and sweeping.
fn wait_qgroup_gone(q: &QuotaFs, id: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        q.commit().unwrap();
        if !q.qgroups().unwrap().iter().any(|g| g.id == id) {
            return true;
        }
        q.sweep_stale().unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    false
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
        q.commit().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        q.commit().unwrap();
        assert_eq!(
            q.sweep_stale().unwrap(),
            0,
            "{mode:?}: bytes still accounted"
        );
        // Once the sharer drops the extents the qgroup goes: by the kernel or by the sweep.
        fs::remove_file(fs.path("staged")).unwrap();
        assert!(
            wait_qgroup_gone(&q, id),
            "{mode:?}: stale qgroup 0/{id} left"
        );
    }
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
