//! Unix-socket transport: the [`Server`] (with its [`ConnectionLimits`]) and its [`Handler`]
//! seam, the blocking [`Client`], peer credentials and the access policy, SCM_RIGHTS fd
//! passing, and frames with descriptors ([`wire`]).

mod client;
mod creds;
mod fdpass;
mod server;
mod socket;
mod sys;
pub mod wire;

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use nix::sys::socket::{send, MsgFlags};

pub use client::transfer::{DownloadSource, UploadSink};
pub use client::{open_image_source, Client, ClientError, Subscription};
pub use creds::{peer_groups, proc_groups, AccessPolicy, Caller, CredsError, PeerCred};
pub use fdpass::{recv_with_fds, send_with_fds, FdPassError, MAX_FDS_PER_MESSAGE};
pub use server::{chunk_bytes, Chunk, LinkError, TransferLink};
pub use server::{
    ConnectionLimits, Handler, LimitsError, Quota, Server, ServerConfig, ServerError, ServerHandle,
    ShutdownTrigger, DEFAULT_SOCKET_MODE, MAX_REQUEST_FDS,
};
pub use server::{ServerCounts, ServerStats};
pub use socket::{bind_socket, BindError, BoundSocket};
pub use wire::{recv_message, recv_message_by, send_message, WireError};

/// A [`Write`] over a Unix stream that sends with `MSG_NOSIGNAL`, so that writing to a peer that
/// went away returns `EPIPE` instead of raising `SIGPIPE` (which would kill a host process that
/// did not ignore it, e.g. a C program linking this library).
#[derive(Debug)]
pub(crate) struct NoSigPipe<'a>(pub(crate) &'a UnixStream);

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        send(self.0.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL).map_err(io::Error::from)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Whether an I/O error means the peer closed or reset the connection.
pub(crate) fn is_disconnect(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn writing_to_a_closed_peer_returns_epipe_without_a_signal() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let err = NoSigPipe(&a).write_all(b"hello").unwrap_err();
        assert!(is_disconnect(&err), "{err:?}");
    }
}
