//! A private `belayerd` started as a child of `belayer` when no daemon answers, so that the
//! rollout (the main job) needs no daemon started by hand.
//!
//! The child is the `belayerd` installed next to `belayer`, with its built-in defaults (the
//! node's config file is not read), a fresh state dir and socket under
//! `/var/lib/belayer/scratch` (the btrfs state file system of `scripts/setup.sh`, so sandboxes
//! get their disk quota), and the log level of this command. Dropping the handle removes the
//! child's sandboxes through the protocol, stops it with SIGTERM and removes its state dir
//! (only once the daemon reports no sandbox left: otherwise the dir stays, with a warning).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use belayer_ipc::{Client, Request, Response};

/// Parent of the private daemons' state dirs (on the node's state file system).
pub const SCRATCH_DIR: &str = "/var/lib/belayer/scratch";

/// How long the child may take to answer its first ping.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A running private `belayerd`.
#[derive(Debug)]
pub struct Embedded {
    /// Its socket.
    pub socket: PathBuf,
    state_dir: PathBuf,
    child: Option<Child>,
}

impl Embedded {
    /// Starts a private `belayerd` with a fresh state dir; `log` is its `BELAYER_LOG` unless
    /// the environment sets one.
    ///
    /// Errors: `belayerd` is not next to this binary, cannot be started, exits, or does not
    /// answer within a minute (its log is on stderr).
    pub fn start(log: &str) -> Result<Embedded> {
        let nonce = blake3::hash(format!("{}-{:?}", std::process::id(), Instant::now()).as_bytes())
            .to_hex();
        let state_dir =
            Path::new(SCRATCH_DIR).join(format!("embedded-{}-{}", std::process::id(), &nonce[..8]));
        std::fs::create_dir_all(&state_dir)
            .with_context(|| format!("creating {}", state_dir.display()))?;
        let socket = state_dir.join("belayer.sock");
        let mut e = Embedded {
            socket,
            state_dir,
            child: None,
        };
        let exe = crate::forward::sibling("belayerd")?;
        let mut cmd = Command::new(&exe);
        cmd.arg("--config")
            .arg("/dev/null")
            .arg("--socket")
            .arg(&e.socket)
            .arg("--state-dir")
            .arg(&e.state_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if std::env::var_os("BELAYER_LOG").is_none() {
            cmd.env("BELAYER_LOG", log);
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {} (installed next to belayer)", exe.display()))?;
        e.child = Some(child);
        e.wait_ready()?;
        tracing::info!(socket = %e.socket.display(), "started a private belayerd");
        Ok(e)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if matches!(c.call(Request::Ping), Ok(Response::Pong { .. })) {
                    return Ok(());
                }
            }
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait().context("waiting for belayerd")? {
                    self.child = None;
                    bail!("the private belayerd exited with {status} (its log is above)");
                }
            }
            if Instant::now() > deadline {
                bail!("the private belayerd did not answer within {START_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Embedded {
    fn drop(&mut self) {
        // The daemon removes its sandboxes (with its hardened removal); only an empty state
        // dir is deleted here, so nothing a sandbox left behind is walked from the host.
        let mut emptied = false;
        if let Ok(mut c) = Client::connect(&self.socket) {
            if let Ok(Response::Sandboxes(list)) = c.call(Request::ListSandboxes) {
                for s in list {
                    let _ = c.call(Request::RemoveSandbox { id: s.id });
                }
            }
            emptied = matches!(
                c.call(Request::ListSandboxes),
                Ok(Response::Sandboxes(list)) if list.is_empty()
            );
        }
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        if !emptied {
            tracing::warn!(dir = %self.state_dir.display(), "the private belayerd kept sandboxes; its state dir is left in place");
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.state_dir) {
            tracing::warn!(dir = %self.state_dir.display(), error = %e, "cannot remove the private belayerd's state dir");
        }
    }
}

/// Connects to the daemon at `socket`, or starts a private one (logging at `log`) when none
/// answers.
///
/// Errors: as [`Embedded::start`].
pub fn connect_or_embed(socket: &Path, log: &str) -> Result<(Client, Option<Embedded>)> {
    if let Ok(mut c) = Client::connect(socket) {
        match c.call(Request::Ping) {
            Ok(Response::Pong { .. }) => return Ok((c, None)),
            // A daemon is there but does not answer as this client expects (e.g. another
            // protocol version): a second daemon beside it would share its uid pool, cgroup
            // parent and dump stage.
            other => bail!(
                "belayerd at {} did not answer a ping ({}); not starting a private one beside it",
                socket.display(),
                match other {
                    Ok(r) => format!("{r:?}"),
                    Err(e) => belayer_ipc::error_chain(&e),
                }
            ),
        }
    }
    // Nor beside the node's daemon when the caller named another socket.
    let node = Path::new(belayer_ipc::DEFAULT_SOCKET);
    if socket != node && Client::connect(node).is_ok() {
        bail!(
            "no belayerd at {}, but the node's belayerd listens at {}: use --socket {} (a private daemon beside it would share its uid pool, cgroup parent and dump stage)",
            socket.display(),
            node.display(),
            node.display()
        );
    }
    let e = Embedded::start(log)?;
    let c = Client::connect(&e.socket).context("connecting to the private belayerd")?;
    Ok((c, Some(e)))
}
