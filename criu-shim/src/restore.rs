//! `criu restore`: bringing a dumped process tree back to life, detached from CRIU.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use crate::dump::{manage_cgroups_arg, stat_value};
use crate::locate::Criu;
use crate::log::{LogLevel, LogTail};
use crate::options::NetworkLock;
use crate::run::{self, push, ChildSetup};

/// Name of CRIU's log file inside the work dir.
pub const RESTORE_LOG: &str = "restore.log";

/// Name of the pidfile (inside the work dir) where CRIU writes the restored root's host pid.
pub const RESTORE_PIDFILE: &str = "restore.pid";

/// What to restore and how. Built with [`RestoreRequest::new`] and the option setters, then handed
/// to [`Criu::restore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreRequest {
    images_dir: PathBuf,
    work_dir: PathBuf,
    root: Option<PathBuf>,
    restore_sibling: bool,
    ext_mount_auto: bool,
    tcp_established: bool,
    file_locks: bool,
    manage_cgroups: bool,
    network_lock: Option<NetworkLock>,
    join_cgroups: Vec<PathBuf>,
    netns: Option<PathBuf>,
    empty_netns: bool,
    new_cgroupns: bool,
    time_limit: Option<std::time::Duration>,
    log_level: LogLevel,
}

/// A restored tree.
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreOutcome {
    /// Host pid of the restored root task. The caller must reap it (see [`Criu::restore`]).
    pub pid: i32,
    /// Wall time of the `criu restore` process, from spawn to exit, in milliseconds.
    pub duration_ms: f64,
    /// CRIU's own "Restore time", in milliseconds, when it said.
    pub restore_time_ms: Option<f64>,
}

/// Why a restore failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The images dir holds no CRIU images (no `inventory.img`).
    #[error("no criu images in {} (inventory.img missing)", path.display())]
    NoImages {
        /// The images dir.
        path: PathBuf,
    },
    /// The work dir could not be created.
    #[error("cannot create work dir {}", path.display())]
    CreateWorkDir {
        /// The work dir.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A pidfile left by an earlier restore could not be removed.
    #[error("cannot remove stale pidfile {}", path.display())]
    RemoveStalePidfile {
        /// The pidfile.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The network namespace to join could not be opened.
    #[error("cannot open network namespace {}", path.display())]
    OpenNetns {
        /// The nsfs path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A cgroup to join could not be opened (its `cgroup.procs`).
    #[error("cannot open {} to join it", path.display())]
    OpenCgroup {
        /// The `cgroup.procs` file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// `criu` could not be started (or could not join the cgroups).
    #[error("cannot run {}", criu.display())]
    Spawn {
        /// The binary.
        criu: PathBuf,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// `criu restore` exited non-zero; CRIU has killed whatever it had restored.
    #[error("criu restore from {} failed ({status}): {log}", images_dir.display())]
    Restore {
        /// The images dir.
        images_dir: PathBuf,
        /// CRIU's exit status.
        status: ExitStatus,
        /// The end of CRIU's log, and its path.
        log: LogTail,
    },
    /// `criu restore` ran past its [`RestoreRequest::time_limit`] and was killed (with its
    /// process group); whatever it had restored is left, stopped or half-built, in the joined
    /// cgroups for the caller to kill. The images are untouched.
    #[error("criu restore from {} killed after its {limit:?} time limit: {log}", images_dir.display())]
    TimedOut {
        /// The images dir.
        images_dir: PathBuf,
        /// The limit.
        limit: std::time::Duration,
        /// The end of CRIU's log, and its path.
        log: LogTail,
    },
    /// CRIU reported success but its pidfile could not be read: the tree runs, its pid is unknown.
    #[error("cannot read the pidfile {} of a restore that succeeded", path.display())]
    ReadPidfile {
        /// The pidfile.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// CRIU's pidfile does not hold a pid.
    #[error("pidfile {} holds {content:?}, not a pid", path.display())]
    ParsePidfile {
        /// The pidfile.
        path: PathBuf,
        /// What it holds.
        content: String,
    },
}

impl RestoreRequest {
    /// Restore from `images_dir` (a finished dump), with CRIU's log, stats and pidfile in
    /// `work_dir` (created if missing).
    ///
    /// Defaults: no new root (tasks keep the root they were dumped with), `restore_sibling` on,
    /// `ext_mount_auto` on, `tcp_established`/`file_locks`/`manage_cgroups` off, CRIU's default
    /// network lock, no cgroups to join, [`LogLevel::Debug`].
    pub fn new(images_dir: impl Into<PathBuf>, work_dir: impl Into<PathBuf>) -> Self {
        RestoreRequest {
            images_dir: images_dir.into(),
            work_dir: work_dir.into(),
            root: None,
            restore_sibling: true,
            ext_mount_auto: true,
            tcp_established: false,
            file_locks: false,
            manage_cgroups: false,
            network_lock: None,
            join_cgroups: Vec::new(),
            netns: None,
            empty_netns: false,
            new_cgroupns: false,
            time_limit: None,
            log_level: LogLevel::default(),
        }
    }

    /// Runs CRIU in a new cgroup namespace rooted at the cgroups it joined first
    /// ([`Self::join_cgroups`]): for a tree dumped with
    /// [`DumpRequest::in_cgroupns`](crate::DumpRequest::in_cgroupns), the restored tree
    /// lives in a cgroup namespace rooted at its fresh cgroup.
    pub fn new_cgroupns(mut self, on: bool) -> Self {
        self.new_cgroupns = on;
        self
    }

    /// Wall-clock limit on the whole `criu restore` run: past it CRIU's process group is killed
    /// and the restore fails with [`RestoreError::TimedOut`]; whatever it had restored is left
    /// in the joined cgroups, for the caller to kill. `None`: no limit.
    pub fn time_limit(mut self, limit: Option<std::time::Duration>) -> Self {
        self.time_limit = limit;
        self
    }

    /// Restores a tree dumped with [`DumpRequest::in_netns`](crate::DumpRequest::in_netns)
    /// into the network namespace at `path` (an nsfs file: `/proc/<pid>/ns/net`, or
    /// `/proc/self/fd/<n>` of an open one): CRIU runs inside it, and the restored tree,
    /// whose namespace the images do not describe, stays in it.
    pub fn join_netns(mut self, path: impl Into<PathBuf>) -> Self {
        self.netns = Some(path.into());
        self
    }

    /// `--empty-ns net`, for a tree dumped with
    /// [`DumpRequest::empty_netns`](crate::DumpRequest::empty_netns): CRIU creates the tree's
    /// network namespace (with its user namespace, so that one owns it) and leaves it bare,
    /// `lo` down. Use [`Criu::restore_staged`] to ready it before any socket is restored.
    pub fn empty_netns(mut self, on: bool) -> Self {
        self.empty_netns = on;
        self
    }

    /// `--root DIR`: the restored mount namespace gets `dir` as its root; for a sandbox, the merged
    /// dir of a fresh overlay mount holding the checkpoint's upper layer.
    pub fn root(mut self, dir: impl Into<PathBuf>) -> Self {
        self.root = Some(dir.into());
        self
    }

    /// `--restore-sibling` (on, the default): the restored root task is created as a sibling of
    /// CRIU, i.e. a child of the calling process. Off: plain `--restore-detached`, the root is
    /// CRIU's child and, once CRIU exits, is re-parented to the nearest child subreaper (or init).
    pub fn restore_sibling(mut self, on: bool) -> Self {
        self.restore_sibling = on;
        self
    }

    /// `--ext-mount-map auto`: re-create the mounts the dump recorded as external from the same host
    /// paths. Must match the dump.
    pub fn ext_mount_auto(mut self, on: bool) -> Self {
        self.ext_mount_auto = on;
        self
    }

    /// `--tcp-established`: restore established TCP connections. Must match the dump.
    pub fn tcp_established(mut self, on: bool) -> Self {
        self.tcp_established = on;
        self
    }

    /// `--file-locks`: restore file locks. Must match the dump.
    pub fn file_locks(mut self, on: bool) -> Self {
        self.file_locks = on;
        self
    }

    /// `--manage-cgroups=soft` when on (CRIU re-creates the dumped cgroups), `=ignore` when off.
    /// Must match the dump.
    pub fn manage_cgroups(mut self, on: bool) -> Self {
        self.manage_cgroups = on;
        self
    }

    /// `--network-lock`; `None` keeps CRIU's default. Must match the dump.
    pub fn network_lock(mut self, lock: Option<NetworkLock>) -> Self {
        self.network_lock = lock;
        self
    }

    /// Cgroup dirs (a v2 dir and/or v1 controller dirs, e.g. the fresh sandbox's) that CRIU joins
    /// before it starts: with `manage_cgroups` off, the restored tasks are born in them, so limits
    /// and the freezer apply from their first instruction. CRIU itself (one short-lived process
    /// and its helpers) is charged to them while it runs.
    pub fn join_cgroups(mut self, dirs: impl IntoIterator<Item = impl Into<PathBuf>>) -> Self {
        self.join_cgroups = dirs.into_iter().map(Into::into).collect();
        self
    }

    /// `-vN`: CRIU's log verbosity.
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }

    /// Where the images are read from.
    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    /// Where CRIU's log, stats and pidfile go.
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// The log file this restore writes.
    pub fn log_path(&self) -> PathBuf {
        self.work_dir.join(RESTORE_LOG)
    }

    /// The pidfile this restore writes.
    pub fn pidfile_path(&self) -> PathBuf {
        self.work_dir.join(RESTORE_PIDFILE)
    }

    /// The `criu` arguments for this request.
    pub(crate) fn args(&self) -> Vec<OsString> {
        // A host CRIU config (/etc/criu/default.conf, ~/.criu/default.conf) must not add options
        // to what is described here (e.g. --link-remap).
        let mut a: Vec<OsString> = vec!["restore".into(), "--no-default-config".into()];
        push(&mut a, "--images-dir", &self.images_dir);
        push(&mut a, "--work-dir", &self.work_dir);
        push(&mut a, "--log-file", RESTORE_LOG);
        a.push(self.log_level.arg().into());
        a.push("--display-stats".into());
        // Detached: CRIU exits once the tree runs, instead of waiting for the root to exit.
        a.push("--restore-detached".into());
        if self.restore_sibling {
            a.push("--restore-sibling".into());
        }
        push(&mut a, "--pidfile", self.pidfile_path());
        if let Some(root) = &self.root {
            push(&mut a, "--root", root);
        }
        if self.ext_mount_auto {
            push(&mut a, "--ext-mount-map", "auto");
        }
        if self.tcp_established {
            a.push("--tcp-established".into());
        }
        if self.file_locks {
            a.push("--file-locks".into());
        }
        a.push(manage_cgroups_arg(self.manage_cgroups).into());
        if let Some(lock) = self.network_lock {
            push(&mut a, "--network-lock", lock.arg());
        }
        if self.empty_netns {
            push(&mut a, "--empty-ns", "net");
        }
        a
    }
}

impl Criu {
    /// Restores the tree in `req.images_dir` with `criu restore --restore-detached` and returns the
    /// restored root's host pid (from CRIU's `--pidfile`).
    ///
    /// CRIU restores every task with the pid it had when dumped (in the host pid namespace too, for
    /// a tree without its own): those pids must be free. A killed original that has not been reaped
    /// yet (a zombie) still holds its pid and fails the restore with "File exists".
    ///
    /// **Reaping.** With `restore_sibling` (the default) the restored root is a child of the
    /// calling process; otherwise it is re-parented to the nearest child subreaper once CRIU exits
    /// (the agent sets `PR_SET_CHILD_SUBREAPER` on itself), or to init. Either way the caller must
    /// `waitpid` it when it exits, or it stays a zombie holding its pid (and its session id),
    /// which fails later restores of the same checkpoint.
    ///
    /// Errors: [`RestoreError::NoImages`] before running CRIU, [`RestoreError::CreateWorkDir`],
    /// [`RestoreError::RemoveStalePidfile`], [`RestoreError::OpenCgroup`],
    /// [`RestoreError::Spawn`], [`RestoreError::Restore`] with the tail of CRIU's log,
    /// [`RestoreError::TimedOut`] past the time limit,
    /// [`RestoreError::ReadPidfile`] / [`RestoreError::ParsePidfile`].
    pub fn restore(&self, req: &RestoreRequest) -> Result<RestoreOutcome, RestoreError> {
        let setup = req.child_setup()?;
        let done =
            run::run(self.path(), &req.args(), setup).map_err(|source| RestoreError::Spawn {
                criu: self.path().to_path_buf(),
                source,
            })?;
        req.finish(done)
    }
}

impl RestoreRequest {
    /// Checks the images dir, makes the work dir, removes a stale pidfile and opens what the
    /// CRIU child joins (cgroups, network namespace).
    pub(crate) fn child_setup(&self) -> Result<ChildSetup, RestoreError> {
        let req = self;
        if !req.images_dir.join("inventory.img").is_file() {
            return Err(RestoreError::NoImages {
                path: req.images_dir.clone(),
            });
        }
        std::fs::create_dir_all(&req.work_dir).map_err(|source| RestoreError::CreateWorkDir {
            path: req.work_dir.clone(),
            source,
        })?;
        let pidfile = req.pidfile_path();
        match std::fs::remove_file(&pidfile) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(RestoreError::RemoveStalePidfile {
                    path: pidfile,
                    source,
                })
            }
        }
        let cgroups = open_cgroup_procs(&req.join_cgroups)?;
        let netns =
            run::open_netns(req.netns.as_deref()).map_err(|source| RestoreError::OpenNetns {
                path: req.netns.clone().unwrap_or_default(),
                source,
            })?;
        Ok(ChildSetup {
            netns,
            cgroups,
            new_cgroupns: req.new_cgroupns,
            time_limit: req.time_limit,
            inheritable_from_permitted: true,
            ..ChildSetup::default()
        })
    }

    /// Turns CRIU's exit into the outcome: the time limit, the exit status (with the log's
    /// tail), the pidfile.
    pub(crate) fn finish(&self, done: run::Finished) -> Result<RestoreOutcome, RestoreError> {
        let req = self;
        let pidfile = req.pidfile_path();
        if let Some(limit) = done.killed_after {
            let log = LogTail::collect(&req.log_path(), &done.stderr);
            tracing::warn!(images = %req.images_dir.display(), ?limit, %log, "criu restore killed at its time limit");
            return Err(RestoreError::TimedOut {
                images_dir: req.images_dir.clone(),
                limit,
                log,
            });
        }
        if !done.status.success() {
            let log = LogTail::collect(&req.log_path(), &done.stderr);
            tracing::debug!(images = %req.images_dir.display(), status = %done.status, %log, "criu restore failed");
            return Err(RestoreError::Restore {
                images_dir: req.images_dir.clone(),
                status: done.status,
                log,
            });
        }
        let content =
            std::fs::read_to_string(&pidfile).map_err(|source| RestoreError::ReadPidfile {
                path: pidfile.clone(),
                source,
            })?;
        let pid = match content.trim().parse::<i32>() {
            Ok(pid) if pid > 0 => pid,
            _ => {
                return Err(RestoreError::ParsePidfile {
                    path: pidfile,
                    content,
                })
            }
        };
        let outcome = RestoreOutcome {
            pid,
            duration_ms: done.elapsed_ms(),
            restore_time_ms: stat_value(&done.stdout, "Restore time:").map(|us| us as f64 / 1e3),
        };
        tracing::debug!(
            pid,
            duration_ms = outcome.duration_ms,
            images = %req.images_dir.display(),
            "criu restore done"
        );
        Ok(outcome)
    }
}

/// Opens `<dir>/cgroup.procs` of each dir for writing (close-on-exec, as std opens everything).
fn open_cgroup_procs(dirs: &[PathBuf]) -> Result<Vec<OwnedFd>, RestoreError> {
    dirs.iter()
        .map(|dir| {
            let path = dir.join("cgroup.procs");
            OpenOptions::new()
                .write(true)
                .open(&path)
                .map(OwnedFd::from)
                .map_err(|source| RestoreError::OpenCgroup { path, source })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn joined(req: &RestoreRequest) -> String {
        req.args()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn default_args_restore_detached_as_a_sibling_with_a_pidfile() {
        let args = joined(&RestoreRequest::new("/ck/img", "/ck/work"));
        assert!(args.starts_with(
            "restore --no-default-config --images-dir /ck/img --work-dir /ck/work --log-file restore.log -v4"
        ));
        for expected in [
            "--restore-detached",
            "--restore-sibling",
            "--pidfile /ck/work/restore.pid",
            "--ext-mount-map auto",
            "--manage-cgroups=ignore",
        ] {
            assert!(args.contains(expected), "{expected} missing in {args}");
        }
        assert!(!args.contains("--root"));
    }

    #[test]
    fn options_map_to_flags() {
        let req = RestoreRequest::new("/i", "/w")
            .root("/sb/merged")
            .restore_sibling(false)
            .ext_mount_auto(false)
            .tcp_established(true)
            .file_locks(true)
            .manage_cgroups(true)
            .network_lock(Some(NetworkLock::Nftables))
            .empty_netns(true)
            .log_level(LogLevel::Info);
        let args = joined(&req);
        assert!(!joined(&RestoreRequest::new("/i", "/w")).contains("--empty-ns"));
        for expected in [
            "--empty-ns net",
            "--root /sb/merged",
            "--tcp-established",
            "--file-locks",
            "--manage-cgroups=soft",
            "--network-lock nftables",
            " -v3 ",
            "--restore-detached",
        ] {
            assert!(args.contains(expected), "{expected} missing in {args}");
        }
        assert!(!args.contains("--restore-sibling"));
        assert!(!args.contains("--ext-mount-map"));
    }

    #[test]
    fn missing_cgroup_is_reported_with_its_path() {
        let err = open_cgroup_procs(&[PathBuf::from("/nonexistent/cg")]).unwrap_err();
        match err {
            RestoreError::OpenCgroup { path, .. } => {
                assert_eq!(path, PathBuf::from("/nonexistent/cg/cgroup.procs"))
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}
