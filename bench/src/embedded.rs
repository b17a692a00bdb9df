//! An agent started inside the `belayer-bench` process when no `belayerd` answers, so that the
//! benchmarks need no daemon started by hand (the `belayer` client starts a `belayerd` child
//! instead: it links no daemon code).
//!
//! It uses a private state dir and socket under `/var/lib/belayer/scratch` (the btrfs state file
//! system of `scripts/setup.sh`, so sandboxes get their disk quota; see
//! [`belayer_daemon::config::scratch_state_dir`]) and removes its sandboxes and state when dropped.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use belayer_ipc::{Client, Request, Response, Server, ServerConfig, ServerHandle};

use belayer_daemon::config::Config;
use belayer_daemon::service::Agent;

/// A running in-process agent.
#[derive(Debug)]
pub struct Embedded {
    /// Its socket.
    pub socket: PathBuf,
    state_dir: PathBuf,
    server: Option<ServerHandle>,
}

impl Embedded {
    /// Starts an agent with a fresh state dir.
    pub fn start() -> Result<Embedded> {
        let state_dir = belayer_daemon::config::scratch_state_dir("embedded");
        std::fs::create_dir_all(&state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        let started = Self::serve(&state_dir);
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&state_dir);
        }
        started
    }

    fn serve(state_dir: &Path) -> Result<Embedded> {
        let state_dir = state_dir.to_path_buf();
        let socket = state_dir.join("belayer.sock");
        let config = Config {
            socket: socket.clone(),
            state_dir: state_dir.clone(),
            ..Config::default()
        };
        let max_frame = config.max_frame_bytes;
        let agent = Agent::start(config).context("starting the embedded agent")?;
        let server = Server::bind(ServerConfig::new(&socket).max_frame(max_frame))
            .context("binding the embedded agent's socket")?;
        let handler: Arc<dyn belayer_ipc::Handler> = agent;
        let server = server
            .spawn(handler)
            .context("starting the embedded agent's server")?;
        tracing::info!(socket = %socket.display(), "started an embedded agent");
        Ok(Embedded {
            socket,
            state_dir,
            server: Some(server),
        })
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        if let Ok(mut c) = Client::connect(&self.socket) {
            if let Ok(Response::Sandboxes(list)) = c.call(Request::ListSandboxes) {
                for s in list {
                    let _ = c.call(Request::RemoveSandbox { id: s.id });
                }
            }
        }
        if let Some(server) = self.server.take() {
            if let Err(e) = server.shutdown() {
                tracing::warn!(error = %e, "embedded agent server did not stop cleanly");
            }
        }
        let _ = belayer_overlay::remove_dir_all(&self.state_dir);
    }
}

/// Connects to the daemon at `socket`, or starts an embedded agent when none answers.
pub fn connect_or_embed(socket: &Path) -> Result<(Client, Option<Embedded>)> {
    if let Ok(mut c) = Client::connect(socket) {
        if matches!(c.call(Request::Ping), Ok(Response::Pong { .. })) {
            return Ok((c, None));
        }
    }
    let e = Embedded::start()?;
    let c = Client::connect(&e.socket).context("connecting to the embedded agent")?;
    Ok((c, Some(e)))
}
