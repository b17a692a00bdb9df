//! The dump stage: a tmpfs where CRIU writes a checkpoint's images inside the frozen window
//! (paper: "Environment-state recovery", keeping the frozen window short). Writing a process's
//! memory into the page cache of the state dir's disk filesystem runs at a fraction of memory
//! speed on these machines (≈0.5 GB/s against ≈1.3 GB/s for tmpfs) and stalls behind dirty-page
//! write-back; the images are moved into the checkpoint directory after the thaw, where they
//! are fsync'd with the rest of the checkpoint.
//!
//! A restore of a checkpoint whose memory is in page packs assembles the pages files CRIU
//! reads in a slot of the same stage (`sandbox::restore`): the pages come out of the packs'
//! page cache and CRIU reads them from memory, where a copy on the disk filesystem would be
//! a fresh inode read back from the disk.
//!
//! The stage has a byte budget: a checkpoint reserves its sandbox's charged memory (plus a
//! margin) before dumping, and dumps straight into the checkpoint directory when the budget
//! cannot cover it. tmpfs pages are memory only while a dump sits there.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::mount::{mount, MsFlags};

/// Why the stage could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// Creating, clearing or examining the stage directory failed.
    #[error("dump stage {path}: {op} failed")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Mounting the tmpfs failed.
    #[error("cannot mount a tmpfs on the dump stage {path}")]
    Mount {
        /// The stage directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: nix::Error,
    },
}

/// Bytes reserved on top of a sandbox's charged memory for the non-page images.
const MARGIN_BYTES: u64 = 64 << 20;

/// A tmpfs with a byte budget shared by concurrent checkpoints.
#[derive(Debug)]
pub struct DumpStage {
    dir: PathBuf,
    capacity: u64,
    reserved: Mutex<u64>,
    next: Mutex<u64>,
}

/// Room for one dump in the stage: a fresh directory; removed, and its bytes given back, on
/// drop.
#[derive(Debug)]
pub struct StageSlot<'a> {
    stage: &'a DumpStage,
    dir: PathBuf,
    bytes: u64,
}

impl DumpStage {
    /// Mounts a tmpfs of `capacity` bytes (mode 0700) at `mount_point` unless one is mounted
    /// there already, and uses its subdirectory for the daemon of `state_dir` (named by a
    /// digest of that path, so daemons of different state dirs never share or clear each
    /// other's dumps), clearing what an earlier daemon of that state dir left in it.
    ///
    /// Errors: [`StageError`].
    pub fn mount(
        mount_point: &Path,
        state_dir: &Path,
        capacity: u64,
    ) -> Result<DumpStage, StageError> {
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| StageError::Io { op, path, source }
        };
        fs::create_dir_all(mount_point).map_err(io("mkdir", mount_point))?;
        let is_tmpfs = nix::sys::statfs::statfs(mount_point)
            .map(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
            .unwrap_or(false);
        if !is_tmpfs {
            let options = format!("size={capacity},mode=0700");
            mount(
                Some("tmpfs"),
                mount_point,
                Some("tmpfs"),
                MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some(options.as_str()),
            )
            .map_err(|source| StageError::Mount {
                path: mount_point.to_path_buf(),
                source,
            })?;
        }
        // Directories of daemons that ended without cleaning up: only empty ones go (`rmdir`
        // refuses the others); a live daemon re-creates its directory when it next dumps.
        for entry in fs::read_dir(mount_point).into_iter().flatten().flatten() {
            let _ = fs::remove_dir(entry.path());
        }
        let owner = blake3::hash(state_dir.as_os_str().as_encoded_bytes()).to_hex();
        let dir = mount_point.join(&owner.as_str()[..16]);
        let _ = belayer_overlay::remove_dir_all(&dir);
        fs::create_dir(&dir).map_err(io("mkdir", &dir))?;
        Ok(DumpStage {
            dir,
            capacity,
            reserved: Mutex::new(0),
            next: Mutex::new(0),
        })
    }

    /// The stage directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reserves room for the images of a sandbox charged `memory` bytes; `None` when the
    /// budget left or the tmpfs's free space cannot cover it (or the slot directory cannot
    /// be made).
    pub fn reserve(&self, memory: u64) -> Option<StageSlot<'_>> {
        let bytes = memory.saturating_add(MARGIN_BYTES);
        {
            let mut reserved = self.reserved.lock().unwrap_or_else(|p| p.into_inner());
            if reserved.saturating_add(bytes) > self.capacity {
                return None;
            }
            // The tmpfs may be shared (daemons of other state dirs mount it once, each with
            // its own budget): what is free there bounds every one of them.
            // Of the mount point: another daemon starting removes this one's directory while
            // it is empty (the slot below makes it again).
            let mount_point = self.dir.parent().unwrap_or(&self.dir);
            let free = nix::sys::statvfs::statvfs(mount_point)
                .map(|v| v.blocks_available().saturating_mul(v.fragment_size()))
                .unwrap_or(0);
            if free < bytes {
                return None;
            }
            *reserved += bytes;
        }
        let n = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            *next += 1;
            *next
        };
        let slot = StageSlot {
            stage: self,
            dir: self.dir.join(format!("dump-{n}")),
            bytes,
        };
        match fs::create_dir_all(&slot.dir) {
            Ok(()) => Some(slot),
            Err(e) => {
                tracing::warn!(path = %slot.dir.display(), error = %e, "cannot use the dump stage");
                None
            }
        }
    }
}

impl Drop for DumpStage {
    /// Removes this daemon's stage directory (the tmpfs stays mounted for the next one).
    fn drop(&mut self) {
        let _ = belayer_overlay::remove_dir_all(&self.dir);
    }
}

impl StageSlot<'_> {
    /// The slot's directory (where CRIU dumps, or a restore assembles its images).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Copies every image into `dest` (an existing, empty directory on the state dir's
    /// filesystem); the caller fsyncs them.
    pub fn move_into(&self, dest: &Path) -> std::io::Result<()> {
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                fs::copy(entry.path(), dest.join(entry.file_name()))?;
                fs::remove_file(entry.path())?;
            }
        }
        Ok(())
    }
}

impl Drop for StageSlot<'_> {
    fn drop(&mut self) {
        let _ = belayer_overlay::remove_dir_all(&self.dir);
        let mut reserved = self
            .stage
            .reserved
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *reserved = reserved.saturating_sub(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tmpfs_another_daemon_filled_refuses_the_reservation() {
        let dir = tempfile::tempdir().unwrap();
        let mount_point = dir.path().join("stage");
        // Two daemons (two state dirs), one tmpfs, each with the whole budget.
        let one = DumpStage::mount(&mount_point, &dir.path().join("one"), 256 << 20).unwrap();
        let two = DumpStage::mount(&mount_point, &dir.path().join("two"), 256 << 20).unwrap();
        let held = one.reserve(100 << 20).expect("fits");
        fs::write(held.dir().join("pages-1.img"), vec![7u8; 150 << 20]).unwrap();
        assert!(
            two.reserve(100 << 20).is_none(),
            "its own budget is free, the tmpfs is not"
        );
        drop(held);
        assert!(two.reserve(100 << 20).is_some(), "room again");
        drop((one, two));
        let _ = nix::mount::umount2(&mount_point, nix::mount::MntFlags::MNT_DETACH);
    }

    #[test]
    fn reservations_share_the_budget_and_return_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let mount_point = dir.path().join("stage");
        let stage = DumpStage::mount(&mount_point, dir.path(), 400 << 20).unwrap();
        let a = stage.reserve(100 << 20).expect("fits");
        let b = stage.reserve(100 << 20).expect("fits");
        assert!(stage.reserve(100 << 20).is_none(), "over budget");
        assert_ne!(a.dir(), b.dir());
        fs::write(a.dir().join("pages-1.img"), b"pages").unwrap();
        let dest = dir.path().join("dest");
        fs::create_dir(&dest).unwrap();
        a.move_into(&dest).unwrap();
        assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), b"pages");
        let a_dir = a.dir().to_path_buf();
        drop(a);
        assert!(!a_dir.exists());
        assert!(stage.reserve(100 << 20).is_some(), "budget given back");
        drop(b);
        let _ = nix::mount::umount2(&mount_point, nix::mount::MntFlags::MNT_DETACH);
    }
}
