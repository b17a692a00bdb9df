//! The socket server: binds the Unix socket, admits peers by credentials and by the
//! connection quotas, and serves each admitted connection on its own thread through a
//! [`Handler`].
//!
//! The server is deliberately thin: framing, credentials, admission, timeouts and error
//! replies live here, every decision about a request lives behind [`Handler`].
//!
//! - `config`: [`ServerConfig`], [`ConnectionLimits`] and their defaults;
//! - `admission`: the census of served connections, quotas per uid and eviction of idle
//!   connections when a pool is full;
//! - `connection`: the thread of one connection (idle wait, frame, handler, response, event
//!   stream);
//! - `deadline`: socket reads and writes bounded in time;
//! - `reply`: responses and refusals on the wire;
//! - `transfer`: the [`TransferLink`] of a streaming upload or download.
//!
//! The accept loop never waits on a peer: it reads the peer's credentials, checks the access
//! policy and the quotas, and answers a refused peer with one non-blocking `send` before
//! closing. So the number of threads is bounded by the connection quota (plus at most
//! 16 evicted connections whose threads are ending), whatever clients do.

mod admission;
mod config;
mod connection;
mod deadline;
mod handler;
mod reply;
mod stats;
mod transfer;

use std::fs;
use std::io;
use std::net::Shutdown;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{debug, error, info, warn};

use self::admission::{Activity, Census, Refusal, MAX_DRAINING};
pub use self::config::{ConnectionLimits, LimitsError, Quota, ServerConfig, DEFAULT_SOCKET_MODE};
use self::connection::{serve_connection, Connection};
pub use self::handler::{Handler, MAX_REQUEST_FDS};
use self::reply::refuse_now;
pub use self::stats::{ServerCounts, ServerStats};
pub use self::transfer::{chunk_bytes, Chunk, LinkError, TransferLink};
use super::creds::{AccessPolicy, PeerCred};
use super::socket::{bind_socket, BindError, BoundSocket};
use crate::error_chain;
use crate::message::ErrorCode;

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
    /// The configured [`ConnectionLimits`] are unusable.
    #[error("invalid connection limits")]
    Limits {
        /// What is wrong with them.
        #[source]
        source: LimitsError,
    },
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
    limits: ConnectionLimits,
    stop_rx: OwnedFd,
    trigger: ShutdownTrigger,
    stats: Arc<ServerStats>,
}

impl Server {
    /// Binds the socket described by `config`: checks the limits, creates the parent
    /// directory, removes a stale socket file left by a dead server, binds, then sets the mode
    /// and group.
    ///
    /// Errors: [`ServerError::Limits`], [`ServerError::Bind`] (with a [`BindError`]: e.g.
    /// `InUse` when a live server answers there, `NotASocket`), [`ServerError::Configure`],
    /// [`ServerError::Pipe`].
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        config
            .limits
            .validate()
            .map_err(|source| ServerError::Limits { source })?;
        let path = config.path;
        let BoundSocket { listener, identity } = bind_socket(&path, config.mode, config.group)?;
        let (stop_rx, stop_tx) = configure(&listener, &path).inspect_err(|_| {
            let _ = fs::remove_file(&path);
        })?;
        let limits = config.limits;
        info!(path = %path.display(), mode = format_args!("{:o}", config.mode),
              group = ?config.group, allowed_gid = ?config.policy.allowed_gid,
              max_connections = limits.connections.total,
              max_connections_per_uid = limits.connections.per_uid,
              max_subscriptions = limits.subscriptions.total,
              idle_timeout_s = limits.idle_timeout.as_secs(), "socket bound");
        Ok(Server {
            listener,
            path,
            identity,
            policy: config.policy,
            max_frame: config.max_frame,
            limits,
            stop_rx,
            trigger: ShutdownTrigger {
                tx: Arc::new(stop_tx),
            },
            stats: Arc::default(),
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

    /// The server's connection counters (open connections and event streams, admitted,
    /// refused, evicted), updated while it serves.
    pub fn stats(&self) -> Arc<ServerStats> {
        Arc::clone(&self.stats)
    }

    /// Accepts connections until the [`ShutdownTrigger`] fires, serving each admitted one on
    /// its own thread with `handler` (refused ones are answered and closed by this loop). On
    /// shutdown, open connections are shut down and their threads joined, and the socket file
    /// is removed.
    ///
    /// Errors: [`ServerError::Poll`] (accept errors are logged and survived).
    pub fn serve(self, handler: Arc<dyn Handler>) -> Result<(), ServerError> {
        let shared = Arc::new(Shared {
            handler,
            max_frame: self.max_frame,
            limits: self.limits,
            census: Mutex::new(Census::new(
                self.limits.connections,
                self.limits.subscriptions,
                Arc::clone(&self.stats),
            )),
            epoch: Instant::now(),
        });
        let mut threads: Vec<JoinHandle<()>> = Vec::new();
        let mut next_conn: u64 = 0;
        let mut refusals = RefusalLog::default();
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
            reap_finished(&mut threads);
            if threads.len() >= self.limits.connections.total + MAX_DRAINING {
                // Slots given back by threads that have not ended yet: the census would admit,
                // but the thread bound comes first.
                let refusal = Refusal::Total {
                    what: "connections",
                    limit: self.limits.connections.total,
                };
                self.stats.refused();
                refuse_now(
                    &stream,
                    ErrorCode::Busy,
                    busy_message(&refusal),
                    self.max_frame,
                );
                continue;
            }
            if let Some(thread) = self.admit(&shared, next_conn, stream, &mut refusals) {
                threads.push(thread);
            }
        };
        let open = shared.census().drain();
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

    /// Decides about a freshly accepted connection without waiting on its peer: credentials,
    /// access policy, quotas; starts the thread of an admitted one. Returns that thread.
    fn admit(
        &self,
        shared: &Arc<Shared>,
        conn: u64,
        stream: UnixStream,
        refusals: &mut RefusalLog,
    ) -> Option<JoinHandle<()>> {
        if let Err(err) = stream.set_nonblocking(false) {
            warn!(conn, error = %err, "making the connection blocking failed; dropping it");
            return None;
        }
        let peer = match PeerCred::of(&stream) {
            Ok(peer) => peer,
            Err(err) => {
                warn!(conn, error = %error_chain(&err), "reading peer credentials failed; closing");
                return None;
            }
        };
        if let Err(err) = self.policy.authorize(&stream, &peer) {
            let message = error_chain(&err);
            refusals.note(conn, &peer, &message, "refusing peer");
            self.stats.refused();
            refuse_now(
                &stream,
                ErrorCode::PermissionDenied,
                message,
                self.max_frame,
            );
            return None;
        }
        let clone = match stream.try_clone() {
            Ok(clone) => clone,
            Err(err) => {
                warn!(conn, error = %err, "duplicating the connection failed; dropping it");
                return None;
            }
        };
        let activity = Arc::new(Activity::new(shared.now_ms()));
        let admitted = shared
            .census()
            .admit(conn, peer.uid, clone, Arc::clone(&activity));
        match admitted {
            Ok(Some(evicted)) => {
                self.stats.evicted();
                debug!(
                    conn,
                    uid = peer.uid,
                    evicted = evicted.conn,
                    evicted_uid = evicted.uid,
                    "pool full; evicted an idle connection"
                )
            }
            Ok(None) => {}
            Err(refusal) => {
                refusals.note(
                    conn,
                    &peer,
                    &refusal.to_string(),
                    "connection limit reached",
                );
                self.stats.refused();
                refuse_now(
                    &stream,
                    ErrorCode::Busy,
                    busy_message(&refusal),
                    self.max_frame,
                );
                return None;
            }
        }
        self.stats.admitted();
        spawn_connection(
            shared,
            Connection {
                id: conn,
                peer,
                stream,
                activity,
            },
        )
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
pub(crate) struct Shared {
    handler: Arc<dyn Handler>,
    max_frame: u32,
    limits: ConnectionLimits,
    census: Mutex<Census>,
    /// Origin of the server clock used for idle ordering.
    epoch: Instant,
}

impl Shared {
    /// The census (a panic elsewhere never leaves it unusable: every update is a few counts).
    fn census(&self) -> MutexGuard<'_, Census> {
        self.census.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Milliseconds since the server started serving.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// Refusals logged at `warn` at most once per [`RefusalLog::EVERY`], with the number of
/// quieter ones in between (a flood of refused connections must not flood the log).
#[derive(Debug, Default)]
struct RefusalLog {
    last_warn: Option<Instant>,
    quiet: u64,
}

impl RefusalLog {
    const EVERY: Duration = Duration::from_secs(10);

    fn note(&mut self, conn: u64, peer: &PeerCred, reason: &str, what: &str) {
        let due = self
            .last_warn
            .is_none_or(|last| last.elapsed() >= Self::EVERY);
        if due {
            warn!(
                conn,
                pid = peer.pid,
                uid = peer.uid,
                gid = peer.gid,
                reason,
                refused_since_last_warning = self.quiet,
                "{what}; refused"
            );
            self.last_warn = Some(Instant::now());
            self.quiet = 0;
        } else {
            debug!(
                conn,
                pid = peer.pid,
                uid = peer.uid,
                reason,
                "{what}; refused"
            );
            self.quiet += 1;
        }
    }
}

/// The message of the `Busy` reply to a refused connection.
fn busy_message(refusal: &Refusal) -> String {
    format!("server busy: {refusal}; try again later")
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

/// Joins the connection threads that have finished, so that an ended thread is gone from the
/// process (not only done with its closure) before the bound on threads counts it out.
fn reap_finished(threads: &mut Vec<JoinHandle<()>>) {
    let mut i = 0;
    while i < threads.len() {
        if threads[i].is_finished() {
            let _ = threads.swap_remove(i).join();
        } else {
            i += 1;
        }
    }
}

/// Starts the thread of an admitted connection, which gives its census entry back when it
/// ends; on failure the entry is given back at once and the connection dropped.
fn spawn_connection(shared: &Arc<Shared>, conn: Connection) -> Option<JoinHandle<()>> {
    let id = conn.id;
    let worker = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name(format!("belayer-ipc-conn-{id}"))
        .spawn(move || {
            let _release = Release {
                shared: &worker,
                conn: id,
            };
            serve_connection(&worker, &conn);
        });
    match spawned {
        Ok(thread) => Some(thread),
        Err(err) => {
            error!(conn = id, error = %err, "spawning a connection thread failed; dropping it");
            shared.census().release(id);
            None
        }
    }
}

/// Gives a connection's census entry back when its thread ends, even by a panic.
struct Release<'a> {
    shared: &'a Shared,
    conn: u64,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.shared.census().release(self.conn);
    }
}
