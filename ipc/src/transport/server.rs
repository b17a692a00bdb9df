//! The socket server: binds the Unix socket, admits peers by credentials, and serves each
//! connection on its own thread through a [`Handler`].
//!
//! The server is deliberately thin: framing, credentials and error replies live here, every
//! decision about a request lives behind [`Handler`].

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{debug, error, info, warn};

use super::creds::{AccessPolicy, Caller, PeerCred};
use super::socket::{bind_socket, BindError, BoundSocket};
use super::wire::{recv_message, WireError};
use super::{is_disconnect, NoSigPipe};
use crate::error_chain;
use crate::frame::{encode_frame, FrameError, DEFAULT_MAX_FRAME};
use crate::message::{Envelope, ErrorCode, ErrorReply, Event, Request, Response};

/// Default permission bits of the socket file: owner and group may connect.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

/// Most descriptors one request frame may carry; a frame with more is a bad frame (its
/// descriptors are closed, `BadRequest`, connection closed).
pub const MAX_REQUEST_FDS: usize = 1;

/// The daemon core as the server sees it: one request in, one response out.
///
/// Called on the connection's thread; requests of one connection are handled one after the
/// other, requests of different connections concurrently. A panic in `handle` is caught and
/// answered with [`ErrorCode::Internal`].
pub trait Handler: Send + Sync + 'static {
    /// Answers `request` from the (already admitted) peer `peer`.
    fn handle(&self, peer: &PeerCred, request: Request) -> Response;

    /// Answers `request` from `caller` together with the descriptors attached to its frame
    /// (`SCM_RIGHTS`, close-on-exec, at most [`MAX_REQUEST_FDS`]). This is what the server
    /// calls; the default closes the descriptors and answers with [`handle`](Self::handle),
    /// so only handlers of requests that carry descriptors (or that act with the caller's
    /// supplementary groups) implement it.
    fn handle_call(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        drop(fds);
        self.handle(&caller.cred, request)
    }

    /// Opens an event stream for [`Request::Subscribe`] from `peer`: every [`Event`] sent on
    /// the returned channel is written to the connection until the peer closes it, the sender
    /// side is dropped, or the server shuts down. `None` (the default) answers the request
    /// with [`ErrorCode::Unsupported`].
    fn subscribe(&self, peer: &PeerCred) -> Option<Receiver<Event>> {
        let _ = peer;
        None
    }
}

/// Where and how the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Socket path; its parent directory is created when missing.
    pub path: PathBuf,
    /// Permission bits of the socket file (default [`DEFAULT_SOCKET_MODE`]).
    pub mode: u32,
    /// Group that owns the socket file, when set (the owner stays the server's uid).
    pub group: Option<u32>,
    /// Who may talk to the server once connected (default: root only).
    pub policy: AccessPolicy,
    /// Largest accepted request payload and largest sent response payload, bytes.
    pub max_frame: u32,
}

impl ServerConfig {
    /// A configuration for `path` with mode 0660, no group change, root-only access and the
    /// default 16 MiB frame limit.
    pub fn new(path: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            path: path.into(),
            mode: DEFAULT_SOCKET_MODE,
            group: None,
            policy: AccessPolicy::root_only(),
            max_frame: DEFAULT_MAX_FRAME,
        }
    }

    /// Sets the permission bits of the socket file.
    pub fn mode(mut self, mode: u32) -> ServerConfig {
        self.mode = mode;
        self
    }

    /// Sets the group owning the socket file (does not change the access policy).
    pub fn group(mut self, gid: u32) -> ServerConfig {
        self.group = Some(gid);
        self
    }

    /// Sets the access policy.
    pub fn policy(mut self, policy: AccessPolicy) -> ServerConfig {
        self.policy = policy;
        self
    }

    /// Sets the maximum payload size in bytes.
    pub fn max_frame(mut self, max_frame: u32) -> ServerConfig {
        self.max_frame = max_frame;
        self
    }
}

/// Why the server could not be set up or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding the socket failed (see [`BindError`]: a live server there, something that is not
    /// a socket, permissions).
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Making the listener non-blocking failed.
    #[error("configuring the listener on {path} failed")]
    Configure {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Creating the shutdown pipe failed.
    #[error("pipe2 for the shutdown signal failed")]
    Pipe {
        /// The errno.
        #[source]
        source: Errno,
    },
    /// Waiting for connections failed.
    #[error("poll on {path} failed")]
    Poll {
        /// The socket path.
        path: PathBuf,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// Starting the background server thread failed.
    #[error("spawning the server thread failed")]
    SpawnThread {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The background server thread panicked.
    #[error("the server thread panicked")]
    ServeThreadPanicked,
}

/// Makes a running [`Server::serve`] return; cheap to clone, usable from any thread.
#[derive(Debug, Clone)]
pub struct ShutdownTrigger {
    tx: Arc<OwnedFd>,
}

impl ShutdownTrigger {
    /// Asks the server to stop: it stops accepting, shuts down open connections (handlers
    /// running at that moment finish first), removes its socket file and returns from `serve`.
    /// Idempotent.
    pub fn trigger(&self) {
        // Retry on EINTR only; EAGAIN means the pipe is full of earlier triggers, just as good.
        while let Err(Errno::EINTR) = nix::unistd::write(self.tx.as_fd(), &[1]) {}
    }
}

/// A bound Unix socket server, ready to [`serve`](Server::serve).
///
/// Dropping it (or returning from `serve`) removes the socket file, if it is still the one this
/// server created.
#[derive(Debug)]
pub struct Server {
    listener: UnixListener,
    path: PathBuf,
    /// `(st_dev, st_ino)` of the socket file this server created.
    identity: (u64, u64),
    policy: AccessPolicy,
    max_frame: u32,
    stop_rx: OwnedFd,
    trigger: ShutdownTrigger,
}

impl Server {
    /// Binds the socket described by `config`: creates the parent directory, removes a stale
    /// socket file left by a dead server, binds, then sets the mode and group.
    ///
    /// Errors: [`ServerError::Bind`] (with a [`BindError`]: e.g. `InUse` when a live server
    /// answers there, `NotASocket`), [`ServerError::Configure`], [`ServerError::Pipe`].
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let path = config.path;
        let BoundSocket { listener, identity } = bind_socket(&path, config.mode, config.group)?;
        let (stop_rx, stop_tx) = configure(&listener, &path).inspect_err(|_| {
            let _ = fs::remove_file(&path);
        })?;
        info!(path = %path.display(), mode = format_args!("{:o}", config.mode),
              group = ?config.group, allowed_gid = ?config.policy.allowed_gid, "socket bound");
        Ok(Server {
            listener,
            path,
            identity,
            policy: config.policy,
            max_frame: config.max_frame,
            stop_rx,
            trigger: ShutdownTrigger {
                tx: Arc::new(stop_tx),
            },
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A trigger that makes [`serve`](Server::serve) return.
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.trigger.clone()
    }

    /// Accepts connections until the [`ShutdownTrigger`] fires, serving each on its own thread
    /// with `handler`. On shutdown, open connections are shut down and their threads joined,
    /// and the socket file is removed.
    ///
    /// Errors: [`ServerError::Poll`] (accept errors are logged and survived).
    pub fn serve(self, handler: Arc<dyn Handler>) -> Result<(), ServerError> {
        let shared = Arc::new(Shared {
            handler,
            policy: self.policy,
            max_frame: self.max_frame,
            open: Mutex::new(HashMap::new()),
        });
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let mut next_conn: u64 = 0;
        info!(path = %self.path.display(), "serving");
        let result = loop {
            let mut fds = [
                PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.stop_rx.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                Err(source) => {
                    break Err(ServerError::Poll {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
            if fds[1].revents().is_some_and(|events| !events.is_empty()) {
                break Ok(());
            }
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(err) => {
                    handle_accept_error(&self.path, &err);
                    continue;
                }
            };
            next_conn += 1;
            threads.retain(|thread| !thread.is_finished());
            if let Some(thread) = spawn_connection(&shared, next_conn, stream) {
                threads.push(thread);
            }
        };
        let open: Vec<UnixStream> = shared
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, stream)| stream)
            .collect();
        debug!(path = %self.path.display(), open = open.len(), "stopping; closing connections");
        for stream in &open {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for thread in threads {
            let _ = thread.join();
        }
        info!(path = %self.path.display(), "stopped serving");
        result
    }

    /// Runs [`serve`](Server::serve) on a background thread; the returned handle stops it.
    ///
    /// Errors: [`ServerError::SpawnThread`].
    pub fn spawn(self, handler: Arc<dyn Handler>) -> Result<ServerHandle, ServerError> {
        let path = self.path.clone();
        let trigger = self.trigger.clone();
        let thread = thread::Builder::new()
            .name("belayer-ipc-accept".to_owned())
            .spawn(move || self.serve(handler))
            .map_err(|source| ServerError::SpawnThread { source })?;
        Ok(ServerHandle {
            path,
            trigger,
            thread: Some(thread),
        })
    }

    fn remove_socket_file(&self) {
        match fs::symlink_metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.identity => {
                if let Err(err) = fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), error = %err, "removing socket file failed");
                }
            }
            // Gone, or replaced by another server's socket: not ours to remove.
            _ => {}
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.remove_socket_file();
    }
}

/// A server running on a background thread (see [`Server::spawn`]). Dropping it shuts the
/// server down and waits for it.
#[derive(Debug)]
pub struct ServerHandle {
    path: PathBuf,
    trigger: ShutdownTrigger,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl ServerHandle {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A trigger that stops the server without waiting.
    pub fn shutdown_trigger(&self) -> ShutdownTrigger {
        self.trigger.clone()
    }

    /// Stops the server and waits until it has closed every connection and removed its socket
    /// file.
    ///
    /// Errors: what `serve` returned, or [`ServerError::ServeThreadPanicked`].
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), ServerError> {
        self.trigger.trigger();
        match self.thread.take() {
            Some(thread) => thread
                .join()
                .map_err(|_| ServerError::ServeThreadPanicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            warn!(path = %self.path.display(), error = %error_chain(&err), "server stopped with an error");
        }
    }
}

/// State shared by the accept loop and the connection threads.
struct Shared {
    handler: Arc<dyn Handler>,
    policy: AccessPolicy,
    max_frame: u32,
    /// Clones of the open connections, to shut them down on stop.
    open: Mutex<HashMap<u64, UnixStream>>,
}

/// Non-blocking accept for a freshly bound listener, plus the shutdown pipe.
fn configure(listener: &UnixListener, path: &Path) -> Result<(OwnedFd, OwnedFd), ServerError> {
    listener
        .set_nonblocking(true)
        .map_err(|source| ServerError::Configure {
            path: path.to_owned(),
            source,
        })?;
    nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)
        .map_err(|source| ServerError::Pipe { source })
}

fn handle_accept_error(path: &Path, err: &io::Error) {
    match err.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => {}
        io::ErrorKind::ConnectionAborted => {
            debug!(path = %path.display(), error = %err, "connection aborted before accept");
        }
        _ => {
            warn!(path = %path.display(), error = %err, "accept failed");
            // EMFILE/ENFILE and friends: back off instead of spinning on a ready listener.
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Registers `stream` and starts its thread; logs and drops the connection on failure.
fn spawn_connection(shared: &Arc<Shared>, conn: u64, stream: UnixStream) -> Option<JoinHandle<()>> {
    if let Err(err) = stream.set_nonblocking(false) {
        warn!(conn, error = %err, "making the connection blocking failed; dropping it");
        return None;
    }
    let clone = match stream.try_clone() {
        Ok(clone) => clone,
        Err(err) => {
            warn!(conn, error = %err, "duplicating the connection failed; dropping it");
            return None;
        }
    };
    shared
        .open
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(conn, clone);
    let worker = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name(format!("belayer-ipc-conn-{conn}"))
        .spawn(move || {
            serve_connection(&worker, conn, stream);
            worker
                .open
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&conn);
        });
    match spawned {
        Ok(thread) => Some(thread),
        Err(err) => {
            error!(conn, error = %err, "spawning a connection thread failed; dropping it");
            shared
                .open
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&conn);
            None
        }
    }
}

/// Serves one connection: admission, then request after request until the peer leaves, a
/// frame is bad, or the server shuts the connection down.
fn serve_connection(shared: &Shared, conn: u64, stream: UnixStream) {
    let caller = match Caller::of(&stream) {
        Ok(caller) => caller,
        Err(err) => {
            warn!(conn, error = %error_chain(&err), "reading peer credentials failed; closing");
            return;
        }
    };
    let peer = caller.cred;
    if let Err(err) = shared.policy.authorize(&stream, &peer) {
        let message = error_chain(&err);
        warn!(conn, pid = peer.pid, uid = peer.uid, gid = peer.gid, error = %message,
              "refusing peer");
        send_error(
            shared,
            conn,
            &stream,
            0,
            ErrorCode::PermissionDenied,
            message,
        );
        return;
    }
    debug!(
        conn,
        pid = peer.pid,
        uid = peer.uid,
        gid = peer.gid,
        "peer connected"
    );
    loop {
        // One frame at a time, never reading past it: descriptors attached to the next
        // frame stay queued with it.
        let (envelope, fds) =
            match recv_message::<Request, _>(&stream, shared.max_frame, MAX_REQUEST_FDS) {
                Ok(received) => received,
                Err(WireError::Frame {
                    source: FrameError::Closed,
                }) => {
                    debug!(conn, "peer closed the connection");
                    return;
                }
                Err(err) if err.is_disconnect() || is_read_disconnect(&err) => {
                    debug!(conn, error = %error_chain(&err), "peer reset the connection");
                    return;
                }
                Err(err) => {
                    let message = match &err {
                        WireError::Frame { source } => error_chain(source),
                        WireError::FdPass { source } => error_chain(source),
                    };
                    warn!(conn, pid = peer.pid, uid = peer.uid, error = %message,
                      "bad frame; answering BadRequest and closing");
                    send_error(shared, conn, &stream, 0, ErrorCode::BadRequest, message);
                    return;
                }
            };
        let id = envelope.id;
        if envelope.body == Request::Subscribe {
            drop(fds);
            stream_events(shared, conn, &peer, &stream, id);
            return;
        }
        let handled = panic::catch_unwind(AssertUnwindSafe(|| {
            shared.handler.handle_call(&caller, envelope.body, fds)
        }));
        let response = handled.unwrap_or_else(|_| {
            error!(conn, request = id, "request handler panicked");
            Response::Error(ErrorReply {
                code: ErrorCode::Internal,
                message: "the request handler panicked".to_owned(),
            })
        });
        if !send_response(shared, conn, &stream, id, response) {
            return;
        }
    }
}

/// Whether a receive error is a reset connection surfacing as a read error.
fn is_read_disconnect(err: &WireError) -> bool {
    matches!(err, WireError::Frame { source: FrameError::Read { source } } if is_disconnect(source))
}

/// How often an idle event stream checks whether its peer went away.
const EVENT_IDLE_CHECK: Duration = Duration::from_millis(200);

/// Serves [`Request::Subscribe`]: answers `Subscribed` (or `Unsupported`), then writes every
/// event of the handler's channel until the peer leaves, sends anything, or the channel ends.
fn stream_events(shared: &Shared, conn: u64, peer: &PeerCred, stream: &UnixStream, id: u64) {
    let subscribed = panic::catch_unwind(AssertUnwindSafe(|| shared.handler.subscribe(peer)));
    let Ok(Some(events)) = subscribed else {
        send_error(
            shared,
            conn,
            stream,
            id,
            ErrorCode::Unsupported,
            "this server has no event stream".to_owned(),
        );
        return;
    };
    if !send_response(shared, conn, stream, id, Response::Subscribed) {
        return;
    }
    debug!(conn, pid = peer.pid, "event stream opened");
    loop {
        match events.recv_timeout(EVENT_IDLE_CHECK) {
            Ok(event) => {
                let frame = match encode_frame(&Envelope { id: 0, body: event }, shared.max_frame) {
                    Ok(frame) => frame,
                    Err(err) => {
                        warn!(conn, error = %error_chain(&err), "encoding an event failed; skipped");
                        continue;
                    }
                };
                if NoSigPipe(stream).write_all(&frame).is_err() {
                    debug!(conn, "event subscriber left");
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if peer_readable(stream) {
                    debug!(
                        conn,
                        "event subscriber closed or sent data; closing the stream"
                    );
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                debug!(conn, "event source ended; closing the stream");
                return;
            }
        }
    }
}

/// Whether the peer of an event stream closed its side (or sent anything, which a subscriber
/// must not): the socket polls readable or hung up.
fn peer_readable(stream: &UnixStream) -> bool {
    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(n) => n > 0,
        Err(_) => true,
    }
}

/// Encodes and writes one response; a response that cannot be encoded (e.g. over the frame
/// limit) is replaced by an `Internal` error with the same id. Returns whether the connection
/// is still usable.
fn send_response(
    shared: &Shared,
    conn: u64,
    stream: &UnixStream,
    id: u64,
    response: Response,
) -> bool {
    let frame = match encode_frame(&Envelope { id, body: response }, shared.max_frame) {
        Ok(frame) => frame,
        Err(err) => {
            let message = error_chain(&err);
            error!(conn, request = id, error = %message, "encoding the response failed");
            let reply = Envelope {
                id,
                body: Response::Error(ErrorReply {
                    code: ErrorCode::Internal,
                    message: format!("the response could not be sent: {message}"),
                }),
            };
            match encode_frame(&reply, shared.max_frame) {
                Ok(frame) => frame,
                Err(err) => {
                    error!(conn, request = id, error = %error_chain(&err),
                           "encoding the error reply failed; closing");
                    return false;
                }
            }
        }
    };
    match NoSigPipe(stream).write_all(&frame) {
        Ok(()) => true,
        Err(err) => {
            debug!(conn, request = id, error = %err, "peer left before the response was written");
            false
        }
    }
}

/// Best-effort connection-level error reply (request id 0), sent before closing.
fn send_error(
    shared: &Shared,
    conn: u64,
    stream: &UnixStream,
    id: u64,
    code: ErrorCode,
    message: String,
) {
    send_response(
        shared,
        conn,
        stream,
        id,
        Response::Error(ErrorReply { code, message }),
    );
}
