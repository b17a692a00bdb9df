//! Host plumbing shared by the two baselines of `bench capture`: running tools with errors that
//! name the step, overlay mounts, a freezer cgroup and scratch dirs, each undone on drop.

mod freezer;

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

pub use freezer::FreezerCgroup;

/// Bytes of a tool's stderr or log file quoted in an error.
const TAIL_BYTES: usize = 1500;

/// A failed step of a baseline.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// A tool could not be started.
    #[error("{step}: cannot start {program}")]
    Spawn {
        /// The step.
        step: &'static str,
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A tool exited unsuccessfully; `tail` holds the end of its stderr and of its log file.
    #[error("{step}: {program} failed ({status}): {tail}")]
    Tool {
        /// The step.
        step: &'static str,
        /// The program.
        program: String,
        /// Its exit status.
        status: ExitStatus,
        /// End of its stderr (and log).
        tail: String,
    },
    /// A file-system operation failed.
    #[error("{step}: {}", path.display())]
    Io {
        /// The step.
        step: &'static str,
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A mount or unmount failed.
    #[error("{step}: {}", path.display())]
    Mount {
        /// The step.
        step: &'static str,
        /// The mount point.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// No freezer: neither a cgroup2 mount nor a v1 `freezer` hierarchy.
    #[error(
        "no cgroup freezer: no cgroup2 mount and no v1 freezer hierarchy in /proc/self/mountinfo"
    )]
    NoFreezer,
    /// The cgroup did not report frozen in time.
    #[error("freezing {} did not finish within {waited_ms} ms", path.display())]
    FreezeTimeout {
        /// The cgroup dir.
        path: PathBuf,
        /// How long it waited, milliseconds.
        waited_ms: u128,
    },
    /// Processes stayed in the cgroup after being killed.
    #[error("killing the processes of {} did not empty it within {waited_ms} ms", path.display())]
    KillTimeout {
        /// The cgroup dir.
        path: PathBuf,
        /// How long it waited, milliseconds.
        waited_ms: u128,
    },
    /// The workload setup inside the sandbox exited before it was ready.
    #[error("setup of {workload} in the {system} sandbox stopped before it was ready: {log_tail}")]
    SetupExited {
        /// The workload.
        workload: String,
        /// `tar_criu` or `runc`.
        system: &'static str,
        /// End of the setup log (and of the launcher's stderr).
        log_tail: String,
    },
    /// The restored tree does not have the processes that were dumped.
    #[error(
        "{system} restore of {workload}: {found} processes running 1 s after restore, {dumped} dumped"
    )]
    RestoredTree {
        /// The workload.
        workload: String,
        /// `tar_criu` or `runc`.
        system: &'static str,
        /// Processes at checkpoint time.
        dumped: usize,
        /// Processes last seen after restore.
        found: usize,
    },
    /// The workload setup did not finish in time.
    #[error("setup of {workload} in the {system} sandbox not ready after {secs} s: {log_tail}")]
    SetupTimeout {
        /// The workload.
        workload: String,
        /// `tar_criu` or `runc`.
        system: &'static str,
        /// Seconds waited.
        secs: u64,
        /// End of the setup log.
        log_tail: String,
    },
}

/// Result of this module.
pub type HostResult<T> = Result<T, HostError>;

/// The last [`TAIL_BYTES`] of `bytes`, lossily decoded and trimmed.
pub fn tail(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(TAIL_BYTES);
    String::from_utf8_lossy(&bytes[start..]).trim().to_string()
}

/// The tail of a file, or an empty string when it cannot be read.
pub fn file_tail(path: &Path) -> String {
    std::fs::read(path).map(|b| tail(&b)).unwrap_or_default()
}

/// Runs `cmd` to completion (stdin from /dev/null, stdout and stderr captured). A failure names
/// `step` and quotes the end of stderr and, when given, of `log` (e.g. a CRIU log file).
pub fn run(step: &'static str, cmd: &mut Command, log: Option<&Path>) -> HostResult<Output> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|source| HostError::Spawn {
            step,
            program: program.clone(),
            source,
        })?;
    if out.status.success() {
        return Ok(out);
    }
    let mut t = tail(&out.stderr);
    if let Some(log) = log {
        let _ = write!(t, " | {}: {}", log.display(), file_tail(log));
    }
    Err(HostError::Tool {
        step,
        program,
        status: out.status,
        tail: t,
    })
}

/// Runs `cmd` to completion with stdout and stderr appended to the file `out` (for tools that
/// leave detached processes behind, which would hold a pipe open). A failure names `step` and
/// quotes the end of `out` and, when given, of `log`.
pub fn run_to_file(
    step: &'static str,
    cmd: &mut Command,
    out: &Path,
    log: Option<&Path>,
) -> HostResult<()> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .map_err(|source| HostError::Io {
                step,
                path: out.into(),
                source,
            })
    };
    let status = cmd
        .stdin(Stdio::null())
        .stdout(open()?)
        .stderr(open()?)
        .status()
        .map_err(|source| HostError::Spawn {
            step,
            program: program.clone(),
            source,
        })?;
    if status.success() {
        return Ok(());
    }
    let mut t = file_tail(out);
    if let Some(log) = log {
        let _ = write!(t, " | {}: {}", log.display(), file_tail(log));
    }
    Err(HostError::Tool {
        step,
        program,
        status,
        tail: t,
    })
}

/// Milliseconds since `t0`.
pub fn ms_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// `program` found in a directory of `PATH` (then /usr/local/sbin, /usr/sbin, /sbin).
pub fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}

/// `GNU tar` options a careful user gives to keep overlayfs metadata (whiteouts are device
/// nodes, opaque dirs are `trusted.overlay.*` xattrs), ACLs and numeric owners.
pub const TAR_FLAGS: [&str; 4] = [
    "--xattrs",
    "--xattrs-include=*",
    "--acls",
    "--numeric-owner",
];

/// `tar -C dir -cf archive .` with [`TAR_FLAGS`].
pub fn tar_create(dir: &Path, archive: &Path) -> HostResult<()> {
    run(
        "tar of the upper dir",
        Command::new("tar")
            .args(TAR_FLAGS)
            .arg("-C")
            .arg(dir)
            .arg("-cf")
            .arg(archive)
            .arg("."),
        None,
    )
    .map(drop)
}

/// `tar -C dir -xf archive` with [`TAR_FLAGS`].
pub fn tar_extract(archive: &Path, dir: &Path) -> HostResult<()> {
    run(
        "untar into the fresh upper dir",
        Command::new("tar")
            .args(TAR_FLAGS)
            .arg("-C")
            .arg(dir)
            .arg("-xf")
            .arg(archive),
        None,
    )
    .map(drop)
}

/// `sync -f dir`: syncs the file system holding the checkpoint.
pub fn sync_fs(dir: &Path) -> HostResult<()> {
    run(
        "sync -f of the checkpoint",
        Command::new("sync").arg("-f").arg(dir),
        None,
    )
    .map(drop)
}

/// `mkdir -p`.
pub fn mkdirs(step: &'static str, path: &Path) -> HostResult<()> {
    std::fs::create_dir_all(path).map_err(|source| HostError::Io {
        step,
        path: path.into(),
        source,
    })
}

/// A directory removed (recursively) on drop.
#[derive(Debug)]
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates `path` (and parents).
    pub fn create(path: PathBuf) -> HostResult<ScratchDir> {
        mkdirs("creating a scratch dir", &path)?;
        Ok(ScratchDir { path })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = belayer_overlay::remove_dir_all(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "scratch dir left behind");
            }
        }
    }
}

/// An overlayfs mount (`lowerdir` = an image rootfs, fresh `upperdir`/`workdir`), detached on
/// drop.
#[derive(Debug)]
pub struct OverlayMount {
    target: PathBuf,
}

impl OverlayMount {
    /// Mounts `lower` + `upper` (+ `work`) on `target`; creates `upper`, `work` and `target`.
    pub fn mount(lower: &Path, upper: &Path, work: &Path, target: &Path) -> HostResult<Self> {
        for d in [upper, work, target] {
            mkdirs("creating overlay dirs", d)?;
        }
        let data = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            upper.display(),
            work.display()
        );
        mount(
            Some(OsStr::new("overlay")),
            target,
            Some(OsStr::new("overlay")),
            MsFlags::empty(),
            Some(data.as_str()),
        )
        .map_err(|source| HostError::Mount {
            step: "mounting the overlay",
            path: target.into(),
            source,
        })?;
        Ok(OverlayMount {
            target: target.into(),
        })
    }

    /// Detaches the mount now.
    pub fn unmount(self) -> HostResult<()> {
        let r = umount2(&self.target, MntFlags::MNT_DETACH).map_err(|source| HostError::Mount {
            step: "unmounting the overlay",
            path: self.target.clone(),
            source,
        });
        std::mem::forget(self);
        r
    }
}

impl Drop for OverlayMount {
    fn drop(&mut self) {
        if let Err(e) = umount2(&self.target, MntFlags::MNT_DETACH) {
            tracing::warn!(path = %self.target.display(), error = %e, "overlay left mounted");
        }
    }
}

/// Waits until `ready` exists. `alive` says whether the sandbox still runs; `log` is the setup
/// log quoted in errors.
pub fn wait_ready(
    workload: &str,
    system: &'static str,
    ready: &Path,
    log: &Path,
    timeout: Duration,
    mut alive: impl FnMut() -> Option<String>,
) -> HostResult<()> {
    let t0 = Instant::now();
    loop {
        if ready.exists() {
            // Let the init settle into its sleep (the marker is written just before it forks
            // `sleep`), so that the first checkpoint does not catch a fork or exec midway.
            thread::sleep(Duration::from_millis(300));
            return Ok(());
        }
        if let Some(why) = alive() {
            return Err(HostError::SetupExited {
                workload: workload.into(),
                system,
                log_tail: format!("{} {}", file_tail(log), why).trim().to_string(),
            });
        }
        if t0.elapsed() > timeout {
            return Err(HostError::SetupTimeout {
                workload: workload.into(),
                system,
                secs: timeout.as_secs(),
                log_tail: file_tail(log),
            });
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Waits up to 2 s for `pid` (a child of ours, or an orphan re-parented to us as subreaper) to
/// be reaped after it was killed.
pub fn reap(pid: i32) {
    if pid <= 0 {
        return;
    }
    for _ in 0..4000 {
        if belayer_daemon::sys::try_reap(pid) || !Path::new(&format!("/proc/{pid}")).exists() {
            return;
        }
        thread::sleep(Duration::from_micros(500));
    }
}

/// The shell script run as the init of a baseline sandbox once inside its root: it runs the
/// workload's setup with its output in `/tmp/.bench-setup.log`, then drops every host-visible
/// descriptor for the sandbox's own `/dev/null`, writes `/tmp/.bench-ready` and sleeps.
pub fn init_script(prefix: &str, setup: &[String]) -> String {
    let mut s = String::from("mkdir -p /tmp && exec </dev/null >/tmp/.bench-setup.log 2>&1\n");
    s.push_str(prefix);
    s.push_str("set -e\n");
    for cmd in setup {
        s.push_str(cmd);
        s.push('\n');
    }
    s.push_str("exec >/dev/null 2>&1\n: > /tmp/.bench-ready\nwhile :; do sleep 3600; done\n");
    s
}

/// Marker written by [`init_script`] once the setup is done, relative to the sandbox root.
pub const READY_MARKER: &str = "tmp/.bench-ready";
/// Setup log written by [`init_script`], relative to the sandbox root.
pub const SETUP_LOG: &str = "tmp/.bench-setup.log";

/// Waits (at most 1 s) until `count()` reads `dumped` processes, so that a restore whose tree
/// died right away is not reported as a time. Short-lived children (a `sleep` in a loop) make
/// the count flicker, hence the polling.
pub fn check_restored(
    workload: &str,
    system: &'static str,
    dumped: usize,
    mut count: impl FnMut() -> HostResult<usize>,
) -> HostResult<()> {
    let t0 = Instant::now();
    loop {
        let found = count()?;
        if found == dumped {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(1) {
            return Err(HostError::RestoredTree {
                workload: workload.into(),
                system,
                dumped,
                found,
            });
        }
        thread::sleep(Duration::from_millis(2));
    }
}
