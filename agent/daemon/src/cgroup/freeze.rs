//! Freezing and thawing a sandbox cgroup (v2 `cgroup.freeze` or v1 `freezer.state`).

use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::sandbox::{FreezerKind, SandboxCgroup};
use super::sys::{read_file, write_file, Events, EventsFile};
use super::CgroupError;

/// Longest pause between two reads of a v1 `freezer.state` that still says `FREEZING`.
const V1_MAX_PAUSE: Duration = Duration::from_millis(5);

/// A frozen sandbox cgroup. Dropping the guard thaws it (errors are logged);
/// [`FrozenGuard::keep_frozen`] leaves it frozen, [`FrozenGuard::thaw`] thaws and reports errors.
#[must_use = "dropping the guard thaws the cgroup at once"]
#[derive(Debug)]
pub struct FrozenGuard<'a> {
    cgroup: &'a SandboxCgroup,
    armed: bool,
    took: Duration,
}

impl<'a> FrozenGuard<'a> {
    /// The frozen cgroup.
    pub fn cgroup(&self) -> &'a SandboxCgroup {
        self.cgroup
    }

    /// How long [`SandboxCgroup::freeze`] took, from the request until every task was frozen.
    pub fn freeze_took(&self) -> Duration {
        self.took
    }

    /// Leaves the cgroup frozen; thaw it later with [`SandboxCgroup::thaw`].
    pub fn keep_frozen(mut self) {
        self.armed = false;
    }

    /// Thaws now, reporting a failure instead of only logging it.
    pub fn thaw(mut self) -> Result<(), CgroupError> {
        self.armed = false;
        self.cgroup.thaw()
    }
}

impl Drop for FrozenGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(err) = self.cgroup.thaw() {
                tracing::error!(cgroup = %self.cgroup.rel, %err, "thaw on guard drop failed");
            }
        }
    }
}

impl SandboxCgroup {
    /// Freezes every task of the cgroup (and of its descendants) and waits until all are frozen.
    ///
    /// v2: writes `1` to `cgroup.freeze` and waits for `frozen 1` in `cgroup.events`, woken by the
    /// kernel's notification on that file (`poll`, `POLLPRI`) rather than by sleeping. v1: writes
    /// `FROZEN` to `freezer.state` and re-reads (re-writing `FROZEN`, which retries tasks that raced
    /// the first pass) until it reads `FROZEN`, pausing at most 5 ms between reads.
    ///
    /// "Frozen" means no task runs user code until thawed. In `/proc/<pid>/stat`, v2-frozen tasks
    /// show `S`, a vfork parent waiting for its frozen child `D`, and a task woken by a thaw just
    /// before this freeze may show `R` for a moment while it goes back into the freezer without
    /// returning to user space; v1-frozen tasks show `D`. Processes that join later are frozen on
    /// entry. The guard thaws on drop even if the cgroup was already frozen before the call (so a
    /// cgroup left frozen by a crashed daemon is thawed by the next checkpoint).
    ///
    /// Errors: [`CgroupError::FreezerUnavailable`]; [`CgroupError::FreezeTimeout`] when some task
    /// does not freeze within `timeout` (e.g. stuck in uninterruptible sleep in a driver or on a
    /// network file system), in which case the cgroup is thawed again before returning; I/O
    /// errors naming the file.
    pub fn freeze(&self, timeout: Duration) -> Result<FrozenGuard<'_>, CgroupError> {
        let start = Instant::now();
        let deadline = start + timeout;
        let mut guard = match self.freezer {
            FreezerKind::V2 => {
                let dir = self.v2_freezer()?;
                // Open before asking, so that no notification can be missed.
                let events = EventsFile::open(dir)?;
                write_file(&dir.join("cgroup.freeze"), "1")?;
                let guard = self.armed_guard();
                let (events, frozen) = events.wait_until(deadline, |e| e.frozen)?;
                if !frozen {
                    return Err(self.freeze_timeout(dir, timeout, describe_events(events)));
                }
                guard
            }
            FreezerKind::V1 => {
                let dir = self.v1_freezer()?;
                let file = dir.join("freezer.state");
                write_file(&file, "FROZEN")?;
                let guard = self.armed_guard();
                let mut pause = Duration::from_micros(50);
                loop {
                    let state = read_file(&file)?;
                    if state.trim() == "FROZEN" {
                        break;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(self.freeze_timeout(dir, timeout, state.trim().to_owned()));
                    }
                    thread::sleep(pause.min(deadline - now));
                    pause = (pause * 2).min(V1_MAX_PAUSE);
                    write_file(&file, "FROZEN")?;
                }
                guard
            }
        };
        guard.took = start.elapsed();
        tracing::debug!(
            cgroup = %self.rel,
            freezer = ?self.freezer,
            took_us = u64::try_from(guard.took.as_micros()).unwrap_or(u64::MAX),
            "sandbox cgroup frozen"
        );
        Ok(guard)
    }

    /// Thaws the cgroup through the freezer in use (v2 `cgroup.freeze` = `0`, v1 `freezer.state` =
    /// `THAWED`). Thawing a cgroup that is not frozen is fine.
    /// Errors: [`CgroupError::FreezerUnavailable`], [`CgroupError::Write`].
    pub fn thaw(&self) -> Result<(), CgroupError> {
        match self.freezer {
            FreezerKind::V2 => write_file(&self.v2_freezer()?.join("cgroup.freeze"), "0")?,
            FreezerKind::V1 => write_file(&self.v1_freezer()?.join("freezer.state"), "THAWED")?,
        }
        tracing::debug!(cgroup = %self.rel, freezer = ?self.freezer, "sandbox cgroup thawed");
        Ok(())
    }

    /// Whether every task is frozen now through the freezer in use (v2 `frozen 1` in
    /// `cgroup.events`, v1 `freezer.state` reading `FROZEN`; a cgroup still `FREEZING` is not).
    pub fn is_frozen(&self) -> Result<bool, CgroupError> {
        match self.freezer {
            FreezerKind::V2 => Ok(EventsFile::open(self.v2_freezer()?)?.read()?.frozen),
            FreezerKind::V1 => {
                let state = read_file(&self.v1_freezer()?.join("freezer.state"))?;
                Ok(state.trim() == "FROZEN")
            }
        }
    }

    /// Asks the freezer in use to freeze without waiting. Used while signalling pids one by one.
    pub(super) fn request_freeze(&self) -> Result<(), CgroupError> {
        match self.freezer {
            FreezerKind::V2 => write_file(&self.v2_freezer()?.join("cgroup.freeze"), "1"),
            FreezerKind::V1 => write_file(&self.v1_freezer()?.join("freezer.state"), "FROZEN"),
        }
    }

    /// Thaws through every freezer this cgroup has, whichever froze it.
    pub(super) fn thaw_all_freezers(&self) -> Result<(), CgroupError> {
        if let Some(file) = self
            .v2
            .as_ref()
            .map(|d| d.join("cgroup.freeze"))
            .filter(|f| f.exists())
        {
            write_file(&file, "0")?;
        }
        if let Some(dir) = &self.v1_freezer {
            write_file(&dir.join("freezer.state"), "THAWED")?;
        }
        Ok(())
    }

    fn armed_guard(&self) -> FrozenGuard<'_> {
        FrozenGuard {
            cgroup: self,
            armed: true,
            took: Duration::ZERO,
        }
    }

    fn freeze_timeout(&self, dir: &Path, timeout: Duration, state: String) -> CgroupError {
        tracing::warn!(cgroup = %self.rel, ?timeout, %state, "freeze timed out, thawing");
        CgroupError::FreezeTimeout {
            path: dir.to_path_buf(),
            timeout,
            state,
        }
    }

    fn v2_freezer(&self) -> Result<&PathBuf, CgroupError> {
        self.v2
            .as_ref()
            .filter(|d| d.join("cgroup.freeze").exists())
            .ok_or_else(|| self.freezer_unavailable(FreezerKind::V2))
    }

    fn v1_freezer(&self) -> Result<&PathBuf, CgroupError> {
        self.v1_freezer
            .as_ref()
            .ok_or_else(|| self.freezer_unavailable(FreezerKind::V1))
    }

    fn freezer_unavailable(&self, kind: FreezerKind) -> CgroupError {
        CgroupError::FreezerUnavailable {
            rel: self.rel.clone(),
            kind,
        }
    }
}

fn describe_events(events: Events) -> String {
    format!(
        "populated {} frozen {}",
        u8::from(events.populated),
        u8::from(events.frozen)
    )
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::cgroup::limits::Limits;
    use crate::cgroup::test_support::{proc_state, proc_utime, TestCgroup};

    /// A shell that writes an increasing counter to `file` about every 10 ms, forking `sleep`
    /// between writes.
    fn counter_script(file: &Path) -> String {
        format!(
            "i=0; while :; do i=$((i+1)); echo $i > {0}.tmp; mv {0}.tmp {0}; sleep 0.01; done",
            file.display()
        )
    }

    fn read_counter(file: &Path) -> Option<u64> {
        std::fs::read_to_string(file).ok()?.trim().parse().ok()
    }

    fn wait_counter_above(file: &Path, floor: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(v) = read_counter(file).filter(|v| *v > floor) {
                return v;
            }
            assert!(Instant::now() < deadline, "counter stuck at {floor}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn freeze_stops_and_thaw_resumes(kind: FreezerKind) {
        let name = format!("counter-{kind:?}").to_lowercase();
        let mut t = TestCgroup::create(&name, &Limits::default());
        t.set_freezer(kind);
        let file = std::env::temp_dir().join(format!("belayer-{name}-{}", std::process::id()));
        let shell = t.spawn_in(&counter_script(&file));
        let busy = t.spawn_in("while :; do :; done");
        let before = wait_counter_above(&file, 2);

        let guard = t.cg().freeze(Duration::from_secs(5)).unwrap();
        println!(
            "{kind:?} freeze of 2-3 tasks took {:?}",
            guard.freeze_took()
        );
        assert!(t.cg().is_frozen().unwrap());
        let frozen_at = read_counter(&file).unwrap();
        assert!(frozen_at >= before);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            read_counter(&file),
            Some(frozen_at),
            "counter moved while frozen"
        );
        let (s_shell, s_busy) = (proc_state(shell), proc_state(busy));
        println!("{kind:?} frozen states: shell {s_shell}, busy loop {s_busy}");
        // v2 frozen tasks sleep interruptibly (S), except a vfork parent waiting for its frozen
        // child (D, counted as frozen by the kernel); v1 frozen tasks show D. None runs.
        match kind {
            FreezerKind::V2 => {
                assert_eq!(s_busy, 'S');
                assert!(matches!(s_shell, 'S' | 'D'), "{s_shell}");
            }
            FreezerKind::V1 => assert_eq!((s_busy, s_shell), ('D', 'D')),
        }
        let utime = proc_utime(busy);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(proc_utime(busy), utime, "busy loop ran while frozen");

        guard.thaw().unwrap();
        assert!(!t.cg().is_frozen().unwrap());
        wait_counter_above(&file, frozen_at);
        assert_eq!(proc_state(busy), 'R');
        drop(t);
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn v2_freeze_stops_and_thaw_resumes() {
        freeze_stops_and_thaw_resumes(FreezerKind::V2);
    }

    #[test]
    fn v1_freeze_stops_and_thaw_resumes() {
        if crate::cgroup::CgroupLayout::detect()
            .unwrap()
            .v1_mount("freezer")
            .is_none()
        {
            println!("no v1 freezer on this node, skipped");
            return;
        }
        freeze_stops_and_thaw_resumes(FreezerKind::V1);
    }

    #[test]
    fn guard_drop_thaws_and_keep_frozen_keeps() {
        let t = TestCgroup::create("guard", &Limits::default());
        let pid = t.spawn_in("while :; do :; done");
        {
            let _guard = t.cg().freeze(Duration::from_secs(5)).unwrap();
            assert!(t.cg().is_frozen().unwrap());
        }
        assert!(!t.cg().is_frozen().unwrap());
        // Frozen again right after the thaw: the task may still be on its way back into the
        // freezer trap (state R in the kernel, no user code runs); it settles to S quickly.
        t.cg().freeze(Duration::from_secs(5)).unwrap().keep_frozen();
        assert!(t.cg().is_frozen().unwrap());
        let deadline = Instant::now() + Duration::from_secs(1);
        while proc_state(pid) == 'R' {
            assert!(Instant::now() < deadline, "still running while frozen");
            std::thread::sleep(Duration::from_millis(1));
        }
        t.cg().thaw().unwrap();
        assert!(!t.cg().is_frozen().unwrap());
    }

    #[test]
    fn empty_cgroup_freezes() {
        for kind in [FreezerKind::V2, FreezerKind::V1] {
            let mut t = TestCgroup::create(&format!("empty-{kind:?}"), &Limits::default());
            t.set_freezer(kind);
            match t.cg().freeze(Duration::from_secs(1)) {
                Ok(guard) => println!(
                    "{kind:?} freeze of an empty cgroup: {:?}",
                    guard.freeze_took()
                ),
                Err(CgroupError::FreezerUnavailable { .. }) => println!("{kind:?} freezer absent"),
                Err(err) => panic!("{err}"),
            };
        }
    }

    #[test]
    fn freezes_a_forking_workload_and_times_it() {
        for kind in [FreezerKind::V2, FreezerKind::V1] {
            let mut t = TestCgroup::create(&format!("forky-{kind:?}"), &Limits::default());
            t.set_freezer(kind);
            if kind == FreezerKind::V1 && t.cg().v1_freezer.is_none() {
                continue;
            }
            // Twenty sleepers, a busy loop and a shell forking `true` as fast as it can.
            for _ in 0..20 {
                t.spawn_in("exec sleep 1000");
            }
            let busy = t.spawn_in("while :; do :; done");
            t.spawn_in("while :; do /bin/true; done");
            std::thread::sleep(Duration::from_millis(100));
            let mut took = Vec::new();
            for _ in 0..10 {
                let guard = t.cg().freeze(Duration::from_secs(5)).unwrap();
                took.push(guard.freeze_took());
                // Nothing runs user code: no fork changes the pid set, the busy loop gets no
                // CPU time. (A task woken by the previous thaw that has not run yet is still
                // counted as frozen and may show R; it re-enters the freezer without running.)
                let pids = t.cg().pids().unwrap();
                assert!(pids.len() >= 22);
                let utime = proc_utime(busy);
                std::thread::sleep(Duration::from_millis(50));
                assert_eq!(t.cg().pids().unwrap(), pids, "forked while frozen");
                assert_eq!(proc_utime(busy), utime, "busy loop ran while frozen");
                drop(guard);
                std::thread::sleep(Duration::from_millis(20));
            }
            took.sort();
            println!(
                "{kind:?} freeze of {} tasks (forking): min {:?} median {:?} max {:?}",
                t.cg().pids().unwrap().len(),
                took[0],
                took[took.len() / 2],
                took[took.len() - 1]
            );
        }
    }

    #[test]
    fn timeout_is_typed_and_thaws() {
        for kind in [FreezerKind::V2, FreezerKind::V1] {
            let mut t = TestCgroup::create(&format!("timeout-{kind:?}"), &Limits::default());
            t.set_freezer(kind);
            if kind == FreezerKind::V1 && t.cg().v1_freezer.is_none() {
                continue;
            }
            for _ in 0..8 {
                t.spawn_in("while :; do :; done");
            }
            // A zero timeout cannot wait for busy tasks on other CPUs to reach the freezer.
            let mut timed_out = None;
            for _ in 0..50 {
                match t.cg().freeze(Duration::ZERO) {
                    Ok(guard) => drop(guard),
                    Err(err @ CgroupError::FreezeTimeout { .. }) => {
                        timed_out = Some(err);
                        break;
                    }
                    Err(err) => panic!("{err}"),
                }
            }
            let err = timed_out.expect("no freeze timeout in 50 tries");
            println!("{kind:?}: {err}");
            let (file, thawed) = match kind {
                FreezerKind::V2 => (t.cg().v2_dir().unwrap().join("cgroup.freeze"), "0"),
                FreezerKind::V1 => (
                    t.cg().v1_freezer.as_ref().unwrap().join("freezer.state"),
                    "THAWED",
                ),
            };
            assert_eq!(std::fs::read_to_string(file).unwrap().trim(), thawed);
            assert!(!t.cg().is_frozen().unwrap());
        }
    }

    #[test]
    fn unavailable_freezer_is_typed() {
        let t = TestCgroup::create("nofreezer", &Limits::default());
        let mut cg = SandboxCgroup::open(t.cg().rel_path()).unwrap();
        cg.v1_freezer = None;
        cg.v2 = None;
        for kind in [FreezerKind::V1, FreezerKind::V2] {
            cg.freezer = kind;
            assert!(matches!(
                cg.freeze(Duration::from_secs(1)),
                Err(CgroupError::FreezerUnavailable { kind: k, .. }) if k == kind
            ));
        }
    }
}
