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

/// Longest line an action script writes (a stage name and a pid).
pub(crate) const MAX_LINE: usize = 64;
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

/// The action script: at `pre-dump`, and at `post-dump` when `hold` (a flag file) exists by
/// then, report the stage through `ready` and wait for the answer in `go`. Both fifo
/// operations are bounded: a CRIU whose caller died gives up by itself.
fn gate_script(ready: &Path, go: &Path, hold: Option<&Path>) -> String {
    let post_dump = match hold {
        Some(flag) => format!("post-dump) [ -e {} ] || exit 0 ;;\n", quote(flag)),
        None => String::new(),
    };
    format!(
        "#!/bin/sh\ncase \"$CRTOOLS_SCRIPT_ACTION\" in\npre-dump) ;;\n{post_dump}*) exit 0 ;;\nesac\n\
         timeout {wait} sh -c 'echo \"$2\" > \"$1\"' gate {ready} \"$CRTOOLS_SCRIPT_ACTION\" \
         || exit 1\n\
         answer=$(timeout {wait} cat {go}) || exit 1\n\
         [ \"$answer\" = go ]\n",
        wait = ORPHAN_TIMEOUT.as_secs(),
        ready = quote(ready),
        go = quote(go),
    )
}

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
        self.gated(req, gate, None)
    }

    /// [`Criu::dump_gated`], and if `hold` says so of what `gate` returned, `post_dump` runs
    /// with it once CRIU has written every image and before it ends the dump (its `post-dump`
    /// stage: the tree still seized, link remaps of [`DumpRequest::link_remap`] still in
    /// place). An `Err` makes CRIU fail the dump; the tree runs on either way. A dump not held
    /// there pays nothing for it (holding costs about 6 ms: the script waits on its fifos).
    ///
    /// Errors: as [`Criu::dump_gated`]; [`GatedDumpError::Gate`] also for `post_dump`'s.
    pub fn dump_gated_with_post_dump<T, E>(
        &self,
        req: &DumpRequest,
        gate: impl FnOnce() -> Result<T, E>,
        hold: impl FnOnce(&T) -> bool,
        post_dump: impl FnOnce(&mut T) -> Result<(), E>,
    ) -> Result<(DumpStats, T), GatedDumpError<E>> {
        self.gated(req, gate, Some((Box::new(hold), Box::new(post_dump))))
    }

    #[allow(clippy::type_complexity)]
    fn gated<'f, T, E>(
        &self,
        req: &DumpRequest,
        gate: impl FnOnce() -> Result<T, E>,
        post_dump: Option<(
            Box<dyn FnOnce(&T) -> bool + 'f>,
            Box<dyn FnOnce(&mut T) -> Result<(), E> + 'f>,
        )>,
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
        let hold_path = work.join("gate-hold-post-dump");
        match std::fs::remove_file(&hold_path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(setup_err(&hold_path)(e));
            }
            _ => {}
        }
        make_fifo(&ready_path).map_err(setup_err(&ready_path))?;
        make_fifo(&go_path).map_err(setup_err(&go_path))?;
        let text = gate_script(
            &ready_path,
            &go_path,
            post_dump.is_some().then_some(&*hold_path),
        );
        std::fs::write(&script, text).map_err(setup_err(&script))?;
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(setup_err(&script))?;
        // Opened before CRIU starts, so the script's write never blocks on our open; read and
        // write, so that between the two stages `poll` waits for data instead of reporting a
        // hang-up.
        let mut ready = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&ready_path)
            .map_err(setup_err(&ready_path))?;

        let mut args = req.args();
        run::push(&mut args, "--action-script", &script);
        let criu = self.path().to_path_buf();
        let setup = req.child_setup()?;
        let child = std::thread::spawn(move || run::run(&criu, &args, setup));

        let line = read_line(&mut ready, &child, Some(Instant::now() + READY_TIMEOUT));
        if line.as_deref() != Some(b"pre-dump\n".as_slice()) {
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
        let post_dump = match (&gated, post_dump) {
            (Ok(value), Some((hold, post_dump))) => hold(value).then_some(post_dump),
            _ => None,
        };
        if post_dump.is_some() {
            if let Err(e) = std::fs::write(&hold_path, b"") {
                let _ = answer(&go_path, false, &child);
                let _ = join(child, self.path())?;
                return Err(setup_err(&hold_path)(e));
            }
        }
        answer(&go_path, gated.is_ok(), &child).map_err(setup_err(&go_path))?;
        let mut value = match gated {
            Ok(value) => value,
            Err(e) => {
                let _ = join(child, self.path())?;
                return Err(GatedDumpError::Gate(e));
            }
        };
        if let Some(post_dump) = post_dump {
            // No line: CRIU failed before its post-dump stage; its status says why.
            if read_line(&mut ready, &child, None).as_deref() == Some(b"post-dump\n".as_slice()) {
                let after = post_dump(&mut value);
                answer(&go_path, after.is_ok(), &child).map_err(setup_err(&go_path))?;
                if let Err(e) = after {
                    let _ = join(child, self.path())?;
                    return Err(GatedDumpError::Gate(e));
                }
            }
        }
        let done = join(child, self.path())?;
        Ok((req.finish(done)?, value))
    }
}

/// One line from an action script through the fifo `ready` (up to its newline or
/// [`MAX_LINE`] bytes); `None` once CRIU (`child`) has exited without writing one, or at
/// `deadline`.
pub(crate) fn read_line<T>(
    ready: &mut File,
    child: &std::thread::JoinHandle<T>,
    deadline: Option<Instant>,
) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        if line.ends_with(b"\n") || line.len() >= MAX_LINE {
            return Some(line);
        }
        let finished = child.is_finished();
        if deadline.is_some_and(|d| Instant::now() > d) {
            return None;
        }
        let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
        let slice = PollTimeout::try_from(SLICE).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, slice) {
            Ok(0) | Err(nix::errno::Errno::EINTR) if !finished => continue,
            Ok(n) if n > 0 => {
                let mut buf = [0u8; MAX_LINE];
                match ready.read(&mut buf) {
                    Ok(n) if n > 0 => line.extend_from_slice(&buf[..n]),
                    _ if finished => return None,
                    _ => std::thread::sleep(SLICE),
                }
            }
            // CRIU exited and nothing (more) is there.
            _ if finished => return (!line.is_empty()).then_some(line),
            _ => std::thread::sleep(SLICE),
        }
    }
}

/// Tells a gated dump whose caller died (its script waiting in `work_dir` to report ready or
/// for an answer) to abort, so CRIU exits without touching the tree. Returns whether one was
/// waiting. Waits at most about a second.
pub fn abort_gated_dump(work_dir: &Path) -> bool {
    let ready = work_dir.join("gate-ready");
    let go = work_dir.join("gate-go");
    // Opening the ready fifo lets a script blocked on reporting ready go on to wait for
    // the answer.
    let Ok(_reader) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&ready)
    else {
        return false;
    };
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&go)
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

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    fn waiting_script(dir: &Path) -> std::process::Child {
        let (ready, go) = (dir.join("gate-ready"), dir.join("gate-go"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        let script = dir.join("gate.sh");
        std::fs::write(&script, gate_script(&ready, &go, None)).unwrap();
        Command::new("sh")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "pre-dump")
            .spawn()
            .unwrap()
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
    fn an_orphaned_gate_is_released_whether_or_not_it_reported_ready() {
        // Blocked on reporting ready (its caller died before reading): abort releases it.
        let dir = tempfile::tempdir().unwrap();
        let mut script = waiting_script(dir.path());
        std::thread::sleep(Duration::from_millis(100));
        assert!(abort_gated_dump(dir.path()), "a script was waiting");
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(false)
        );

        // Reported ready and waiting for the answer: abort fails it too.
        let dir = tempfile::tempdir().unwrap();
        let mut script = waiting_script(dir.path());
        let mut ready = std::fs::File::open(dir.path().join("gate-ready")).unwrap();
        let mut line = String::new();
        std::io::Read::read_to_string(&mut ready, &mut line).unwrap();
        assert_eq!(line, "pre-dump\n");
        assert!(abort_gated_dump(dir.path()));
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(false)
        );

        // A go lets it succeed; nothing waiting: nothing to abort.
        let dir = tempfile::tempdir().unwrap();
        let mut script = waiting_script(dir.path());
        let mut ready = std::fs::File::open(dir.path().join("gate-ready")).unwrap();
        std::io::Read::read_to_string(&mut ready, &mut line).unwrap();
        let criu_running = std::thread::spawn(|| std::thread::sleep(Duration::from_secs(3)));
        answer(&dir.path().join("gate-go"), true, &criu_running).unwrap();
        assert_eq!(
            exits_within(&mut script, Duration::from_secs(5)),
            Some(true)
        );
        assert!(!abort_gated_dump(tempfile::tempdir().unwrap().path()));
    }

    #[test]
    fn post_dump_is_held_only_when_asked() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, go) = (dir.path().join("gate-ready"), dir.path().join("gate-go"));
        let (script, flag) = (dir.path().join("gate.sh"), dir.path().join("hold"));
        let run = |action: &str| {
            Command::new("sh")
                .arg(&script)
                .env("CRTOOLS_SCRIPT_ACTION", action)
                .status()
                .unwrap()
                .success()
        };
        std::fs::write(&script, gate_script(&ready, &go, None)).unwrap();
        assert!(run("post-dump"), "not held: passes");
        std::fs::write(&script, gate_script(&ready, &go, Some(&flag))).unwrap();
        assert!(run("post-dump"), "no flag: passes");
        assert!(run("network-unlock"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        std::fs::write(&flag, b"").unwrap();
        let mut held = Command::new("sh")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "post-dump")
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::open(&ready).unwrap(), &mut line)
            .unwrap();
        assert_eq!(line, "post-dump\n");
        let criu_running = std::thread::spawn(|| std::thread::sleep(Duration::from_secs(3)));
        answer(&go, true, &criu_running).unwrap();
        assert_eq!(exits_within(&mut held, Duration::from_secs(5)), Some(true));
    }
}
