//! The `belayerd` process of a load run: started on a private socket and state dir, sampled for
//! its resident memory and threads, killed with `SIGKILL` and started again on demand.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use belayer_ipc::{Client, Request, Response};

/// A supervised `belayerd`.
#[derive(Debug)]
pub struct Supervised {
    binary: PathBuf,
    /// Its socket.
    pub socket: PathBuf,
    /// Its state dir.
    pub state_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// Times it was started.
    pub starts: u32,
}

/// Peak use of one daemon process, from `/proc/PID/status`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Peak {
    /// Largest `VmRSS` seen, KiB.
    pub rss_kib: u64,
    /// Largest `Threads` seen.
    pub threads: u64,
}

impl Peak {
    /// Folds one sample of `pid` in; a process that is gone leaves the peak as it was.
    pub fn sample(&mut self, pid: u32) {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return;
        };
        for line in status.lines() {
            let mut words = line.split_whitespace();
            let (Some(key), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(value) = value.parse::<u64>() else {
                continue;
            };
            match key {
                "VmRSS:" => self.rss_kib = self.rss_kib.max(value),
                "Threads:" => self.threads = self.threads.max(value),
                _ => {}
            }
        }
    }
}

impl Supervised {
    /// Starts `binary` (`belayerd`) with `--socket` and `--state-dir` under `dir`, its log in
    /// `dir/belayerd.log`, and waits until it answers a ping (at most 60 s).
    ///
    /// Errors: the binary cannot be started, or it never answers.
    pub fn start(binary: &Path, dir: &Path) -> Result<Supervised> {
        let mut d = Supervised {
            binary: binary.to_path_buf(),
            socket: dir.join("belayer.sock"),
            state_dir: dir.join("state"),
            log: dir.join("belayerd.log"),
            child: None,
            starts: 0,
        };
        d.spawn()?;
        Ok(d)
    }

    /// The running daemon's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn spawn(&mut self) -> Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let child = Command::new(&self.binary)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        self.starts += 1;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if matches!(c.call(Request::Ping), Ok(Response::Pong { .. })) {
                    return Ok(());
                }
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "belayerd exited ({status}) before answering; log: {}",
                    self.log.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "belayerd did not answer within 60 s; log: {}",
                    self.log.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `SIGKILL`s the daemon (sandboxes keep running), reaps it and starts it again; returns
    /// how long it was away, seconds.
    ///
    /// Errors: those of [`Supervised::start`].
    pub fn kill_and_restart(&mut self) -> Result<f64> {
        let started = Instant::now();
        self.kill();
        self.spawn()?;
        Ok(started.elapsed().as_secs_f64())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The path of its log.
    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if let Ok(mut c) = Client::connect(&self.socket) {
            if let Ok(Response::Sandboxes(list)) = c.call(Request::ListSandboxes) {
                for s in list {
                    let _ = c.call(Request::RemoveSandbox { id: s.id });
                }
            }
        }
        self.kill();
    }
}
