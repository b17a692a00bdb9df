//! Helpers for the cgroup tests: unique cgroups that clean up after themselves, and child
//! processes that join a cgroup before they run anything.

use std::cell::RefCell;
use std::io::Read;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::Duration;

use super::limits::Limits;
use super::sandbox::{FreezerKind, KillMethod, SandboxCgroup};

/// `belayer-test/<name>-<pid>`: unique per test and per test process.
pub(crate) fn unique_rel(name: &str) -> String {
    format!("belayer-test/{name}-{}", std::process::id())
}

/// Starts `sh -c 'read _; <script>'`: the shell waits until the returned stdin is dropped, so the
/// caller can move it into a cgroup before `script` forks anything.
pub(crate) fn spawn_gated(script: &str) -> (Child, ChildStdin) {
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("read _; {script}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn sh");
    let stdin = child.stdin.take().expect("piped stdin");
    (child, stdin)
}

/// The fields of `/proc/<pid>/stat` after the command name (field 3 onwards), empty when gone.
fn stat_fields(pid: i32) -> Vec<String> {
    let mut text = String::new();
    let read = std::fs::File::open(format!("/proc/{pid}/stat"))
        .and_then(|mut f| f.read_to_string(&mut text));
    if read.is_err() {
        return Vec::new();
    }
    // The command name is in parentheses and may hold spaces: the fields follow the last ')'.
    text.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// The state letter of `/proc/<pid>/stat` (`R`, `S`, `D`, `Z`, ...), `?` when gone.
pub(crate) fn proc_state(pid: i32) -> char {
    stat_fields(pid)
        .first()
        .and_then(|s| s.chars().next())
        .unwrap_or('?')
}

/// User-mode CPU time of `pid` in clock ticks (`utime`, field 14 of `/proc/<pid>/stat`).
pub(crate) fn proc_utime(pid: i32) -> u64 {
    stat_fields(pid)
        .get(11)
        .and_then(|s| s.parse().ok())
        .expect("utime of a live process")
}

/// A sandbox cgroup for one test, with the children started in it. Drop kills the children,
/// reaps them and removes the cgroup.
pub(crate) struct TestCgroup {
    cg: Option<SandboxCgroup>,
    children: RefCell<Vec<Child>>,
}

impl TestCgroup {
    pub(crate) fn create(name: &str, limits: &Limits) -> TestCgroup {
        let rel = unique_rel(name);
        // A leftover from an aborted earlier run of the same pid would make create fail.
        if let Ok(stale) = SandboxCgroup::open(&rel) {
            let _ = stale.kill_all(Duration::from_secs(5));
            let _ = stale.remove();
        }
        let cg = SandboxCgroup::create(&rel, limits).expect("create test cgroup");
        TestCgroup {
            cg: Some(cg),
            children: RefCell::new(Vec::new()),
        }
    }

    pub(crate) fn cg(&self) -> &SandboxCgroup {
        self.cg.as_ref().expect("cgroup present until drop")
    }

    pub(crate) fn set_freezer(&mut self, kind: FreezerKind) {
        let cg = self.cg.take().expect("cgroup present");
        self.cg = Some(cg.with_freezer(kind));
    }

    pub(crate) fn set_kill_method(&mut self, method: KillMethod) {
        let cg = self.cg.take().expect("cgroup present");
        self.cg = Some(cg.with_kill_method(method));
    }

    /// Starts `sh -c script` inside the cgroup; returns its pid.
    pub(crate) fn spawn_in(&self, script: &str) -> i32 {
        let (child, gate) = spawn_gated(script);
        let pid = i32::try_from(child.id()).expect("pid fits i32");
        self.children.borrow_mut().push(child);
        self.cg().add_pid(pid).expect("add_pid");
        drop(gate);
        pid
    }

    /// Reaps the child `pid` started by [`Self::spawn_in`].
    pub(crate) fn wait_child(&self, pid: i32) -> ExitStatus {
        let mut children = self.children.borrow_mut();
        let idx = children
            .iter()
            .position(|c| i32::try_from(c.id()).ok() == Some(pid))
            .expect("a child of this test");
        let mut child = children.swap_remove(idx);
        child.wait().expect("wait child")
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let Some(cg) = self.cg.take() else { return };
        if let Err(err) = cg.kill_all(Duration::from_secs(10)) {
            eprintln!("test cleanup: kill_all of {}: {err}", cg.rel_path());
        }
        for child in self.children.get_mut().iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Err(err) = cg.remove() {
            eprintln!("test cleanup: remove: {err}");
        }
    }
}
