//! Memory servers started and supervised by `belayerd` (paper: "State isolation": weight and
//! KV-cache servers outlive inference workers).
//!
//! `belayerd`'s config lists servers (`[[memory_server]]` with role, device, layout, socket).
//! The supervisor starts each as a `belayer-memd` child (the binary next to `belayerd`),
//! watches it, and starts it again when it dies: the dead server's allocations are gone, so its
//! workers see the owner-alive check fail and must attach again and reload (the paper reuses
//! allocations only while their owners are alive). A server already answering on its socket
//! (left by a previous `belayerd`) is adopted, not started twice. Servers keep running when
//! `belayerd` stops.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use belayer_ipc::memory::{Backend, MemClient, Role};
use serde::Deserialize;

use super::process::ServerProcess;

/// One supervised memory server (`[[memory_server]]` in the config); role and device are
/// parsed when the config is read, so a bad one is refused with the config's own error.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SupervisedServer {
    /// `weights` or `kv`.
    #[serde(deserialize_with = "role_from_text")]
    pub role: Role,
    /// `host` (default) or `cuda:N`.
    #[serde(default = "default_device", deserialize_with = "device_from_text")]
    pub device: Backend,
    /// Layout file (TOML).
    pub layout: PathBuf,
    /// Socket the server listens on.
    pub socket: PathBuf,
}

fn default_device() -> Backend {
    Backend::Host
}

fn role_from_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
    let text = String::deserialize(d)?;
    super::parse_role(&text).map_err(serde::de::Error::custom)
}

fn device_from_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Backend, D::Error> {
    let text = String::deserialize(d)?;
    super::parse_device(&text).map_err(serde::de::Error::custom)
}

/// Errors of the supervisor.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// Starting the supervisor thread failed.
    #[error("cannot start the memory-server supervisor")]
    Thread(#[source] std::io::Error),
}

/// The running supervisor; stopping it leaves the servers running.
#[derive(Debug)]
pub struct Supervisor {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

enum Slot {
    Child(ServerProcess),
    Adopted,
    Down,
}

fn answers(socket: &Path) -> bool {
    MemClient::connect(socket)
        .and_then(|mut c| c.ping())
        .is_ok()
}

fn start(exe: &Path, s: &SupervisedServer, role: Role, device: Backend) -> Slot {
    if answers(&s.socket) {
        tracing::info!(socket = %s.socket.display(), "adopted running memory server");
        return Slot::Adopted;
    }
    match ServerProcess::spawn(exe, role, device, &s.layout, &s.socket, &[]) {
        Ok(p) => {
            tracing::info!(socket = %s.socket.display(), pid = p.pid(), startup_ms = p.startup().as_secs_f64() * 1e3,
                "memory server started");
            Slot::Child(p)
        }
        Err(e) => {
            tracing::error!(socket = %s.socket.display(), error = %e, "memory server failed to start");
            Slot::Down
        }
    }
}

impl Supervisor {
    /// Starts every server and a thread that restarts the ones that die (checked every
    /// `interval`). `exe` is the `belayer-memd` binary.
    pub fn start(
        exe: &Path,
        servers: &[SupervisedServer],
        interval: Duration,
    ) -> Result<Supervisor, SuperviseError> {
        let specs: Vec<(SupervisedServer, Role, Backend)> = servers
            .iter()
            .map(|s| (s.clone(), s.role, s.device))
            .collect();
        let mut slots: Vec<Slot> = specs
            .iter()
            .map(|(s, r, d)| start(exe, s, *r, *d))
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let exe = exe.to_path_buf();
        let thread = std::thread::Builder::new()
            .name("memory-supervisor".into())
            .spawn(move || {
                while !flag.load(Ordering::SeqCst) {
                    std::thread::sleep(interval);
                    for (slot, (s, role, device)) in slots.iter_mut().zip(&specs) {
                        let dead = match slot {
                            Slot::Child(p) => match p.try_wait() {
                                Some(status) => {
                                    tracing::error!(socket = %s.socket.display(), %status,
                                        "memory server died: its allocations are lost; restarting");
                                    true
                                }
                                None => false,
                            },
                            Slot::Adopted => !answers(&s.socket),
                            Slot::Down => true,
                        };
                        if dead {
                            *slot = start(&exe, s, *role, *device);
                        }
                    }
                }
                // Leave the servers running: they must outlive belayerd.
                for slot in slots {
                    if let Slot::Child(p) = slot {
                        std::mem::forget(p);
                    }
                }
            })
            .map_err(SuperviseError::Thread)?;
        Ok(Supervisor {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
