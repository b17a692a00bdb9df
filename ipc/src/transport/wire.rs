//! Frames with file descriptors: [`send_message`] and [`recv_message`] move one frame of any
//! message kind over a Unix stream with `SCM_RIGHTS` descriptors on its first byte.
//!
//! Reads never go past the end of the frame (header first, then exactly the payload length),
//! so the descriptors of the next frame stay queued for the next call. Used by the daemon's
//! server (requests may carry a descriptor, e.g. an image source) and by the memory protocol
//! (attach responses carry region descriptors).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::{recv_with_fds, send_with_fds, FdPassError};
use crate::frame::{decode_frame, encode_frame, FrameError, Header, Message, HEADER_LEN};
use crate::message::Envelope;

/// Why a frame with descriptors could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Encoding or decoding the frame failed (including a clean close: [`FrameError::Closed`]).
    #[error("framing failed")]
    Frame {
        /// The framing error.
        #[source]
        source: FrameError,
    },
    /// `sendmsg`/`recvmsg` with descriptors failed.
    #[error("passing descriptors failed")]
    FdPass {
        /// The fd-passing error.
        #[source]
        source: FdPassError,
    },
}

impl WireError {
    /// Whether this is the peer closing the connection (cleanly or by reset) rather than a
    /// malformed frame.
    pub fn is_disconnect(&self) -> bool {
        match self {
            WireError::Frame {
                source: FrameError::Closed,
            } => true,
            WireError::FdPass {
                source: FdPassError::Recvmsg { source },
            } => matches!(
                *source,
                nix::errno::Errno::ECONNRESET | nix::errno::Errno::EPIPE
            ),
            WireError::FdPass {
                source: FdPassError::Sendmsg { source },
            } => matches!(
                *source,
                nix::errno::Errno::ECONNRESET | nix::errno::Errno::EPIPE
            ),
            _ => false,
        }
    }
}

/// Encodes `Envelope { id, body }` and sends it over `socket` with `fds` attached to its first
/// byte (at most [`MAX_FDS_PER_MESSAGE`]).
///
/// Errors: [`WireError::Frame`] (encoding, over `max_frame`), [`WireError::FdPass`].
pub fn send_message<M: Message, S: AsFd>(
    socket: &S,
    id: u64,
    body: M,
    fds: &[BorrowedFd<'_>],
    max_frame: u32,
) -> Result<(), WireError> {
    let frame = encode_frame(&Envelope { id, body }, max_frame)
        .map_err(|source| WireError::Frame { source })?;
    send_with_fds(socket, &frame, fds).map_err(|source| WireError::FdPass { source })
}

/// Reads exactly one frame of kind `M::KIND` from `socket`, with the descriptors attached to it
/// (at most `max_fds`; more close them all and fail). Reads never go past the end of the frame,
/// so the descriptors of the next frame stay queued.
///
/// Errors: [`WireError::Frame`] with [`FrameError::Closed`] at a clean end of stream before
/// the frame, `Truncated` mid-frame, or any header, CRC or decoding error;
/// [`WireError::FdPass`].
pub fn recv_message<M: Message, S: AsFd>(
    socket: &S,
    max_frame: u32,
    max_fds: usize,
) -> Result<(Envelope<M>, Vec<OwnedFd>), WireError> {
    recv_message_by(socket, max_frame, max_fds, None)
}

/// [`recv_message`] that must complete by `deadline` (the whole frame, however its bytes are
/// spread): past it, [`WireError::Frame`] with [`FrameError::Read`] of kind `TimedOut`.
pub fn recv_message_by<M: Message, S: AsFd>(
    socket: &S,
    max_frame: u32,
    max_fds: usize,
    deadline: Option<std::time::Instant>,
) -> Result<(Envelope<M>, Vec<OwnedFd>), WireError> {
    let mut fds = Vec::new();
    let mut frame = vec![0u8; HEADER_LEN];
    let got = fill(socket, &mut frame, max_fds, &mut fds, deadline)?;
    if got < HEADER_LEN {
        frame.truncate(got);
        return Err(decode_error::<M>(&frame, max_frame));
    }
    let mut header = [0u8; HEADER_LEN];
    header.copy_from_slice(&frame);
    let parsed = Header::parse(&header, max_frame).map_err(|source| WireError::Frame { source })?;
    frame.resize(HEADER_LEN + parsed.len as usize, 0);
    let got = fill(
        socket,
        &mut frame[HEADER_LEN..],
        max_fds,
        &mut fds,
        deadline,
    )?;
    frame.truncate(HEADER_LEN + got);
    let (envelope, _) =
        decode_frame::<M>(&frame, max_frame).map_err(|source| WireError::Frame { source })?;
    Ok((envelope, fds))
}

/// Waits until `socket` has data (or its peer hung up) or `deadline` passes.
fn wait_until_readable(
    socket: BorrowedFd<'_>,
    deadline: std::time::Instant,
) -> Result<(), WireError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let timed_out = || WireError::Frame {
        source: FrameError::Read {
            source: io::Error::from(io::ErrorKind::TimedOut),
        },
    };
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
        let mut fd = [PollFd::new(socket, PollFlags::POLLIN)];
        match poll(&mut fd, PollTimeout::from(ms)) {
            Ok(0) => continue,
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                return Err(WireError::Frame {
                    source: FrameError::Read {
                        source: io::Error::from(e),
                    },
                })
            }
        }
    }
}

/// The error `decode_frame` gives for an incomplete frame (Closed or Truncated).
fn decode_error<M: Message>(partial: &[u8], max_frame: u32) -> WireError {
    let source = match decode_frame::<M>(partial, max_frame) {
        Err(source) => source,
        Ok(_) => FrameError::Closed,
    };
    WireError::Frame { source }
}

/// Reads until `buf` is full or the stream ends, collecting descriptors; returns bytes read.
fn fill<S: AsFd>(
    socket: &S,
    buf: &mut [u8],
    max_fds: usize,
    fds: &mut Vec<OwnedFd>,
    deadline: Option<std::time::Instant>,
) -> Result<usize, WireError> {
    let mut filled = 0;
    while filled < buf.len() {
        if let Some(deadline) = deadline {
            wait_until_readable(socket.as_fd(), deadline)?;
        }
        let room = max_fds.saturating_sub(fds.len());
        match recv_with_fds(socket, &mut buf[filled..], room) {
            Ok((0, _)) => break,
            Ok((n, more)) => {
                filled += n;
                fds.extend(more);
            }
            Err(FdPassError::Recvmsg {
                source: nix::errno::Errno::EAGAIN,
            }) => {
                return Err(WireError::Frame {
                    source: FrameError::Read {
                        source: io::Error::from(io::ErrorKind::WouldBlock),
                    },
                })
            }
            Err(source) => return Err(WireError::FdPass { source }),
        }
    }
    Ok(filled)
}
