//! Whether the processes that were already running when an action began ran while it ran:
//! the part of a step's dirtiness that no file write shows (see [`super`]).
//!
//! A step can change a sandbox without touching a file or the set of its processes: a request
//! to a server an earlier step started (`curl localhost:8000 -X PUT ...`), a line written to a
//! FIFO a background reader holds, a signal to a process with a handler, keys sent to a `tmux`
//! server. Each of those makes a process that existed before the step run, so the step is
//! dirty when, between the start and the end of the action, a task of such a process
//! consumed CPU time or was scheduled (`/proc/<pid>/task/<tid>/schedstat`: nanoseconds on a
//! CPU and number of time slices, both exact, updated at every switch), a thread of it came
//! or went, it exited, or it is runnable at the end (woken by the action, not yet run).
//!
//! Only the action's own run time is watched, not the wait between actions: what background
//! processes do on their own between two steps (timers, a compile left running) is not a
//! change the next step made, and freezing and thawing a sandbox for a checkpoint, or CRIU's
//! parasite, make every task run. A process woken by a timer during the action counts, which
//! errs towards dirty; so does the sandbox init reaping an orphan of the action that exits
//! during it (the init's own hourly `sleep` is not watched: the caller leaves it out).
//!
//! Known limit: data queued to a process that neither runs nor wakes (a reader asleep on
//! something else) changes kernel state the checkpoint holds without any task running; the BPF
//! counter covers sockets, named FIFOs and IPC (`ebpf/bpf/file_activity.h`).
//!
//! The walk is bounded ([`BUDGET`] tasks); past it, or when a task's entries cannot be read,
//! the answer is [`Ran::Unknown`], which makes the step dirty.

use std::collections::BTreeMap;

/// Tasks one snapshot reads at most, all processes together.
pub const BUDGET: usize = 1 << 14;

/// One task's CPU use: `(tid, nanoseconds on a CPU, time slices)`.
type TaskRun = (i32, u64, u64);

/// The CPU use of each task of some processes at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Activity {
    /// Host pid → its tasks, sorted by tid; `None`: the process is gone.
    procs: BTreeMap<i32, Option<Vec<TaskRun>>>,
    /// Everything was read within the budget.
    complete: bool,
}

/// Why [`Activity::ran_since`] says a process ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ran {
    /// A task of the process ran, or a thread of it started or ended.
    Ran {
        /// Host pid.
        pid: i32,
    },
    /// A task of the process is runnable (woken, not yet run).
    Runnable {
        /// Host pid.
        pid: i32,
    },
    /// The process exited.
    Exited {
        /// Host pid.
        pid: i32,
    },
    /// The tasks could not all be read (budget spent, or a `/proc` error).
    Unknown,
}

impl std::fmt::Display for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ran::Ran { pid } => write!(f, "process {pid}, which was running before, ran"),
            Ran::Runnable { pid } => write!(f, "process {pid} was woken"),
            Ran::Exited { pid } => write!(f, "process {pid} exited"),
            Ran::Unknown => f.write_str("the processes' CPU use could not be read"),
        }
    }
}

impl Activity {
    /// The CPU use of every task of `pids` (host pids) now.
    pub fn snapshot(pids: &[i32]) -> Activity {
        let mut budget = BUDGET;
        let mut complete = true;
        let procs = pids
            .iter()
            .map(|&pid| {
                let tasks = read_tasks(pid, &mut budget, false);
                if matches!(tasks, Read::Unknown) {
                    complete = false;
                }
                (pid, tasks.runs())
            })
            .collect();
        Activity { procs, complete }
    }

    /// Whether one of the processes of this snapshot ran since it was taken: the first reason
    /// found, `None` when none did.
    pub fn ran_since(&self) -> Option<Ran> {
        if !self.complete {
            return Some(Ran::Unknown);
        }
        let mut budget = BUDGET;
        for (&pid, before) in &self.procs {
            let Some(before) = before else { continue };
            match read_tasks(pid, &mut budget, true) {
                Read::Unknown => return Some(Ran::Unknown),
                Read::Gone => return Some(Ran::Exited { pid }),
                Read::Runnable => return Some(Ran::Runnable { pid }),
                Read::Tasks(now) if &now != before => return Some(Ran::Ran { pid }),
                Read::Tasks(_) => {}
            }
        }
        None
    }
}

/// What reading a process's tasks gave.
enum Read {
    Tasks(Vec<TaskRun>),
    /// A task is runnable (only looked for when asked).
    Runnable,
    Gone,
    Unknown,
}

impl Read {
    fn runs(self) -> Option<Vec<TaskRun>> {
        match self {
            Read::Tasks(t) => Some(t),
            // A snapshot never asks for the run state; an unknown one is marked incomplete.
            Read::Runnable | Read::Gone | Read::Unknown => None,
        }
    }
}

fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

fn read_tasks(pid: i32, budget: &mut usize, runnable: bool) -> Read {
    let dir = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(d) => d,
        Err(e) if gone(&e) => return Read::Gone,
        Err(_) => return Read::Unknown,
    };
    let mut runs = Vec::new();
    for entry in dir {
        let name = match entry {
            Ok(e) => e.file_name(),
            Err(e) if gone(&e) => return Read::Gone,
            Err(_) => return Read::Unknown,
        };
        let Some(tid) = name.to_str().and_then(|t| t.parse::<i32>().ok()) else {
            return Read::Unknown;
        };
        let Some(left) = budget.checked_sub(1) else {
            return Read::Unknown;
        };
        *budget = left;
        let task = format!("/proc/{pid}/task/{tid}");
        // A thread that ended between the listing and the read ran: unknown, so dirty.
        let Ok(stat) = std::fs::read_to_string(format!("{task}/schedstat")) else {
            return Read::Unknown;
        };
        let Some((ns, slices)) = parse_schedstat(&stat) else {
            return Read::Unknown;
        };
        if runnable {
            match std::fs::read(format!("{task}/stat")) {
                Ok(s) if task_state(&s) == Some(b'R') => return Read::Runnable,
                Ok(_) => {}
                Err(_) => return Read::Unknown,
            }
        }
        runs.push((tid, ns, slices));
    }
    if runs.is_empty() {
        return Read::Gone;
    }
    runs.sort_unstable();
    Read::Tasks(runs)
}

/// `<ns on a CPU> <ns waiting> <slices>` of a `schedstat` file.
fn parse_schedstat(text: &str) -> Option<(u64, u64)> {
    let mut f = text.split_ascii_whitespace();
    let ns = f.next()?.parse().ok()?;
    let _waiting: u64 = f.next()?.parse().ok()?;
    let slices = f.next()?.parse().ok()?;
    Some((ns, slices))
}

/// The state letter of a task's `stat` line (the first field after the command's closing
/// parenthesis, which may itself hold parentheses).
fn task_state(stat: &[u8]) -> Option<u8> {
    let close = stat.iter().rposition(|b| *b == b')')?;
    stat.get(close + 2).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write};

    #[test]
    fn proc_lines_parse() {
        assert_eq!(parse_schedstat("12345 678 9\n"), Some((12345, 9)));
        assert_eq!(parse_schedstat("12345 678"), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        assert_eq!(task_state(b"42 (a) b) S 1 42"), Some(b'S'));
        assert_eq!(task_state(b"42 (sh) R 1"), Some(b'R'));
        assert_eq!(task_state(b"garbage"), None);
    }

    #[test]
    fn a_sleeping_process_is_still_until_it_is_woken() {
        // A child blocked reading a pipe: still while nothing is written, ran once a byte is.
        let mut child = std::process::Command::new("sh")
            .args(["-c", "read line; sleep 5"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Let it reach its read.
        std::thread::sleep(std::time::Duration::from_millis(300));
        let before = Activity::snapshot(&[pid]);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(before.ran_since(), None, "a blocked reader does not run");
        child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            matches!(before.ran_since(), Some(Ran::Ran { pid: p }) if p == pid),
            "{:?}",
            before.ran_since()
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(before.ran_since(), Some(Ran::Exited { pid }));
        let mut s = String::new();
        let _ = std::fs::File::open("/proc/self/schedstat")
            .unwrap()
            .read_to_string(&mut s);
        assert!(parse_schedstat(&s).is_some(), "{s:?}");
    }

    #[test]
    fn missing_processes_are_not_activity() {
        let a = Activity::snapshot(&[i32::MAX]);
        assert!(a.complete);
        assert_eq!(a.ran_since(), None);
    }
}
