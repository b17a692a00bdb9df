//! The blocking client: one connection, one request at a time; streaming transfers in
//! [`transfer`].

pub(crate) mod transfer;

use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::fdpass::{send_with_fds, FdPassError};
use super::{is_disconnect, NoSigPipe};
use crate::frame::{encode_frame, read_frame, FrameError, DEFAULT_MAX_FRAME};
use crate::message::{Envelope, ErrorCode, Event, Request, Response};

/// Why a call could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting to the socket failed (no server, no permission on the socket file, ...).
    #[error("connecting to {path} failed")]
    Connect {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Setting the read timeout failed.
    #[error("setting the read timeout failed")]
    SetTimeout {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The request could not be encoded or written.
    #[error("sending request {id} failed")]
    Send {
        /// Request id.
        id: u64,
        /// The framing error.
        #[source]
        source: FrameError,
    },
    /// The response could not be read or decoded (including a read timeout).
    #[error("receiving the response to request {id} failed")]
    Receive {
        /// Request id.
        id: u64,
        /// The framing error.
        #[source]
        source: FrameError,
    },
    /// The server answered with another request id than the one asked.
    #[error("response id {got} does not match request id {expected}")]
    IdMismatch {
        /// Id of the request sent.
        expected: u64,
        /// Id of the response received.
        got: u64,
    },
    /// The server closed the connection before answering.
    #[error("the server closed the connection before answering request {id}")]
    ClosedByServer {
        /// Request id.
        id: u64,
    },
    /// An earlier call failed mid-exchange, so the stream may be out of step; reconnect.
    #[error("the connection is unusable after an earlier failed call")]
    Broken,
    /// The server refused to open an event stream.
    #[error("the server refused the event subscription ({code:?}): {message}")]
    SubscribeRefused {
        /// The server's error code.
        code: ErrorCode,
        /// The server's message.
        message: String,
    },
    /// The server answered a subscription with something else than `Subscribed`.
    #[error("unexpected answer to the event subscription: {answer}")]
    SubscribeUnexpected {
        /// The answer, debug-formatted.
        answer: String,
    },
    /// Waiting for the next event failed.
    #[error("poll on the event stream failed")]
    PollEvents {
        /// The errno.
        #[source]
        source: nix::errno::Errno,
    },
    /// Sending the request with its descriptors failed.
    #[error("sending request {id} with its descriptors failed")]
    SendFds {
        /// Request id.
        id: u64,
        /// The fd-passing error.
        #[source]
        source: FdPassError,
    },
    /// The source of an upload failed (reading or packing a host file); the transfer was
    /// cancelled and the connection stays usable.
    #[error("the source of upload {id} failed; the transfer was cancelled")]
    TransferSource {
        /// Request id.
        id: u64,
        /// The source's error.
        #[source]
        source: io::Error,
    },
    /// Consuming a download failed (writing or extracting it on the host); the transfer was
    /// cancelled and the connection stays usable.
    #[error("consuming download {id} failed; the transfer was cancelled")]
    TransferSink {
        /// Request id.
        id: u64,
        /// The consumer's error.
        #[source]
        source: io::Error,
    },
    /// The server answered a transfer out of step (e.g. a download chunk during an upload).
    #[error("unexpected answer during transfer {id}: {answer}")]
    TransferUnexpected {
        /// Request id.
        id: u64,
        /// The answer, debug-formatted (cut).
        answer: String,
    },
    /// An image source could not be opened with this process's rights, or is neither a
    /// directory nor a regular file (see [`open_image_source`]).
    #[error("cannot open image source {path}")]
    OpenSource {
        /// The path as given.
        path: PathBuf,
        /// The cause (`PermissionDenied`, `NotFound`, `InvalidInput` for other file types).
        #[source]
        source: io::Error,
    },
}

/// Opens `path` as an image source with the calling process's own rights, the way
/// [`Client::import_image`] passes it to the daemon: `O_RDONLY | O_CLOEXEC | O_NOCTTY |
/// O_NONBLOCK` (a fifo cannot block the open), following symlinks like any program the user
/// runs. The result must be a directory or a regular file (a tar archive, plain, gzip or
/// zstd).
///
/// Errors: [`ClientError::OpenSource`].
pub fn open_image_source(path: &Path) -> Result<OwnedFd, ClientError> {
    use nix::fcntl::OFlag;
    use nix::sys::stat::{fstat, Mode, SFlag};
    let err = |source: io::Error| ClientError::OpenSource {
        path: path.to_owned(),
        source,
    };
    let fd = nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_CLOEXEC | OFlag::O_NOCTTY | OFlag::O_NONBLOCK,
        Mode::empty(),
    )
    .map_err(|e| err(e.into()))?;
    let kind =
        SFlag::from_bits_truncate(fstat(&fd).map_err(|e| err(e.into()))?.st_mode) & SFlag::S_IFMT;
    if kind != SFlag::S_IFDIR && kind != SFlag::S_IFREG {
        return Err(err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "neither a directory nor a regular file",
        )));
    }
    Ok(fd)
}

/// A blocking connection to a Belayer server.
///
/// Request ids start at 1 and increase by one per call. A connection-level error reply (id 0,
/// e.g. [`ErrorCode::PermissionDenied`](crate::ErrorCode::PermissionDenied) or a
/// `BadRequest` for a bad frame) is returned from [`call`](Client::call) as
/// `Ok(Response::Error(..))`; the server closes the connection after it.
#[derive(Debug)]
pub struct Client {
    stream: UnixStream,
    path: PathBuf,
    next_id: u64,
    max_frame: u32,
    broken: bool,
}

impl Client {
    /// Connects to the server socket at `path`, with the default 16 MiB frame limit and no read
    /// timeout.
    ///
    /// Errors: [`ClientError::Connect`].
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref().to_owned();
        let stream = UnixStream::connect(&path).map_err(|source| ClientError::Connect {
            path: path.clone(),
            source,
        })?;
        Ok(Client {
            stream,
            path,
            next_id: 1,
            max_frame: DEFAULT_MAX_FRAME,
            broken: false,
        })
    }

    /// Sets the largest request payload sent and response payload accepted, bytes.
    pub fn with_max_frame(mut self, max_frame: u32) -> Client {
        self.max_frame = max_frame;
        self
    }

    /// Sets how long [`call`](Client::call) waits for the response (`None`: forever). A call
    /// that times out leaves the client [`Broken`](ClientError::Broken).
    ///
    /// Errors: [`ClientError::SetTimeout`] (e.g. a zero duration).
    pub fn with_read_timeout(self, timeout: Option<Duration>) -> Result<Client, ClientError> {
        self.stream
            .set_read_timeout(timeout)
            .map_err(|source| ClientError::SetTimeout { source })?;
        Ok(self)
    }

    /// The socket path this client connected to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `request` and waits for its response.
    ///
    /// Errors: [`ClientError::Send`], [`ClientError::Receive`], [`ClientError::IdMismatch`],
    /// [`ClientError::ClosedByServer`], [`ClientError::Broken`] after an earlier failure.
    pub fn call(&mut self, request: Request) -> Result<Response, ClientError> {
        self.call_with_fds(request, &[])
    }

    /// Sends `request` with `fds` attached to its frame (`SCM_RIGHTS`; the daemon accepts
    /// at most [`MAX_REQUEST_FDS`](crate::MAX_REQUEST_FDS)) and waits for its response. The
    /// descriptors stay open here; the server gets duplicates.
    ///
    /// Errors: those of [`call`](Client::call), [`ClientError::SendFds`].
    pub fn call_with_fds(
        &mut self,
        request: Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Response, ClientError> {
        let id = self.next_request_id()?;
        let result = self.exchange(id, request, fds);
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    /// Imports the directory or tar archive at `source` as image `name`: opens it here with
    /// this process's rights ([`open_image_source`]) and passes the descriptor with
    /// [`Request::ImportImage`] (`with_fd: true`), so the daemon reads only what this process
    /// may read. The label sent is the absolute path. Answered by `Response::Image` or an
    /// error reply.
    ///
    /// Errors: [`ClientError::OpenSource`], those of [`call_with_fds`](Client::call_with_fds).
    pub fn import_image(&mut self, name: &str, source: &Path) -> Result<Response, ClientError> {
        let fd = open_image_source(source)?;
        let label = std::path::absolute(source).unwrap_or_else(|_| source.to_owned());
        self.call_with_fds(
            Request::ImportImage {
                name: name.to_owned(),
                source: label.display().to_string(),
                with_fd: true,
            },
            &[fd.as_fd()],
        )
    }

    /// Imports an OCI image found by [`crate::oci_source`] (a layout or a docker archive,
    /// opened with this process's rights) as image `name`, passing its layer files as
    /// descriptors with [`Request::ImportOci`]. Answered by `Response::Image` or an error
    /// reply.
    ///
    /// Errors: those of [`call_with_fds`](Client::call_with_fds).
    pub fn import_oci(
        &mut self,
        name: &str,
        source: &crate::oci_source::OciSource,
    ) -> Result<Response, ClientError> {
        let fds: Vec<BorrowedFd<'_>> = source.files.iter().map(AsFd::as_fd).collect();
        self.call_with_fds(
            Request::ImportOci(crate::OciImportRequest {
                name: name.to_owned(),
                source: source.label.clone(),
                manifest: source.manifest.clone(),
                config: source.config.clone(),
                layers: source.layers.clone(),
            }),
            &fds,
        )
    }

    /// Turns this connection into an event stream ([`Request::Subscribe`]).
    ///
    /// Errors: those of [`call`](Client::call), [`ClientError::SubscribeRefused`] when the
    /// server has no event stream or refuses it, [`ClientError::SubscribeUnexpected`].
    pub fn subscribe(mut self) -> Result<Subscription, ClientError> {
        match self.call(Request::Subscribe)? {
            Response::Subscribed => Ok(Subscription {
                stream: self.stream,
                max_frame: self.max_frame,
            }),
            Response::Error(reply) => Err(ClientError::SubscribeRefused {
                code: reply.code,
                message: reply.message,
            }),
            other => Err(ClientError::SubscribeUnexpected {
                answer: format!("{other:?}"),
            }),
        }
    }

    /// The id for the next request.
    ///
    /// Errors: [`ClientError::Broken`] after an earlier failure.
    fn next_request_id(&mut self) -> Result<u64, ClientError> {
        if self.broken {
            return Err(ClientError::Broken);
        }
        let id = self.next_id;
        self.next_id += 1;
        Ok(id)
    }

    fn exchange(
        &mut self,
        id: u64,
        request: Request,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Response, ClientError> {
        let frame = encode_frame(&Envelope { id, body: request }, self.max_frame)
            .map_err(|source| ClientError::Send { id, source })?;
        let sent = if fds.is_empty() {
            NoSigPipe(&self.stream).write_all(&frame)
        } else {
            match send_with_fds(&self.stream, &frame, fds) {
                Ok(()) => Ok(()),
                Err(FdPassError::Sendmsg { source }) => Err(io::Error::from(source)),
                Err(FdPassError::SendRest { source, .. }) => Err(source),
                Err(source) => return Err(ClientError::SendFds { id, source }),
            }
        };
        if let Err(err) = sent {
            // The server may have refused us and closed already: its reply may still be
            // waiting in our receive queue.
            if let Ok(envelope) = read_frame::<Response, _>(&mut &self.stream, self.max_frame) {
                if envelope.id == 0 && matches!(envelope.body, Response::Error(_)) {
                    self.broken = true;
                    return Ok(envelope.body);
                }
            }
            return Err(if is_disconnect(&err) {
                ClientError::ClosedByServer { id }
            } else {
                ClientError::Send {
                    id,
                    source: FrameError::Write { source: err },
                }
            });
        }
        let envelope = match read_frame::<Response, _>(&mut &self.stream, self.max_frame) {
            Ok(envelope) => envelope,
            Err(FrameError::Closed) => return Err(ClientError::ClosedByServer { id }),
            Err(FrameError::Read { source }) if is_disconnect(&source) => {
                return Err(ClientError::ClosedByServer { id })
            }
            Err(source) => return Err(ClientError::Receive { id, source }),
        };
        if envelope.id == id {
            return Ok(envelope.body);
        }
        if envelope.id == 0 && matches!(envelope.body, Response::Error(_)) {
            // Connection-level refusal: the server closes the connection after it.
            self.broken = true;
            return Ok(envelope.body);
        }
        Err(ClientError::IdMismatch {
            expected: id,
            got: envelope.id,
        })
    }
}

/// An event stream from the server (see [`Client::subscribe`]). Dropping it closes the
/// connection, which ends the stream on the server's side.
#[derive(Debug)]
pub struct Subscription {
    stream: UnixStream,
    max_frame: u32,
}

impl Subscription {
    /// Waits up to `timeout` (`None`: forever) for the next event; `Ok(None)` when none came
    /// in time. A frame that started arriving is read whole.
    ///
    /// Errors: [`ClientError::PollEvents`], [`ClientError::ClosedByServer`] (id 0) when the
    /// server closed the stream, [`ClientError::Receive`] (id 0) for a bad frame.
    pub fn next_event(&mut self, timeout: Option<Duration>) -> Result<Option<Event>, ClientError> {
        let timeout = match timeout {
            None => nix::poll::PollTimeout::NONE,
            Some(t) => nix::poll::PollTimeout::try_from(t).unwrap_or(nix::poll::PollTimeout::MAX),
        };
        let mut fds = [nix::poll::PollFd::new(
            self.stream.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        loop {
            match nix::poll::poll(&mut fds, timeout) {
                Ok(0) => return Ok(None),
                Ok(_) => break,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(source) => return Err(ClientError::PollEvents { source }),
            }
        }
        match read_frame::<Event, _>(&mut &self.stream, self.max_frame) {
            Ok(envelope) => Ok(Some(envelope.body)),
            Err(FrameError::Closed) => Err(ClientError::ClosedByServer { id: 0 }),
            Err(FrameError::Read { source }) if is_disconnect(&source) => {
                Err(ClientError::ClosedByServer { id: 0 })
            }
            Err(source) => Err(ClientError::Receive { id: 0, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connecting_to_a_missing_socket_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");
        match Client::connect(&path) {
            Err(ClientError::Connect { path: p, source }) => {
                assert_eq!(p, path);
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
    }
}
