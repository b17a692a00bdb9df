//! The `exec` helper's builtin transfers (`--builtin unpack` / `--builtin pack`): file transfer
//! into and out of a sandbox, run by a process of the sandbox.
//!
//! The helper enters the sandbox exactly as for an action ([`super::exec`]: namespaces of the
//! init, its cgroup, its user namespace, a new session, the container capability set,
//! `no_new_privs`, the seccomp filter), but where the action process would execute
//! `/bin/sh -c CMD`, the child runs the hardened extractor or packer of `belayer-transfer` in
//! process. It never executes anything, so it stays non-dumpable (the sandbox cannot ptrace
//! it or open its `/proc/<pid>/fd`), and the image needs no `tar`. Its writes are charged to
//! the sandbox's disk limit and memory cgroup, and the files it creates belong to the
//! sandbox's root. Paths are resolved inside the sandbox (`RESOLVE_IN_ROOT`, see
//! [`belayer_transfer::resolve_destination`]).
//!
//! Data: for `unpack`, the child's stdin is a pipe the daemon writes the stream into in frames
//! ([`FramedReader`]: a 4-byte little-endian length, then that many bytes; length 0 ends the
//! stream), so a stream that ends without its end marker (the client went away, the transfer
//! was cancelled) is an abort, never a shorter archive taken as complete. For `pack`, the
//! child writes the tar to its stdout, a pipe the daemon reads. The waiting parent closes its
//! own copies of both, so the daemon sees the end of the stream when the child ends.
//!
//! The parent waits for the child's report: the pid it reported first, then its outcome (a
//! [`OUTCOME_MARK`] byte, one line of JSON), until the transfer's timeout, or until the daemon
//! closes the control pipe (`--control-fd`: the transfer is aborted, or the daemon is gone).
//! Then it kills the child from inside the cgroup, as a timed-out action is killed. The status
//! line is `transfer=<BuiltinStatus as JSON>`.

use std::fs;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use belayer_transfer::{
    pack, resolve_destination, resolve_source, unpack, Resolution, Summary, TransferError,
};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use super::exec::{become_sandbox_root, enter_cgroup, Entry, ExecHelperError, Killer, Report};
use super::{Args, KILL_GRACE};
use crate::sys::{self, SyscallError};

/// First byte of the child's outcome on the report pipe (after its 4-byte pid); a failure to
/// start is plain text there instead.
pub const OUTCOME_MARK: u8 = 1;

/// Bytes buffered between the pipes and the tar code.
const PIPE_BUFFER: usize = 256 << 10;

/// What the builtin does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Builtin {
    /// Extracts the framed tar stream on stdin at `dest`.
    Unpack {
        /// Destination inside the sandbox.
        dest: String,
        /// One tree that may become `dest` (else an arbitrary archive into a directory).
        single: bool,
    },
    /// Writes `src` as a tar stream to stdout.
    Pack {
        /// Source inside the sandbox.
        src: String,
    },
}

impl Builtin {
    /// `--builtin KIND` with the path after `--`; `--archive` makes an unpack take an
    /// arbitrary archive.
    pub(super) fn parse(
        kind: &str,
        path: &str,
        args: &Args<'_>,
    ) -> Result<Builtin, ExecHelperError> {
        let archive = args.one("--archive") == Some("1");
        match kind {
            "unpack" => Ok(Builtin::Unpack {
                dest: path.to_owned(),
                single: !archive,
            }),
            "pack" => Ok(Builtin::Pack {
                src: path.to_owned(),
            }),
            _ => Err(ExecHelperError::BadArgument("--builtin")),
        }
    }
}

/// What the child reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The transfer finished.
    Done {
        /// Members packed or created.
        files: u64,
        /// Bytes of file content.
        bytes: u64,
        /// Special files left out.
        skipped: u64,
        /// Files that changed size while packed.
        changed: u64,
    },
    /// The transfer failed.
    Failed {
        /// [`belayer_transfer::ErrorClass::as_str`].
        class: String,
        /// The error with its causes.
        message: String,
    },
}

/// The helper's status line for a builtin, after `transfer=`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct BuiltinStatus {
    /// The child's outcome, when it reported one.
    pub outcome: Option<Outcome>,
    /// Why the child could not enter the sandbox, when it could not.
    pub start_error: Option<String>,
    /// The timeout passed and the child was killed.
    pub timed_out: bool,
    /// The daemon closed the control pipe and the child was killed.
    pub aborted: bool,
    /// The signal that ended the child, if one did.
    pub signal: Option<i32>,
}

/// In the forked child: enters the sandbox, confines itself, runs `builtin` and reports its
/// outcome. Never returns.
pub(super) fn child(
    entry: &Entry,
    filter: &super::seccomp::SandboxFilter,
    report: &mut fs::File,
    builtin: &Builtin,
) -> ! {
    let confined = (|| -> Result<(), SyscallError> {
        enter_cgroup(entry, report)?;
        become_sandbox_root(entry)?;
        // Everything but stdio (the data pipe) and the report pipe: the namespace and cgroup
        // fds, the status pipe, the control pipe.
        super::finish::close_all_but(&[report.as_raw_fd() as u32])?;
        super::finish::confine(filter, entry.userns.is_some(), None)
    })();
    if let Err(err) = confined {
        let _ = write!(report, "{}", super::init::error_chain(&err));
        // SAFETY: _exit ends the child immediately; always safe.
        unsafe { libc::_exit(127) }
    }
    let outcome = match run(builtin) {
        Ok(s) => Outcome::Done {
            files: s.files,
            bytes: s.bytes,
            skipped: s.skipped,
            changed: s.changed,
        },
        Err(e) => Outcome::Failed {
            class: e.class().as_str().to_owned(),
            message: super::init::error_chain(&e),
        },
    };
    let mut line = vec![OUTCOME_MARK];
    line.extend(serde_json::to_vec(&outcome).unwrap_or_default());
    line.push(b'\n');
    let _ = report.write_all(&line);
    // SAFETY: _exit ends the child immediately; always safe.
    unsafe { libc::_exit(0) }
}

/// The builtin itself, confined inside the sandbox.
fn run(builtin: &Builtin) -> Result<Summary, TransferError> {
    let root = rustix::fs::open(
        "/",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| TransferError::DestinationParent {
        path: "/".into(),
        source: e.into(),
    })?;
    match builtin {
        Builtin::Unpack { dest, single } => {
            let dest =
                resolve_destination(root.as_fd(), dest.as_bytes(), Resolution::InRoot, *single)?;
            // SAFETY: fd 0 is the data pipe the daemon gave the helper; nothing else in this
            // process uses it.
            let stdin = unsafe { fs::File::from_raw_fd(0) };
            let mut framed = FramedReader::new(BufReader::with_capacity(PIPE_BUFFER, stdin));
            match unpack(&mut framed, &dest, *single) {
                Ok(summary) => {
                    framed
                        .drain()
                        .map_err(|source| TransferError::ReadArchive { source })?;
                    Ok(summary)
                }
                Err(_) if framed.cut => Err(TransferError::ReadArchive {
                    source: cut_stream(),
                }),
                Err(e) => Err(e),
            }
        }
        Builtin::Pack { src } => {
            let source = resolve_source(root.as_fd(), src.as_bytes(), Resolution::InRoot)?;
            // SAFETY: fd 1 is the data pipe the daemon gave the helper; nothing else in this
            // process uses it.
            let stdout = unsafe { fs::File::from_raw_fd(1) };
            pack(&source, BufWriter::with_capacity(PIPE_BUFFER, stdout))
        }
    }
}

fn cut_stream() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the stream ended before its end marker (the transfer was aborted)",
    )
}

/// Reads the framed stream the daemon writes into an unpack's stdin (see the module docs).
#[derive(Debug)]
pub struct FramedReader<R> {
    inner: R,
    /// Bytes left in the current frame.
    left: usize,
    /// The end marker was read.
    ended: bool,
    /// The stream ended without its end marker.
    cut: bool,
}

impl<R: Read> FramedReader<R> {
    /// A reader of the frames of `inner`.
    pub fn new(inner: R) -> Self {
        FramedReader {
            inner,
            left: 0,
            ended: false,
            cut: false,
        }
    }

    /// Reads and drops what is left up to the end marker (the padding after a tar's end).
    ///
    /// Errors: `UnexpectedEof` when the stream ends without its marker.
    pub fn drain(&mut self) -> io::Result<()> {
        let mut scratch = [0u8; 8192];
        while self.read(&mut scratch)? > 0 {}
        Ok(())
    }

    fn fail(&mut self) -> io::Error {
        self.cut = true;
        cut_stream()
    }
}

impl<R: Read> Read for FramedReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.ended || buf.is_empty() {
            return Ok(0);
        }
        if self.cut {
            return Err(cut_stream());
        }
        while self.left == 0 {
            let mut len = [0u8; 4];
            match self.inner.read_exact(&mut len) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(self.fail()),
                Err(e) => return Err(e),
            }
            self.left = u32::from_le_bytes(len) as usize;
            if self.left == 0 {
                self.ended = true;
                return Ok(0);
            }
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(self.fail());
        }
        self.left -= n;
        Ok(n)
    }
}

/// How the parent's wait ended.
enum Waited {
    /// The report pipe closed, or the outcome line is complete.
    Reported,
    TimedOut,
    Aborted,
}

/// In the parent: waits for the child's report (see the module docs), kills the child when
/// the timeout passes or the daemon aborts, reaps it, and returns the status line.
pub(super) fn parent(
    entry: &Entry,
    child: Pid,
    report: OwnedFd,
    timeout_ms: Option<u64>,
    args: &Args<'_>,
) -> Result<String, ExecHelperError> {
    // SAFETY: closing our stdin and stdout, the data pipe's ends the child holds too; no Rust
    // object owns them here (the helper never wraps fd 0 or 1), and std treats a closed stdout
    // as a sink.
    unsafe {
        libc::close(0);
        libc::close(1);
    }
    let control = args
        .one("--control-fd")
        .and_then(|s| s.parse::<i32>().ok())
        // SAFETY: the daemon passes this descriptor (dup2'ed before exec) and nothing else in
        // this process owns it.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
    let deadline = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
    let mut bytes = Vec::new();
    let waited = wait_report(&report, control.as_ref(), deadline, &mut bytes)?;
    let killer = Report::ns_pid(&bytes).map(|ns_pid| Killer {
        cgroup_procs: &entry.cgroup_procs,
        ns_pid,
        host_pid: child,
    });
    let pidfd = sys::pidfd_open(child.as_raw())?;
    let mut exited = matches!(waited, Waited::Reported)
        && sys::pidfd_wait(pidfd.as_fd(), Some(KILL_GRACE.as_millis() as u64))?;
    if !exited {
        match &killer {
            Some(k) => k.kill(),
            None => {
                let _ = kill(child, Signal::SIGKILL);
            }
        }
        exited = sys::pidfd_wait(pidfd.as_fd(), Some(KILL_GRACE.as_millis() as u64))?;
    }
    let signal = if exited {
        match waitpid(child, Some(WaitPidFlag::__WALL)) {
            Ok(WaitStatus::Signaled(_, sig, _)) => Some(sig as i32),
            _ => None,
        }
    } else {
        Some(libc::SIGKILL)
    };
    let rest = bytes.get(4..).unwrap_or_default();
    let (outcome, start_error) = match rest.split_first() {
        Some((&OUTCOME_MARK, json)) => (
            serde_json::from_slice::<Outcome>(json.trim_ascii_end()).ok(),
            None,
        ),
        Some(_) => (None, Some(String::from_utf8_lossy(rest).into_owned())),
        None => (None, None),
    };
    let status = BuiltinStatus {
        outcome,
        start_error,
        timed_out: matches!(waited, Waited::TimedOut),
        aborted: matches!(waited, Waited::Aborted),
        signal,
    };
    Ok(format!(
        "transfer={}\n",
        serde_json::to_string(&status).unwrap_or_default()
    ))
}

/// Reads the report pipe into `bytes` until it closes or holds a whole outcome line, the
/// control pipe hangs up, or `deadline` passes.
fn wait_report(
    report: &OwnedFd,
    control: Option<&OwnedFd>,
    deadline: Option<Instant>,
    bytes: &mut Vec<u8>,
) -> Result<Waited, ExecHelperError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut chunk = [0u8; 4096];
    loop {
        if bytes.len() > 4 && bytes[4] == OUTCOME_MARK && bytes.ends_with(b"\n") {
            return Ok(Waited::Reported);
        }
        let timeout = match deadline {
            None => PollTimeout::NONE,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok(Waited::TimedOut);
                }
                PollTimeout::try_from(left.as_millis().clamp(1, i32::MAX as u128) as i32)
                    .unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = vec![PollFd::new(report.as_fd(), PollFlags::POLLIN)];
        if let Some(c) = control {
            fds.push(PollFd::new(c.as_fd(), PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(SyscallError::new("poll", "transfer report", e).into()),
        }
        let aborted = fds
            .get(1)
            .and_then(PollFd::revents)
            .is_some_and(|r| !r.is_empty());
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            match rustix::io::read(report, &mut chunk) {
                Ok(0) => return Ok(Waited::Reported),
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                Err(rustix::io::Errno::INTR | rustix::io::Errno::AGAIN) => {}
                Err(e) => return Err(SyscallError::io("read", "transfer report", e.into()).into()),
            }
        } else if aborted {
            return Ok(Waited::Aborted);
        }
    }
}

/// Parses the helper's status line for a builtin; `Err` holds the helper's error message.
pub fn parse_status(line: &str) -> Result<BuiltinStatus, String> {
    let line = line.trim();
    if let Some(err) = line.strip_prefix("error=") {
        return Err(err.to_string());
    }
    let Some(json) = line.strip_prefix("transfer=") else {
        return Err(format!("no status from the transfer helper ({line:?})"));
    };
    serde_json::from_str(json).map_err(|e| format!("bad status from the transfer helper: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&[u8]], end: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for p in parts {
            out.extend((p.len() as u32).to_le_bytes());
            out.extend_from_slice(p);
        }
        if end {
            out.extend(0u32.to_le_bytes());
        }
        out
    }

    #[test]
    fn framed_streams_end_only_at_their_marker() {
        let data = frames(&[b"hello ", b"world"], true);
        let mut r = FramedReader::new(data.as_slice());
        let mut got = String::new();
        r.read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello world");
        assert!(r.ended && !r.cut);

        let cut = frames(&[b"hello"], false);
        let mut r = FramedReader::new(cut.as_slice());
        let mut got = Vec::new();
        let err = r.read_to_end(&mut got).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(r.cut);

        let mid = &frames(&[b"hello"], true)[..6];
        let mut r = FramedReader::new(mid);
        assert!(r.drain().is_err());
    }

    #[test]
    fn status_lines_round_trip() {
        let status = BuiltinStatus {
            outcome: Some(Outcome::Failed {
                class: "no_space".into(),
                message: "no space left while writing \"x\"".into(),
            }),
            timed_out: true,
            ..Default::default()
        };
        let line = format!("transfer={}\n", serde_json::to_string(&status).unwrap());
        assert_eq!(parse_status(&line), Ok(status));
        assert_eq!(parse_status("error=boom"), Err("boom".into()));
        assert!(parse_status("exit=0").is_err());
    }
}
