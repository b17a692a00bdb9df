//! The worker's connection to a memory server: attach and detach, flush, the weights version,
//! worker registration, and the owner-alive check.
//!
//! Leases belong to the connection: they end with [`MemClient::detach`], or when the
//! connection closes (dropping the client, or the worker dying). Mappings do not depend on
//! the connection and stay usable after it closes.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::socket::{recv, MsgFlags};

use super::layout::Layout;
use super::mapping::{MapError, Mapping};
use super::message::{
    recv_message, send_message, AttachInfo, AttachRequest, LeaseMode, MemErrorCode, MemRequest,
    MemResponse, ServerInfo, WireError,
};
use crate::frame::DEFAULT_MAX_FRAME;
use crate::transport::{CredsError, PeerCred};

/// Why a call to a memory server failed.
#[derive(Debug, thiserror::Error)]
pub enum MemClientError {
    /// Connecting to the socket failed.
    #[error("connecting to memory server {path} failed")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Reading the server's credentials (`SO_PEERCRED`) failed.
    #[error("reading the memory server's credentials failed")]
    PeerCred {
        /// The credentials error.
        #[source]
        source: CredsError,
    },
    /// Setting the read timeout failed.
    #[error("setting the read timeout failed")]
    SetTimeout {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Sending a request failed.
    #[error("sending memory request {id} failed")]
    Send {
        /// Request id.
        id: u64,
        /// The wire error.
        #[source]
        source: WireError,
    },
    /// Receiving a response failed (including a timeout or the server closing).
    #[error("receiving the answer to memory request {id} failed")]
    Receive {
        /// Request id.
        id: u64,
        /// The wire error.
        #[source]
        source: WireError,
    },
    /// The server answered with an error.
    #[error("memory server refused: {code:?}: {message}")]
    Refused {
        /// Machine-readable reason.
        code: MemErrorCode,
        /// Detail.
        message: String,
    },
    /// The server answered another id or an unexpected variant.
    #[error("memory server answered request {id} with an unexpected {what}")]
    Unexpected {
        /// Request id.
        id: u64,
        /// What was received instead.
        what: String,
    },
    /// Mapping the attached regions failed; the attachment was detached again.
    #[error("mapping attachment {attachment} failed")]
    Map {
        /// Attachment id.
        attachment: u64,
        /// The mapping error.
        #[source]
        source: MapError,
    },
    /// An earlier call failed mid-exchange; the stream may be out of step. Reconnect.
    #[error("the connection is unusable after an earlier failed call")]
    Broken,
}

/// Why the memory server is not (or no longer) usable, from [`MemClient::owner_alive`].
#[derive(Debug, thiserror::Error)]
pub enum OwnerError {
    /// The server process has exited (its pidfd became readable).
    #[error("memory server process {pid} has exited")]
    ServerExited {
        /// Server pid.
        pid: i32,
    },
    /// The server closed (or reset) this connection, so the leases are gone.
    #[error("the memory server closed the connection")]
    ConnectionClosed,
    /// The socket file is gone.
    #[error("memory server socket {path} is gone")]
    SocketGone {
        /// Socket path.
        path: PathBuf,
    },
    /// Another socket (another server) now sits at the path.
    #[error("memory server socket {path} was replaced by another one")]
    SocketReplaced {
        /// Socket path.
        path: PathBuf,
    },
    /// A check itself failed.
    #[error("checking the memory server failed in {call}")]
    Check {
        /// The system call.
        call: &'static str,
        /// The errno.
        #[source]
        source: Errno,
    },
}

/// A blocking connection to one memory server.
#[derive(Debug)]
pub struct MemClient {
    stream: UnixStream,
    path: PathBuf,
    server: PeerCred,
    /// pidfd of the server process, when it is visible in our pid namespace.
    pidfd: Option<OwnedFd>,
    /// `(dev, ino)` of the socket file at connect time.
    socket_id: Option<(u64, u64)>,
    next_id: u64,
    max_frame: u32,
    broken: bool,
}

impl MemClient {
    /// Connects to the memory server at `path` and records who it is: its credentials
    /// (`SO_PEERCRED`), a pidfd of its process and the identity of the socket file, for
    /// [`owner_alive`](MemClient::owner_alive).
    ///
    /// Errors: [`MemClientError::Connect`], [`MemClientError::PeerCred`].
    pub fn connect(path: impl AsRef<Path>) -> Result<MemClient, MemClientError> {
        let path = path.as_ref().to_owned();
        let socket_id = std::fs::metadata(&path)
            .ok()
            .map(|meta| (meta.dev(), meta.ino()));
        let stream = UnixStream::connect(&path).map_err(|source| MemClientError::Connect {
            path: path.clone(),
            source,
        })?;
        let server = PeerCred::of(&stream).map_err(|source| MemClientError::PeerCred { source })?;
        let pidfd = if server.pid > 0 {
            pidfd_open(server.pid).ok()
        } else {
            None
        };
        Ok(MemClient {
            stream,
            path,
            server,
            pidfd,
            socket_id,
            next_id: 1,
            max_frame: DEFAULT_MAX_FRAME,
            broken: false,
        })
    }

    /// Sets how long a call waits for its answer (`None`: forever). A timed-out call leaves
    /// the client [`Broken`](MemClientError::Broken).
    ///
    /// Errors: [`MemClientError::SetTimeout`].
    pub fn with_read_timeout(self, timeout: Option<Duration>) -> Result<MemClient, MemClientError> {
        self.stream
            .set_read_timeout(timeout)
            .map_err(|source| MemClientError::SetTimeout { source })?;
        Ok(self)
    }

    /// The server's credentials as the kernel recorded them at connect time.
    pub fn server(&self) -> PeerCred {
        self.server
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends `request`; returns the answer and its descriptors. Error answers become
    /// [`MemClientError::Refused`].
    fn call(
        &mut self,
        request: MemRequest,
        max_fds: usize,
    ) -> Result<(MemResponse, Vec<OwnedFd>), MemClientError> {
        if self.broken {
            return Err(MemClientError::Broken);
        }
        let id = self.next_id;
        self.next_id += 1;
        let result = self.exchange(id, request, max_fds);
        if matches!(
            result,
            Err(MemClientError::Send { .. }
                | MemClientError::Receive { .. }
                | MemClientError::Unexpected { .. })
        ) {
            self.broken = true;
        }
        result
    }

    fn exchange(
        &mut self,
        id: u64,
        request: MemRequest,
        max_fds: usize,
    ) -> Result<(MemResponse, Vec<OwnedFd>), MemClientError> {
        if let Err(source) = send_message(&self.stream, id, request, &[], self.max_frame) {
            // The server may have refused us and closed already: its reply (id 0) may still be
            // waiting in our receive queue. (Only after a socket error: the peer is gone, so the
            // read cannot block.)
            let closed = matches!(source, WireError::FdPass { .. });
            if let Some(Ok((envelope, _))) =
                closed.then(|| recv_message::<MemResponse, _>(&self.stream, self.max_frame, 0))
            {
                if let (0, MemResponse::Error(reply)) = (envelope.id, envelope.body) {
                    self.broken = true;
                    return Err(MemClientError::Refused {
                        code: reply.code,
                        message: reply.message,
                    });
                }
            }
            return Err(MemClientError::Send { id, source });
        }
        let (envelope, fds) = self.receive(id, max_fds)?;
        if envelope.0 != id {
            if let MemResponse::Error(reply) = envelope.1 {
                if envelope.0 == 0 {
                    self.broken = true;
                    return Err(MemClientError::Refused {
                        code: reply.code,
                        message: reply.message,
                    });
                }
            }
            return Err(MemClientError::Unexpected {
                id,
                what: format!("response id {}", envelope.0),
            });
        }
        match envelope.1 {
            MemResponse::Error(reply) => Err(MemClientError::Refused {
                code: reply.code,
                message: reply.message,
            }),
            body => Ok((body, fds)),
        }
    }

    fn receive(
        &mut self,
        id: u64,
        max_fds: usize,
    ) -> Result<((u64, MemResponse), Vec<OwnedFd>), MemClientError> {
        let (envelope, fds) = recv_message::<MemResponse, _>(&self.stream, self.max_frame, max_fds)
            .map_err(|source| MemClientError::Receive { id, source })?;
        Ok(((envelope.id, envelope.body), fds))
    }

    /// Asks the server who it is ([`MemRequest::Ping`]).
    ///
    /// Errors: [`MemClientError::Send`], [`MemClientError::Receive`],
    /// [`MemClientError::Refused`], [`MemClientError::Unexpected`], [`MemClientError::Broken`].
    pub fn ping(&mut self) -> Result<ServerInfo, MemClientError> {
        match self.call(MemRequest::Ping, 0)? {
            (MemResponse::Pong(info), _) => Ok(info),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    fn unexpected(&mut self, body: MemResponse) -> MemClientError {
        self.broken = true;
        MemClientError::Unexpected {
            id: self.next_id - 1,
            what: format!("{body:?}"),
        }
    }

    /// Attaches: takes `request.mode` leases on the requested regions, receives their
    /// descriptors and maps them ([`Mapping::map`]). If mapping fails, the attachment is
    /// detached again before the error is returned.
    ///
    /// Errors: [`MemClientError::Refused`] (`UnknownWorker`, `LayoutMismatch`,
    /// `UnknownRegion`, `LeaseConflict`, ...), [`MemClientError::Map`], and the transport
    /// errors of [`ping`](MemClient::ping).
    pub fn attach(&mut self, request: AttachRequest) -> Result<Mapping, MemClientError> {
        let (info, fds) = self.attach_raw(request)?;
        let attachment = info.attachment;
        Mapping::map(info, fds).map_err(|source| {
            let _ = self.detach_id(attachment);
            MemClientError::Map { attachment, source }
        })
    }

    /// [`attach`](MemClient::attach) to every region of `layout` (its hash is sent) as worker
    /// `worker` with lease `mode`.
    ///
    /// Errors: those of `attach`.
    pub fn attach_layout(
        &mut self,
        worker: &str,
        layout: &Layout,
        mode: LeaseMode,
    ) -> Result<Mapping, MemClientError> {
        self.attach(AttachRequest {
            worker: worker.to_owned(),
            layout_hash: layout.hash(),
            mode,
            regions: Vec::new(),
        })
    }

    /// The attach exchange without mapping: the answer and one descriptor per region, in
    /// region order (for callers that map by themselves).
    ///
    /// Errors: those of [`attach`](MemClient::attach) except `Map`.
    pub fn attach_raw(
        &mut self,
        request: AttachRequest,
    ) -> Result<(AttachInfo, Vec<OwnedFd>), MemClientError> {
        let (info, mut fds) = match self.call(MemRequest::Attach(request), usize::MAX)? {
            (MemResponse::Attached(info), fds) => (info, fds),
            (other, _) => return Err(self.unexpected(other)),
        };
        let id = self.next_id - 1;
        while fds.len() < info.regions.len() {
            let ((got, body), more) = self
                .receive(id, usize::MAX)
                .inspect_err(|_| self.broken = true)?;
            match body {
                MemResponse::MoreFds { first, count }
                    if got == id && first as usize == fds.len() && count as usize == more.len() =>
                {
                    fds.extend(more)
                }
                other => return Err(self.unexpected(other)),
            }
        }
        if fds.len() != info.regions.len() {
            let attachment = info.attachment;
            let got = fds.len();
            let _ = self.detach_id(attachment);
            return Err(MemClientError::Map {
                attachment,
                source: MapError::FdCount {
                    expected: info.regions.len(),
                    got,
                },
            });
        }
        Ok((info, fds))
    }

    /// Releases the leases of `mapping` on the server, then unmaps it.
    ///
    /// Errors: the transport errors of [`ping`](MemClient::ping), [`MemClientError::Refused`]
    /// (`UnknownAttachment`); the mapping is unmapped in every case.
    pub fn detach(&mut self, mapping: Mapping) -> Result<(), MemClientError> {
        let attachment = mapping.info().attachment;
        drop(mapping);
        self.detach_id(attachment)
    }

    /// Releases the leases of attachment `attachment`.
    ///
    /// Errors: those of [`detach`](MemClient::detach).
    pub fn detach_id(&mut self, attachment: u64) -> Result<(), MemClientError> {
        match self.call(MemRequest::Detach { attachment }, 0)? {
            (MemResponse::Done, _) => Ok(()),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// Has the server zero KV-arena region `region` (the handover flush); returns the bytes
    /// zeroed. Refused (`NoLease`) while another connection holds a write lease on it.
    ///
    /// Errors: [`MemClientError::Refused`] (`UnknownRegion`, `Unsupported`, `NoLease`), and
    /// the transport errors.
    pub fn flush(&mut self, region: &str) -> Result<u64, MemClientError> {
        match self.call(
            MemRequest::Flush {
                region: region.to_owned(),
            },
            0,
        )? {
            (MemResponse::Flushed { bytes, .. }, _) => Ok(bytes),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// The server's weights version counter.
    ///
    /// Errors: the transport errors.
    pub fn version(&mut self) -> Result<u64, MemClientError> {
        match self.call(MemRequest::Version, 0)? {
            (MemResponse::Version { version }, _) => Ok(version),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// Bumps the weights version counter after a weight update; returns the new version.
    /// Needs a write lease on a region of a weights server.
    ///
    /// Errors: [`MemClientError::Refused`] (`NoLease`, `Unsupported`), the transport errors.
    pub fn bump_version(&mut self) -> Result<u64, MemClientError> {
        match self.call(MemRequest::BumpVersion, 0)? {
            (MemResponse::Version { version }, _) => Ok(version),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// Registers worker id `worker` for peers of uid `uid` (root only).
    ///
    /// Errors: [`MemClientError::Refused`] (`PermissionDenied`, `BadRequest`), the transport
    /// errors.
    pub fn register_worker(&mut self, worker: &str, uid: u32) -> Result<(), MemClientError> {
        match self.call(
            MemRequest::RegisterWorker {
                worker: worker.to_owned(),
                uid,
            },
            0,
        )? {
            (MemResponse::Done, _) => Ok(()),
            (other, _) => Err(self.unexpected(other)),
        }
    }

    /// Owner-alive check (paper: allocations are reused only while their owner lives), without
    /// a round trip: the server process has not exited (pidfd), this connection is open (a
    /// non-blocking peek sees no end of stream), and the socket file is still the one
    /// connected to.
    ///
    /// Errors: [`OwnerError::ServerExited`], [`OwnerError::ConnectionClosed`],
    /// [`OwnerError::SocketGone`], [`OwnerError::SocketReplaced`], [`OwnerError::Check`].
    pub fn owner_alive(&self) -> Result<(), OwnerError> {
        if let Some(pidfd) = &self.pidfd {
            let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
            let ready = poll(&mut fds, PollTimeout::ZERO).map_err(|source| OwnerError::Check {
                call: "poll(pidfd)",
                source,
            })?;
            if ready > 0 {
                return Err(OwnerError::ServerExited {
                    pid: self.server.pid,
                });
            }
        }
        let mut byte = [0u8; 1];
        match recv(
            self.stream.as_raw_fd(),
            &mut byte,
            MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(0) | Err(Errno::ECONNRESET) => return Err(OwnerError::ConnectionClosed),
            Ok(_) | Err(Errno::EAGAIN) => {}
            Err(source) => {
                return Err(OwnerError::Check {
                    call: "recv(MSG_PEEK)",
                    source,
                })
            }
        }
        match std::fs::metadata(&self.path) {
            Ok(meta) if !meta.file_type().is_socket() => Err(OwnerError::SocketReplaced {
                path: self.path.clone(),
            }),
            Ok(meta)
                if self
                    .socket_id
                    .is_some_and(|id| id != (meta.dev(), meta.ino())) =>
            {
                Err(OwnerError::SocketReplaced {
                    path: self.path.clone(),
                })
            }
            Ok(_) => Ok(()),
            Err(_) => Err(OwnerError::SocketGone {
                path: self.path.clone(),
            }),
        }
    }
}

/// `pidfd_open(pid, 0)` (Linux 5.3+): a descriptor that becomes readable when `pid` exits and
/// cannot be fooled by pid reuse.
fn pidfd_open(pid: i32) -> Result<OwnedFd, Errno> {
    // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or -1;
    // no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just created descriptor `fd` for this process; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connecting_to_a_missing_socket_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("absent.sock");
        match MemClient::connect(&path) {
            Err(MemClientError::Connect { path: p, source }) => {
                assert_eq!(p, path);
                assert_eq!(source.kind(), io::ErrorKind::NotFound);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_pidfd_reports_a_child_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pidfd = pidfd_open(child.id() as i32).unwrap();
        let readable = |fd: &OwnedFd| {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            poll(&mut fds, PollTimeout::ZERO).unwrap() > 0
        };
        assert!(!readable(&pidfd));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(readable(&pidfd));
    }
}
