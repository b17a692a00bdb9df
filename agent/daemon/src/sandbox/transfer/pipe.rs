//! The daemon's side of the pipes to a transfer's helper: creating them, waiting on them with
//! a bound, and the framed stream an unpacking helper reads
//! ([`crate::helper::transfer::FramedReader`]).

use std::fs;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use super::{Run, TransferError};
use crate::sys::SyscallError;

/// Pipe buffer asked for between the daemon and the helper, bytes.
const PIPE_BYTES: usize = 1 << 20;

/// What [`hung_up_first`] saw first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Finished {
    /// The helper's status line (or its end) is readable.
    Status,
    /// The client hung up or sent something.
    Peer,
    /// Neither within the wait.
    TimedOut,
}

/// Waits at most `wait` until `status` is readable (the helper's status line, or its end) or
/// the client behind `peer` hangs up or sends anything (a well-behaved one sends nothing but a
/// `TransferCancel` while it waits for the answer: both abort). (`POLLIN`, not `POLLRDHUP`:
/// `nix` reports no `revents` for the latter.)
pub(super) fn hung_up_first(
    peer: BorrowedFd<'_>,
    status: &fs::File,
    wait: std::time::Duration,
) -> Result<Finished, TransferError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let deadline = std::time::Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [
            PollFd::new(status.as_fd(), PollFlags::POLLIN),
            PollFd::new(peer, PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(SyscallError::new("poll", "transfer status", e).into()),
        }
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            return Ok(Finished::Status);
        }
        if fds[1].revents().is_some_and(|r| !r.is_empty()) {
            return Ok(Finished::Peer);
        }
        if left.is_zero() {
            return Ok(Finished::TimedOut);
        }
    }
}

pub(super) fn data_pipe() -> Result<(OwnedFd, OwnedFd), TransferError> {
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| SyscallError::io("pipe2", "transfer data", e.into()))?;
    // A bigger pipe means fewer wakeups; the default stays if the kernel refuses.
    let _ = rustix::pipe::fcntl_setpipe_size(&wr, PIPE_BYTES);
    Ok((rd, wr))
}

pub(super) fn nonblocking(fd: &OwnedFd) -> Result<(), TransferError> {
    rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::NONBLOCK)
        .map_err(|e| SyscallError::io("fcntl(F_SETFL)", "transfer pipe", e.into()).into())
}

/// Waits until `fd` is ready for `events` for at most `wait`; `false` when the time ran out.
pub(super) fn ready(
    fd: &OwnedFd,
    events: nix::poll::PollFlags,
    wait: Duration,
) -> Result<bool, TransferError> {
    use nix::poll::{poll, PollFd, PollTimeout};
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let timeout = PollTimeout::try_from(left.as_millis().clamp(1, i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(fd.as_fd(), events)];
        match poll(&mut fds, timeout) {
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(SyscallError::new("poll", "transfer pipe", e).into()),
        }
    }
}

/// How writing into the helper's pipe ended.
pub(super) enum Fed {
    Ok,
    /// The helper closed its end (it finished or failed): the rest is drained.
    Closed,
    /// No progress in time (`true`: the transfer's deadline).
    Stalled(bool),
}

/// Writes one frame (4-byte little-endian length, then `data`) into the helper's pipe.
pub(super) fn feed(run: &Run, pipe: &OwnedFd, data: &[u8]) -> Result<Fed, TransferError> {
    let len = (data.len() as u32).to_le_bytes();
    for part in [&len[..], data] {
        let mut done = 0;
        while done < part.len() {
            match rustix::io::write(pipe, &part[done..]) {
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    let (wait, by_deadline) = run.wait();
                    if !ready(pipe, nix::poll::PollFlags::POLLOUT, wait)? {
                        return Ok(Fed::Stalled(by_deadline));
                    }
                }
                Err(Errno::PIPE) => return Ok(Fed::Closed),
                Err(e) => return Err(SyscallError::io("write", "transfer pipe", e.into()).into()),
            }
        }
    }
    Ok(Fed::Ok)
}
