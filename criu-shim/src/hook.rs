//! A restore with a hook at CRIU's `post-setup-namespaces` stage: CRIU has created the
//! restored tree's namespaces (the root task exists, no file or socket is restored yet) and
//! runs its action script, which reports the root task's host pid and waits for a go. The
//! caller readies the namespaces meanwhile (for a tree restored with
//! [`RestoreRequest::empty_netns`]: `lo` up, sysctls, a lock against early packets).
//!
//! The script and its fifos (`hook-ready`, `hook-go`) live in the restore's work dir. An
//! answer other than `go` fails the script, which makes CRIU abort the restore (it kills the
//! half-restored tree). A CRIU killed at its time limit takes the script with it (they share
//! CRIU's process group).

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::gate::{answer, join_runner, make_fifo, quote, ORPHAN_TIMEOUT, SLICE};
use crate::restore::{RestoreError, RestoreOutcome, RestoreRequest};
use crate::{run, Criu};

/// Longest pid line the script writes.
const MAX_LINE: usize = 32;

/// Why a hooked restore failed.
#[derive(Debug, thiserror::Error)]
pub enum HookedRestoreError<E> {
    /// The caller's hook failed; CRIU was told to abort the restore.
    #[error("the step at the restore's post-setup-namespaces stage failed")]
    Hook(#[source] E),
    /// Setting up the hook (script, fifos) failed, or CRIU reported a pid that is none.
    #[error("cannot set up the restore hook at {}", path.display())]
    Setup {
        /// The file involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// CRIU exited before its post-setup-namespaces stage, or the restore itself failed.
    #[error(transparent)]
    Restore(#[from] RestoreError),
}

fn setup_err<E>(path: &Path) -> impl FnOnce(io::Error) -> HookedRestoreError<E> {
    let path = path.to_path_buf();
    move |source| HookedRestoreError::Setup { path, source }
}

/// The action script: on `post-setup-namespaces`, write `$CRTOOLS_INIT_PID` into `ready` and
/// wait for the answer in `go`; every other stage passes. Both fifo operations are bounded.
fn hook_script(ready: &Path, go: &Path) -> String {
    format!(
        "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-setup-namespaces ] || exit 0\n\
         timeout {wait} sh -c 'echo \"$CRTOOLS_INIT_PID\" > \"$1\"' hook {ready} || exit 1\n\
         answer=$(timeout {wait} cat {go}) || exit 1\n\
         [ \"$answer\" = go ]\n",
        wait = ORPHAN_TIMEOUT.as_secs(),
        ready = quote(ready),
        go = quote(go),
    )
}

impl Criu {
    /// Like [`Criu::restore`], but `hook` runs with the restored root task's host pid once
    /// CRIU has created the tree's namespaces and before it restores any file or socket; CRIU
    /// goes on if `hook` returned `Ok` and aborts the restore (killing what it made) if it
    /// returned `Err`. CRIU's time limit ([`RestoreRequest::time_limit`]) bounds the wait for
    /// that stage. Returns the outcome and what `hook` returned.
    ///
    /// Errors: [`HookedRestoreError::Hook`], [`HookedRestoreError::Setup`],
    /// [`HookedRestoreError::Restore`] (CRIU exited before the stage, or failed after it).
    pub fn restore_hooked<T, E>(
        &self,
        req: &RestoreRequest,
        hook: impl FnOnce(i32) -> Result<T, E>,
    ) -> Result<(RestoreOutcome, T), HookedRestoreError<E>> {
        let setup = req.child_setup()?;
        let work = req.work_dir().to_path_buf();
        let ready_path = work.join("hook-ready");
        let go_path = work.join("hook-go");
        let script = work.join("hook.sh");
        make_fifo(&ready_path).map_err(setup_err(&ready_path))?;
        make_fifo(&go_path).map_err(setup_err(&go_path))?;
        std::fs::write(&script, hook_script(&ready_path, &go_path)).map_err(setup_err(&script))?;
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(setup_err(&script))?;
        // Opened before CRIU starts, so the script's write never blocks on our open.
        let mut ready = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&ready_path)
            .map_err(setup_err(&ready_path))?;

        let mut args = req.args();
        run::push(&mut args, "--action-script", &script);
        let criu = self.path().to_path_buf();
        let child = std::thread::spawn(move || run::run(&criu, &args, setup));

        let mut line = Vec::new();
        let reported = loop {
            if child.is_finished() {
                break false;
            }
            let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
            let slice = PollTimeout::try_from(SLICE).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, slice) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => {
                    let mut buf = [0u8; MAX_LINE];
                    match ready.read(&mut buf) {
                        Ok(n) if n > 0 => {
                            line.extend_from_slice(&buf[..n]);
                            if line.ends_with(b"\n") || line.len() >= MAX_LINE {
                                break true;
                            }
                        }
                        // Writer gone (EOF) or nothing yet: keep polling.
                        _ => std::thread::sleep(SLICE),
                    }
                }
                Err(e) => return Err(setup_err(&ready_path)(e.into())),
            }
        };
        if !reported {
            let done = join(child, self.path())?;
            req.finish(done)?;
            return Err(setup_err(&ready_path)(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "criu exited before its post-setup-namespaces stage",
            )));
        }
        let pid = std::str::from_utf8(&line)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .filter(|&p| p > 1);
        let hooked = pid.map(hook);
        let proceed = matches!(hooked, Some(Ok(_)));
        let answered = answer(&go_path, proceed, &child);
        let done = join(child, self.path())?;
        answered.map_err(setup_err(&go_path))?;
        match hooked {
            Some(Ok(value)) => Ok((req.finish(done)?, value)),
            Some(Err(e)) => Err(HookedRestoreError::Hook(e)),
            None => Err(setup_err(&ready_path)(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "criu reported root pid {:?}",
                    String::from_utf8_lossy(&line)
                ),
            ))),
        }
    }
}

fn join(
    child: std::thread::JoinHandle<io::Result<run::Finished>>,
    criu: &Path,
) -> Result<run::Finished, RestoreError> {
    join_runner(child).map_err(|source| RestoreError::Spawn {
        criu: criu.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    #[test]
    fn the_script_reports_the_root_pid_and_passes_other_stages() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, go) = (dir.path().join("hook-ready"), dir.path().join("hook-go"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        let script = dir.path().join("hook.sh");
        std::fs::write(&script, hook_script(&ready, &go)).unwrap();
        let other = Command::new("sh")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "post-restore")
            .status()
            .unwrap();
        assert!(other.success());
        let mut child = Command::new("sh")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "post-setup-namespaces")
            .env("CRTOOLS_INIT_PID", "4242")
            .spawn()
            .unwrap();
        let mut text = String::new();
        std::fs::File::open(&ready)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "4242\n");
        let criu_running =
            std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_secs(3)));
        answer(&go, false, &criu_running).unwrap();
        assert!(
            !child.wait().unwrap().success(),
            "an abort fails the script"
        );
    }
}
