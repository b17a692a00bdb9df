//! A memory server run as a child process (`belayer-memd ...`), as a supervisor
//! (belayerd, the benchmark, the tests) starts it: spawn, wait for its `ready` line, stop it
//! with SIGTERM or kill it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::memory::{Backend, Role};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Why a memory-server process could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// Spawning the binary failed.
    #[error("spawning memory server {exe} failed")]
    Spawn {
        /// The `belayer-memd` binary.
        exe: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The process exited (or closed stdout) before printing its `ready` line.
    #[error("memory server for {socket} exited before it was ready ({status})")]
    NotReady {
        /// Socket path.
        socket: PathBuf,
        /// Exit status, or what was read instead.
        status: String,
    },
    /// Signalling the process failed.
    #[error("sending {signal:?} to memory server pid {pid} failed")]
    Signal {
        /// Pid.
        pid: i32,
        /// Signal.
        signal: Signal,
        /// The errno.
        #[source]
        source: nix::errno::Errno,
    },
    /// Waiting for the process failed.
    #[error("waiting for memory server pid {pid} failed")]
    Wait {
        /// Pid.
        pid: i32,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A running `belayer-memd` child. Dropping it kills and reaps the process.
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    socket: PathBuf,
    /// Kept open so that the server never writes to a closed pipe.
    _stdout: BufReader<ChildStdout>,
    /// Time from spawn to the `ready` line.
    startup: Duration,
}

impl ServerProcess {
    /// Runs `exe --role ROLE --device DEVICE --layout LAYOUT --socket SOCKET
    /// [extra...]` and waits until it prints its `ready` line (stderr is inherited).
    ///
    /// Errors: [`ProcessError::Spawn`], [`ProcessError::NotReady`].
    pub fn spawn(
        exe: &Path,
        role: Role,
        device: Backend,
        layout: &Path,
        socket: &Path,
        extra: &[&str],
    ) -> Result<ServerProcess, ProcessError> {
        let started = Instant::now();
        let mut child = Command::new(exe)
            .args(["--role", role.as_str()])
            .args(["--device", &device.to_string()])
            .arg("--layout")
            .arg(layout)
            .arg("--socket")
            .arg(socket)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| ProcessError::Spawn {
                exe: exe.to_owned(),
                source,
            })?;
        let Some(stdout) = child.stdout.take() else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ProcessError::NotReady {
                socket: socket.to_owned(),
                status: "no stdout pipe".to_owned(),
            });
        };
        let mut stdout = BufReader::new(stdout);
        let mut line = String::new();
        let read = stdout.read_line(&mut line);
        if !matches!(read, Ok(n) if n > 0 && line.starts_with("ready")) {
            let _ = child.kill();
            let status = child
                .wait()
                .map(|s| s.to_string())
                .unwrap_or_else(|e| e.to_string());
            return Err(ProcessError::NotReady {
                socket: socket.to_owned(),
                status: format!("{status}; stdout {line:?}"),
            });
        }
        Ok(ServerProcess {
            child,
            socket: socket.to_owned(),
            _stdout: stdout,
            startup: started.elapsed(),
        })
    }

    /// The server's pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The server's socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The exit status if the server has exited (non-blocking; reaps it).
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Time from spawn to the `ready` line (allocation included).
    pub fn startup(&self) -> Duration {
        self.startup
    }

    fn signal(&self, signal: Signal) -> Result<(), ProcessError> {
        kill(Pid::from_raw(self.pid()), signal).map_err(|source| ProcessError::Signal {
            pid: self.pid(),
            signal,
            source,
        })
    }

    /// Stops the server with SIGTERM and reaps it; returns its exit code (`None` if killed).
    ///
    /// Errors: [`ProcessError::Signal`], [`ProcessError::Wait`].
    pub fn stop(mut self) -> Result<Option<i32>, ProcessError> {
        self.signal(Signal::SIGTERM)?;
        let pid = self.pid();
        let status = self
            .child
            .wait()
            .map_err(|source| ProcessError::Wait { pid, source })?;
        Ok(status.code())
    }

    /// Kills the server with SIGKILL (no cleanup at all, as in a crash) and reaps it.
    ///
    /// Errors: [`ProcessError::Signal`], [`ProcessError::Wait`].
    pub fn kill(mut self) -> Result<(), ProcessError> {
        self.signal(Signal::SIGKILL)?;
        let pid = self.pid();
        self.child
            .wait()
            .map_err(|source| ProcessError::Wait { pid, source })?;
        Ok(())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
