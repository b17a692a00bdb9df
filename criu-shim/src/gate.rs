//! A dump whose freeze happens after CRIU has started: CRIU runs a `pre-dump` action script
//! once it is initialised (binary loaded, kernel-feature cache read, options checked) and
//! before it seizes the tree; the script tells the caller it is ready and waits for a go.
//! The caller freezes the sandbox and captures its file system in between, so CRIU's own
//! start-up (≈20 ms here) is no longer inside the sandbox's frozen window.
//!
//! The script and its two fifos (`gate-ready`, `gate-go`) live in the dump's work dir. An
//! answer other than `go` makes the script fail, which makes CRIU abort the dump before it
//! touched the tree.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::stat::Mode;

use crate::dump::{DumpError, DumpRequest, DumpStats};
use crate::locate::Criu;
use crate::run;

/// Longest wait for CRIU to reach its `pre-dump` stage.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait of the script for an answer: a CRIU whose caller died gives up after it.
pub(crate) const ORPHAN_TIMEOUT: Duration = Duration::from_secs(120);
/// Poll slice while waiting: how soon an early CRIU exit is noticed.
pub(crate) const SLICE: Duration = Duration::from_millis(20);

/// Why a gated dump failed.
#[derive(Debug, thiserror::Error)]
pub enum GatedDumpError<E> {
    /// The caller's gate step failed; CRIU was told to abort and did not touch the tree.
    #[error("the step before the dump failed")]
    Gate(#[source] E),
    /// Setting up the gate (script, fifos) failed, or CRIU never reached its `pre-dump` stage.
    #[error("cannot set up the dump gate at {}", path.display())]
    Setup {
        /// The file involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The dump itself failed.
    #[error(transparent)]
    Dump(#[from] DumpError),
}

fn setup_err<E>(path: &Path) -> impl FnOnce(io::Error) -> GatedDumpError<E> {
    let path = path.to_path_buf();
    move |source| GatedDumpError::Setup { path, source }
}

pub(crate) fn make_fifo(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    nix::unistd::mkfifo(path, Mode::from_bits_truncate(0o600)).map_err(io::Error::from)
}

/// An action script that holds CRIU at each action in `held` (CRIU's stage names): it writes
/// `line` (shell words, expanded by the script) and a newline into the fifo `ready`, waits for
/// the answer in the fifo `go`, and succeeds if that is `go`; every other action passes. One
/// program start per held stage: `bash -p` (privileged mode: no `$BASH_ENV`, no functions
/// from the environment), whose `read -t` bounds the wait, so a CRIU whose caller died gives
/// up by itself after [`ORPHAN_TIMEOUT`]. Both fifos are opened read-write, which never
/// blocks: the report sits in `ready` for the caller (who holds it open from before CRIU
/// starts), and the script is a reader of `go` from then on (the caller's and
/// [`abort_waiting_script`]'s non-blocking open for writing finds it). It stays in CRIU's
/// process group, so a CRIU killed with its group takes it along.
pub(crate) fn holding_script(held: &[&str], line: &str, ready: &Path, go: &Path) -> String {
    format!(
        "#!/bin/bash -p
case \"$CRTOOLS_SCRIPT_ACTION\" in
{held}) ;;
*) exit 0 ;;
esac
\
         echo {line} 1<> {ready} || exit 1
\
         read -t {wait} -r answer 0<> {go} || exit 1
\
         [ \"$answer\" = go ]
",
        held = held.join("|"),
        wait = ORPHAN_TIMEOUT.as_secs(),
        ready = quote(ready),
        go = quote(go),
    )
}

/// The `pre-dump` action script ([`holding_script`]): reports `ready`, waits for the answer.
/// The CRIU `scripts/setup.sh` builds runs it at `pre-dump` only (`ChildSetup::script_actions`),
/// so nothing of it runs once the tree is frozen; another CRIU runs it at every stage, where it
/// passes (a `bash` start each, three of them in the frozen window).
fn gate_script(ready: &Path, go: &Path) -> String {
    holding_script(&[GATE_ACTION], "ready", ready, go)
}

/// The stage a gated dump holds CRIU at.
const GATE_ACTION: &str = "pre-dump";

/// Single-quotes `path` for `sh`.
pub(crate) fn quote(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

impl Criu {
    /// Like [`Criu::dump`], but the tree is seized only after `gate` ran: CRIU is started,
    /// and once it is ready to dump (its `pre-dump` stage) `gate` is called; CRIU then dumps
    /// if `gate` returned `Ok`, and aborts without touching the tree if it returned `Err`.
    /// Use it to freeze the tree's cgroup (`req` should say
    /// [`freeze_cgroup`](DumpRequest::freeze_cgroup)) and capture state that must be taken
    /// in the same frozen instant, without CRIU's start-up in the frozen window. Returns the
    /// dump's stats and what `gate` returned.
    ///
    /// Errors: [`GatedDumpError::Gate`], [`GatedDumpError::Setup`] (CRIU exited or hung
    /// before its `pre-dump` stage: the log tail is in a following [`DumpError`] when CRIU
    /// exited), [`GatedDumpError::Dump`].
    pub fn dump_gated<T, E>(
        &self,
        req: &DumpRequest,
        gate: impl FnOnce() -> Result<T, E>,
    ) -> Result<(DumpStats, T), GatedDumpError<E>> {
        req.check_images_dir()?;
        let work = req.work_dir().to_path_buf();
        std::fs::create_dir_all(&work).map_err(|source| DumpError::CreateWorkDir {
            path: work.clone(),
            source,
        })?;
        let ready_path = work.join("gate-ready");
        let go_path = work.join("gate-go");
        let script = work.join("gate.sh");
        make_fifo(&ready_path).map_err(setup_err(&ready_path))?;
        make_fifo(&go_path).map_err(setup_err(&go_path))?;
        // Written by CRIU's own process before its exec (`ChildSetup::scripts`), not here.
        let text = run::script_file(&script, gate_script(&ready_path, &go_path))
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
        let mut setup = req.child_setup()?;
        setup.scripts.push(text);
        // Only the gate acts, at pre-dump; a caller's own script may act anywhere.
        if req.action_script_path().is_none() {
            setup.script_actions = Some(GATE_ACTION.to_string());
        }
        let child = std::thread::spawn(move || run::run(&criu, &args, setup));

        let started = Instant::now();
        let mut seen_ready = false;
        while !seen_ready {
            if child.is_finished() || started.elapsed() > READY_TIMEOUT {
                break;
            }
            let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
            let slice = PollTimeout::try_from(SLICE).unwrap_or(PollTimeout::MAX);
            match poll(&mut fds, slice) {
                Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
                Ok(_) => {
                    let mut buf = [0u8; 16];
                    match ready.read(&mut buf) {
                        Ok(n) if n > 0 => seen_ready = true,
                        // A hang-up without a report: wait a slice instead of spinning.
                        _ => std::thread::sleep(SLICE),
                    }
                }
                Err(e) => return Err(setup_err(&ready_path)(e.into())),
            }
        }
        if !seen_ready {
            if !child.is_finished() {
                // Hung before pre-dump: answer anyway so the script (if any) ends, then wait.
                let _ = answer(&go_path, false, &child);
            }
            let done = join(child, self.path())?;
            req.finish(done)?;
            return Err(setup_err(&ready_path)(io::Error::new(
                io::ErrorKind::TimedOut,
                "criu exited or stalled before its pre-dump stage",
            )));
        }
        let gated = gate();
        answer(&go_path, gated.is_ok(), &child).map_err(setup_err(&go_path))?;
        let done = join(child, self.path())?;
        match gated {
            Ok(value) => Ok((req.finish(done)?, value)),
            Err(e) => Err(GatedDumpError::Gate(e)),
        }
    }
}

/// Tells a gated dump whose caller died (its script waiting in `work_dir` to report ready or
/// for an answer) to abort, so CRIU exits without touching the tree. Returns whether one was
/// waiting. Waits at most about a second.
pub fn abort_gated_dump(work_dir: &Path) -> bool {
    abort_waiting_script(&work_dir.join("gate-ready"), &work_dir.join("gate-go"))
}

/// Answers `abort` to a staged restore ([`crate::Criu::restore_staged`]) whose caller died
/// while CRIU's action script in `work_dir` waited at a stage, so CRIU stops waiting for the
/// script's whole bound (at `post-setup-namespaces` it then aborts; at `pre-resume` it goes
/// on: kill the restored tree first). Returns whether one was waiting. Waits at most about
/// a second.
pub fn abort_held_restore(work_dir: &Path) -> bool {
    abort_waiting_script(&work_dir.join("hook-ready"), &work_dir.join("hook-go"))
}

/// Opens `ready` for reading, then writes `abort` into `go` once a reader has it open. A
/// [`holding_script`] never blocks on its report (it opens `ready` read-write); the open is
/// for a script an earlier version wrote (`echo > ready`, which blocks without a reader), left
/// waiting by a daemon that was upgraded meanwhile.
fn abort_waiting_script(ready: &Path, go: &Path) -> bool {
    // Lets an earlier version's script blocked on reporting go on to wait for the answer.
    let Ok(_reader) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(ready)
    else {
        return false;
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(go)
        {
            Ok(mut fifo) => return fifo.write_all(b"abort\n").is_ok(),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return false,
        }
    }
}

/// Writes the answer into the go fifo once the script opened it for reading.
pub(crate) fn answer<T>(
    go: &Path,
    proceed: bool,
    child: &std::thread::JoinHandle<T>,
) -> io::Result<()> {
    let started = Instant::now();
    let mut fifo: File = loop {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(go)
        {
            Ok(f) => break f,
            // No reader yet.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                if child.is_finished() || started.elapsed() > READY_TIMEOUT {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            Err(e) => return Err(e),
        }
    };
    fifo.write_all(if proceed { b"go\n" } else { b"abort\n" })
}

fn join(
    child: std::thread::JoinHandle<io::Result<run::Finished>>,
    criu: &Path,
) -> Result<run::Finished, DumpError> {
    join_runner(child).map_err(|source| DumpError::Spawn {
        criu: criu.to_path_buf(),
        source,
    })
}

/// Waits for the thread running CRIU (a panic in it is an error like a failed spawn).
pub(crate) fn join_runner(
    child: std::thread::JoinHandle<io::Result<run::Finished>>,
) -> io::Result<run::Finished> {
    child
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("criu runner thread panicked")))
}

/// The caller's end of a `ready` fifo, opened before the script starts (as
/// [`Criu::dump_gated`] and [`Criu::restore_staged`] do).
#[cfg(test)]
pub(crate) fn caller_end(ready: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(ready)
        .unwrap()
}

/// One line from the caller's end of a `ready` fifo (blocks until it comes).
#[cfg(test)]
pub(crate) fn read_report(ready: &mut File) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\n") {
        assert_eq!(ready.read(&mut byte).unwrap(), 1);
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// The gate script waiting in `dir`, and the caller's end of its `ready` fifo when
    /// `caller` (opened before the script starts, as [`Criu::dump_gated`] does).
    fn waiting_script(dir: &Path, caller: bool) -> (std::process::Child, Option<File>) {
        let (ready, go) = (dir.join("gate-ready"), dir.join("gate-go"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        let end = caller.then(|| caller_end(&ready));
        let script = dir.join("gate.sh");
        std::fs::write(&script, gate_script(&ready, &go)).unwrap();
        let child = Command::new("bash")
            .arg("-p")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "pre-dump")
            .spawn()
            .unwrap();
        (child, end)
    }

    fn exits_within(child: &mut std::process::Child, limit: Duration) -> Option<bool> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status.success());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        None
    }

    #[test]
    fn an_orphaned_gate_is_released_whether_or_not_its_report_was_read() {
        // Its caller died before reading the report (nobody holds `ready`): abort releases it.
        let dir = tempfile::tempdir().unwrap();
        let (mut script, _) = waiting_script(dir.path(), false);
        std::thread::sleep(Duration::from_millis(100));
        assert!(abort_gated_dump(dir.path()), "a script was waiting");
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(false)
        );

        // Reported ready and waiting for the answer: abort fails it too.
        let dir = tempfile::tempdir().unwrap();
        let (mut script, ready) = waiting_script(dir.path(), true);
        assert_eq!(read_report(&mut ready.unwrap()), "ready\n");
        assert!(abort_gated_dump(dir.path()));
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(false)
        );

        // A go lets it succeed; nothing waiting: nothing to abort.
        let dir = tempfile::tempdir().unwrap();
        let (mut script, ready) = waiting_script(dir.path(), true);
        assert_eq!(read_report(&mut ready.unwrap()), "ready\n");
        let criu_running = std::thread::spawn(|| std::thread::sleep(Duration::from_secs(3)));
        answer(&dir.path().join("gate-go"), true, &criu_running).unwrap();
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(true)
        );
        assert!(!abort_gated_dump(tempfile::tempdir().unwrap().path()));
    }
}
