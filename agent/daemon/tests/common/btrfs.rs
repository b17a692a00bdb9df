//! A loop-mounted btrfs test file system, shared by the quota tests.

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use belayer_daemon::quota::{self, QuotaFs, QuotaMode};

pub const MIB: u64 = 1 << 20;

/// A loop-mounted btrfs image; unmounted and deleted on drop.
pub struct Btrfs {
    pub dir: PathBuf,
    pub mnt: PathBuf,
}

impl Btrfs {
    /// A fresh file system with quotas in `mode` (`None`: quotas off).
    pub fn new(mode: Option<QuotaMode>) -> Btrfs {
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

    pub fn quota(&self) -> QuotaFs {
        QuotaFs::probe(&self.mnt).unwrap()
    }

    pub fn path(&self, name: &str) -> PathBuf {
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
pub fn write_bytes(path: &Path, bytes: u64) -> (u64, Option<io::Error>) {
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
