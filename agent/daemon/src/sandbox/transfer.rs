//! `upload` and `download`: file transfer into and out of a sandbox, as tar streams.
//!
//! The stream is extracted or packed inside the sandbox by the `exec` helper's builtin
//! ([`crate::helper::transfer`]), a process of the sandbox confined like an action, never by
//! the daemon itself: hostile symlinks resolve inside the sandbox, writes are charged to its
//! disk limit and memory cgroup, files belong to its root. The daemon only moves bytes between
//! the client's connection ([`TransferLink`]) and the helper's pipe, each side bounded in time:
//! the client by the server's idle, frame and send timeouts, the helper by the transfer's
//! timeout (the request's, else the daemon's exec timeout) and, for every pipe read or write,
//! [`STALL`] without progress (the sandbox can stop its helper: it is its root).
//!
//! Like an action, a transfer holds the sandbox's verb lock (no checkpoint starts mid-way),
//! needs a running sandbox (restored ones included) and goes through the tracer: an upload
//! makes the sandbox dirty for the checkpoint policy whatever the tracer saw, a download is
//! dirty only if the tracer saw a change. An aborted transfer (the client went away or
//! cancelled, the timeout passed) kills the helper; what it extracted before stays.

use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use belayer_ipc::{
    Chunk, DownloadRequest, ErrorCode, LinkError, TransferInfo, TransferLink, UploadRequest,
};
use belayer_transfer::ErrorClass;
use rustix::io::Errno;

use super::helper_cmd::{self, not_running, HelperCommand};
use super::SandboxSlot;
use crate::cgroup::SandboxCgroup;
use crate::helper::exec::ActionStatus;
use crate::helper::spawn;
use crate::helper::transfer::{parse_status, BuiltinStatus, Outcome};
use crate::runtime::Runtime;
use crate::sandbox::SandboxRecord;
use crate::sys::SyscallError;

mod pipe;

use pipe::{data_pipe, feed, hung_up_first, nonblocking, ready, Fed, Finished};

/// Fd numbers the status and control pipes get in the helper.
const STATUS_FD: i32 = 3;
const CONTROL_FD: i32 = 4;
/// Where the helper finds the daemon's sealed seccomp program (`--seccomp-fd`).
const SECCOMP_FD: i32 = 5;

/// Longest a pipe read or write to the helper may make no progress before the transfer is
/// stopped as stalled.
pub const STALL: Duration = Duration::from_secs(30);

/// Errors of a transfer.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The request is malformed.
    #[error("invalid transfer request: {0}")]
    Invalid(String),
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
    #[error("transfer helper for sandbox {id} failed")]
    Helper {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The helper could not enter the sandbox (e.g. the sandbox died meanwhile).
    #[error("cannot enter sandbox {id}: {message}")]
    Enter {
        /// Sandbox id.
        id: String,
        /// The helper's message.
        message: String,
    },
    /// The extractor or packer inside the sandbox failed.
    #[error("transfer in sandbox {id} failed: {message}")]
    Failed {
        /// Sandbox id.
        id: String,
        /// Its class.
        class: ErrorClass,
        /// Its message.
        message: String,
    },
    /// The transfer's timeout passed, or the helper made no progress for [`STALL`].
    #[error("transfer in sandbox {id} stopped: {what}")]
    TimedOut {
        /// Sandbox id.
        id: String,
        /// What timed out.
        what: String,
    },
    /// The helper ended without an outcome (killed inside the sandbox, or by the OOM killer).
    #[error("transfer helper in sandbox {id} ended without an outcome (signal {signal:?})")]
    Lost {
        /// Sandbox id.
        id: String,
        /// The signal that ended it.
        signal: Option<i32>,
    },
    /// The client's side of the transfer failed (cancelled, gone, stalled, out of step).
    #[error("transfer for sandbox {id} stopped")]
    Link {
        /// Sandbox id.
        id: String,
        /// Cause.
        #[source]
        source: LinkError,
    },
}

impl TransferError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            TransferError::Invalid(_) => ErrorCode::BadRequest,
            TransferError::NotRunning { .. } => ErrorCode::InvalidState,
            TransferError::TimedOut { .. } => ErrorCode::TransferTimedOut,
            TransferError::Failed { class, .. } => match class {
                ErrorClass::NotFound => ErrorCode::NotFound,
                ErrorClass::NoSpace => ErrorCode::NoSpace,
                _ => ErrorCode::TransferFailed,
            },
            _ => ErrorCode::TransferFailed,
        }
    }
}

/// A running helper of one transfer, and what the verb needs after it.
struct Run {
    rec: SandboxRecord,
    child: spawn::Helper,
    status: fs::File,
    /// Dropped to abort: the helper kills its child.
    control: Option<OwnedFd>,
    cgroup: SandboxCgroup,
    probe: crate::trace::ActionProbe,
    before: Option<bool>,
    deadline: Option<Instant>,
    timeout_ms: Option<u64>,
    started: Instant,
}

fn check_path(path: &str, what: &str) -> Result<(), TransferError> {
    if path.contains('\0') || !path.starts_with('/') {
        return Err(TransferError::Invalid(format!(
            "{what} must be an absolute path without NUL bytes"
        )));
    }
    Ok(())
}

/// Starts the builtin `kind` for `path` under the held verb lock of a running sandbox;
/// `data` becomes the helper's stdin (`unpack`) or stdout (`pack`).
fn start(
    rt: &Runtime,
    slot: &SandboxSlot,
    kind: &str,
    path: &str,
    archive: bool,
    timeout_ms: Option<u64>,
    data: OwnedFd,
) -> Result<Run, TransferError> {
    let rec = slot.refresh();
    if let Some(state) = not_running(&rec) {
        return Err(TransferError::NotRunning {
            id: rec.id.clone(),
            state,
        });
    }
    let timeout_ms = helper_cmd::timeout_ms(rt, timeout_ms);
    let cgroup = SandboxCgroup::open(&rec.cgroup).map_err(|e| TransferError::Enter {
        id: rec.id.clone(),
        message: e.to_string(),
    })?;
    let probe = rt
        .tracer
        .begin_action(&rec, &cgroup, &slot.paths.upper(rec.instance));
    let before = slot.changes.begin_action();
    let pipe = |what| {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| SyscallError::io("pipe2", what, e.into()))
    };
    let (status_rd, status_wr) = pipe("transfer status")?;
    let (control_rd, control_wr) = pipe("transfer control")?;
    let mut cmd = HelperCommand::exec(rt, &rec, STATUS_FD, SECCOMP_FD, timeout_ms, &cgroup);
    cmd.flag("--builtin", kind);
    cmd.flag("--control-fd", CONTROL_FD.to_string());
    cmd.flag("--archive", if archive { "1" } else { "0" });
    let cmd = cmd.finish(path);
    let null = fs::File::open("/dev/null").map_err(|e| SyscallError::io("open", "/dev/null", e))?;
    let (stdin, stdout) = if kind == "unpack" {
        (data.as_fd(), null.as_fd())
    } else {
        (null.as_fd(), data.as_fd())
    };
    let fds = [
        (stdin, 0),
        (stdout, 1),
        (null.as_fd(), 2),
        (status_wr.as_fd(), STATUS_FD),
        (control_rd.as_fd(), CONTROL_FD),
        (rt.seccomp.as_fd(), SECCOMP_FD),
    ];
    let child = spawn::spawn(&rt.helper.exec_path(), &cmd, &fds)?;
    drop((null, data, status_wr, control_rd));
    Ok(Run {
        rec,
        child,
        status: fs::File::from(status_rd),
        control: Some(control_wr),
        cgroup,
        probe,
        before,
        deadline: timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms)),
        timeout_ms,
        started: Instant::now(),
    })
}

impl Run {
    /// How long a pipe operation may wait now: [`STALL`], or less when the deadline is nearer.
    fn wait(&self) -> (Duration, bool) {
        match self.deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left < STALL {
                    (left, true)
                } else {
                    (STALL, false)
                }
            }
            None => (STALL, false),
        }
    }

    fn timed_out(&self, by_deadline: bool) -> TransferError {
        TransferError::TimedOut {
            id: self.rec.id.clone(),
            what: if by_deadline {
                format!("its timeout of {} ms passed", self.timeout_ms.unwrap_or(0))
            } else {
                format!("the helper made no progress for {} s", STALL.as_secs())
            },
        }
    }

    /// Waits for the helper's status (aborting it first when `abort`, or as soon as the client
    /// behind `peer` hangs up or cancels), records the verdict, and turns the status into the
    /// transfer's outcome.
    fn finish(
        mut self,
        rt: &Runtime,
        slot: &SandboxSlot,
        abort: bool,
        upload: bool,
        peer: Option<BorrowedFd<'_>>,
    ) -> Result<TransferInfo, TransferError> {
        let mut late = None;
        if abort {
            self.control.take();
        } else if let Some(peer) = peer {
            // The stream is in: what is left is at most a pipe's worth of data and the
            // directories' metadata. A helper the sandbox stopped must not hold the sandbox
            // (and this connection) past the stall bound or the deadline.
            let (wait, by_deadline) = self.wait();
            match hung_up_first(peer, &self.status, wait)? {
                Finished::Status => {}
                Finished::Peer => {
                    tracing::debug!(sandbox = %self.rec.id, "client gone while the helper finishes: aborting");
                    self.control.take();
                }
                Finished::TimedOut => {
                    tracing::debug!(sandbox = %self.rec.id, "the helper did not finish in time: aborting");
                    late = Some(self.timed_out(by_deadline));
                    self.control.take();
                }
            }
        }
        let mut line = String::new();
        let read = self.status.read_to_string(&mut line);
        let waited = self.child.wait();
        drop(self.control.take());
        let id = self.rec.id.clone();
        let helper_err = |source| TransferError::Helper {
            id: id.clone(),
            source,
        };
        read.map_err(helper_err)?;
        waited?;
        let status = parse_status(&line).map_err(|message| TransferError::Enter {
            id: id.clone(),
            message,
        });
        let action = ActionStatus {
            exit_code: 0,
            signal: status.as_ref().ok().and_then(|s| s.signal),
            timed_out: status.as_ref().is_ok_and(|s| s.timed_out || s.aborted),
        };
        let upper = slot.paths.upper(self.rec.instance);
        let verdict = self
            .probe
            .finish(&rt.tracer, &self.rec, &self.cgroup, &upper, &action);
        if let Some(f) = &verdict.infra_fault {
            tracing::warn!(sandbox = %id, kind = f.kind.as_str(), pid = ?f.pid, signal = ?f.signal, "infrastructure fault during a transfer");
            slot.fail();
        }
        // An upload changed the sandbox even if it failed half-way.
        let dirty = if upload { Some(true) } else { verdict.dirty };
        slot.changes.end_action(self.before, dirty);
        if let Some(err) = late {
            return Err(err);
        }
        let status = status?;
        let duration_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        outcome(&id, status, duration_ms, self.timeout_ms)
    }
}

/// The transfer's result from the helper's status.
fn outcome(
    id: &str,
    status: BuiltinStatus,
    duration_ms: f64,
    timeout_ms: Option<u64>,
) -> Result<TransferInfo, TransferError> {
    match status.outcome {
        Some(Outcome::Done {
            files,
            bytes,
            skipped,
            changed,
        }) => Ok(TransferInfo {
            files,
            bytes,
            skipped,
            changed,
            duration_ms,
        }),
        Some(Outcome::Failed { class, message }) => Err(TransferError::Failed {
            id: id.to_owned(),
            class: ErrorClass::parse(&class),
            message,
        }),
        None if status.timed_out => Err(TransferError::TimedOut {
            id: id.to_owned(),
            what: format!("its timeout of {} ms passed", timeout_ms.unwrap_or(0)),
        }),
        None => match status.start_error {
            Some(message) => Err(TransferError::Enter {
                id: id.to_owned(),
                message,
            }),
            None => Err(TransferError::Lost {
                id: id.to_owned(),
                signal: status.signal,
            }),
        },
    }
}

/// Serves [`belayer_ipc::Request::Upload`]: answers `TransferReady`, feeds the client's chunks
/// to the unpacking helper, and returns the outcome once the client's stream ended.
pub fn upload(
    rt: &Runtime,
    slot: &SandboxSlot,
    req: &UploadRequest,
    link: &mut TransferLink<'_>,
) -> Result<TransferInfo, TransferError> {
    check_path(&req.dest, "dest")?;
    let _op = slot.lock_op();
    let (rd, wr) = data_pipe()?;
    let run = start(
        rt,
        slot,
        "unpack",
        &req.dest,
        req.archive,
        req.timeout_ms,
        rd,
    )?;
    nonblocking(&wr)?;
    if let Err(source) = link.ready() {
        return Err(link_failed(run, rt, slot, source, true));
    }
    let mut open = true;
    let mut stop: Option<TransferError> = None;
    loop {
        match link.recv_chunk(run.deadline) {
            Ok(Chunk::Data(bytes)) if open => match feed(&run, &wr, &bytes)? {
                Fed::Ok => {}
                Fed::Closed => open = false,
                Fed::Stalled(by_deadline) => {
                    // Nothing more reaches the helper; the client's rest is drained.
                    stop.get_or_insert(run.timed_out(by_deadline));
                    open = false;
                }
            },
            Ok(Chunk::Data(_)) => {}
            Ok(Chunk::End) => {
                if open && stop.is_none() {
                    if let Fed::Stalled(by_deadline) = feed(&run, &wr, &[])? {
                        stop = Some(run.timed_out(by_deadline));
                    }
                }
                break;
            }
            Err(source) => return Err(link_failed(run, rt, slot, source, true)),
        }
    }
    drop(wr);
    let id = run.rec.id.clone();
    let result = run.finish(rt, slot, stop.is_some(), true, Some(link.peer_fd()));
    tracing::debug!(sandbox = %id, ok = result.is_ok(), "upload finished");
    match stop {
        Some(err) => Err(err),
        None => result,
    }
}

/// Aborts `run` after the client's side failed with `source`.
fn link_failed(
    run: Run,
    rt: &Runtime,
    slot: &SandboxSlot,
    source: LinkError,
    upload: bool,
) -> TransferError {
    let id = run.rec.id.clone();
    let ended = run.finish(rt, slot, true, upload, None);
    tracing::debug!(sandbox = %id, error = %source, helper = ?ended.err(), "transfer stopped by its link");
    match source {
        LinkError::Deadline => TransferError::TimedOut {
            id,
            what: "its timeout passed while waiting for the client".into(),
        },
        source => TransferError::Link { id, source },
    }
}

/// Serves [`belayer_ipc::Request::Download`]: forwards what the packing helper writes as
/// download chunks and returns the outcome.
pub fn download(
    rt: &Runtime,
    slot: &SandboxSlot,
    req: &DownloadRequest,
    link: &mut TransferLink<'_>,
) -> Result<TransferInfo, TransferError> {
    check_path(&req.src, "src")?;
    let _op = slot.lock_op();
    let (rd, wr) = data_pipe()?;
    let run = start(rt, slot, "pack", &req.src, false, req.timeout_ms, wr)?;
    nonblocking(&rd)?;
    let mut buf = vec![0u8; link.chunk_bytes()];
    let mut filled = 0;
    let mut stop = None;
    loop {
        let eof = match rustix::io::read(&rd, &mut buf[filled..]) {
            Ok(0) => true,
            Ok(n) => {
                filled += n;
                if filled < buf.len() {
                    continue;
                }
                false
            }
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) if filled == 0 => {
                let (wait, by_deadline) = run.wait();
                if !ready(&rd, nix::poll::PollFlags::POLLIN, wait)? {
                    stop = Some(run.timed_out(by_deadline));
                    break;
                }
                continue;
            }
            Err(Errno::AGAIN) => false,
            Err(e) => return Err(SyscallError::io("read", "transfer pipe", e.into()).into()),
        };
        if filled > 0 {
            if let Err(source) = link.send_chunk(&buf[..filled]) {
                drop(rd);
                return Err(link_failed(run, rt, slot, source, false));
            }
            filled = 0;
        }
        if eof {
            break;
        }
    }
    drop(rd);
    let result = run.finish(rt, slot, stop.is_some(), false, Some(link.peer_fd()));
    match stop {
        Some(err) => Err(err),
        None => result,
    }
}
