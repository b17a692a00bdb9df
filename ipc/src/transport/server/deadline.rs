//! Socket I/O against a deadline: waiting for the next request, reading a frame and writing a
//! reply, each bounded in time however slowly (or never) the peer reads or writes.
//!
//! The socket stays in blocking mode; every call here uses `MSG_DONTWAIT` and waits with
//! `poll(2)` for the time left, so one slow peer can hold a connection thread for at most the
//! timeout that applies, not forever.

use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{recv, send, MsgFlags};

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

/// A [`Read`] over a connection that fails with `TimedOut` once its deadline passed; without a
/// deadline it blocks like the socket.
#[derive(Debug)]
pub(crate) struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Option<Instant>,
}

impl<'a> DeadlineReader<'a> {
    /// A reader over `stream` with no deadline yet.
    pub(crate) fn new(stream: &'a UnixStream) -> DeadlineReader<'a> {
        DeadlineReader {
            stream,
            deadline: None,
        }
    }

    /// Sets the instant after which reads fail.
    pub(crate) fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = Some(deadline);
    }
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(deadline) = self.deadline else {
            return (&mut &*self.stream).read(buf);
        };
        loop {
            match recv(self.stream.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
                Ok(n) => return Ok(n),
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => {
                    if !wait(self.stream, PollFlags::POLLIN, deadline)? {
                        return Err(timed_out());
                    }
                }
                Err(errno) => return Err(errno.into()),
            }
        }
    }
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
    use std::io::Write;

    use super::*;

    #[test]
    fn a_read_past_its_deadline_times_out_and_data_in_time_is_read() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut reader = DeadlineReader::new(&a);
        reader.set_deadline(Instant::now() + Duration::from_millis(50));
        let started = Instant::now();
        let mut buf = [0u8; 4];
        let err = reader.read(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(50));
        b.write_all(b"hi").unwrap();
        reader.set_deadline(Instant::now() + Duration::from_secs(5));
        assert_eq!(reader.read(&mut buf).unwrap(), 2);
        assert!(!wait_readable(&a, Duration::from_millis(10)).unwrap());
        drop(b);
        assert!(wait_readable(&a, Duration::from_secs(5)).unwrap());
    }

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
