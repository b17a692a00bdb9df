//! Host plumbing shared by the two baselines of `bench capture`: running tools with errors that
//! name the step, overlay mounts, a freezer cgroup and scratch dirs, each undone on drop.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

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

/// Which freezer a [`FreezerCgroup`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freezer {
    /// cgroup v2 `cgroup.freeze` / `cgroup.events` / `cgroup.kill`.
    V2,
    /// cgroup v1 `freezer.state`.
    V1,
}

/// A cgroup of its own for a hand-made sandbox: v2 where a cgroup2 hierarchy is mounted (it has
/// `cgroup.freeze` and `cgroup.kill`), else the v1 `freezer` hierarchy. Its processes are
/// killed and the cgroup removed on drop.
#[derive(Debug)]
pub struct FreezerCgroup {
    dir: PathBuf,
    kind: Freezer,
}

/// Mount points of cgroup2 and of the v1 freezer hierarchy, from `/proc/self/mountinfo`.
fn cgroup_mounts() -> HostResult<(Option<PathBuf>, Option<PathBuf>)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| HostError::Io {
        step: "reading the mount table",
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split(' ');
        let (fstype, _src, opts) = (r.next(), r.next(), r.next().unwrap_or(""));
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        match fstype {
            Some("cgroup2") if v2.is_none() => v2 = Some(PathBuf::from(point)),
            Some("cgroup") if v1.is_none() && opts.split(',').any(|o| o == "freezer") => {
                v1 = Some(PathBuf::from(point))
            }
            _ => {}
        }
    }
    Ok((v2, v1))
}

impl FreezerCgroup {
    /// Creates cgroup `name` under the cgroup2 root (or the v1 freezer root).
    pub fn create(name: &str) -> HostResult<FreezerCgroup> {
        let (v2, v1) = cgroup_mounts()?;
        let (dir, kind) = match (v2, v1) {
            (Some(root), _) if root.join("cgroup.procs").exists() => (root.join(name), Freezer::V2),
            (_, Some(root)) => (root.join(name), Freezer::V1),
            _ => return Err(HostError::NoFreezer),
        };
        std::fs::create_dir(&dir).map_err(|source| HostError::Io {
            step: "creating the sandbox cgroup",
            path: dir.clone(),
            source,
        })?;
        let cg = FreezerCgroup { dir, kind };
        if kind == Freezer::V2 && !cg.dir.join("cgroup.freeze").exists() {
            return Err(HostError::NoFreezer);
        }
        Ok(cg)
    }

    /// The cgroup dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its `cgroup.procs` file.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn write(&self, file: &str, value: &str) -> HostResult<()> {
        let path = self.dir.join(file);
        std::fs::write(&path, value).map_err(|source| HostError::Io {
            step: "writing a cgroup file",
            path,
            source,
        })
    }

    fn read(&self, file: &str) -> HostResult<String> {
        let path = self.dir.join(file);
        std::fs::read_to_string(&path).map_err(|source| HostError::Io {
            step: "reading a cgroup file",
            path,
            source,
        })
    }

    /// Freezes every task and waits (polling every 0.2 ms, at most 10 s) until the kernel
    /// reports the cgroup frozen.
    pub fn freeze(&self) -> HostResult<()> {
        let t0 = Instant::now();
        let (file, on, done): (&str, &str, fn(&str) -> bool) = match self.kind {
            Freezer::V2 => ("cgroup.freeze", "1", |s| s.lines().any(|l| l == "frozen 1")),
            Freezer::V1 => ("freezer.state", "FROZEN", |s| s.trim() == "FROZEN"),
        };
        self.write(file, on)?;
        let status = if self.kind == Freezer::V2 {
            "cgroup.events"
        } else {
            file
        };
        loop {
            if done(&self.read(status)?) {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                let _ = self.thaw();
                return Err(HostError::FreezeTimeout {
                    path: self.dir.clone(),
                    waited_ms: t0.elapsed().as_millis(),
                });
            }
            if self.kind == Freezer::V1 {
                self.write(file, on)?;
            }
            thread::sleep(Duration::from_micros(200));
        }
    }

    /// Thaws the cgroup.
    pub fn thaw(&self) -> HostResult<()> {
        match self.kind {
            Freezer::V2 => self.write("cgroup.freeze", "0"),
            Freezer::V1 => self.write("freezer.state", "THAWED"),
        }
    }

    /// Pids in the cgroup.
    pub fn pids(&self) -> HostResult<Vec<i32>> {
        Ok(self
            .read("cgroup.procs")?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    /// SIGKILLs every process in the cgroup (thawing it first) and waits until it is empty.
    pub fn kill_all(&self) -> HostResult<()> {
        let t0 = Instant::now();
        let _ = self.thaw();
        loop {
            let pids = self.pids()?;
            if pids.is_empty() {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(HostError::KillTimeout {
                    path: self.dir.clone(),
                    waited_ms: t0.elapsed().as_millis(),
                });
            }
            match self.kind {
                Freezer::V2 => self.write("cgroup.kill", "1")?,
                Freezer::V1 => {
                    for pid in pids {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            thread::sleep(Duration::from_micros(500));
        }
    }
}

impl Drop for FreezerCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.kill_all() {
            tracing::warn!(cgroup = %self.dir.display(), error = %e, "processes left in cgroup");
        }
        // The last killed task may leave the cgroup a moment after cgroup.procs reads empty.
        for _ in 0..200 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
        tracing::warn!(cgroup = %self.dir.display(), "cgroup left behind");
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
