//! `criu dump`: checkpointing a process tree into an images dir.

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use crate::locate::Criu;
use crate::log::{LogLevel, LogTail};
use crate::options::NetworkLock;
use crate::refusal::FileRefusal;
use crate::run::{self, push, ChildSetup};

/// Name of CRIU's log file inside the work dir.
pub const DUMP_LOG: &str = "dump.log";

/// Default [`DumpRequest::ghost_limit_bytes`]: 256 MiB.
pub const DEFAULT_GHOST_LIMIT_BYTES: u64 = 256 << 20;

/// What to dump and how. Built with [`DumpRequest::new`] and the option setters, then handed to
/// [`Criu::dump`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpRequest {
    pid: i32,
    images_dir: PathBuf,
    work_dir: PathBuf,
    leave_running: bool,
    freeze_cgroup: Option<PathBuf>,
    tcp_established: bool,
    skip_in_flight: bool,
    file_locks: bool,
    ext_mount_auto: bool,
    ghost_limit_bytes: u64,
    manage_cgroups: bool,
    network_lock: Option<NetworkLock>,
    timeout_s: Option<u32>,
    time_limit: Option<std::time::Duration>,
    action_script: Option<(PathBuf, String)>,
    netns: Option<PathBuf>,
    empty_netns: bool,
    cgroupns: Option<PathBuf>,
    log_level: LogLevel,
}

/// What a successful dump produced and cost.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpStats {
    /// Wall time of the `criu dump` process, from spawn to exit, in milliseconds.
    pub duration_ms: f64,
    /// Total size of the files in the images dir, in bytes.
    pub image_bytes: u64,
    /// Number of files in the images dir.
    pub image_files: u64,
    /// How long CRIU kept the tree frozen (its "Frozen time"), in milliseconds, when it said.
    pub frozen_ms: Option<f64>,
    /// Memory pages CRIU wrote (its "Memory pages written"), when it said.
    pub pages_written: Option<u64>,
}

/// Why a dump failed.
#[derive(Debug, thiserror::Error)]
pub enum DumpError {
    /// The network or cgroup namespace to run CRIU in could not be opened.
    #[error("cannot open namespace {}", path.display())]
    OpenNetns {
        /// The nsfs path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The images dir could not be read (missing, not a directory, no permission).
    #[error("cannot read images dir {}", path.display())]
    ReadImagesDir {
        /// The images dir.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The images dir already holds files; a dump must not mix with older images.
    #[error("images dir {} is not empty ({entries} entries)", path.display())]
    ImagesDirNotEmpty {
        /// The images dir.
        path: PathBuf,
        /// How many entries it holds.
        entries: usize,
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
    /// The action script's path cannot be handed to the child (a NUL byte in it).
    #[error("cannot use {} as the action script's path", path.display())]
    ScriptPath {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `criu` could not be started.
    #[error("cannot run {}", criu.display())]
    Spawn {
        /// The binary.
        criu: PathBuf,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// `criu dump` exited non-zero. With `leave_running`, CRIU has let the tree go again (thawing
    /// or re-freezing its cgroup as it found it).
    #[error("criu dump of pid {pid} failed ({status}): {log}")]
    Dump {
        /// The root task dumped.
        pid: i32,
        /// CRIU's exit status.
        status: ExitStatus,
        /// The end of CRIU's log, and its path.
        log: LogTail,
    },
    /// `criu dump` refused a file of the tree ([`FileRefusal`]): a deleted-but-open file above
    /// the ghost limit, or a file open under a removed name that another hard link keeps.
    /// With `leave_running`, the tree runs on as for [`DumpError::Dump`].
    #[error("criu dump of pid {pid} refused {}: {log}", describe(refusal, *ghost_limit))]
    File {
        /// The root task dumped.
        pid: i32,
        /// The file and why.
        refusal: FileRefusal,
        /// The request's [`DumpRequest::ghost_limit_bytes`].
        ghost_limit: u64,
        /// The end of CRIU's log, and its path.
        log: LogTail,
    },
    /// `criu dump` ran past its [`DumpRequest::time_limit`] and was killed; the tree is no
    /// longer traced (it may have died meanwhile, which is what usually stalls CRIU).
    #[error("criu dump of pid {pid} killed after its {limit:?} time limit: {log}")]
    TimedOut {
        /// The root task dumped.
        pid: i32,
        /// The limit.
        limit: std::time::Duration,
        /// The end of CRIU's log, and its path.
        log: LogTail,
    },
    /// The dump succeeded but its images could not be measured.
    #[error("cannot measure images in {}", path.display())]
    MeasureImages {
        /// The images dir.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl DumpRequest {
    /// Dump the tree rooted at host pid `pid` into `images_dir` (must exist and be empty), with
    /// CRIU's log and stats in `work_dir` (created if missing; never the images dir).
    ///
    /// Defaults, chosen for Belayer sandboxes: `leave_running` on (a checkpoint never kills a
    /// sandbox), `ext_mount_auto` on, `ghost_limit_bytes` [`DEFAULT_GHOST_LIMIT_BYTES`], no
    /// freezer cgroup, `tcp_established`/`file_locks`/`manage_cgroups` off, CRIU's default network
    /// lock, no timeout beyond CRIU's own, [`LogLevel::Debug`].
    pub fn new(pid: i32, images_dir: impl Into<PathBuf>, work_dir: impl Into<PathBuf>) -> Self {
        DumpRequest {
            pid,
            images_dir: images_dir.into(),
            work_dir: work_dir.into(),
            leave_running: true,
            freeze_cgroup: None,
            tcp_established: false,
            skip_in_flight: false,
            file_locks: false,
            ext_mount_auto: true,
            ghost_limit_bytes: DEFAULT_GHOST_LIMIT_BYTES,
            manage_cgroups: false,
            network_lock: None,
            timeout_s: None,
            time_limit: None,
            action_script: None,
            netns: None,
            empty_netns: false,
            cgroupns: None,
            log_level: LogLevel::default(),
        }
    }

    /// `--leave-running`: the tree keeps running after the dump (otherwise CRIU kills it).
    pub fn leave_running(mut self, on: bool) -> Self {
        self.leave_running = on;
        self
    }

    /// `--freeze-cgroup DIR`: CRIU finds the tasks through this cgroup's freezer instead of
    /// stopping them one by one with ptrace, which is both faster and race-free against forks. A
    /// v2 cgroup dir (with `cgroup.freeze`) or a v1 freezer dir (with `freezer.state`). If the
    /// caller froze it already, CRIU seizes the frozen tasks and leaves the cgroup frozen again
    /// when done (with `leave_running`); the caller thaws it.
    pub fn freeze_cgroup(mut self, dir: impl Into<PathBuf>) -> Self {
        self.freeze_cgroup = Some(dir.into());
        self
    }

    /// `--tcp-established`: dump established TCP connections (restore must say so too).
    pub fn tcp_established(mut self, on: bool) -> Self {
        self.tcp_established = on;
        self
    }

    /// `--skip-in-flight`: connections still in a listening socket's accept queue (not yet
    /// `accept`ed) are left out instead of failing the dump. Their client ends, established,
    /// are dumped; after a restore the server never sees them and the client's next segment
    /// is answered with RST (`ECONNRESET`), as after a network failure.
    pub fn skip_in_flight(mut self, on: bool) -> Self {
        self.skip_in_flight = on;
        self
    }

    /// `--file-locks`: dump file locks (restore must say so too).
    pub fn file_locks(mut self, on: bool) -> Self {
        self.file_locks = on;
        self
    }

    /// `--ext-mount-map auto`: mounts of the sandbox's mount namespace whose source lies outside it
    /// (bind mounts from the host) are recorded as external instead of failing the dump.
    pub fn ext_mount_auto(mut self, on: bool) -> Self {
        self.ext_mount_auto = on;
        self
    }

    /// `--ghost-limit N`: deleted-but-open files up to `bytes` each are copied into the images
    /// (CRIU's own default is 1 MiB, too small for temp files agents unlink while holding open).
    pub fn ghost_limit_bytes(mut self, bytes: u64) -> Self {
        self.ghost_limit_bytes = bytes;
        self
    }

    /// `--manage-cgroups=soft` when on; `--manage-cgroups=ignore` when off (the default: the
    /// caller owns cgroups, and a restore joins fresh ones, see
    /// [`RestoreRequest::join_cgroups`](crate::RestoreRequest::join_cgroups)). Skipping the cgroup
    /// dump also saves time. Restore must use the same setting.
    pub fn manage_cgroups(mut self, on: bool) -> Self {
        self.manage_cgroups = on;
        self
    }

    /// `--network-lock`: how CRIU blocks the tree's network while dumping. `None` (default) keeps
    /// CRIU's default (iptables). [`NetworkLock::Skip`] for sandboxes without network.
    pub fn network_lock(mut self, lock: Option<NetworkLock>) -> Self {
        self.network_lock = lock;
        self
    }

    /// Wall-clock limit on the whole `criu dump` run: past it the process is killed (which
    /// ends its ptrace of the tree) and the dump fails with [`DumpError::TimedOut`]. CRIU's own
    /// `--timeout` covers only freezing and seizing; a tree that dies while seized (a pid
    /// namespace init killed while CRIU waits for it to trap, its last child a zombie only
    /// CRIU may reap) leaves CRIU and the init waiting on each other forever. `None`: no limit.
    pub fn time_limit(mut self, limit: Option<std::time::Duration>) -> Self {
        self.time_limit = limit;
        self
    }

    /// `--timeout S`: CRIU gives up (and lets the tree go) after `seconds` of freezing/dumping.
    /// `None` keeps CRIU's default (10 s for freezing).
    pub fn timeout_s(mut self, seconds: Option<u32>) -> Self {
        self.timeout_s = seconds;
        self
    }

    /// `--action-script PATH`: CRIU runs the script `text` (a file at `path`, which CRIU's own
    /// process writes before its exec, so that no other process can hold it open for writing
    /// and fail the exec with `ETXTBSY`) at each stage of the dump (pre-dump, network-lock,
    /// post-dump, ...) with the stage in `$CRTOOLS_SCRIPT_ACTION`; a non-zero exit aborts the
    /// dump. Used to hook into the middle of a dump (e.g. fault injection in tests).
    pub fn action_script(mut self, script: Option<(PathBuf, String)>) -> Self {
        self.action_script = script;
        self
    }

    /// The path of the script [`DumpRequest::action_script`] set, if any.
    pub(crate) fn action_script_path(&self) -> Option<&Path> {
        self.action_script.as_ref().map(|(p, _)| p.as_path())
    }

    /// `-vN`: CRIU's log verbosity.
    pub fn log_level(mut self, level: LogLevel) -> Self {
        self.log_level = level;
        self
    }

    /// The root task's host pid.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Where the images go.
    pub fn images_dir(&self) -> &Path {
        &self.images_dir
    }

    /// Where CRIU's log and stats go.
    pub fn work_dir(&self) -> &Path {
        &self.work_dir
    }

    /// The log file this dump writes.
    pub fn log_path(&self) -> PathBuf {
        self.work_dir.join(DUMP_LOG)
    }

    /// Runs CRIU inside the network namespace at `path` (the tree's: `/proc/<pid>/ns/net`).
    /// CRIU then sees the tree's namespace as its own and does not dump it: no links,
    /// addresses, routes or firewall rules (`ip`, `iptables-save` runs), and no conntrack
    /// table walks (≈9 ms each on a host with 262 144 conntrack buckets): ≈20–35 ms of the
    /// frozen window for a sandbox that has only `lo`. Sockets are still dumped. Restore
    /// into a namespace of the caller's ([`RestoreRequest::join_netns`](crate::RestoreRequest::join_netns)).
    pub fn in_netns(mut self, path: impl Into<PathBuf>) -> Self {
        self.netns = Some(path.into());
        self
    }

    /// `--empty-ns net`: the tree's own network namespace (one CRIU is not in) is dumped as a
    /// bare entry, without its links, addresses, routes or firewall rules (CRIU runs no `ip`
    /// or `iptables-save` in the frozen window; it still dumps the namespace's conntrack
    /// entries), for a restore with [`RestoreRequest::empty_netns`](crate::RestoreRequest::empty_netns),
    /// which makes a fresh namespace owned by the restored user namespace.
    pub fn empty_netns(mut self, on: bool) -> Self {
        self.empty_netns = on;
        self
    }

    /// Runs CRIU inside the cgroup namespace at `path` (the tree's: `/proc/<pid>/ns/cgroup`),
    /// so it is not dumped (with `--manage-cgroups=ignore` CRIU keeps no cgroup state that
    /// could describe it); restore makes a fresh one rooted at the new cgroup
    /// ([`RestoreRequest::new_cgroupns`](crate::RestoreRequest::new_cgroupns)).
    pub fn in_cgroupns(mut self, path: impl Into<PathBuf>) -> Self {
        self.cgroupns = Some(path.into());
        self
    }

    /// The `criu` arguments for this request.
    pub(crate) fn args(&self) -> Vec<OsString> {
        // A host CRIU config (/etc/criu/default.conf, ~/.criu/default.conf) must not add options
        // to what is described here (e.g. --link-remap).
        let mut a: Vec<OsString> = vec!["dump".into(), "--no-default-config".into()];
        push(&mut a, "--tree", self.pid.to_string());
        push(&mut a, "--images-dir", &self.images_dir);
        push(&mut a, "--work-dir", &self.work_dir);
        push(&mut a, "--log-file", DUMP_LOG);
        a.push(self.log_level.arg().into());
        // Stats on stdout ("Frozen time", "Memory pages written"), parsed into DumpStats.
        a.push("--display-stats".into());
        if self.leave_running {
            a.push("--leave-running".into());
        }
        if let Some(cg) = &self.freeze_cgroup {
            push(&mut a, "--freeze-cgroup", cg);
        }
        if self.ext_mount_auto {
            push(&mut a, "--ext-mount-map", "auto");
        }
        if self.tcp_established {
            a.push("--tcp-established".into());
        }
        if self.skip_in_flight {
            a.push("--skip-in-flight".into());
        }
        if self.file_locks {
            a.push("--file-locks".into());
        }
        push(&mut a, "--ghost-limit", self.ghost_limit_bytes.to_string());
        a.push(manage_cgroups_arg(self.manage_cgroups).into());
        if let Some(lock) = self.network_lock {
            push(&mut a, "--network-lock", lock.arg());
        }
        if let Some(t) = self.timeout_s {
            push(&mut a, "--timeout", t.to_string());
        }
        if let Some((script, _)) = &self.action_script {
            push(&mut a, "--action-script", script);
        }
        if self.empty_netns {
            push(&mut a, "--empty-ns", "net");
        }
        a
    }
}

/// The file and the reason of a [`DumpError::File`].
fn describe(refusal: &FileRefusal, ghost_limit: u64) -> String {
    match refusal {
        FileRefusal::GhostTooLarge { path, bytes } => format!(
            "deleted-but-open file {path}: {bytes} bytes allocated, above the ghost limit of {ghost_limit} bytes"
        ),
        FileRefusal::LinkRemap { path } => format!(
            "file open under its removed name {path} while another hard link keeps it (no link remap is made in a sandbox)"
        ),
    }
}

/// `--manage-cgroups=soft|ignore` (CRIU's default without the flag is `soft`, so off is explicit).
pub(crate) fn manage_cgroups_arg(on: bool) -> &'static str {
    if on {
        "--manage-cgroups=soft"
    } else {
        "--manage-cgroups=ignore"
    }
}

impl Criu {
    /// Dumps the process tree described by `req` with `criu dump` and measures the images.
    ///
    /// Blocks until CRIU exits (tens of ms for a small tree, mostly proportional to memory). The
    /// tree must be dumpable by CRIU: a session leader inside its pid namespace, entered with
    /// `pivot_root`, with no fds that point outside its mount namespace (see the crate docs).
    ///
    /// Errors: [`DumpError::ReadImagesDir`] / [`DumpError::ImagesDirNotEmpty`] before running
    /// CRIU, [`DumpError::CreateWorkDir`], [`DumpError::Spawn`], [`DumpError::Dump`] with the tail
    /// of CRIU's log, [`DumpError::MeasureImages`].
    pub fn dump(&self, req: &DumpRequest) -> Result<DumpStats, DumpError> {
        req.check_images_dir()?;
        std::fs::create_dir_all(&req.work_dir).map_err(|source| DumpError::CreateWorkDir {
            path: req.work_dir.clone(),
            source,
        })?;
        let done = run::run(self.path(), &req.args(), req.child_setup()?).map_err(|source| {
            DumpError::Spawn {
                criu: self.path().to_path_buf(),
                source,
            }
        })?;
        req.finish(done)
    }
}

impl DumpRequest {
    /// What the CRIU child does before exec: enter the tree's network namespace if asked.
    pub(crate) fn child_setup(&self) -> Result<ChildSetup, DumpError> {
        let netns =
            run::open_netns(self.netns.as_deref()).map_err(|source| DumpError::OpenNetns {
                path: self.netns.clone().unwrap_or_default(),
                source,
            })?;
        let cgroupns =
            run::open_netns(self.cgroupns.as_deref()).map_err(|source| DumpError::OpenNetns {
                path: self.cgroupns.clone().unwrap_or_default(),
                source,
            })?;
        let scripts = match &self.action_script {
            Some((path, text)) => vec![run::script_file(path, text.clone()).map_err(|source| {
                DumpError::ScriptPath {
                    path: path.clone(),
                    source,
                }
            })?],
            None => Vec::new(),
        };
        Ok(ChildSetup {
            netns,
            cgroupns,
            scripts,
            time_limit: self.time_limit,
            ..ChildSetup::default()
        })
    }

    /// The images dir must exist and be empty.
    pub(crate) fn check_images_dir(&self) -> Result<(), DumpError> {
        let entries = std::fs::read_dir(&self.images_dir)
            .map_err(|source| DumpError::ReadImagesDir {
                path: self.images_dir.clone(),
                source,
            })?
            .count();
        if entries > 0 {
            return Err(DumpError::ImagesDirNotEmpty {
                path: self.images_dir.clone(),
                entries,
            });
        }
        Ok(())
    }

    /// Turns a finished `criu dump` run into stats, or its failure into a [`DumpError`].
    pub(crate) fn finish(&self, done: run::Finished) -> Result<DumpStats, DumpError> {
        if let Some(limit) = done.killed_after {
            let log = LogTail::collect(&self.log_path(), &done.stderr);
            tracing::warn!(pid = self.pid, ?limit, %log, "criu dump killed at its time limit");
            return Err(DumpError::TimedOut {
                pid: self.pid,
                limit,
                log,
            });
        }
        if !done.status.success() {
            let log = LogTail::collect(&self.log_path(), &done.stderr);
            tracing::debug!(pid = self.pid, status = %done.status, %log, "criu dump failed");
            if let Some(refusal) = FileRefusal::from_log(&log) {
                return Err(DumpError::File {
                    pid: self.pid,
                    refusal,
                    ghost_limit: self.ghost_limit_bytes,
                    log,
                });
            }
            return Err(DumpError::Dump {
                pid: self.pid,
                status: done.status,
                log,
            });
        }
        let (image_bytes, image_files) =
            measure_dir(&self.images_dir).map_err(|source| DumpError::MeasureImages {
                path: self.images_dir.clone(),
                source,
            })?;
        let stats = DumpStats {
            duration_ms: done.elapsed_ms(),
            image_bytes,
            image_files,
            frozen_ms: stat_value(&done.stdout, "Frozen time:").map(|us| us as f64 / 1e3),
            pages_written: stat_value(&done.stdout, "Memory pages written:"),
        };
        tracing::debug!(
            pid = self.pid,
            duration_ms = stats.duration_ms,
            frozen_ms = ?stats.frozen_ms,
            image_bytes,
            image_files,
            "criu dump done"
        );
        Ok(stats)
    }
}

/// Total bytes and number of the files directly in `dir` (CRIU's images dir is flat).
fn measure_dir(dir: &Path) -> io::Result<(u64, u64)> {
    let mut bytes = 0;
    let mut files = 0;
    for entry in std::fs::read_dir(dir)? {
        let meta = entry?.metadata()?;
        if meta.is_file() {
            bytes += meta.len();
            files += 1;
        }
    }
    Ok((bytes, files))
}

/// The first number after `label` in CRIU's `--display-stats` output, e.g. `"Frozen time: 8146 us"`.
pub(crate) fn stat_value(stdout: &str, label: &str) -> Option<u64> {
    stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests;
