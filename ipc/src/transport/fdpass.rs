//! Passing file descriptors over a Unix stream socket (`SCM_RIGHTS`).
//!
//! The descriptors ride on the first byte of a message: [`send_with_fds`] sends the bytes with
//! the descriptors attached, and a [`recv_with_fds`] whose read covers that byte receives them.
//! The kernel never merges the descriptors of two messages into one read.

use std::io::{IoSlice, IoSliceMut, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::cmsg_space;
use nix::errno::Errno;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// Most descriptors one message may carry (the kernel's `SCM_MAX_FD`).
pub const MAX_FDS_PER_MESSAGE: usize = 253;

/// Why descriptors could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum FdPassError {
    /// Descriptors need at least one byte of data to ride on.
    #[error("a message carrying {fds} fds must hold at least one byte")]
    EmptyMessage {
        /// Number of descriptors that were to be sent.
        fds: usize,
    },
    /// More descriptors than one message may carry.
    #[error("{fds} fds exceed the {MAX_FDS_PER_MESSAGE} one message may carry")]
    TooManyFds {
        /// Number of descriptors that were to be sent.
        fds: usize,
    },
    /// `sendmsg(2)` failed.
    #[error("sendmsg(SCM_RIGHTS) failed")]
    Sendmsg {
        /// The errno.
        #[source]
        source: Errno,
    },
    /// Writing the rest of the message after the descriptors failed.
    #[error("sending the remaining {remaining} bytes after the fds failed")]
    SendRest {
        /// Bytes left to send.
        remaining: usize,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `recvmsg(2)` failed (`ENOBUFS`: the control data was truncated).
    #[error("recvmsg(SCM_RIGHTS) failed")]
    Recvmsg {
        /// The errno.
        #[source]
        source: Errno,
    },
    /// The peer sent more descriptors than the receiver accepts; all of them were closed.
    #[error("peer sent {got} fds, more than the {max_fds} accepted; they were closed")]
    TooManyReceived {
        /// Number received.
        got: usize,
        /// Number accepted.
        max_fds: usize,
    },
}

/// Sends all of `bytes` over the connected Unix stream `socket`, with `fds` attached to the
/// first chunk (`sendmsg` with `SCM_RIGHTS`, `MSG_NOSIGNAL`). The descriptors stay open on
/// this side; the receiver gets duplicates.
///
/// Errors: [`FdPassError::EmptyMessage`] when `fds` is non-empty and `bytes` empty,
/// [`FdPassError::TooManyFds`] beyond [`MAX_FDS_PER_MESSAGE`], [`FdPassError::Sendmsg`],
/// [`FdPassError::SendRest`].
pub fn send_with_fds<S: AsFd>(
    socket: &S,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), FdPassError> {
    if bytes.is_empty() {
        return match fds.len() {
            0 => Ok(()),
            n => Err(FdPassError::EmptyMessage { fds: n }),
        };
    }
    if fds.len() > MAX_FDS_PER_MESSAGE {
        return Err(FdPassError::TooManyFds { fds: fds.len() });
    }
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let socket = socket.as_fd();
    let sent = loop {
        let iov = [IoSlice::new(bytes)];
        let cmsgs = [ControlMessage::ScmRights(&raw)];
        let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsgs };
        match sendmsg::<()>(
            socket.as_raw_fd(),
            &iov,
            cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(sent) => break sent,
            Err(Errno::EINTR) => continue,
            Err(source) => return Err(FdPassError::Sendmsg { source }),
        }
    };
    if sent < bytes.len() {
        let stream = UnixStream::from(socket.try_clone_to_owned().map_err(|source| {
            FdPassError::SendRest {
                remaining: bytes.len() - sent,
                source,
            }
        })?);
        super::NoSigPipe(&stream)
            .write_all(&bytes[sent..])
            .map_err(|source| FdPassError::SendRest {
                remaining: bytes.len() - sent,
                source,
            })?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes from the connected Unix stream `socket`, with the
/// descriptors attached to them (`recvmsg` with `MSG_CMSG_CLOEXEC`, so they are close-on-exec).
/// Returns the number of bytes read (0 at end of stream) and the received descriptors.
///
/// At most `max_fds` descriptors are accepted (capped at [`MAX_FDS_PER_MESSAGE`]): when the
/// peer sends more, every received descriptor is closed and the call fails.
///
/// Errors: [`FdPassError::Recvmsg`], [`FdPassError::TooManyReceived`].
pub fn recv_with_fds<S: AsFd>(
    socket: &S,
    buf: &mut [u8],
    max_fds: usize,
) -> Result<(usize, Vec<OwnedFd>), FdPassError> {
    let max_fds = max_fds.min(MAX_FDS_PER_MESSAGE);
    // Room for the most a sender can attach, so the kernel never truncates the control data
    // (which would leave descriptors installed here that the truncated header cannot name).
    let mut space = cmsg_space!([RawFd; MAX_FDS_PER_MESSAGE]);
    let socket = socket.as_fd();
    loop {
        let mut iov = [IoSliceMut::new(buf)];
        let msg = match recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(Errno::EINTR) => continue,
            Err(source) => return Err(FdPassError::Recvmsg { source }),
        };
        let mut fds = Vec::new();
        for cmsg in msg
            .cmsgs()
            .map_err(|source| FdPassError::Recvmsg { source })?
        {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                for fd in raw {
                    // SAFETY: the kernel has just installed `fd` in this process's descriptor
                    // table for this message (SCM_RIGHTS); nothing else refers to it yet, so
                    // the OwnedFd becomes its only owner.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if fds.len() > max_fds {
            return Err(FdPassError::TooManyReceived {
                got: fds.len(),
                max_fds,
            });
        }
        return Ok((msg.bytes, fds));
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{Read, Seek, SeekFrom};

    use super::*;

    #[test]
    fn empty_and_oversized_sends_are_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let fd = a.as_fd();
        assert!(matches!(
            send_with_fds(&a, b"", &[fd]),
            Err(FdPassError::EmptyMessage { fds: 1 })
        ));
        let many = vec![fd; MAX_FDS_PER_MESSAGE + 1];
        assert!(matches!(
            send_with_fds(&a, b"x", &many),
            Err(FdPassError::TooManyFds { fds: 254 })
        ));
        send_with_fds(&a, b"", &[]).unwrap();
    }

    #[test]
    fn plain_bytes_pass_without_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(&a, b"plain", &[]).unwrap();
        let mut buf = [0u8; 16];
        let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
        assert_eq!(&buf[..n], b"plain");
        assert!(fds.is_empty());
    }

    #[test]
    fn a_file_passes_and_is_cloexec() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"through the socket").unwrap();
        send_with_fds(&a, b"f", &[file.as_fd()]).unwrap();
        let mut buf = [0u8; 1];
        let (n, mut fds) = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert_eq!((n, fds.len()), (1, 1));
        let flags = nix::fcntl::fcntl(&fds[0], nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
        let mut received = File::from(fds.remove(0));
        received.seek(SeekFrom::Start(0)).unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "through the socket");
    }
}
