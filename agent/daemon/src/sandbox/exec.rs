//! `exec`: one action (a shell command) inside a sandbox.
//!
//! The action runs through the `exec` helper ([`crate::helper::exec`]); its stdout and stderr go
//! to two memfds that the agent reads after the shell exits (bounded by the output limit), or
//! to one memfd given as both fd 1 and fd 2 when the request merges them (one open file
//! description: both share its offset, so the order of writes is kept as on a terminal). Bytes
//! for the action's stdin (at most [`stdin_limit`]) go to the helper in a memfd of the agent's;
//! the action process copies them, once it sits in the sandbox's cgroup (so the copy is charged
//! to the sandbox, however long background processes keep it), into a sealed memfd whose
//! read-only twin becomes its stdin ([`sys::SealableMemfd`]): the sandbox can neither change
//! what it reads nor grow it.
//! Processes the action leaves in the background keep running inside the sandbox.

use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Instant;

use belayer_ipc::{ErrorCode, ExecRequest, ExecResult};

use super::create::{valid_dir, valid_env, WORKDIR_MAX};
use super::helper_cmd::{self, not_running, HelperCommand};
use super::SandboxSlot;
use crate::cgroup::SandboxCgroup;
use crate::helper::exec::parse_status;
use crate::helper::init::SANDBOX_PATH;
use crate::helper::spawn;
use crate::runtime::Runtime;
use crate::sys::{self, SyscallError};

/// Fd number the status pipe gets in the helper.
const STATUS_FD: i32 = 3;
/// Fd number the sealed seccomp filter gets in the helper.
const SECCOMP_FD: i32 = 4;

/// Errors of an action (not the action's own failure, which is its exit code).
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The request is malformed.
    #[error("invalid exec request: {0}")]
    Invalid(String),
    /// The request's stdin is over the daemon's bound ([`stdin_limit`]).
    #[error("exec stdin of {bytes} bytes is over the limit of {limit} bytes")]
    StdinTooLarge {
        /// Bytes sent.
        bytes: u64,
        /// The bound.
        limit: u64,
    },
    /// The sandbox is not running (failed, or being restored).
    #[error("sandbox {id} is {state}: restore it first")]
    NotRunning {
        /// Sandbox id.
        id: String,
        /// Its state.
        state: &'static str,
    },
    /// Setting up the helper failed.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    /// Starting or waiting for the helper failed.
    #[error("exec helper for sandbox {id} failed")]
    Helper {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The helper could not run the action (e.g. the sandbox died meanwhile).
    #[error("cannot run action in sandbox {id}: {message}")]
    Enter {
        /// Sandbox id.
        id: String,
        /// The helper's message.
        message: String,
    },
}

impl ExecError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ExecError::Invalid(_) | ExecError::StdinTooLarge { .. } => ErrorCode::BadRequest,
            ExecError::NotRunning { .. } => ErrorCode::InvalidState,
            _ => ErrorCode::ExecFailed,
        }
    }
}

pub use belayer_ipc::command_line;

/// The most stdin bytes an action may get: the daemon's output limit, and no more than a
/// quarter of the frame maximum (like each output stream). The agent's copy lives for the
/// verb; the sandbox's (charged to its cgroup) as long as the action or a background process of
/// it keeps it open.
pub fn stdin_limit(config: &crate::config::Config) -> u64 {
    config
        .output_limit_bytes
        .min(u64::from(config.max_frame_bytes) / 4)
}

/// Runs `req` in the sandbox of `slot`. Holds the sandbox's verb lock for the whole action.
pub fn exec(rt: &Runtime, slot: &SandboxSlot, req: &ExecRequest) -> Result<ExecResult, ExecError> {
    if req.argv.is_empty() || req.argv.iter().any(|a| a.contains('\0')) {
        return Err(ExecError::Invalid(
            "empty command or NUL byte in the command".into(),
        ));
    }
    if let Some((k, _)) = req.env.iter().find(|(k, v)| !valid_env(k, v)) {
        return Err(ExecError::Invalid(format!(
            "bad environment variable {k:?}"
        )));
    }
    if req.cwd.as_deref().is_some_and(|c| !valid_dir(c)) {
        return Err(ExecError::Invalid(format!(
            "cwd must be an absolute path of at most {WORKDIR_MAX} bytes without NUL"
        )));
    }
    let stdin_max = stdin_limit(&rt.config);
    if req.stdin.len() as u64 > stdin_max {
        return Err(ExecError::StdinTooLarge {
            bytes: req.stdin.len() as u64,
            limit: stdin_max,
        });
    }
    let _op = slot.lock_op();
    slot.drain_outputs();
    let rec = slot.refresh();
    if let Some(state) = not_running(&rec) {
        return Err(ExecError::NotRunning {
            id: rec.id.clone(),
            state,
        });
    }
    // Both outputs travel in one response frame: keep them well inside its maximum.
    let limit = req
        .output_limit
        .unwrap_or(rt.config.output_limit_bytes)
        .min(u64::from(rt.config.max_frame_bytes) / 4);
    let timeout_ms = helper_cmd::timeout_ms(rt, req.timeout_ms);
    let cgroup = SandboxCgroup::open(&rec.cgroup).map_err(|e| ExecError::Enter {
        id: rec.id.clone(),
        message: e.to_string(),
    })?;

    // Tracer snapshot before the helper joins the cgroup (its own activity never counts: it
    // only writes to pipes, memfds and cgroup files, and is reaped before the second look).
    let upper = slot.paths.upper(rec.instance);
    let probe = rt.tracer.begin_action(&rec, &cgroup, &upper);
    // Unknown until the verdict: an action that fails half-way leaves it so.
    let before = slot.changes.begin_action();

    let stdout = sys::memfd("belayer-stdout")?;
    // Merged: stderr is the same open file description as stdout (one offset, one order).
    let stderr = if req.merge_stderr {
        None
    } else {
        Some(sys::memfd("belayer-stderr")?)
    };
    let owner = rec.userns.map(|range| range.host_base);
    if let Some(id) = owner {
        // Background processes keep these: owned by the sandbox's root, they are files of
        // the sandbox like any other (CRIU restores their owner inside its namespace).
        for f in std::iter::once(&stdout).chain(stderr.as_ref()) {
            std::os::unix::fs::fchown(f, Some(id), Some(id))
                .map_err(|e| SyscallError::io("fchown", "output memfd", e))?;
        }
    }
    let stdin = if req.stdin.is_empty() {
        None
    } else {
        let f = sys::memfd("belayer-stdin-source")?;
        std::os::unix::fs::FileExt::write_all_at(&f, &req.stdin, 0)
            .map_err(|e| SyscallError::io("pwrite", "stdin memfd", e))?;
        Some(f)
    };
    let (status_rd, status_wr): (OwnedFd, OwnedFd) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| SyscallError::io("pipe2", "exec status", e.into()))?;

    let mut cmd = HelperCommand::exec(rt, &rec, STATUS_FD, SECCOMP_FD, timeout_ms, &cgroup);
    // The action's own, else the sandbox's default (`SandboxSpec::workdir`), else `/`.
    cmd.flag(
        "--cwd",
        req.cwd
            .as_deref()
            .or(rec.spec.workdir.as_deref())
            .unwrap_or("/"),
    );
    if stdin.is_some() {
        cmd.flag("--stdin", "copy");
        if let Some(id) = owner {
            cmd.flag("--stdin-owner", id.to_string());
        }
    }
    let user = rec.spec.user.as_deref().and_then(parse_user);
    if let Some((uid, gid)) = user.filter(|&(uid, _)| uid != 0) {
        cmd.flag("--user", format!("{uid}:{gid}"));
    }
    let home = if user.is_some_and(|(uid, _)| uid != 0) {
        "/"
    } else {
        "/root"
    };
    let defaults = [
        ("PATH".to_string(), SANDBOX_PATH.to_string()),
        ("HOME".to_string(), home.to_string()),
    ];
    let all = defaults.iter().chain(&rec.spec.env).chain(&req.env);
    for (k, v) in merge_env(all) {
        cmd.flag("--env", format!("{k}={v}"));
    }
    let cmd = cmd.finish(command_line(&req.argv));
    let helper_err = |source| ExecError::Helper {
        id: rec.id.clone(),
        source,
    };
    let null = match &stdin {
        Some(_) => None,
        None => Some(
            fs::File::open("/dev/null").map_err(|e| SyscallError::io("open", "/dev/null", e))?,
        ),
    };
    let input = stdin.as_ref().or(null.as_ref()).map(AsFd::as_fd);
    let stderr_fd = stderr.as_ref().unwrap_or(&stdout).as_fd();
    let mut fds = vec![
        (stdout.as_fd(), 1),
        (stderr_fd, 2),
        (status_wr.as_fd(), STATUS_FD),
        (rt.seccomp.as_fd(), SECCOMP_FD),
    ];
    fds.extend(input.map(|fd| (fd, 0)));
    let started = Instant::now();
    let child = spawn::spawn(&rt.helper.exec_path(), &cmd, &fds)?;
    // The child holds what it needs; the parent's copies (the stdin memfd among them) go now,
    // not when the action ends.
    drop(fds);
    drop(null);
    drop(stdin);
    drop(status_wr);
    let mut line = String::new();
    let read = fs::File::from(status_rd).read_to_string(&mut line);
    let helper_pid = Some(child.id());
    let waited = child.wait();
    let duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    read.map_err(helper_err)?;
    let helper_status = waited?;
    let (status, helper_killed) =
        action_status(&line, helper_status).map_err(|message| ExecError::Enter {
            id: rec.id.clone(),
            message,
        })?;
    let mut verdict = probe.finish(&rt.tracer, &rec, &cgroup, &upper, &status);
    if helper_killed && verdict.infra_fault.is_none() {
        // The helper runs in the sandbox's cgroup and never kills itself: a signal that
        // ended it before its status line came from outside the action.
        verdict.infra_fault = Some(belayer_ipc::InfraFault {
            kind: belayer_ipc::InfraFaultKind::ExternalKill,
            pid: helper_pid,
            signal: status.signal,
        });
    }
    if let Some(f) = &verdict.infra_fault {
        tracing::warn!(sandbox = %rec.id, kind = f.kind.as_str(), pid = ?f.pid, signal = ?f.signal, "infrastructure fault during the action");
        // Whatever the tracer already did: the sandbox is not trustworthy any more (the
        // daemon announces it as failed); the caller restores.
        slot.fail();
    }

    slot.changes.end_action(before, verdict.dirty);
    let (out, t1) = read_bounded(&stdout, limit).map_err(helper_err)?;
    let (err, t2) = match &stderr {
        Some(f) => read_bounded(f, limit).map_err(helper_err)?,
        None => (Vec::new(), false),
    };
    slot.keep_output(stdout);
    if let Some(f) = stderr {
        slot.keep_output(f);
    }
    tracing::debug!(sandbox = %rec.id, exit = status.exit_code, duration_ms, dirty = ?verdict.dirty, "action finished");
    Ok(ExecResult {
        exit_code: status.exit_code,
        signal: status.signal,
        stdout: out,
        stderr: err,
        truncated: t1 || t2,
        timed_out: status.timed_out,
        duration_ms,
        infra_fault: verdict.infra_fault,
        dirty: verdict.dirty,
    })
}

/// The action's status from the helper's status `line`, or, when the helper died without
/// writing one (killed with the sandbox's processes from the host, or by the OOM killer: it
/// sits in the sandbox's cgroup), from the helper's own wait status; the flag says which.
/// The output written so far is in the memfds either way and is returned with the fault.
/// `Err`: the helper's error message, or a helper that exited without a status.
fn action_status(
    line: &str,
    helper: std::process::ExitStatus,
) -> Result<(crate::helper::exec::ActionStatus, bool), String> {
    use std::os::unix::process::ExitStatusExt;
    match parse_status(line) {
        Ok(status) => Ok((status, false)),
        Err(message) => match helper.signal() {
            Some(sig) if line.trim().is_empty() => Ok((
                crate::helper::exec::ActionStatus {
                    exit_code: 128 + sig,
                    signal: Some(sig),
                    timed_out: false,
                },
                true,
            )),
            _ => Err(format!("{message}; the helper ended with {helper}")),
        },
    }
}

/// Reads at most `limit` bytes from the start of `file`; the flag says whether it held more.
fn read_bounded(file: &fs::File, limit: u64) -> std::io::Result<(Vec<u8>, bool)> {
    let size = file.metadata()?.len();
    let n = size.min(limit) as usize;
    let mut buf = vec![0u8; n];
    let mut off = 0;
    while off < n {
        let r = file.read_at(&mut buf[off..], off as u64)?;
        if r == 0 {
            break;
        }
        off += r;
    }
    buf.truncate(off);
    Ok((buf, size > limit))
}

/// `uid` or `uid:gid` ([`belayer_ipc::SandboxSpec::user`]); a bare uid runs with gid 0, as
/// in Docker. `None` for anything else (refused at creation, so never seen here).
pub(crate) fn parse_user(s: &str) -> Option<(u32, u32)> {
    match s.split_once(':') {
        Some((u, g)) => Some((u.parse().ok()?, g.parse().ok()?)),
        None => s.parse().ok().map(|u| (u, 0)),
    }
}

/// The environment `vars` in order of first appearance of each key, each key with its last
/// value (an action's variable overrides the sandbox's, which overrides the image's and the
/// defaults).
pub(crate) fn merge_env<'a>(
    vars: impl IntoIterator<Item = &'a (String, String)>,
) -> Vec<(&'a str, &'a str)> {
    let mut out: Vec<(&str, &str)> = Vec::new();
    for (k, v) in vars {
        match out.iter_mut().find(|(key, _)| *key == k.as_str()) {
            Some(slot) => slot.1 = v.as_str(),
            None => out.push((k.as_str(), v.as_str())),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines() {
        assert_eq!(
            command_line(&["echo hi > /tmp/x".into()]),
            "echo hi > /tmp/x"
        );
        assert_eq!(
            command_line(&["ls".into(), "-la".into(), "/a b".into()]),
            "ls -la '/a b'"
        );
        assert_eq!(
            command_line(&["echo".into(), "it's".into()]),
            "echo 'it'\\''s'"
        );
    }

    #[test]
    fn a_killed_helper_yields_the_signal_status() {
        use std::os::unix::process::ExitStatusExt;
        let killed = std::process::ExitStatus::from_raw(libc::SIGKILL);
        let (status, lost) = action_status("", killed).unwrap();
        assert!(lost);
        assert_eq!(status.exit_code, 137);
        assert_eq!(status.signal, Some(libc::SIGKILL));
        let (status, lost) = action_status("exit=0 signal=- timed_out=0\n", killed).unwrap();
        assert!(!lost);
        assert_eq!(status.exit_code, 0);
        assert!(action_status("", std::process::ExitStatus::from_raw(0)).is_err());
        assert!(action_status("error=boom", killed).is_err());
    }

    #[test]
    fn stdin_is_bounded_by_the_output_limit_and_the_frame() {
        let mut config = crate::config::Config {
            output_limit_bytes: 1 << 30,
            ..Default::default()
        };
        assert_eq!(stdin_limit(&config), u64::from(config.max_frame_bytes) / 4);
        config.output_limit_bytes = 10;
        assert_eq!(stdin_limit(&config), 10);
    }

    #[test]
    fn sealed_stdin_cannot_change() {
        use std::io::{Seek, Write};
        use std::os::fd::{AsFd, AsRawFd};
        let src = sys::memfd("src").unwrap();
        std::os::unix::fs::FileExt::write_all_at(&src, b"in\0put", 0).unwrap();
        let memfd = sys::SealableMemfd::create("t").unwrap();
        let reader = memfd.fill_and_seal(src.as_fd(), None).unwrap();
        let mut f = fs::File::from(reader.try_clone_to_owned().unwrap());
        drop(memfd);
        let mut got = Vec::new();
        (&f).read_to_end(&mut got).unwrap();
        assert_eq!(got, b"in\0put");
        assert!((&f).write_all(b"x").is_err(), "read-only description");
        let path = format!("/proc/self/fd/{}", f.as_raw_fd());
        let reopened = fs::OpenOptions::new().write(true).open(&path);
        if let Ok(mut w) = reopened {
            assert!(w.write_all(b"x").is_err(), "write sealed");
            assert!(w.set_len(0).is_err(), "shrink sealed");
        }
        f.rewind().unwrap();
        got.clear();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"in\0put");
    }

    #[test]
    fn bounded_reads() {
        let f = sys::memfd("t").unwrap();
        use std::io::Write;
        (&f).write_all(b"hello world").unwrap();
        assert_eq!(read_bounded(&f, 5).unwrap(), (b"hello".to_vec(), true));
        assert_eq!(
            read_bounded(&f, 100).unwrap(),
            (b"hello world".to_vec(), false)
        );
    }
}
