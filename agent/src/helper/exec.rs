//! The `exec` helper: runs one action inside an existing sandbox.
//!
//! It opens the namespaces of the sandbox init (`/proc/<pid>/ns/*`) and the sandbox's
//! `cgroup.procs` files, joins the cgroup, `setns`es into pid, uts, ipc, net, time and mount namespaces
//! and forks: the child is in the sandbox's pid namespace, leads a new session (so a timeout can
//! kill the action's whole process group), takes stdin from the sandbox's own `/dev/null`, keeps
//! the stdout/stderr memfds the agent gave it, and execs `/bin/sh -c CMD`. Background processes
//! it starts are re-parented to the sandbox init when the shell exits and keep running. memfds
//! (not pipes) hold the output so that such processes never get SIGPIPE and CRIU can dump them.
//!
//! The result goes to the status fd as one line: `exit=<code> signal=<n|-> timed_out=<0|1>`.

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::fd::{AsFd, FromRawFd};

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{chdir, execve, fork, setsid, ForkResult, Pid};

use super::Args;
use crate::sys::{self, SyscallError};

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
    /// Joining the sandbox cgroup failed.
    #[error(transparent)]
    JoinCgroup(#[from] super::JoinCgroupError),
    /// A syscall failed.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
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
            let _ = writeln!(status, "error={e}");
            125
        }
    }
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
    let command = args
        .rest()
        .first()
        .ok_or(ExecHelperError::BadArgument("command"))?;
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
        let path = format!("/proc/{pid}/ns/{name}");
        let f = fs::File::open(&path).map_err(|source| ExecHelperError::OpenNamespace {
            path: path.clone(),
            source,
        })?;
        namespaces.push((f, flag, path));
    }
    // The namespace fds pin the namespaces; check they belong to the init we were told about.
    if !sys::process_matches(pid, start) {
        return Err(ExecHelperError::InitGone { pid });
    }
    super::join_cgroup(&args.all("--procs"))?;
    for (f, flag, path) in &namespaces {
        setns(f.as_fd(), *flag).map_err(|e| SyscallError::new("setns", path.clone(), e))?;
    }
    drop(namespaces);
    chdir("/").map_err(|e| SyscallError::new("chdir", "/", e))?;

    // SAFETY: this helper is single-threaded (fresh exec, no threads started), so the child may
    // run arbitrary code after fork.
    match unsafe { fork() }.map_err(|e| SyscallError::new("fork", "action", e))? {
        ForkResult::Child => {
            let err = action(cwd, command, &env);
            let _ = writeln!(std::io::stderr(), "belayer: {err}");
            // SAFETY: _exit ends the child immediately; always safe.
            unsafe { libc::_exit(127) }
        }
        ForkResult::Parent { child } => wait_action(child, timeout_ms),
    }
}

/// In the forked child: becomes the action process. Returns only on error.
fn action(cwd: &str, command: &str, env: &[CString]) -> SyscallError {
    let run = || -> Result<std::convert::Infallible, SyscallError> {
        setsid().map_err(|e| SyscallError::new("setsid", "action", e))?;
        let null =
            fs::File::open("/dev/null").map_err(|e| SyscallError::io("open", "/dev/null", e))?;
        use std::os::fd::AsRawFd;
        // SAFETY: dup2 onto stdin; `null` stays open during the call.
        if unsafe { libc::dup2(null.as_raw_fd(), 0) } < 0 {
            return Err(SyscallError::new("dup2", "0", nix::errno::Errno::last()));
        }
        drop(null);
        sys::close_range(3, u32::MAX)?;
        super::drop_capabilities().map_err(|e| {
            SyscallError::io(
                "capset",
                "sandbox capabilities",
                std::io::Error::other(e.to_string()),
            )
        })?;
        chdir(cwd).map_err(|e| SyscallError::new("chdir", cwd, e))?;
        let argv = [
            CString::from(c"sh"),
            CString::from(c"-c"),
            CString::new(command.as_bytes()).map_err(|_| {
                SyscallError::new("execve", "command with NUL", nix::errno::Errno::EINVAL)
            })?,
        ];
        execve(c"/bin/sh", &argv, env).map_err(|e| SyscallError::new("execve", "/bin/sh", e))
    };
    match run() {
        Err(e) => e,
        Ok(never) => match never {},
    }
}

/// Waits for the action with an optional timeout; kills its process group on expiry.
fn wait_action(child: Pid, timeout_ms: Option<u64>) -> Result<String, ExecHelperError> {
    let pidfd = sys::pidfd_open(child.as_raw())?;
    let exited = sys::pidfd_wait(pidfd.as_fd(), timeout_ms)?;
    let timed_out = !exited;
    if timed_out {
        // The child leads its own process group (setsid); kill the whole group.
        let _ = kill(Pid::from_raw(-child.as_raw()), Signal::SIGKILL);
        let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    }
    let status = loop {
        match waitpid(child, None) {
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
