//! Kernel-enforced disk quotas for sandboxes: each sandbox instance's directory (`inst-<n>`,
//! holding the overlay's `upper` and `work`) is a btrfs subvolume whose level-0 qgroup carries
//! the sandbox's byte limit. A write, `fallocate`, copy-up or mkdir past the limit fails inside
//! the sandbox with `EDQUOT` ("Disk quota exceeded"); the daemon, the host's file systems and
//! other sandboxes are untouched.
//!
//! Why btrfs: the machines this runs on have no XFS project quotas (`CONFIG_XFS_QUOTA` unset),
//! no ext4 quota formats (`CONFIG_QFMT_V2` unset) and no tmpfs quotas, while btrfs is built in
//! and its qgroups work. So the state dir must live on btrfs; `scripts/setup.sh` loop-mounts an
//! image at `/var/lib/belayer` where the host's file system is not btrfs.
//!
//! - [`QuotaFs::probe`] / [`QuotaFs::enable`]: is the state dir on btrfs with quotas on (turn
//!   them on)? Typed errors say why not ([`QuotaError::NotBtrfs`], [`QuotaError::Disabled`]).
//! - [`Volume::create`] (subvolume + limit), [`Volume::usage`], [`Volume::set_limit`],
//!   [`Volume::delete`]; [`QuotaFs::stale_qgroups`] counts qgroups left by deleted subvolumes
//!   (never removed: it says why).
//! - [`make_instance_dir`] / [`remove_instance_dir`]: what the instance code calls;
//!   [`resolve_limit`]: spec limit vs the daemon default; [`remove_contents`]: the one function
//!   that walks a plain (non-volume) tree to delete it; [`open_state_quota`]: the daemon's policy
//!   at start.
//!
//! Everything goes through ioctls ([`sys`]); no btrfs CLI is needed at run time. Every call
//! needs `CAP_SYS_ADMIN` (tree search, qgroup control) — `belayerd` runs as root.
//!
//! # Accounting mode: simple quotas
//!
//! [`QuotaFs::enable`] turns on *simple quotas* (squota, Linux ≥ 6.7) when quotas are off, and
//! keeps full qgroups when those are already on; both enforce the same limit item. Under
//! simple quotas an extent is charged, for its whole life, to the subvolume that allocated it
//! (referenced = exclusive); under full qgroups every subvolume that can reach an extent is
//! charged for it in "referenced", found by backref walks at transaction commits.
//!
//! Measured here (debug build, loop-mounted image, 2 busy cores; `tests/quota.rs`): create +
//! limit of a volume 0.09–0.14 ms, a limit change 0.004 ms, delete 0.22–0.37 ms (median of 50;
//! a plain `mkdir` is 0.02 ms), the same in both modes — well inside the few-ms budget of a
//! sandbox create or restore. Where they differ is dropping volumes whose extents are shared,
//! which restores (reflinked blobs) and captures (upper files reflinked into the blob store)
//! make the normal case: deleting 96 volumes that share a 256-extent file took 0.7–1.6 s with
//! quotas off, 3–5 s with simple quotas and 39–43 s with full qgroups, whose commits stall every
//! writer of the file system (checkpoint `fsync`s included) meanwhile. Simple quotas suffice
//! because what they bound is what a sandbox can take from the disk: the bytes it allocated.
//!
//! # Reflinks and which limit is set
//!
//! On btrfs, `copy_file_range` and overlayfs copy-up reflink (share extents) instead of copying
//! when source and target are on the same file system, as the state dir's image lower layers,
//! blob store and instances are. So a restore's materialize (blobs → upper) and a copy-up of an
//! image file allocate no data, and a capture's staging copy (upper → blobs) shares the
//! sandbox's extents with the blob store.
//!
//! - Simple quotas: a reflinked extent stays charged to the subvolume that wrote it. A restored
//!   instance starts at ~0 bytes however large its checkpoint (the blob store holds those
//!   bytes), and every byte it writes counts. A deleted instance whose extents the blob store
//!   still shares keeps a stale qgroup with those bytes until the blobs are collected; then it
//!   sits at 0; Belayer leaves it there ([`QuotaFs::stale_qgroups`]).
//! - Full qgroups: "referenced" counts every extent the instance can reach, shared or not, so
//!   a restored instance starts at its checkpoint's size; "exclusive" counts only unshared
//!   extents and so moves when *another* subvolume (the blob store, by collection) drops its
//!   share — a sandbox could be pushed over an exclusive limit by a blob collection.
//!
//! The limit set is `max_rfer` (`BTRFS_QGROUP_LIMIT_MAX_RFER`): under simple quotas it equals
//! the exclusive limit; under full qgroups it depends only on what the sandbox itself can see,
//! never on other subvolumes' lifetimes, and bounds the upper layer a checkpoint captures. A
//! file cloned many times inside one instance counts once in either mode (one extent), which is
//! also what it costs the disk.
//!
//! Usage numbers ([`Volume::usage`]) are those of the last committed transaction; the limit is
//! enforced at once, on the reservations every write makes.
//!
//! # Restored instances
//!
//! A restore from an upper snapshot ([`crate::store::snapshot`]) shares the whole checkpointed
//! layer, file data *and* metadata (directories, inodes, extended attributes, which simple
//! quotas charge too), with earlier volumes; a materialized restore shares only the file data
//! it places from blobs. Under simple quotas neither is charged to the new volume, so each
//! instance records what it inherited (`SandboxRecord::inherited_bytes`): for a snapshot, the
//! charge recorded with it at the checkpoint (its volume's usage, current after the snapshot's
//! commit, plus what that instance had inherited) less its ghost files, which CRIU writes anew;
//! materialized, the shared file data, each blob once. The instance's limit is the sandbox's
//! minus that (at least 1 byte), set once the overlay is mounted and before CRIU runs; only the
//! mount goes without one, so a restore of a sandbox at its limit still mounts, and CRIU's
//! ghost files count (a checkpoint whose ghosts would not fit is refused; see
//! `tests/disk_quota_restores.rs`). The
//! inherited charge is an upper bound: bytes of it the sandbox deletes stay counted. So a
//! restore installs a snapshot only while its charge is within a slack (16 MiB, or a sixteenth
//! of the limit) of the layer's file data, and otherwise materializes, which charges the new
//! volume what the layer holds now.
//!
//! # Threat model
//!
//! A sandbox sees its instance only through overlayfs: btrfs ioctls on overlay files fail
//! (`ENOTTY`), so it can neither create nested subvolumes (which would block deletion) nor
//! change qgroups, and it has no `CAP_SYS_ADMIN`. Deleting a volume walks nothing in user
//! space. No qgroup is ever removed from user space: on 6.18 that can abort a transaction and
//! force the state file system read-only ([`QuotaFs::stale_qgroups`]).

pub mod fs;
pub mod instance;
pub mod qgroup;
pub mod startup;
pub mod sys;
pub mod volume;

use std::path::PathBuf;

pub use fs::{QuotaFs, QuotaMode};
pub use instance::{
    make_instance_dir, remove_contents, remove_instance_dir, resolve_limit, InstanceDir,
    MIN_DISK_LIMIT,
};
pub use qgroup::Qgroup;
pub use startup::open_state_quota;
pub use volume::{is_volume, Volume, VolumeUsage};

use crate::sys::SyscallError;

/// Errors of disk quotas.
#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    /// A directory could not be opened or stat'ed.
    #[error("cannot open {path}")]
    Open {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file system of a directory could not be examined.
    #[error("cannot probe disk quotas of {path}")]
    Probe {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// The directory is not on btrfs, the only file system with working quotas here.
    #[error("{path} is not on btrfs (file system magic {fs_type:#x}): no disk quota")]
    NotBtrfs {
        /// The directory.
        path: PathBuf,
        /// `statfs` `f_type`.
        fs_type: i64,
    },
    /// The directory is on btrfs with quotas off.
    #[error("{path} is on btrfs with quotas disabled: no disk quota")]
    Disabled {
        /// The directory.
        path: PathBuf,
    },
    /// Turning quotas on failed.
    #[error("cannot enable btrfs quotas on {path}")]
    Enable {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// A path is not absolute or its last component is not a valid subvolume name.
    #[error("invalid volume path {path}")]
    InvalidPath {
        /// The path.
        path: PathBuf,
    },
    /// Creating a subvolume failed.
    #[error("cannot create volume {path}")]
    Create {
        /// The volume path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Snapshotting a volume failed.
    #[error("cannot snapshot volume {from} as {path}")]
    Snapshot {
        /// The volume snapshotted.
        from: PathBuf,
        /// The snapshot's path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// A directory is not a btrfs subvolume root.
    #[error("{path} is not a btrfs subvolume")]
    NotAVolume {
        /// The path.
        path: PathBuf,
    },
    /// The subvolume id could not be looked up.
    #[error("cannot look up the subvolume id of {path}")]
    Lookup {
        /// The volume path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Setting a qgroup limit failed.
    #[error("cannot set the disk limit of volume {path} (qgroup 0/{id})")]
    SetLimit {
        /// The volume path.
        path: PathBuf,
        /// Subvolume id.
        id: u64,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Reading a volume's qgroup failed.
    #[error("cannot read the disk usage of volume {path} (qgroup 0/{id})")]
    Usage {
        /// The volume path.
        path: PathBuf,
        /// Subvolume id.
        id: u64,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// A volume has no qgroup (made while quotas were off).
    #[error("volume {path} has no qgroup 0/{id}")]
    NoQgroup {
        /// The volume path.
        path: PathBuf,
        /// Subvolume id.
        id: u64,
    },
    /// Listing or removing qgroups failed.
    #[error("cannot list the qgroups of {path}")]
    Qgroups {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Committing the transaction failed.
    #[error("cannot commit the file system of {path}")]
    Commit {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Something is mounted inside a volume that is to be deleted.
    #[error("volume {path} is busy: {mount} is mounted inside")]
    Busy {
        /// The volume path.
        path: PathBuf,
        /// The mount point.
        mount: PathBuf,
    },
    /// The volume's name now leads elsewhere.
    #[error("{path} is no longer the volume that was opened")]
    Replaced {
        /// The volume path.
        path: PathBuf,
    },
    /// Deleting a subvolume failed.
    #[error("cannot delete volume {path}")]
    Delete {
        /// The volume path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: SyscallError,
    },
    /// Making a plain instance directory failed.
    #[error("cannot create directory {path}")]
    Mkdir {
        /// The path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Removing a plain directory tree failed.
    #[error("cannot remove {path}")]
    RemoveContents {
        /// The directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A disk limit was asked for where quotas are unavailable.
    #[error("cannot limit {path} to {bytes} bytes: the state dir has no disk quota")]
    Unavailable {
        /// The instance directory.
        path: PathBuf,
        /// The limit asked for.
        bytes: u64,
    },
    /// A requested disk limit is too small.
    #[error("disk limit {bytes} is below the minimum of {min} bytes")]
    InvalidLimit {
        /// The limit asked for.
        bytes: u64,
        /// [`MIN_DISK_LIMIT`].
        min: u64,
    },
}
