//! Socket I/O against a deadline: waiting for the next request and writing a reply (frames are
//! read against theirs by `transport::wire`), each bounded in time however slowly the peer acts.
//!
//! The socket stays in blocking mode; every call here uses `MSG_DONTWAIT` and waits with
//! `poll(2)` for the time left, so one slow peer can hold a connection thread for at most the
//! timeout that applies, not forever.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{send, MsgFlags};

/// The error of an operation whose deadline passed (`io::ErrorKind::TimedOut`).
pub(crate) fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "deadline passed")
}

/// Waits until `stream` has something to read (data, end of stream or an error) for at most
/// `timeout`; `Ok(false)` when the time ran out.
///
/// Errors: the errno of `poll`.
pub(crate) fn wait_readable(stream: &UnixStream, timeout: Duration) -> io::Result<bool> {
    let deadline = Instant::now() + timeout;
    wait(stream, PollFlags::POLLIN, deadline)
}

/// Polls `stream` for `events` until `deadline`; `Ok(false)` when it passed first.
fn wait(stream: &UnixStream, events: PollFlags, deadline: Instant) -> io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(false);
        }
        let mut fds = [PollFd::new(stream.as_fd(), events)];
        match poll(&mut fds, poll_timeout(left)) {
            Ok(0) => continue,
            Ok(_) => return Ok(true),
            Err(Errno::EINTR) => continue,
            Err(errno) => return Err(errno.into()),
        }
    }
}

/// `left` as a poll timeout in whole milliseconds, rounded up (so a wait never ends before the
/// deadline and never spins on a zero timeout), at most `i32::MAX` ms.
fn poll_timeout(left: Duration) -> PollTimeout {
    let ms = left.as_micros().div_ceil(1000);
    PollTimeout::try_from(i32::try_from(ms).unwrap_or(i32::MAX)).unwrap_or(PollTimeout::MAX)
}

/// Writes all of `bytes` to `stream` by `deadline` (`MSG_NOSIGNAL`: a gone peer is `EPIPE`,
/// never `SIGPIPE`).
///
/// Errors: `TimedOut` when the peer did not take the bytes in time (some may have been
/// written), the errno of `send` or `poll` otherwise.
pub(crate) fn write_all_by(stream: &UnixStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        match send(
            stream.as_raw_fd(),
            &bytes[written..],
            MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(n) => written += n,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => {
                if !wait(stream, PollFlags::POLLOUT, deadline)? {
                    return Err(timed_out());
                }
            }
            Err(errno) => return Err(errno.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn writing_to_a_peer_that_never_reads_times_out() {
        let (a, _b) = UnixStream::pair().unwrap();
        let big = vec![0u8; 64 << 20];
        let started = Instant::now();
        let err = write_all_by(&a, &big, Instant::now() + Duration::from_millis(100)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn poll_timeouts_round_up() {
        assert_eq!(
            poll_timeout(Duration::from_micros(1)),
            PollTimeout::from(1u8)
        );
        assert_eq!(
            poll_timeout(Duration::from_millis(7)),
            PollTimeout::from(7u8)
        );
        assert_eq!(
            poll_timeout(Duration::from_secs(u64::MAX)),
            PollTimeout::MAX
        );
    }
}
