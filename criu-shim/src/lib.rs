//! Everything Belayer asks of CRIU: finding a usable `criu`, checking the kernel, dumping a
//! sandbox's process tree into an images dir and restoring it, detached, into a fresh sandbox,
//! with typed errors that carry the end of CRIU's log.
//!
//! ```no_run
//! use belayer_criu::{Criu, DumpRequest, RestoreRequest};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let criu = Criu::locate(None)?; // $BELAYER_CRIU, /usr/local/sbin/criu, then $PATH
//! let stats = criu.dump(
//!     &DumpRequest::new(4242, "/ck/7/images", "/ck/7/work")
//!         .freeze_cgroup("/sys/fs/cgroup/unified/belayer/sb-1"),
//! )?;
//! println!("dumped {} bytes in {:.1} ms", stats.image_bytes, stats.duration_ms);
//! let restored = criu.restore(&RestoreRequest::new("/ck/7/images", "/ck/7/restore").root("/sb/2/merged"))?;
//! // `restored.pid` is now a child of this process: reap it when it exits.
//! # Ok(()) }
//! ```
//!
//! # Minimum version
//! CRIU 4.x ([`MIN_MAJOR_VERSION`]). Debian 12's CRIU 3.17 fails on the 6.x kernels of the target
//! machines ("Unexpected rt vDSO area bounds"); `scripts/setup.sh` builds CRIU 4.1.1 from source
//! into `/usr/local/sbin/criu`. [`Criu::locate`] says so when it finds none or an old one.
//!
//! # The `criu` command line, not `criu swrk` RPC
//! Dumps and restores run the `criu` binary with command-line options, once per operation. The
//! `rust-criu` crate (0.6.1, RPC over `criu swrk`) was the first choice but lacks options these
//! sandboxes need: it has no setter for `auto_ext_mnt` (`--ext-mount-map auto`), `ghost_limit` or
//! `network_lock`, and its `restore()` drops CRIU's response, so the restored pid could only be
//! learned through a notify callback kept in a static. The command line offers every option,
//! `--pidfile` for the restored pid, and `--restore-sibling` for the same parentage as RPC's
//! `rst_sibling`; both ways exec one `criu` per operation, so neither is faster.
//!
//! # Options used, and why
//! Learned by dumping and restoring overlayfs sandboxes by hand on the target machines:
//! - `--leave-running` (dump): a checkpoint never stops the sandbox.
//! - `--freeze-cgroup <sandbox cgroup>` (dump): CRIU collects the tree through the freezer, with no
//!   race against forks. The agent freezes the cgroup first (to capture the overlay upper layer in
//!   the same instant); CRIU accepts an already-frozen cgroup and leaves it frozen when done, and
//!   the agent thaws it. v2 (`cgroup.freeze`) and v1 (`freezer.state`) dirs both work.
//! - `--ext-mount-map auto` (dump and restore): bind mounts whose source lies outside the sandbox's
//!   mount namespace are recorded as external and re-created from the same host paths.
//! - `--ghost-limit` (dump, 256 MiB by default): deleted-but-open files are copied into the images;
//!   CRIU's 1 MiB default fails on the temp files agents keep open after unlinking. A larger one
//!   fails the dump with [`DumpError::File`] ([`FileRefusal::GhostTooLarge`]).
//! - `--manage-cgroups=ignore` (both, by default): the agent owns cgroups; a restore joins the
//!   fresh sandbox's cgroups *before* CRIU starts ([`RestoreRequest::join_cgroups`]), so the
//!   restored tasks are born in them.
//! - `--restore-detached --restore-sibling --pidfile` (restore): CRIU exits once the tree runs, the
//!   restored root becomes a child of the caller, and its host pid comes from the pidfile.
//! - `--root <merged dir>` (restore): the tree is restored into a fresh overlay mount, never into
//!   the failed sandbox.
//! - the process itself (not an option): every run is in a process group of its own, killed as
//!   a whole at its time limit ([`DumpError::TimedOut`], [`RestoreError::TimedOut`]), and a
//!   killed run's orphans are reaped by [`reap_orphans`]; a restore starts with its inheritable
//!   set raised to its permitted set, since the restorer `capset`s each task's dumped sets after
//!   trimming its bounding set and the kernel refuses an inheritable set outside the old
//!   inheritable set ∪ bounding set (a task that dropped an inheritable capability from its
//!   bounding set). In a user namespace the images recreate, the restorer's inheritable set is
//!   empty whatever CRIU's is: such a task cannot be restored there.
//! - `--display-stats`: CRIU's own frozen time and page counts, reported in [`DumpStats`].
//! - `--tcp-established`, `--file-locks`, `--network-lock`: off / CRIU's default unless asked for.
//! - never `--link-remap` (dump): with it, CRIU would hard-link a deleted-but-linked file at a
//!   name it builds from the file's path, resolved from the tree's root but with absolute
//!   symbolic links of the sandbox resolved from the host root; without it such a dump fails
//!   with [`DumpError::File`] ([`FileRefusal::LinkRemap`]).
//!
//! # Restoring hostile images
//! Part of a restore runs as host root from the host's root directory with paths from the
//! images (ghost files of deleted-but-open files, their removal, tmpfs extraction, deleted
//! bind-mount sources). [`validate_restore_paths`] checks every path a restore will create,
//! open, bind or remove against the fresh root before CRIU runs; call it right before
//! [`Criu::restore`] (module [`images`] lists CRIU's path operations and how each is covered).
//!
//! What CRIU demands of the tree (the sandbox code must provide it): the root task enters its root
//! with `pivot_root`, not `chroot`; it is a session leader inside its pid namespace (`setsid`); it
//! inherits no host fds (close them before exec'ing the sandbox init) and has stdio that lives
//! inside the sandbox; `/dev` is a private tmpfs. CRIU restores every task with its dumped pid, so
//! those pids must be free: reap a killed original before restoring it (see [`Criu::restore`]).
//!
//! # Logs
//! CRIU's log goes to the request's work dir (`dump.log`, `restore.log`), never into the images dir,
//! which is published as a checkpoint artifact; CRIU also writes its stats file (`stats-dump`,
//! `stats-restore`) and the restore pidfile (`restore.pid`) there. The default verbosity is `-v4`
//! ([`LogLevel::Debug`]), as container runtimes use. A failed dump or restore carries the last
//! [`log::TAIL_LINES`] lines and the log's path ([`LogTail`]); its message shows CRIU's last
//! `Error` lines. CRIU's restore log always holds one harmless error on these machines: raising
//! `RLIMIT_NOFILE` for itself is refused.
//!
//! # Kernel-feature cache
//! CRIU re-probes the kernel on every run (20 ms on an idle machine, 40-60 ms on a busy one: more
//! than half of a small dump) unless its cache file sits on a tmpfs; on
//! hosts whose `/run` is not one, [`Criu::kdat_cache`] keeps the cache on a small tmpfs of the
//! caller's (see [`kdat`]).
//!
//! # Dependencies
//! - `nix`: mounts, `unshare`, `statfs` and `write` for the kdat cache and for joining cgroups
//!   between fork and exec, `openat2` for the image path check, with typed errnos.
//! - `libc`: `close_range(CLOSE_RANGE_CLOEXEC)`, which `nix` lacks, so no caller fd leaks into CRIU.
//! - `rustix`: `pidfd_open`, which `nix` lacks, to wait for a CRIU run with a time limit.
//! - `thiserror`: the error enums. `tracing`: debug events per CRIU run (library: no subscriber).
//! - `tar`, `flate2`: reading the gzip'd tmpfs archives of an images dir to check their members
//!   and to model the tmpfs for later path checks (the same crates the agent uses for layers).
//! - `tempfile` (tests only): scratch images and work dirs.
#![warn(missing_docs)]

mod dump;
mod gate;
mod hook;
pub mod images;
pub mod kdat;
mod locate;
pub mod log;
mod options;
mod refusal;
mod restore;
mod run;
mod sys;

pub use dump::{DumpError, DumpRequest, DumpStats, DEFAULT_GHOST_LIMIT_BYTES, DUMP_LOG};
pub use gate::{abort_gated_dump, abort_held_restore, GatedDumpError};
pub use hook::{HookedRestoreError, RestoreStage};
pub use images::{
    rebase_userns_images, tcp_connections, userns_uid_map, validate_restore_paths,
    validate_restore_paths_allowing, AllowedBind, IdExtent, ImagePathReport, PathOp,
    SocketImageError, TcpConnection, UnsafeImagePath, UnsafeKind, UsernsImageError,
    ALLOWED_CHAR_DEVICES, PTY_OPEN_TRIES,
};
pub use kdat::{KdatCache, KdatError, KdatMode};
pub use locate::{CheckError, Criu, LocateError, CRIU_ENV, DEFAULT_CRIU_PATH, MIN_MAJOR_VERSION};
pub use log::{LogLevel, LogTail};
pub use options::NetworkLock;
pub use refusal::FileRefusal;
pub use restore::{RestoreError, RestoreOutcome, RestoreRequest, RESTORE_LOG, RESTORE_PIDFILE};
pub use run::reap_orphans;
pub use sys::SyscallError;
