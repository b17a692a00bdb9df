//! Running the `criu` binary once: arguments in, exit status, output and wall time out.

use std::ffi::{CString, OsString};
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::sys;

/// What the child does between `fork` and `exec`, besides marking inherited fds close-on-exec.
#[derive(Debug, Default)]
pub(crate) struct ChildSetup {
    /// Enter this network namespace (an open nsfs fd) first: CRIU then treats the tree's
    /// network namespace as its own and neither dumps nor recreates it.
    pub netns: Option<OwnedFd>,
    /// Join these cgroups (open `cgroup.procs` files), so that what CRIU forks (the restored
    /// tree) is born in them.
    pub cgroups: Vec<OwnedFd>,
    /// Run in a private mount namespace with `.0` bind-mounted over `.1`.
    pub private_bind: Option<(CString, CString)>,
    /// Enter this cgroup namespace (an open nsfs fd): CRIU then treats the tree's cgroup
    /// namespace as its own and does not dump it.
    pub cgroupns: Option<OwnedFd>,
    /// After joining [`Self::cgroups`], unshare a cgroup namespace rooted there: the restored
    /// tree is born in it, as the dumped tree lived in one rooted at its own cgroup.
    pub new_cgroupns: bool,
    /// Raise the inheritable set to the permitted set before exec (so CRIU starts with every
    /// capability inheritable). A restore needs it: the restorer `capset`s each task's dumped
    /// sets after trimming its bounding set, and the kernel (`cap_capset`) refuses a new
    /// inheritable set that is not within the *old inheritable* ∪ bounding set. A task that
    /// raised a capability into its inheritable set and then dropped it from its bounding set
    /// is only restorable by a restorer whose inheritable set already holds it.
    pub inheritable_from_permitted: bool,
    /// Write these action scripts (path, text) first ([`sys::child_write_script`]): only the
    /// child ever holds them open for writing, so CRIU's exec of them cannot meet `ETXTBSY`.
    pub scripts: Vec<(CString, Vec<u8>)>,
    /// `$CRTOOLS_SCRIPT_ACTIONS` for CRIU: the only actions its scripts act on, space-separated
    /// (CRIU's stage names). The CRIU `scripts/setup.sh` builds (`scripts/criu-patches`) then
    /// runs them for those actions only, instead of a fork and an exec of each script at every
    /// other stage (three of them in a dump's frozen window); another CRIU ignores it, and the
    /// scripts pass the other actions themselves. `None`: every action.
    pub script_actions: Option<String>,
    /// Kill the run (`SIGKILL`) once it has taken this long (not used by the child).
    pub time_limit: Option<Duration>,
}

/// The variable that names [`ChildSetup::script_actions`] for CRIU.
pub(crate) const SCRIPT_ACTIONS_ENV: &str = "CRTOOLS_SCRIPT_ACTIONS";

/// The [`ChildSetup::scripts`] entry for an action script at `path` with `text`. Errors: a path with
/// a NUL byte.
pub(crate) fn script_file(path: &Path, text: String) -> io::Result<(CString, Vec<u8>)> {
    let path = CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    Ok((path, text.into_bytes()))
}

/// Opens the namespace file at `path` (for [`ChildSetup::netns`], [`ChildSetup::cgroupns`]),
/// if any.
pub(crate) fn open_netns(path: Option<&Path>) -> io::Result<Option<OwnedFd>> {
    path.map(|p| std::fs::File::open(p).map(OwnedFd::from))
        .transpose()
}

/// One finished `criu` run.
#[derive(Debug)]
pub(crate) struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// `Some(limit)` when the run was killed at its [`ChildSetup::time_limit`].
    pub killed_after: Option<Duration>,
}

impl Finished {
    /// Milliseconds of wall time, fractional.
    pub(crate) fn elapsed_ms(&self) -> f64 {
        self.elapsed.as_secs_f64() * 1e3
    }
}

/// Runs `criu args...` to completion with stdin on /dev/null and stdout/stderr captured; a run
/// that outlives `setup.time_limit` is killed with `SIGKILL` (and reaped) at that point.
///
/// CRIU runs in a process group of its own (its pid): at the limit the whole group is killed,
/// so helpers CRIU forked (and tasks it has not moved to their dumped group yet) die with it
/// instead of lingering as orphans.
///
/// Errors: only when the process cannot be started (or waited for); a non-zero exit is a
/// [`Finished`] with that status.
pub(crate) fn run(criu: &Path, args: &[OsString], mut setup: ChildSetup) -> io::Result<Finished> {
    let limit = setup.time_limit.take();
    let mut cmd = Command::new(criu);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // Never the daemon's own: unset, the scripts run at every action.
    match setup.script_actions.take() {
        Some(actions) => cmd.env(SCRIPT_ACTIONS_ENV, actions),
        None => cmd.env_remove(SCRIPT_ACTIONS_ENV),
    };
    // SAFETY: the hook runs in the forked child before exec. It only calls async-signal-safe
    // syscalls (unlink, open, fchmod, write, close, setns, unshare, mount, capget/capset,
    // close_range)
    // on fds, C strings and buffers created before the fork,
    // and does not allocate: the closure owns `setup`, and errors are built from raw errnos.
    unsafe {
        cmd.pre_exec(move || {
            for (path, text) in &setup.scripts {
                sys::child_write_script(path, text)?;
            }
            if let Some(fd) = &setup.netns {
                sys::child_enter_netns(fd.as_fd())?;
            }
            for fd in &setup.cgroups {
                sys::child_join_cgroup(fd.as_fd())?;
            }
            if let Some(fd) = &setup.cgroupns {
                sys::child_enter_cgroupns(fd.as_fd())?;
            }
            if setup.new_cgroupns {
                sys::child_new_cgroupns()?;
            }
            if let Some((source, target)) = &setup.private_bind {
                sys::child_private_bind(source, target)?;
            }
            if setup.inheritable_from_permitted {
                sys::child_inheritable_from_permitted()?;
            }
            sys::child_mark_fds_cloexec()
        });
    }
    tracing::debug!(criu = %criu.display(), ?args, ?limit, "running criu");
    let started = Instant::now();
    let Some(limit) = limit else {
        let output = cmd.output()?;
        return Ok(finished(output, started.elapsed(), None));
    };
    let mut child = cmd.spawn()?;
    // Both pipes are drained meanwhile, so a chatty CRIU never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    // The pidfd is opened while the child is unreaped, so it names that process.
    let pidfd = rustix::process::Pid::from_raw(child.id() as i32)
        .ok_or(rustix::io::Errno::SRCH)
        .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()));
    let killed_after = match pidfd {
        Ok(pidfd) if !sys::pidfd_wait_until(pidfd.as_fd(), started + limit) => {
            // The group id is the child's pid, which cannot be reused before the child is
            // reaped below: the signal reaches CRIU's group and nothing else.
            if sys::kill_process_group(child.id()).is_err() {
                let _ = child.kill();
            }
            Some(limit)
        }
        Ok(_) => None,
        // No pidfd (a kernel before 5.3): no limit, as before.
        Err(_) => None,
    };
    let status = child.wait()?;
    if killed_after.is_some() {
        orphan_group(child.id());
    }
    let output = std::process::Output {
        status,
        stdout: collect(stdout, killed_after.is_some()),
        stderr: collect(stderr, killed_after.is_some()),
    };
    Ok(finished(output, started.elapsed(), killed_after))
}

/// How long the output of a run killed at its limit is waited for.
const KILLED_OUTPUT_GRACE: Duration = Duration::from_millis(500);

/// What a drain thread read. For a run killed at its limit, at most
/// [`KILLED_OUTPUT_GRACE`] is waited: a task CRIU forked outside its process group (a
/// half-restored root task, in a session of its own) still holds CRIU's stdout and stderr,
/// so the pipes see no end until the caller kills that task, after this returns. Such a
/// thread is left to end then; the output it holds is dropped.
fn collect(drain: std::thread::JoinHandle<Vec<u8>>, killed: bool) -> Vec<u8> {
    if killed {
        let deadline = Instant::now() + KILLED_OUTPUT_GRACE;
        while !drain.is_finished() {
            if Instant::now() > deadline {
                return b"(output not collected: a task of the killed run holds its pipe)\n"
                    .to_vec();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    drain.join().unwrap_or_default()
}

/// Process groups of killed CRIU runs whose members may still be unreaped orphans.
static ORPHAN_GROUPS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// Remembers the group of a killed run: what CRIU had forked (helpers, tasks not yet moved to
/// their dumped group) is re-parented to the nearest child subreaper, the daemon, and only
/// [`reap_orphans`] waits for it.
fn orphan_group(pgid: u32) {
    if let Ok(pgid) = i32::try_from(pgid) {
        if let Ok(mut groups) = ORPHAN_GROUPS.lock() {
            groups.push(pgid);
        }
        reap_orphans();
    }
}

/// Reaps (without blocking) the exited children of the calling process that belong to the
/// process group of a CRIU run killed at its time limit: CRIU's orphaned helpers, re-parented
/// to a child subreaper (`belayerd`). A group is forgotten once it has no child of ours left.
///
/// Safe against stealing statuses: a group id names a killed CRIU's pid, which the kernel does
/// not hand out again while any process still uses it as its group; so `waitpid(-pgid)` only
/// ever matches CRIU's own descendants, which nobody else waits for. Call it periodically (the
/// daemon's reaper does).
pub fn reap_orphans() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let Ok(mut groups) = ORPHAN_GROUPS.lock() else {
        return;
    };
    groups.retain(|&pgid| loop {
        match waitpid(
            nix::unistd::Pid::from_raw(-pgid),
            Some(WaitPidFlag::WNOHANG),
        ) {
            Ok(WaitStatus::StillAlive) => break true,
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            // ECHILD: no child of ours in that group (any more).
            Err(_) => break false,
        }
    });
}

fn finished(
    output: std::process::Output,
    elapsed: Duration,
    killed_after: Option<Duration>,
) -> Finished {
    Finished {
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed,
        killed_after,
    }
}

/// Appends `name` and `value` as two arguments (`--images-dir /ck/img`).
pub(crate) fn push(args: &mut Vec<OsString>, name: &str, value: impl Into<OsString>) {
    args.push(name.into());
    args.push(value.into());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_and_captures_output() {
        let done = run(
            Path::new("/bin/sh"),
            &["-c".into(), "echo out; echo err >&2; exit 3".into()],
            ChildSetup::default(),
        )
        .unwrap();
        assert_eq!(done.status.code(), Some(3));
        assert_eq!(done.stdout, "out\n");
        assert_eq!(done.stderr, "err\n");
        assert!(done.elapsed_ms() > 0.0);
    }

    #[test]
    fn a_script_written_by_the_child_is_executable_while_other_threads_fork() {
        // Other threads fork children that stay between fork and exec for a while, holding
        // copies of whatever fds were open when they forked (a script the caller was
        // writing would be one: its exec then fails with ETXTBSY). The child writes the
        // script itself, so none of them can hold it.
        let dir = tempfile::tempdir().unwrap();
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let mut cmd = Command::new("/bin/true");
                        // SAFETY: nanosleep only, in the forked child.
                        unsafe {
                            cmd.pre_exec(|| {
                                libc::usleep(20_000);
                                Ok(())
                            });
                        }
                        let _ = cmd.status();
                    }
                });
            }
            for i in 0..100 {
                let path = dir.path().join("hook.sh");
                let setup = ChildSetup {
                    scripts: vec![script_file(&path, format!("#!/bin/sh\necho {i}\n")).unwrap()],
                    ..ChildSetup::default()
                };
                let done = run(
                    Path::new("/bin/sh"),
                    &["-c".into(), "exec \"$0\"".into(), path.into_os_string()],
                    setup,
                )
                .unwrap();
                assert!(done.status.success(), "run {i}: {}", done.stderr);
                assert_eq!(done.stdout, format!("{i}\n"));
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }

    #[test]
    fn inherited_fds_do_not_reach_the_child() {
        // An fd without close-on-exec in the parent must still be gone in the child.
        let (keep, _other) = nix::unistd::pipe().unwrap();
        let raw = std::os::fd::AsRawFd::as_raw_fd(&keep);
        nix::fcntl::fcntl(
            &keep,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .unwrap();
        let done = run(
            Path::new("/bin/sh"),
            &["-c".into(), format!("test -e /proc/self/fd/{raw}").into()],
            ChildSetup::default(),
        )
        .unwrap();
        assert_eq!(
            done.status.code(),
            Some(1),
            "fd {raw} leaked into the child"
        );
    }

    #[test]
    fn missing_binary_is_an_error() {
        let err = run(Path::new("/nonexistent/criu"), &[], ChildSetup::default()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
