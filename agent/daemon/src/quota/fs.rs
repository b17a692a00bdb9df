//! The state dir's file system as a quota domain: probing, enabling and listing qgroups.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::qgroup::qgroups;
pub use super::qgroup::Qgroup;
use super::sys::{self, le_u64};
use super::volume::Volume;
use super::QuotaError;

/// How the file system accounts qgroup usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    /// Simple quotas (Linux ≥ 6.7): an extent is charged to the subvolume that allocated it, for
    /// its whole life; referenced = exclusive.
    Simple,
    /// Full qgroups: referenced and exclusive bytes from backref walks at every commit; every
    /// subvolume reaching an extent is charged for it in "referenced".
    Full,
}

/// A btrfs file system with quotas on, reached through a directory on it (the state dir).
///
/// Probe once at start ([`QuotaFs::probe`] or [`QuotaFs::enable`]); cheap to keep (one fd).
#[derive(Debug)]
pub struct QuotaFs {
    dir: PathBuf,
    fd: OwnedFd,
    mode: QuotaMode,
    inconsistent: bool,
}

/// `BTRFS_QGROUP_STATUS_FLAG_ON`.
const STATUS_ON: u64 = 1 << 0;
/// `BTRFS_QGROUP_STATUS_FLAG_INCONSISTENT`.
const STATUS_INCONSISTENT: u64 = 1 << 2;
/// `BTRFS_QGROUP_STATUS_FLAG_SIMPLE_MODE`.
const STATUS_SIMPLE_MODE: u64 = 1 << 3;
/// Subvolume ids are at least `BTRFS_FIRST_FREE_OBJECTID`...
const FIRST_SUBVOL: u64 = 256;
/// ...and at most `BTRFS_LAST_FREE_OBJECTID` (-256).
const LAST_SUBVOL: u64 = u64::MAX - 255;

impl QuotaFs {
    /// Checks that `dir` is on btrfs with quotas on, without changing anything.
    ///
    /// Errors: [`QuotaError::Open`], [`QuotaError::NotBtrfs`] (e.g. ext4, xfs, tmpfs),
    /// [`QuotaError::Disabled`] (btrfs with quotas off), [`QuotaError::Probe`] (the quota tree
    /// could not be read: needs `CAP_SYS_ADMIN`).
    pub fn probe(dir: &Path) -> Result<QuotaFs, QuotaError> {
        let fd = open_dir(dir)?;
        let fs_type = sys::fs_type(fd.as_fd()).map_err(|source| QuotaError::Probe {
            path: dir.to_path_buf(),
            source,
        })?;
        if fs_type != sys::BTRFS_SUPER_MAGIC {
            return Err(QuotaError::NotBtrfs {
                path: dir.to_path_buf(),
                fs_type,
            });
        }
        match status(&fd, dir)? {
            None => Err(QuotaError::Disabled {
                path: dir.to_path_buf(),
            }),
            Some(flags) => Ok(QuotaFs {
                dir: dir.to_path_buf(),
                fd,
                mode: if flags & STATUS_SIMPLE_MODE != 0 {
                    QuotaMode::Simple
                } else {
                    QuotaMode::Full
                },
                inconsistent: flags & STATUS_INCONSISTENT != 0,
            }),
        }
    }

    /// Like [`QuotaFs::probe`], but turns quotas on when `dir` is on btrfs with quotas off:
    /// simple quotas where the kernel has them (≥ 6.7), else full qgroups (which start a
    /// rescan of existing data). Quotas that are already on are kept in their mode.
    ///
    /// Errors: as [`QuotaFs::probe`], plus [`QuotaError::Enable`].
    pub fn enable(dir: &Path) -> Result<QuotaFs, QuotaError> {
        match Self::probe(dir) {
            Err(QuotaError::Disabled { .. }) => {}
            other => return other,
        }
        let fd = open_dir(dir)?;
        let enable_err = |source| QuotaError::Enable {
            path: dir.to_path_buf(),
            source,
        };
        match sys::quota_ctl(fd.as_fd(), sys::QUOTA_CTL_ENABLE_SIMPLE) {
            Ok(()) => {}
            // Kernels before 6.7 do not know the simple-quota command.
            Err(e)
                if matches!(
                    e.source.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP)
                ) =>
            {
                sys::quota_ctl(fd.as_fd(), sys::QUOTA_CTL_ENABLE).map_err(enable_err)?
            }
            Err(e) => return Err(enable_err(e)),
        }
        tracing::info!(state_dir = %dir.display(), "enabled btrfs quotas");
        Self::probe(dir)
    }

    /// The directory this was probed through.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The accounting mode (see the module docs for what each charges).
    pub fn mode(&self) -> QuotaMode {
        self.mode
    }

    /// Whether the kernel flagged qgroup numbers inconsistent when probed (full mode after
    /// certain operations; limits then act on stale numbers until a rescan).
    pub fn inconsistent(&self) -> bool {
        self.inconsistent
    }

    /// Creates the subvolume `path` (its parent must exist on this file system, its name must
    /// be new) with a limit of `limit` referenced bytes (`None`: unlimited, usage still
    /// accounted). See [`Volume::create`].
    pub fn create_volume(&self, path: &Path, limit: Option<u64>) -> Result<Volume, QuotaError> {
        Volume::create(path, limit)
    }

    /// Opens the existing subvolume `path`. See [`Volume::open`].
    pub fn open_volume(&self, path: &Path) -> Result<Volume, QuotaError> {
        Volume::open(path)
    }

    /// Every level-0 qgroup (one per subvolume, live or stale), as of the last commit.
    ///
    /// Errors: [`QuotaError::Qgroups`].
    pub fn qgroups(&self) -> Result<Vec<Qgroup>, QuotaError> {
        qgroups(&self.fd, None).map_err(|source| QuotaError::Qgroups {
            path: self.dir.clone(),
            source,
        })
    }

    /// How many level-0 qgroups have no subvolume any more (stale qgroups), as of the last
    /// commit. The kernel (6.18) removes a deleted subvolume's qgroup itself when the cleaner
    /// ends the drop with no bytes charged to it; under simple quotas a qgroup whose extents are
    /// still shared then (reflinked into the blob store, say) stays, and often stays at 0 bytes
    /// once those are freed (the kernel removes some of those then, not all). Belayer never removes qgroups itself: on 6.18, removing the qgroup
    /// of a subvolume that still owns an extent — and usage items lag behind delayed refs, so
    /// "0 bytes" does not prove it owns none — aborts the next transaction that frees the
    /// extent and forces the whole file system read-only ("Transaction aborted (error -2)" in
    /// `do_free_extent_accounting`). A stale qgroup costs two items in the quota tree and a
    /// few hundred bytes of kernel memory; `btrfs qgroup clear-stale` removes them while no
    /// daemon runs.
    ///
    /// Errors: [`QuotaError::Qgroups`] when the trees cannot be read.
    pub fn stale_qgroups(&self) -> Result<usize, QuotaError> {
        let err = |source| QuotaError::Qgroups {
            path: self.dir.clone(),
            source,
        };
        let roots = subvolume_roots(&self.fd).map_err(err)?;
        let groups = qgroups(&self.fd, None).map_err(err)?;
        Ok(groups
            .iter()
            .filter(|g| g.id >= FIRST_SUBVOL && !roots.contains(&g.id))
            .count())
    }

    /// Writes back dirty data and commits the current transaction, so that [`Volume::usage`]
    /// and [`QuotaFs::qgroups`] are current (`BTRFS_IOC_SYNC`: costly on a busy file system;
    /// limits are enforced without it).
    ///
    /// Errors: [`QuotaError::Commit`].
    pub fn commit(&self) -> Result<(), QuotaError> {
        sys::sync(self.fd.as_fd()).map_err(|source| QuotaError::Commit {
            path: self.dir.clone(),
            source,
        })
    }
}

fn open_dir(dir: &Path) -> Result<OwnedFd, QuotaError> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map(OwnedFd::from)
        .map_err(|source| QuotaError::Open {
            path: dir.to_path_buf(),
            source,
        })
}

/// Flags of the quota status item, `None` when quotas are off (no quota tree).
fn status(fd: &OwnedFd, dir: &Path) -> Result<Option<u64>, QuotaError> {
    let key = (0, sys::QGROUP_STATUS_KEY, 0);
    match sys::tree_search(fd.as_fd(), sys::QUOTA_TREE, key, key) {
        Ok(items) => Ok(items
            .iter()
            .find(|i| i.kind == sys::QGROUP_STATUS_KEY)
            .map(|i| le_u64(&i.data, 16))
            .filter(|flags| flags & STATUS_ON != 0)),
        Err(e) if e.source.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(source) => Err(QuotaError::Probe {
            path: dir.to_path_buf(),
            source,
        }),
    }
}

/// Ids of every subvolume root item of the file system, live or being dropped.
fn subvolume_roots(fd: &OwnedFd) -> Result<HashSet<u64>, crate::sys::SyscallError> {
    let items = sys::tree_search(
        fd.as_fd(),
        sys::ROOT_TREE,
        (FIRST_SUBVOL, sys::ROOT_ITEM_KEY, 0),
        (LAST_SUBVOL, sys::ROOT_ITEM_KEY, u64::MAX),
    )?;
    Ok(items
        .iter()
        .filter(|i| i.kind == sys::ROOT_ITEM_KEY)
        .map(|i| i.objectid)
        .collect())
}
