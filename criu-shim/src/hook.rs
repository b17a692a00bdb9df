//! A restore that stops at CRIU's action-script stages and calls back:
//! - `post-setup-namespaces` ([`RestoreStage::Namespaces`]): CRIU has created the restored
//!   tree's namespaces (the root task exists, no file or socket is restored yet). The caller
//!   readies them (for a tree restored with [`RestoreRequest::empty_netns`]: `lo` up, sysctls,
//!   a lock against early packets); an error aborts the restore.
//! - `pre-resume` ([`RestoreStage::PreResume`]): every task is restored and held by CRIU
//!   (ptrace-stopped on its last `rt_sigreturn`), tasks that were stopped at dump time already
//!   have their stop signal again; CRIU lets the tree run once the callback returns. The caller
//!   lists the tree as CRIU rebuilt it and sets what must be set before any task runs (the pid
//!   counter). CRIU ignores the script's status at this stage, so the tree resumes whatever the
//!   callback returns; its error is returned once CRIU has finished.
//!
//! Holding the tree at `pre-resume` instead of `--leave-stopped` sends no signal to it: a
//! `SIGSTOP` to every task and a `SIGCONT` afterwards would reach their parents as job-control
//! events (`SIGCHLD` with `CLD_STOPPED`, `waitpid` reporting `WIFCONTINUED`) that never happened
//! before the failure, and would lose the stop signal of tasks stopped by another one than
//! `SIGSTOP`.
//!
//! The script and its fifos (`hook-ready`, `hook-go`) live in the restore's work dir; the
//! script reports `<stage> <root pid>` and waits for the answer
//! ([`crate::gate::holding_script`]: one `bash -p` per held stage, its wait bounded by
//! `read -t`). An answer other than `go` fails the script. A CRIU killed at its time limit
//! takes the script with it: it stays in CRIU's process group.

use std::fs::OpenOptions;
use std::io::{self, Read};
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::gate::{answer, holding_script, join_runner, make_fifo, SLICE};
use crate::locate::Criu;
use crate::restore::{RestoreError, RestoreOutcome, RestoreRequest};
use crate::run;

/// Longest line the script writes (`pre-resume ` and a pid).
const MAX_LINE: usize = 64;

/// A stage of a restore at which [`Criu::restore_staged`] calls back (in CRIU's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum RestoreStage {
    /// `post-setup-namespaces`: namespaces made, nothing restored in them; `Err` aborts.
    Namespaces,
    /// `pre-resume`: the whole tree restored and held; it runs after the callback whatever it
    /// returns.
    PreResume,
}

impl RestoreStage {
    /// CRIU's name of the stage (`$CRTOOLS_SCRIPT_ACTION`).
    pub fn action(self) -> &'static str {
        match self {
            RestoreStage::Namespaces => "post-setup-namespaces",
            RestoreStage::PreResume => "pre-resume",
        }
    }
}

/// Why a hooked restore failed.
#[derive(Debug, thiserror::Error)]
pub enum HookedRestoreError<E> {
    /// The caller's callback at `stage` failed (at [`RestoreStage::Namespaces`] CRIU was told
    /// to abort the restore; at [`RestoreStage::PreResume`] the tree runs).
    #[error("the step at the restore's {} stage failed", stage.action())]
    Hook {
        /// The stage.
        stage: RestoreStage,
        /// The callback's error.
        #[source]
        source: E,
    },
    /// Setting up the hook (script, fifos) failed, or CRIU reported a stage or pid that is
    /// not the one expected.
    #[error("cannot set up the restore hook at {}", path.display())]
    Setup {
        /// The file involved.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// CRIU's action script at `stage` ended before the caller answered (killed, or its
    /// wait on the answer failed), so CRIU went on without the caller's say: at
    /// [`RestoreStage::PreResume`] the tree may have run before the callback's work was done
    /// (kill it; the images are untouched and a new restore may be tried), at
    /// [`RestoreStage::Namespaces`] CRIU aborted. `log` holds what CRIU's log says about its
    /// scripts (their output and exit statuses), at most 8 lines.
    #[error("CRIU's action script at its {} stage ended before the answer ({log})", stage.action())]
    ScriptEnded {
        /// The stage.
        stage: RestoreStage,
        /// CRIU's log lines about its scripts, `; `-joined.
        log: String,
    },
    /// CRIU exited before a stage, or the restore itself failed.
    #[error(transparent)]
    Restore(#[from] RestoreError),
}

/// Most lines of CRIU's log a [`HookedRestoreError::ScriptEnded`] carries.
const SCRIPT_LOG_LINES: usize = 8;

/// What CRIU's log at `log` says about the action scripts: lines naming a script or its
/// exit status, and the script's own output (CRIU logs its stdout and stderr), newest last.
fn script_lines(log: &Path) -> String {
    let tail = crate::log::LogTail::collect(log, "");
    let mut lines: Vec<&str> = tail
        .lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| {
            l.contains("cript") || l.contains("hook") || l.contains("timeout") || l.contains("sh: ")
        })
        .collect();
    let skip = lines.len().saturating_sub(SCRIPT_LOG_LINES);
    lines.drain(..skip);
    if lines.is_empty() {
        "nothing about the scripts in CRIU's log".to_string()
    } else {
        lines.join("; ")
    }
}

fn setup_err<E>(path: &Path) -> impl FnOnce(io::Error) -> HookedRestoreError<E> {
    let path = path.to_path_buf();
    move |source| HookedRestoreError::Setup { path, source }
}

/// The action script ([`crate::gate::holding_script`]): at each of the actions `held`
/// ([`RestoreStage::action`]), report `<action> $CRTOOLS_INIT_PID` into `ready` and wait for
/// the answer in `go`; every other stage passes.
fn hook_script(held: &[&str], ready: &Path, go: &Path) -> String {
    holding_script(
        held,
        "\"$CRTOOLS_SCRIPT_ACTION $CRTOOLS_INIT_PID\"",
        ready,
        go,
    )
}

/// CRIU's names of `stages`.
fn actions(stages: &[RestoreStage]) -> Vec<&'static str> {
    stages.iter().map(|s| s.action()).collect()
}

/// Parses `<stage> <pid>` as the script writes it; `None` unless it is `expected` with a pid
/// above 1.
fn parse_line(line: &[u8], expected: RestoreStage) -> Option<i32> {
    let text = std::str::from_utf8(line).ok()?;
    let (action, pid) = text.trim().split_once(' ')?;
    (action == expected.action())
        .then(|| pid.parse::<i32>().ok())
        .flatten()
        .filter(|&p| p > 1)
}

impl Criu {
    /// Like [`Criu::restore`], but CRIU stops at each of `stages` and `on_stage` runs with the
    /// stage and the restored root task's host pid (see the module docs for what holds at
    /// each). At [`RestoreStage::Namespaces`] CRIU goes on if `on_stage` returned `Ok` and
    /// aborts the restore (killing what it made) if it returned `Err`; at
    /// [`RestoreStage::PreResume`] it goes on either way. CRIU's time limit
    /// ([`RestoreRequest::time_limit`]) bounds the whole restore, waits included.
    ///
    /// Errors: [`HookedRestoreError::Hook`], [`HookedRestoreError::Setup`],
    /// [`HookedRestoreError::Restore`] (CRIU exited before a stage, or failed after it).
    pub fn restore_staged<E>(
        &self,
        req: &RestoreRequest,
        stages: &[RestoreStage],
        mut on_stage: impl FnMut(RestoreStage, i32) -> Result<(), E>,
    ) -> Result<RestoreOutcome, HookedRestoreError<E>> {
        let mut stages = stages.to_vec();
        stages.sort();
        stages.dedup();
        if stages.is_empty() {
            return Ok(self.restore(req)?);
        }
        let mut setup = req.child_setup()?;
        let work = req.work_dir().to_path_buf();
        let ready_path = work.join("hook-ready");
        let go_path = work.join("hook-go");
        let script = work.join("hook.sh");
        make_fifo(&ready_path).map_err(setup_err(&ready_path))?;
        make_fifo(&go_path).map_err(setup_err(&go_path))?;
        // Written by CRIU's own process before its exec (`ChildSetup::scripts`), not here.
        let held = actions(&stages);
        setup.scripts.push(
            run::script_file(&script, hook_script(&held, &ready_path, &go_path))
                .map_err(setup_err(&script))?,
        );
        setup.script_actions = Some(held.join(" "));
        // Opened before CRIU starts, so the script's write never blocks on our open; read and
        // write, so that between two stages the fifo has a writer and `poll` waits for data
        // instead of reporting a hang-up.
        let mut ready = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&ready_path)
            .map_err(setup_err(&ready_path))?;

        let mut args = req.args();
        run::push(&mut args, "--action-script", &script);
        let criu = self.path().to_path_buf();
        let child = std::thread::spawn(move || run::run(&criu, &args, setup));

        let mut failed = None;
        for stage in stages {
            let Some(line) = read_line(&mut ready, &child) else {
                let done = join(child, self.path())?;
                req.finish(done)?;
                return Err(setup_err(&ready_path)(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("criu exited before its {} stage", stage.action()),
                )));
            };
            let Some(pid) = parse_line(&line, stage) else {
                let _ = answer(&go_path, false, &child);
                let done = join(child, self.path())?;
                let _ = req.finish(done);
                return Err(setup_err(&ready_path)(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "criu reported {:?} where {} was expected",
                        String::from_utf8_lossy(&line),
                        stage.action()
                    ),
                )));
            };
            let result = on_stage(stage, pid);
            let proceed = result.is_ok();
            if let Err(source) = result {
                failed = Some(HookedRestoreError::Hook { stage, source });
            }
            if let Err(e) = answer(&go_path, proceed, &child) {
                let gone = child.is_finished();
                let done = join(child, self.path())?;
                req.finish(done)?;
                if gone {
                    // CRIU succeeded without the answer: the script left before it.
                    return Err(HookedRestoreError::ScriptEnded {
                        stage,
                        log: script_lines(&req.log_path()),
                    });
                }
                return Err(setup_err(&go_path)(e));
            }
            if !proceed && stage == RestoreStage::Namespaces {
                break;
            }
        }
        let done = join(child, self.path())?;
        match failed {
            Some(e) => {
                let _ = req.finish(done);
                Err(e)
            }
            None => Ok(req.finish(done)?),
        }
    }
}

/// One line from the script (up to its newline or [`MAX_LINE`] bytes); `None` once CRIU has
/// exited without writing one.
fn read_line(
    ready: &mut std::fs::File,
    child: &std::thread::JoinHandle<io::Result<run::Finished>>,
) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    loop {
        if child.is_finished() && line.is_empty() {
            // A last look: the line may have come just before CRIU went on and exited.
            let mut buf = [0u8; MAX_LINE];
            match ready.read(&mut buf) {
                Ok(n) if n > 0 => line.extend_from_slice(&buf[..n]),
                _ => return None,
            }
        }
        if line.ends_with(b"\n") || line.len() >= MAX_LINE {
            return Some(line);
        }
        let mut fds = [PollFd::new(ready.as_fd(), PollFlags::POLLIN)];
        let slice = PollTimeout::try_from(SLICE).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, slice) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {
                let mut buf = [0u8; MAX_LINE];
                match ready.read(&mut buf) {
                    Ok(n) if n > 0 => line.extend_from_slice(&buf[..n]),
                    _ => std::thread::sleep(SLICE),
                }
            }
            Err(_) => std::thread::sleep(SLICE),
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
    use crate::gate::{caller_end, read_report};

    #[test]
    fn the_script_reports_stage_and_root_pid_and_passes_other_stages() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, go) = (dir.path().join("hook-ready"), dir.path().join("hook-go"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        let script = dir.path().join("hook.sh");
        let stages = [RestoreStage::Namespaces, RestoreStage::PreResume];
        std::fs::write(&script, hook_script(&actions(&stages), &ready, &go)).unwrap();
        for other in ["post-restore", "post-resume", "setup-namespaces"] {
            let status = Command::new("bash")
                .arg("-p")
                .arg(&script)
                .env("CRTOOLS_SCRIPT_ACTION", other)
                .status()
                .unwrap();
            assert!(status.success(), "{other}");
        }
        let mut caller = caller_end(&ready);
        for (stage, proceed) in [
            (RestoreStage::Namespaces, true),
            (RestoreStage::PreResume, false),
        ] {
            let mut child = Command::new("bash")
                .arg("-p")
                .arg(&script)
                .env("CRTOOLS_SCRIPT_ACTION", stage.action())
                .env("CRTOOLS_INIT_PID", "4242")
                .spawn()
                .unwrap();
            let text = read_report(&mut caller);
            assert_eq!(text, format!("{} 4242\n", stage.action()));
            assert_eq!(parse_line(text.as_bytes(), stage), Some(4242));
            let criu_running =
                std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_secs(3)));
            answer(&go, proceed, &criu_running).unwrap();
            assert_eq!(
                child.wait().unwrap().success(),
                proceed,
                "an abort fails the script"
            );
        }
    }

    #[test]
    fn a_held_script_dies_with_criu_s_process_group() {
        use std::os::unix::process::CommandExt;
        let dir = tempfile::tempdir().unwrap();
        let (ready, go) = (dir.path().join("hook-ready"), dir.path().join("hook-go"));
        make_fifo(&ready).unwrap();
        make_fifo(&go).unwrap();
        let script = dir.path().join("hook.sh");
        std::fs::write(
            &script,
            hook_script(&[RestoreStage::PreResume.action()], &ready, &go),
        )
        .unwrap();
        // The script as the child of a group's leader, as under CRIU; held at its stage.
        let mut caller = caller_end(&ready);
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(format!("bash -p '{}'; true", script.display()))
            .env("CRTOOLS_SCRIPT_ACTION", "pre-resume")
            .env("CRTOOLS_INIT_PID", "4242")
            .process_group(0)
            .spawn()
            .unwrap();
        let pgid = child.id() as i32;
        assert_eq!(read_report(&mut caller), "pre-resume 4242\n");
        // What killing CRIU at its time limit does: the whole group goes.
        nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pgid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let left = live_naming(&script.display().to_string());
            if left.is_empty() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "left after the kill of the group: {left:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Live (not zombie) processes whose command line names `needle` (the held script's
    /// shell names the script), in whatever group they are.
    fn live_naming(needle: &str) -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
                let state = stat.rsplit_once(") ")?.1.split_whitespace().next()?;
                let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                (text.contains(needle) && state != "Z").then_some(text)
            })
            .collect()
    }

    #[test]
    fn only_the_asked_stages_are_held() {
        let dir = tempfile::tempdir().unwrap();
        let (ready, go) = (dir.path().join("hook-ready"), dir.path().join("hook-go"));
        let script = dir.path().join("hook.sh");
        std::fs::write(
            &script,
            hook_script(&[RestoreStage::PreResume.action()], &ready, &go),
        )
        .unwrap();
        let status = Command::new("bash")
            .arg("-p")
            .arg(&script)
            .env("CRTOOLS_SCRIPT_ACTION", "post-setup-namespaces")
            .status()
            .unwrap();
        assert!(status.success());
    }

    #[test]
    fn a_line_for_another_stage_or_pid_is_refused() {
        let ns = RestoreStage::Namespaces;
        assert_eq!(parse_line(b"pre-resume 4242\n", ns), None);
        assert_eq!(parse_line(b"post-setup-namespaces 1\n", ns), None);
        assert_eq!(parse_line(b"post-setup-namespaces \n", ns), None);
        assert_eq!(parse_line(b"post-setup-namespaces 77\n", ns), Some(77));
    }
}
