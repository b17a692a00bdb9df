//! The server side of a streaming transfer ([`Request::Upload`], [`Request::Download`]): the
//! [`TransferLink`] a [`Handler::transfer`](super::Handler::transfer) reads upload chunks from
//! and writes download chunks to, each bounded by the server's timeouts.
//!
//! The exchange stays on the connection's thread: upload chunks are requests with the
//! transfer's id, download chunks responses with it; the handler's return value is the final
//! response. A client that goes away, stalls past the timeouts or sends anything else than
//! what the transfer expects breaks the link: the handler sees a [`LinkError`] and stops (it
//! kills its helper), and the server closes the connection instead of answering.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::config::ConnectionLimits;
use super::deadline::{wait_readable, write_all_by};
use crate::frame::{encode_frame, FrameError};
use crate::message::{Envelope, Request, Response};
use crate::transport::wire::{recv_message_by, WireError};

/// The largest chunk of a transfer: 1 MiB, and at most a quarter of the frame limit.
pub fn chunk_bytes(max_frame: u32) -> usize {
    (1usize << 20).min(max_frame as usize / 4).max(1)
}

/// One piece of an upload.
#[derive(Debug, PartialEq, Eq)]
pub enum Chunk {
    /// Bytes of the stream (never empty).
    Data(Vec<u8>),
    /// The client ended the stream.
    End,
}

/// Why a transfer's link cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The client sent [`Request::TransferCancel`].
    #[error("the client cancelled the transfer")]
    Cancelled,
    /// The client closed or reset the connection.
    #[error("the client went away")]
    Gone,
    /// The client sent no chunk for the idle timeout, or a chunk frame took longer than the
    /// frame timeout.
    #[error("the client sent nothing for {ms} ms")]
    Stalled {
        /// The timeout that passed, milliseconds.
        ms: u64,
    },
    /// The transfer's own deadline passed while waiting for the client.
    #[error("the transfer's deadline passed while waiting for the next chunk")]
    Deadline,
    /// The client did not read a download chunk within the send timeout.
    #[error("the client did not read a chunk within {ms} ms")]
    SendTimeout {
        /// The send timeout, milliseconds.
        ms: u64,
    },
    /// The client sent something the transfer does not expect (another request, a chunk over
    /// the size, a frame with another id or with descriptors).
    #[error("the client sent {got} during the transfer")]
    Unexpected {
        /// What it sent.
        got: String,
    },
}

/// The connection of a transfer in progress (see the module docs).
#[derive(Debug)]
pub struct TransferLink<'a> {
    stream: &'a UnixStream,
    id: u64,
    max_frame: u32,
    limits: ConnectionLimits,
    /// The final response cannot be written (the client is gone or out of step).
    broken: bool,
    /// The final response is written, then the connection closed.
    close_after: bool,
}

impl<'a> TransferLink<'a> {
    pub(crate) fn new(
        stream: &'a UnixStream,
        id: u64,
        max_frame: u32,
        limits: ConnectionLimits,
    ) -> Self {
        TransferLink {
            stream,
            id,
            max_frame,
            limits,
            broken: false,
            close_after: false,
        }
    }

    /// The largest chunk this link carries, bytes ([`chunk_bytes`] of the frame limit).
    pub fn chunk_bytes(&self) -> usize {
        chunk_bytes(self.max_frame)
    }

    /// The client's socket, for a handler that waits on something else (its helper) and
    /// wants to notice the client hanging up meanwhile (`POLLRDHUP`). Reading or writing it
    /// directly would break the exchange.
    pub fn peer_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.stream.as_fd()
    }

    /// Whether the final response can still be written.
    pub(crate) fn usable(&self) -> bool {
        !self.broken
    }

    /// Whether the connection closes after the final response.
    pub(crate) fn close_after(&self) -> bool {
        self.close_after
    }

    fn fail(&mut self, err: LinkError) -> LinkError {
        match err {
            LinkError::Cancelled => {}
            LinkError::Deadline | LinkError::Unexpected { .. } => self.close_after = true,
            LinkError::Gone | LinkError::Stalled { .. } | LinkError::SendTimeout { .. } => {
                self.broken = true
            }
        }
        err
    }

    fn send(&mut self, response: Response) -> Result<(), LinkError> {
        let frame = encode_frame(
            &Envelope {
                id: self.id,
                body: response,
            },
            self.max_frame,
        )
        .map_err(|e| LinkError::Unexpected {
            got: format!("a chunk the frame limit refuses ({e})"),
        });
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Err(self.fail(e)),
        };
        let send_timeout = self.limits.send_timeout;
        match write_all_by(self.stream, &frame, Instant::now() + send_timeout) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                Err(self.fail(LinkError::SendTimeout {
                    ms: send_timeout.as_millis() as u64,
                }))
            }
            Err(_) => Err(self.fail(LinkError::Gone)),
        }
    }

    /// Tells an uploading client to send its stream ([`Response::TransferReady`]).
    ///
    /// Errors: [`LinkError::Gone`], [`LinkError::SendTimeout`].
    pub fn ready(&mut self) -> Result<(), LinkError> {
        let chunk_bytes = u32::try_from(self.chunk_bytes()).unwrap_or(u32::MAX);
        self.send(Response::TransferReady { chunk_bytes })
    }

    /// Reads the next upload chunk: waits for it up to the idle timeout (and `deadline`, when
    /// given), then reads its frame within the frame timeout.
    ///
    /// Errors: every [`LinkError`] but `SendTimeout`.
    pub fn recv_chunk(&mut self, deadline: Option<Instant>) -> Result<Chunk, LinkError> {
        let idle = self.limits.idle_timeout;
        let wait = match deadline {
            Some(d) => idle.min(d.saturating_duration_since(Instant::now())),
            None => idle,
        };
        match wait_readable(self.stream, wait) {
            Ok(true) => {}
            Ok(false) if deadline.is_some_and(|d| Instant::now() >= d) => {
                return Err(self.fail(LinkError::Deadline))
            }
            Ok(false) => {
                return Err(self.fail(LinkError::Stalled {
                    ms: idle.as_millis() as u64,
                }))
            }
            Err(_) => return Err(self.fail(LinkError::Gone)),
        }
        match self.read_request()? {
            Request::UploadChunk { data } if data.is_empty() => Ok(Chunk::End),
            Request::UploadChunk { data } if data.len() <= self.chunk_bytes() => {
                Ok(Chunk::Data(data))
            }
            Request::UploadChunk { data } => Err(self.fail(LinkError::Unexpected {
                got: format!(
                    "a chunk of {} bytes (at most {})",
                    data.len(),
                    self.chunk_bytes()
                ),
            })),
            Request::TransferCancel => Err(self.fail(LinkError::Cancelled)),
            other => Err(self.fail(LinkError::Unexpected {
                got: format!("{other:?}").chars().take(64).collect(),
            })),
        }
    }

    /// Reads one request frame of this transfer within the frame timeout.
    fn read_request(&mut self) -> Result<Request, LinkError> {
        let deadline = Instant::now() + self.limits.frame_timeout;
        match recv_message_by::<Request, _>(self.stream, self.max_frame, 0, Some(deadline)) {
            Ok((envelope, _)) if envelope.id == self.id => Ok(envelope.body),
            Ok((envelope, _)) => Err(self.fail(LinkError::Unexpected {
                got: format!(
                    "a frame with id {} (the transfer's is {})",
                    envelope.id, self.id
                ),
            })),
            Err(WireError::Frame {
                source: FrameError::Read { source },
            }) if source.kind() == std::io::ErrorKind::TimedOut => {
                Err(self.fail(LinkError::Stalled {
                    ms: self.limits.frame_timeout.as_millis() as u64,
                }))
            }
            Err(err) if err.is_disconnect() => Err(self.fail(LinkError::Gone)),
            Err(WireError::Frame {
                source: FrameError::Closed | FrameError::Truncated { .. },
            }) => Err(self.fail(LinkError::Gone)),
            Err(err) => Err(self.fail(LinkError::Unexpected {
                got: format!("a bad frame ({})", crate::error_chain(&err)),
            })),
        }
    }

    /// Writes one download chunk (at most [`chunk_bytes`](Self::chunk_bytes)) within the send
    /// timeout, after checking that the client has not cancelled.
    ///
    /// Errors: [`LinkError::Cancelled`], [`LinkError::Gone`], [`LinkError::SendTimeout`],
    /// [`LinkError::Unexpected`].
    pub fn send_chunk(&mut self, data: &[u8]) -> Result<(), LinkError> {
        let mut fds = [PollFd::new(self.stream.as_fd(), PollFlags::POLLIN)];
        if poll(&mut fds, PollTimeout::ZERO).unwrap_or(1) > 0 {
            let request = self.read_request()?;
            return Err(self.fail(match request {
                Request::TransferCancel => LinkError::Cancelled,
                other => LinkError::Unexpected {
                    got: format!("{other:?}").chars().take(64).collect(),
                },
            }));
        }
        self.send(Response::DownloadChunk {
            data: data.to_vec(),
        })
    }
}
