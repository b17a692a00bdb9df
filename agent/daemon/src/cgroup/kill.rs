//! Killing every process of a sandbox cgroup.

use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::sandbox::{KillMethod, SandboxCgroup};
use super::sys::{write_file, EventsFile};
use super::CgroupError;

/// Longest pause between two rounds of signals in [`KillMethod::Signals`].
const MAX_ROUND_PAUSE: Duration = Duration::from_millis(50);

impl SandboxCgroup {
    /// Kills every process of the cgroup and its descendants, and waits until it is empty.
    ///
    /// With [`KillMethod::CgroupKill`] and a v2 `cgroup.kill` (Linux 5.14+), one write kills the
    /// whole tree (forks racing it are refused by the kernel). Otherwise each round freezes the
    /// cgroup (no forks, no pid reuse meanwhile), sends `SIGKILL` to every listed pid and thaws,
    /// until no pid is left. Works on a frozen cgroup: every freezer is thawed after the kill is sent
    /// (v1-frozen tasks take no signal while frozen), so the cgroup is left thawed and empty. Waiting
    /// uses `populated 0` in v2 `cgroup.events` where available, else re-reads `cgroup.procs`.
    ///
    /// Errors: [`CgroupError::KillTimeout`] listing the survivors after `timeout`,
    /// [`CgroupError::Kill`] when `kill(2)` fails other than with `ESRCH`, I/O errors naming the
    /// file.
    pub fn kill_all(&self, timeout: Duration) -> Result<(), CgroupError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let Some(main) = self.main_dir() else {
            return Ok(());
        };
        let events = match &self.v2 {
            Some(dir) => Some(EventsFile::open(dir)?),
            None => None,
        };
        let kill_file = self
            .v2
            .as_ref()
            .map(|d| d.join("cgroup.kill"))
            .filter(|f| self.kill == KillMethod::CgroupKill && f.exists());
        let emptied = match (kill_file, &events) {
            (Some(file), Some(events)) => {
                write_file(&file, "1")?;
                self.thaw_all_freezers()?;
                events.wait_until(deadline, |e| !e.populated)?.1
            }
            _ => self.kill_by_signals(deadline, events.as_ref())?,
        };
        if !emptied {
            let remaining = self.pids()?;
            if !remaining.is_empty() {
                tracing::warn!(cgroup = %self.rel, ?remaining, "kill timed out");
                return Err(CgroupError::KillTimeout {
                    path: main.to_path_buf(),
                    timeout,
                    remaining,
                });
            }
        }
        tracing::debug!(
            cgroup = %self.rel,
            took_us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX),
            "sandbox cgroup killed"
        );
        Ok(())
    }

    /// Rounds of freeze, `SIGKILL` to every pid, thaw, until empty or `deadline`. Returns whether
    /// the cgroup emptied.
    fn kill_by_signals(
        &self,
        deadline: Instant,
        events: Option<&EventsFile>,
    ) -> Result<bool, CgroupError> {
        let mut pause = Duration::from_millis(1);
        loop {
            let pids = self.pids()?;
            if pids.is_empty() {
                // Leave no freezer set, even when there was nothing to kill.
                self.thaw_all_freezers()?;
                return Ok(true);
            }
            if let Err(err) = self.request_freeze() {
                tracing::debug!(cgroup = %self.rel, %err, "no freeze while signalling");
            }
            // Listed again now that nothing can fork any more.
            for pid in self.pids()? {
                match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                    Ok(()) | Err(Errno::ESRCH) => {}
                    Err(source) => return Err(CgroupError::Kill { pid, source }),
                }
            }
            self.thaw_all_freezers()?;
            let now = Instant::now();
            if now >= deadline {
                return Ok(self.pids()?.is_empty());
            }
            let until = (now + pause).min(deadline);
            match events {
                Some(events) => {
                    events.wait_until(until, |e| !e.populated)?;
                }
                None => thread::sleep(until - now),
            }
            pause = (pause * 2).min(MAX_ROUND_PAUSE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::limits::Limits;
    use crate::cgroup::sandbox::FreezerKind;
    use crate::cgroup::test_support::TestCgroup;

    fn kill_case(name: &str, freezer: FreezerKind, method: KillMethod, frozen: bool) {
        let mut t = TestCgroup::create(name, &Limits::default());
        if freezer == FreezerKind::V1 && t.cg().v1_freezer.is_none() {
            println!("{name}: no v1 freezer, skipped");
            return;
        }
        t.set_freezer(freezer);
        t.set_kill_method(method);
        let mut pids = Vec::new();
        for _ in 0..5 {
            pids.push(t.spawn_in("exec sleep 1000"));
        }
        pids.push(t.spawn_in("while :; do :; done"));
        pids.push(t.spawn_in("while :; do /bin/true; done"));
        std::thread::sleep(Duration::from_millis(50));
        if frozen {
            t.cg().freeze(Duration::from_secs(5)).unwrap().keep_frozen();
        }
        let start = Instant::now();
        t.cg().kill_all(Duration::from_secs(5)).unwrap();
        let took = start.elapsed();
        println!("{name}: kill_all took {took:?}");
        assert!(t.cg().pids().unwrap().is_empty());
        assert!(!t.cg().is_frozen().unwrap(), "left frozen");
        for pid in pids {
            let status = t.wait_child(pid);
            assert_eq!(
                std::os::unix::process::ExitStatusExt::signal(&status),
                Some(libc::SIGKILL),
                "{pid}: {status:?}"
            );
        }
        // Reusable afterwards: a new process runs and is not frozen.
        let pid = t.spawn_in("exec sleep 1000");
        assert_eq!(t.cg().pids().unwrap(), vec![pid]);
    }

    #[test]
    fn cgroup_kill_running() {
        kill_case("kill-v2", FreezerKind::V2, KillMethod::CgroupKill, false);
    }

    #[test]
    fn cgroup_kill_v2_frozen() {
        kill_case(
            "kill-v2-frozen",
            FreezerKind::V2,
            KillMethod::CgroupKill,
            true,
        );
    }

    #[test]
    fn cgroup_kill_v1_frozen() {
        kill_case(
            "kill-v1-frozen",
            FreezerKind::V1,
            KillMethod::CgroupKill,
            true,
        );
    }

    #[test]
    fn signals_running() {
        kill_case("sig", FreezerKind::V2, KillMethod::Signals, false);
    }

    #[test]
    fn signals_v2_frozen() {
        kill_case("sig-v2-frozen", FreezerKind::V2, KillMethod::Signals, true);
    }

    #[test]
    fn signals_v1_frozen() {
        kill_case("sig-v1-frozen", FreezerKind::V1, KillMethod::Signals, true);
    }

    #[test]
    fn empty_cgroup_kill_is_immediate() {
        let t = TestCgroup::create("kill-empty", &Limits::default());
        t.cg().kill_all(Duration::from_millis(100)).unwrap();
        let cg = SandboxCgroup::open(t.cg().rel_path())
            .unwrap()
            .with_kill_method(KillMethod::Signals);
        cg.kill_all(Duration::from_millis(100)).unwrap();
    }
}
