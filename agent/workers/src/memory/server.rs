//! The memory server: owns a layout's allocations, listens on its own socket, admits peers by
//! credentials, hands out region descriptors under leases, flushes the KV arena and counts
//! weights versions (paper: "State isolation").
//!
//! One thread accepts; each connection gets its own thread that reads [`MemRequest`]s one
//! after the other. A connection's leases end when it closes, whatever the reason (detach,
//! exit, `SIGKILL`), so a dead worker never blocks its replacement.

mod connection;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};

use belayer_ipc::memory::layout::MAX_NAME_LEN;
use belayer_ipc::memory::{Backend, Layout, LayoutError, Role, ServerInfo};
use belayer_ipc::{bind_socket, AccessPolicy, BindError, BoundSocket, DEFAULT_SOCKET_MODE};
use tracing::{info, warn};

use super::alloc::{AllocError, Allocation};
use super::lease::LeaseTable;
use connection::serve_connection;

/// Why a memory server could not start.
#[derive(Debug, thiserror::Error)]
pub enum MemoryServerError {
    /// The layout does not suit the role.
    #[error("the layout does not suit role {role}")]
    Layout {
        /// The role.
        role: Role,
        /// The layout error.
        #[source]
        source: LayoutError,
    },
    /// Allocating the regions failed (including a CUDA device without a driver).
    #[error("allocating the {role} layout on {backend} failed")]
    Allocate {
        /// The role.
        role: Role,
        /// The backend.
        backend: Backend,
        /// The allocation error.
        #[source]
        source: AllocError,
    },
    /// A registered worker id is not `[A-Za-z0-9._-]{1,128}`.
    #[error("worker id {worker:?} is invalid")]
    BadWorkerId {
        /// The id.
        worker: String,
    },
    /// Binding the socket failed (a live server there, something that is not a socket,
    /// permissions).
    #[error(transparent)]
    Bind(#[from] BindError),
    /// Spawning the accept thread failed.
    #[error("spawning the accept thread failed")]
    SpawnThread {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// How to run a memory server.
#[derive(Debug, Clone)]
pub struct MemoryServerConfig {
    /// Weights or KV arena.
    pub role: Role,
    /// Where the memory lives.
    pub backend: Backend,
    /// The regions.
    pub layout: Layout,
    /// Socket path (the parent directory is created when missing).
    pub socket: PathBuf,
    /// Who may connect (checked on the peer's kernel credentials): root, plus a group.
    pub policy: AccessPolicy,
    /// Group of the socket file; `None` leaves it as created.
    pub socket_group: Option<u32>,
    /// Mode of the socket file (default 0660).
    pub socket_mode: u32,
    /// Worker ids registered up front, each with the uid its peers must have.
    pub workers: Vec<(String, u32)>,
    /// Refuse attaches whose worker id is not registered.
    pub require_registration: bool,
}

impl MemoryServerConfig {
    /// A server of `role` on `backend` for `layout` at `socket`: root-only, socket mode 0660,
    /// no registered workers, registration not required.
    pub fn new(role: Role, backend: Backend, layout: Layout, socket: impl Into<PathBuf>) -> Self {
        MemoryServerConfig {
            role,
            backend,
            layout,
            socket: socket.into(),
            policy: AccessPolicy::root_only(),
            socket_group: None,
            socket_mode: DEFAULT_SOCKET_MODE,
            workers: Vec::new(),
            require_registration: false,
        }
    }

    /// Sets the access policy.
    pub fn policy(mut self, policy: AccessPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets the socket file's group.
    pub fn socket_group(mut self, gid: u32) -> Self {
        self.socket_group = Some(gid);
        self
    }

    /// Registers worker id `worker` for peers of uid `uid`.
    pub fn worker(mut self, worker: impl Into<String>, uid: u32) -> Self {
        self.workers.push((worker.into(), uid));
        self
    }

    /// Requires (or not) every attaching worker id to be registered.
    pub fn require_registration(mut self, required: bool) -> Self {
        self.require_registration = required;
        self
    }
}

/// State changed by requests, under one lock.
#[derive(Debug)]
struct State {
    leases: LeaseTable,
    workers: HashMap<String, u32>,
    version: u64,
}

/// What the connection threads share.
#[derive(Debug)]
struct Shared {
    role: Role,
    layout_hash: String,
    alloc: Allocation,
    policy: AccessPolicy,
    require_registration: bool,
    state: Mutex<State>,
    next_attachment: AtomicU64,
    stopping: AtomicBool,
    /// Clones of the open connections, to shut them down on stop.
    open: Mutex<HashMap<u64, UnixStream>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn info(&self) -> ServerInfo {
        let state = self.state();
        ServerInfo {
            role: self.role,
            backend: self.alloc.backend(),
            layout_hash: self.layout_hash.clone(),
            version: state.version,
            pid: std::process::id() as i32,
            regions: self.alloc.placement().regions.len() as u32,
            bytes: self.alloc.bytes(),
            attachments: state.leases.attachments() as u32,
        }
    }
}

/// A running memory server. Dropping it stops it (like [`shutdown`](MemoryServer::shutdown));
/// the allocations go with it.
#[derive(Debug)]
pub struct MemoryServer {
    shared: Arc<Shared>,
    path: PathBuf,
    listener: Arc<UnixListener>,
    identity: (u64, u64),
    accept: Option<JoinHandle<()>>,
}

impl MemoryServer {
    /// Validates the layout for the role, allocates every region, binds the socket (a stale
    /// socket file is replaced, a live one refused) and starts accepting.
    ///
    /// Errors: [`MemoryServerError::Layout`], [`MemoryServerError::Allocate`] (with
    /// `CudaError::NoDriver` underneath for a CUDA device on a machine without a driver),
    /// [`MemoryServerError::BadWorkerId`], the socket errors, [`MemoryServerError::SpawnThread`].
    pub fn start(config: MemoryServerConfig) -> Result<MemoryServer, MemoryServerError> {
        let role = config.role;
        config
            .layout
            .validate_for(role)
            .map_err(|source| MemoryServerError::Layout { role, source })?;
        if let Some((worker, _)) = config.workers.iter().find(|(w, _)| !valid_worker(w)) {
            return Err(MemoryServerError::BadWorkerId {
                worker: worker.clone(),
            });
        }
        let alloc = Allocation::new(config.backend, &config.layout).map_err(|source| {
            MemoryServerError::Allocate {
                role,
                backend: config.backend,
                source,
            }
        })?;
        let BoundSocket { listener, identity } =
            bind_socket(&config.socket, config.socket_mode, config.socket_group)?;
        let shared = Arc::new(Shared {
            role,
            layout_hash: config.layout.hash(),
            policy: config.policy,
            require_registration: config.require_registration,
            state: Mutex::new(State {
                leases: LeaseTable::new(alloc.placement().regions.len()),
                workers: config.workers.into_iter().collect(),
                version: 0,
            }),
            alloc,
            next_attachment: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
        });
        let listener = Arc::new(listener);
        let accept = {
            let shared = Arc::clone(&shared);
            let listener = Arc::clone(&listener);
            thread::Builder::new()
                .name("belayer-mem-accept".to_owned())
                .spawn(move || accept_loop(&shared, &listener))
                .map_err(|source| MemoryServerError::SpawnThread { source })?
        };
        let server = MemoryServer {
            shared,
            path: config.socket,
            listener,
            identity,
            accept: Some(accept),
        };
        let info = server.info();
        info!(role = %info.role, backend = %info.backend, regions = info.regions, bytes = info.bytes,
              layout = %info.layout_hash, socket = %server.path.display(), "memory server ready");
        Ok(server)
    }

    /// Who the server is and what it holds.
    pub fn info(&self) -> ServerInfo {
        self.shared.info()
    }

    /// The socket path.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Stops accepting, closes every connection (ending all leases), waits for the threads and
    /// removes the socket file if it is still this server's. The allocations are released when
    /// the server is dropped.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // shutdown(2) on a listening socket wakes a blocked accept(2) with EINVAL on Linux.
        let _ =
            nix::sys::socket::shutdown(self.listener.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        let open: Vec<UnixStream> = self
            .shared
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, stream)| stream)
            .collect();
        for stream in &open {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        let _ = accept.join();
        match fs::symlink_metadata(&self.path) {
            Ok(meta) if (meta.dev(), meta.ino()) == self.identity => {
                if let Err(err) = fs::remove_file(&self.path) {
                    warn!(path = %self.path.display(), error = %err, "removing the socket failed");
                }
            }
            _ => {}
        }
        info!(socket = %self.path.display(), "memory server stopped");
    }
}

impl Drop for MemoryServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn valid_worker(worker: &str) -> bool {
    belayer_ipc::names::valid_name(worker, MAX_NAME_LEN, true)
}

fn accept_loop(shared: &Arc<Shared>, listener: &UnixListener) {
    let mut next_conn = 0u64;
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(_) if shared.stopping.load(Ordering::SeqCst) => break,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => {
                warn!(error = %err, "accept failed");
                thread::sleep(std::time::Duration::from_millis(20));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        next_conn += 1;
        threads.retain(|t| !t.is_finished());
        let conn = next_conn;
        let clone = match stream.try_clone() {
            Ok(clone) => clone,
            Err(err) => {
                warn!(conn, error = %err, "duplicating the connection failed; dropping it");
                continue;
            }
        };
        shared
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(conn, clone);
        // A stop that drained `open` before this insert has set `stopping` before it took the
        // lock, so it is visible here: close the connection instead of serving it.
        if shared.stopping.load(Ordering::SeqCst) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        let worker = Arc::clone(shared);
        match thread::Builder::new()
            .name(format!("belayer-mem-conn-{conn}"))
            .spawn(move || {
                serve_connection(&worker, conn, &stream);
                worker
                    .open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&conn);
            }) {
            Ok(thread) => threads.push(thread),
            Err(err) => {
                warn!(conn, error = %err, "spawning a connection thread failed; dropping it");
                shared
                    .open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&conn);
            }
        }
    }
    for thread in threads {
        let _ = thread.join();
    }
}

#[cfg(test)]
mod tests;
