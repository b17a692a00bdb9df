//! The `exec` helper: runs one action inside an existing sandbox.
//!
//! The helper (host root, outside the sandbox cgroup) opens the namespaces of the sandbox
//! init (`/proc/<pid>/ns/*`) and the sandbox's `cgroup.procs` files, checks the init is
//! still the one it was told about, `setns`es into the pid, uts, ipc, net, time and mount
//! namespaces and forks. The child joins the cgroup, its cgroup namespace and its user
//! namespace (becoming the sandbox's root, unless the sandbox runs with `--userns=host`),
//! leads a new session (so a timeout can kill the action's whole process group), takes stdin
//! from the sandbox's own `/dev/null` (if it is still the null device, else an empty pipe:
//! [`sandbox_stdin`]) or, with `--stdin copy`, from a sealed memfd: the helper creates it and
//! its read-only twin before it enters the mount namespace, and the child, once in the
//! sandbox's cgroup (the copy is charged to the sandbox), copies the agent's stdin memfd (the
//! helper's fd 0) into it, gives it to `--stdin-owner`, seals it and takes the twin as fd 0
//! ([`crate::sys::SealableMemfd`]); it keeps the stdout/stderr memfds the agent gave it (one
//! memfd as both when the request merges them),
//! drops to the container capability set with `no_new_privs`, and executes the sandbox's
//! `/bin/sh -c CMD` opened beneath the sandbox root ([`super::finish`]). Background processes
//! it starts are re-parented to the sandbox init when the shell exits and keep running.
//! memfds (not pipes) hold the output so that such processes never get SIGPIPE and CRIU can
//! dump them.
//!
//! The waiting parent stays outside the sandbox's cgroup and user namespace, so a sandbox
//! that stops or freezes itself cannot stop the clock: on timeout it kills the action's
//! process group and answers within [`KILL_GRACE`] even if the group does not die. The clock
//! starts at the fork, not at the `execve`: once the child is the sandbox's root, the sandbox
//! can stop it (`SIGSTOP`) before it executes the action, and that must not hold the helper
//! (and the sandbox's verb lock) past the timeout either.
//!
//! The result goes to the status fd as one line: `exit=<code> signal=<n|-> timed_out=<0|1>`.

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{chdir, fork, setsid, ForkResult, Pid};

use super::Args;
use crate::sys::{self, SyscallError};

/// How long the helper waits for an action to die after killing it on timeout.
pub const KILL_GRACE: Duration = Duration::from_secs(2);

/// Errors of the exec helper.
#[derive(Debug, thiserror::Error)]
pub enum ExecHelperError {
    /// A required argument is missing or malformed.
    #[error("bad argument {0}")]
    BadArgument(&'static str),
    /// The sandbox init is gone or was replaced.
    #[error("sandbox init {pid} is not running")]
    InitGone {
        /// Host pid.
        pid: i32,
    },
    /// Opening a namespace of the init failed.
    #[error("cannot open namespace {path}")]
    OpenNamespace {
        /// `/proc/<pid>/ns/<name>`.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening a `cgroup.procs` file failed.
    #[error("cannot open {path}")]
    OpenCgroup {
        /// The file.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A syscall failed.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    /// The seccomp filter could not be built.
    #[error(transparent)]
    Seccomp(#[from] super::seccomp::SeccompError),
    /// The action process could not start the action (its shell, cwd, namespaces, ...).
    #[error("cannot start the action: {0}")]
    Start(String),
}

/// Entry point; returns the helper's exit code (0 when a status line was written).
pub fn main(args: &[String]) -> i32 {
    let args = Args::new(args);
    let Some(status_fd) = args.one("--status-fd").and_then(|s| s.parse::<i32>().ok()) else {
        eprintln!("belayer exec helper: missing --status-fd");
        return 125;
    };
    // SAFETY: the agent passes this descriptor to the helper (dup2'ed before exec) and nothing
    // else in this process owns it.
    let mut status = unsafe { fs::File::from_raw_fd(status_fd) };
    match run(&args) {
        Ok(line) => {
            let _ = status.write_all(line.as_bytes());
            0
        }
        Err(e) => {
            let _ = writeln!(status, "error={}", super::init::error_chain(&e));
            125
        }
    }
}

/// What the child needs, all opened by the parent before it entered the mount namespace.
pub(super) struct Entry {
    pub(super) cgroup_procs: Vec<OwnedFd>,
    cgroupns: OwnedFd,
    pub(super) userns: Option<OwnedFd>,
    /// The action's stdin, when the request has bytes for it.
    stdin: Option<StdinCopy>,
    /// `(uid, gid)` the action runs as inside the sandbox (`--user`); `None`: its root.
    pub(super) user: Option<(u32, u32)>,
}

/// The sealed memfd the action's stdin bytes are copied into, and its owner (host uid).
struct StdinCopy {
    memfd: sys::SealableMemfd,
    owner: Option<u32>,
}

fn open_ns(pid: i32, name: &str) -> Result<OwnedFd, ExecHelperError> {
    let path = format!("/proc/{pid}/ns/{name}");
    fs::File::open(&path)
        .map(OwnedFd::from)
        .map_err(|source| ExecHelperError::OpenNamespace { path, source })
}

fn run(args: &Args<'_>) -> Result<String, ExecHelperError> {
    let pid: i32 = args
        .one("--pid")
        .and_then(|s| s.parse().ok())
        .ok_or(ExecHelperError::BadArgument("--pid"))?;
    let start: u64 = args
        .one("--start-time")
        .and_then(|s| s.parse().ok())
        .ok_or(ExecHelperError::BadArgument("--start-time"))?;
    let timeout_ms: Option<u64> = args.one("--timeout-ms").and_then(|s| s.parse().ok());
    let cwd = args.one("--cwd").unwrap_or("/");
    let private_userns = args.one("--userns").unwrap_or("private") != "host";
    let stdin = match args.one("--stdin") {
        None => None,
        Some("copy") => Some(StdinCopy {
            memfd: sys::SealableMemfd::create("belayer-stdin")?,
            owner: match args.one("--stdin-owner") {
                None => None,
                Some(s) => Some(
                    s.parse()
                        .map_err(|_| ExecHelperError::BadArgument("--stdin-owner"))?,
                ),
            },
        }),
        Some(_) => return Err(ExecHelperError::BadArgument("--stdin")),
    };
    let command = args
        .rest()
        .first()
        .ok_or(ExecHelperError::BadArgument("command"))?;
    // `--builtin pack|unpack`: the child runs the transfer code instead of the shell, and
    // `command` is the path ([`super::transfer`]).
    let builtin = args
        .one("--builtin")
        .map(|kind| super::transfer::Builtin::parse(kind, command, args))
        .transpose()?;
    let user = args.one("--user").map(parse_user).transpose()?;
    let env: Vec<CString> = args
        .all("--env")
        .into_iter()
        .map(|s| CString::new(s).unwrap_or_default())
        .collect();

    let mut namespaces = Vec::new();
    for (name, flag) in [
        ("pid", CloneFlags::CLONE_NEWPID),
        ("uts", CloneFlags::CLONE_NEWUTS),
        ("ipc", CloneFlags::CLONE_NEWIPC),
        ("net", CloneFlags::CLONE_NEWNET),
        // A restored sandbox lives in a time namespace CRIU made (it keeps the monotonic and
        // boot clocks continuous): actions must be in it too, or the next dump spans two
        // time namespaces and cannot be restored.
        ("time", CloneFlags::from_bits_retain(libc::CLONE_NEWTIME)),
        ("mnt", CloneFlags::CLONE_NEWNS),
    ] {
        namespaces.push((open_ns(pid, name)?, flag, name));
    }
    let entry = Entry {
        cgroupns: open_ns(pid, "cgroup")?,
        userns: private_userns.then(|| open_ns(pid, "user")).transpose()?,
        stdin,
        user,
        cgroup_procs: args
            .all("--procs")
            .into_iter()
            .map(|path| {
                fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .map(OwnedFd::from)
                    .map_err(|source| ExecHelperError::OpenCgroup {
                        path: path.to_string(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()?,
    };
    // The namespace fds pin the namespaces; check they belong to the init we were told about.
    if !sys::process_matches(pid, start) {
        return Err(ExecHelperError::InitGone { pid });
    }
    for (f, flag, name) in &namespaces {
        setns(f.as_fd(), *flag).map_err(|e| SyscallError::new("setns", *name, e))?;
    }
    drop(namespaces);
    chdir("/").map_err(|e| SyscallError::new("chdir", "/", e))?;

    // Compiled by the daemon once, sealed in a memfd: read it, don't compile it again.
    let filter = super::seccomp::sealed::from_helper_arg(args.one("--seccomp-fd"))?;
    // The child reports on a close-on-exec pipe: first its pid inside the sandbox (the
    // process group a timeout kills), then, only if it cannot start the action, why.
    let (report_rd, report_wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| SyscallError::io("pipe2", "exec report", e.into()))?;
    // SAFETY: this helper is single-threaded (fresh exec, no threads started), so the child may
    // run arbitrary code after fork.
    match unsafe { fork() }.map_err(|e| SyscallError::new("fork", "action", e))? {
        ForkResult::Child => {
            drop(report_rd);
            let mut report = fs::File::from(report_wr);
            if let Some(builtin) = &builtin {
                super::transfer::child(&entry, &filter, &mut report, builtin);
            }
            let err = action(&entry, &filter, &mut report, cwd, command, &env);
            let _ = write!(report, "{}", super::init::error_chain(&err));
            // SAFETY: _exit ends the child immediately; always safe.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => {
            drop(report_wr);
            if builtin.is_some() {
                return super::transfer::parent(&entry, child, report_rd, timeout_ms, args);
            }
            // The clock runs from the fork: between joining the sandbox's user namespace and
            // its `execve` the child can be stopped by the sandbox (it is the sandbox's root by
            // then) or held in an open of a sandbox file, and must not hold the helper past
            // the timeout.
            let deadline = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
            let report = match read_report(&report_rd, deadline)? {
                Report::Closed(bytes) => bytes,
                Report::Late(bytes) => {
                    // Not started within the timeout: kill it by its pid inside the sandbox
                    // from inside the cgroup, as a timed-out action, and answer as a timeout.
                    // (It reports that pid first thing, while it is still host root, so the
                    // sandbox cannot keep it from doing so.)
                    match Report::ns_pid(&bytes) {
                        Some(ns_pid) => Killer {
                            cgroup_procs: &entry.cgroup_procs,
                            ns_pid,
                            host_pid: child,
                        }
                        .kill(),
                        None => {
                            let _ = kill(child, Signal::SIGKILL);
                        }
                    }
                    let pidfd = sys::pidfd_open(child.as_raw())?;
                    if sys::pidfd_wait(pidfd.as_fd(), Some(KILL_GRACE.as_millis() as u64))? {
                        let _ = waitpid(child, Some(WaitPidFlag::__WALL));
                    }
                    return Ok("exit=137 signal=9 timed_out=1\n".to_string());
                }
            };
            let failure = report.get(4..).unwrap_or_default();
            let (Some(ns_pid), true) = (Report::ns_pid(&report), failure.is_empty()) else {
                let _ = waitpid(child, Some(WaitPidFlag::__WALL));
                return Err(ExecHelperError::Start(if failure.is_empty() {
                    "the action process exited before it started".into()
                } else {
                    String::from_utf8_lossy(failure).into_owned()
                }));
            };
            let killer = Killer {
                cgroup_procs: &entry.cgroup_procs,
                ns_pid,
                host_pid: child,
            };
            let left = deadline.map(|d| {
                d.saturating_duration_since(Instant::now())
                    .as_millis()
                    .max(1) as u64
            });
            wait_action(child, left, &killer)
        }
    }
}

/// In the forked child: becomes the action process. Returns only on error.
fn action(
    entry: &Entry,
    filter: &super::seccomp::SandboxFilter,
    report: &mut fs::File,
    cwd: &str,
    command: &str,
    env: &[CString],
) -> SyscallError {
    let mut run = || -> Result<std::convert::Infallible, SyscallError> {
        enter_cgroup(entry, report)?;
        // In the sandbox's cgroup, still host root: the copy is charged to the sandbox, and
        // its source is the agent's memfd (fd 0), which never blocks.
        let stdin = match &entry.stdin {
            Some(s) => {
                // SAFETY: with `--stdin copy`, fd 0 is the agent's stdin memfd (passed as the
                // helper's stdin); nothing closes it before the dup2 below.
                let source = unsafe { std::os::fd::BorrowedFd::borrow_raw(0) };
                Some(s.memfd.fill_and_seal(source, s.owner)?)
            }
            None => None,
        };
        become_sandbox_root(entry)?;
        let null = match stdin {
            Some(_) => None,
            None => Some(sandbox_stdin()?),
        };
        let input = stdin.or(null.as_ref().map(AsFd::as_fd));
        if let Some(input) = input {
            // SAFETY: dup2 onto stdin; `input` stays open during the call.
            if unsafe { libc::dup2(input.as_raw_fd(), 0) } < 0 {
                return Err(SyscallError::new("dup2", "0", nix::errno::Errno::last()));
            }
        }
        drop(null);
        chdir(cwd).map_err(|e| SyscallError::new("chdir", cwd, e))?;
        let shell = super::finish::open_executable("/bin/sh")?;
        // Everything but stdio, the shell and the (close-on-exec) report pipe: the namespace
        // and cgroup fds, the status pipe.
        super::finish::close_all_but(&[shell.as_raw_fd() as u32, report.as_raw_fd() as u32])?;
        super::finish::confine(filter, entry.userns.is_some(), entry.user)?;
        let argv = [
            CString::from(c"sh"),
            CString::from(c"-c"),
            CString::new(command.as_bytes()).map_err(|_| {
                SyscallError::new("execve", "command with NUL", nix::errno::Errno::EINVAL)
            })?,
        ];
        Err(super::finish::exec_fd(&shell, "/bin/sh", &argv, env))
    };
    match run() {
        Err(e) => e,
        Ok(never) => match never {},
    }
}

/// `--user UID:GID` (both decimal).
fn parse_user(s: &str) -> Result<(u32, u32), ExecHelperError> {
    let (uid, gid) = s
        .split_once(':')
        .ok_or(ExecHelperError::BadArgument("--user"))?;
    match (uid.parse(), gid.parse()) {
        (Ok(uid), Ok(gid)) => Ok((uid, gid)),
        _ => Err(ExecHelperError::BadArgument("--user")),
    }
}

/// In the forked child, first: reports our pid in the sandbox's pid namespace (the fork made
/// it there) before anything of the sandbox can reach this process (once it is the sandbox's
/// root, the sandbox may stop it, and a timeout must still be able to kill it from inside),
/// then joins the sandbox's cgroup and cgroup namespace.
pub(super) fn enter_cgroup(entry: &Entry, report: &mut fs::File) -> Result<(), SyscallError> {
    let pid = nix::unistd::getpid();
    report
        .write_all(&pid.as_raw().to_ne_bytes())
        .map_err(|e| SyscallError::io("write", "exec report", e))?;
    for fd in &entry.cgroup_procs {
        rustix::io::write(fd, b"0")
            .map_err(|e| SyscallError::io("write", "cgroup.procs", e.into()))?;
    }
    setns(entry.cgroupns.as_fd(), CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| SyscallError::new("setns", "cgroup", e))
}

/// In the forked child, after [`enter_cgroup`]: joins the sandbox's user namespace (unless it
/// runs in the host's) and leads a new session and process group, numbered after the pid
/// reported.
pub(super) fn become_sandbox_root(entry: &Entry) -> Result<(), SyscallError> {
    if let Some(userns) = &entry.userns {
        super::init::enter_userns(userns.as_fd())?;
    }
    setsid().map_err(|e| SyscallError::new("setsid", "action", e))?;
    Ok(())
}

/// What the child reported on its pipe: its pid inside the sandbox (4 bytes), then why it
/// could not start the action, if it could not.
pub(super) enum Report {
    /// The pipe closed (the child executed the action or exited): everything it wrote.
    Closed(Vec<u8>),
    /// The deadline passed first: what had arrived by then.
    Late(Vec<u8>),
}

impl Report {
    /// The child's pid inside the sandbox, once reported.
    pub(super) fn ns_pid(bytes: &[u8]) -> Option<i32> {
        bytes
            .get(..4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(i32::from_ne_bytes)
    }
}

/// Reads the child's report until the pipe closes or until `deadline` (`None`: no deadline).
fn read_report(report: &OwnedFd, deadline: Option<Instant>) -> Result<Report, ExecHelperError> {
    let mut out = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()).as_millis() as u64);
        if left == Some(0) || !sys::pidfd_wait(report.as_fd(), left)? {
            return Ok(Report::Late(out));
        }
        match rustix::io::read(report, &mut chunk) {
            Ok(0) => return Ok(Report::Closed(out)),
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(SyscallError::io("read", "exec report", e.into()).into()),
        }
    }
}

/// The action's stdin: the sandbox's `/dev/null`, opened without blocking and only if it is
/// the null device; otherwise (the sandbox renamed its `/dev` and put a fifo, whose open would
/// block until a writer comes, a file, a link or nothing there) the read end of an empty pipe
/// whose write end is closed, which reads as end of file just the same. The sandbox keeps
/// running actions (and can repair its `/dev`).
fn sandbox_stdin() -> Result<OwnedFd, SyscallError> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
    let null = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open("/dev/null")
        .ok()
        .filter(|f| {
            f.metadata()
                .is_ok_and(|m| m.file_type().is_char_device() && m.rdev() == libc::makedev(1, 3))
        });
    match null {
        Some(null) => {
            rustix::fs::fcntl_setfl(&null, rustix::fs::OFlags::empty())
                .map_err(|e| SyscallError::io("fcntl(F_SETFL)", "/dev/null", e.into()))?;
            Ok(null.into())
        }
        None => {
            let (rd, _wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| SyscallError::io("pipe2", "empty stdin", e.into()))?;
            Ok(rd)
        }
    }
}

/// Kills an action's process group *from inside the sandbox's cgroup*: a short-lived child of
/// the helper joins the cgroup and sends the signals, so the tracer sees the kill as the
/// sandbox's own (a timeout is not an infrastructure fault), while the waiting helper itself
/// never sits in the cgroup (a sandbox that stops itself cannot stop the clock).
pub(super) struct Killer<'a> {
    pub(super) cgroup_procs: &'a [OwnedFd],
    /// The action's pid inside the sandbox's pid namespace (it leads its process group).
    pub(super) ns_pid: i32,
    /// The same process as the helper sees it.
    pub(super) host_pid: Pid,
}

/// How long the helper waits for the timeout killer, milliseconds.
const KILLER_WAIT_MS: u64 = 1000;

impl Killer<'_> {
    pub(super) fn kill(&self) {
        // SAFETY: this helper is single-threaded; the child only makes raw syscalls.
        match unsafe { fork() } {
            Ok(ForkResult::Child) => {
                for fd in self.cgroup_procs {
                    let _ = rustix::io::write(fd, b"0");
                }
                let _ = kill(Pid::from_raw(-self.ns_pid), Signal::SIGKILL);
                let _ = kill(Pid::from_raw(self.ns_pid), Signal::SIGKILL);
                // SAFETY: ends the forked child.
                unsafe { libc::_exit(0) }
            }
            Ok(ForkResult::Parent { child }) => {
                // Inside the sandbox's pid namespace the killer can be signalled by a sandbox
                // in the host's user namespace (same uid, CAP_KILL): one that keeps stopping
                // it gets it killed, and the group killed from here instead.
                let done = sys::pidfd_open(child.as_raw())
                    .and_then(|fd| sys::pidfd_wait(fd.as_fd(), Some(KILLER_WAIT_MS)))
                    .unwrap_or(false);
                if !done {
                    let _ = kill(child, Signal::SIGKILL);
                    let _ = kill(Pid::from_raw(-self.host_pid.as_raw()), Signal::SIGKILL);
                    let _ = kill(self.host_pid, Signal::SIGKILL);
                }
                let _ = waitpid(child, Some(WaitPidFlag::__WALL));
            }
            Err(e) => eprintln!("belayer exec helper: cannot fork the timeout killer: {e}"),
        }
    }
}

/// Waits for the action with an optional timeout. On expiry it kills the action's process
/// group and waits at most [`KILL_GRACE`] for it (a group frozen by the v1 freezer dies only
/// when thawed); the answer says `timed_out=1` either way.
fn wait_action(
    child: Pid,
    timeout_ms: Option<u64>,
    killer: &Killer<'_>,
) -> Result<String, ExecHelperError> {
    let pidfd = sys::pidfd_open(child.as_raw())?;
    let exited = sys::pidfd_wait(pidfd.as_fd(), timeout_ms)?;
    let timed_out = !exited;
    if timed_out {
        killer.kill();
        if !sys::pidfd_wait(pidfd.as_fd(), Some(KILL_GRACE.as_millis() as u64))? {
            return Ok("exit=137 signal=9 timed_out=1\n".to_string());
        }
    }
    let status = loop {
        match waitpid(child, Some(WaitPidFlag::__WALL)) {
            Err(nix::errno::Errno::EINTR) => continue,
            other => {
                break other.map_err(|e| SyscallError::new("waitpid", child.to_string(), e))?
            }
        }
    };
    let (code, signal) = match status {
        WaitStatus::Exited(_, code) => (code, None),
        WaitStatus::Signaled(_, sig, _) => (128 + sig as i32, Some(sig as i32)),
        _ => (125, None),
    };
    let signal = signal.map_or_else(|| "-".to_string(), |s| s.to_string());
    Ok(format!(
        "exit={code} signal={signal} timed_out={}\n",
        u8::from(timed_out)
    ))
}

/// A parsed status line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionStatus {
    /// Exit code (128 + signal when killed).
    pub exit_code: i32,
    /// Terminating signal.
    pub signal: Option<i32>,
    /// Whether the timeout fired.
    pub timed_out: bool,
}

/// Parses the helper's status line; `Err` holds the helper's error message.
pub fn parse_status(line: &str) -> Result<ActionStatus, String> {
    let line = line.trim();
    if let Some(err) = line.strip_prefix("error=") {
        return Err(err.to_string());
    }
    let mut status = ActionStatus {
        exit_code: -1,
        signal: None,
        timed_out: false,
    };
    let mut seen = 0;
    for part in line.split_whitespace() {
        match part.split_once('=') {
            Some(("exit", v)) => {
                status.exit_code = v.parse().map_err(|_| format!("bad status line {line:?}"))?;
                seen += 1;
            }
            Some(("signal", v)) => status.signal = v.parse().ok(),
            Some(("timed_out", v)) => status.timed_out = v == "1",
            _ => {}
        }
    }
    if seen == 0 {
        return Err(format!("no status from the exec helper ({line:?})"));
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_parse() {
        assert_eq!(
            parse_status("exit=3 signal=- timed_out=0\n"),
            Ok(ActionStatus {
                exit_code: 3,
                signal: None,
                timed_out: false
            })
        );
        assert_eq!(
            parse_status("exit=137 signal=9 timed_out=1"),
            Ok(ActionStatus {
                exit_code: 137,
                signal: Some(9),
                timed_out: true
            })
        );
        assert_eq!(
            parse_status("error=sandbox init 5 is not running"),
            Err("sandbox init 5 is not running".into())
        );
        assert!(parse_status("").is_err());
    }
}
