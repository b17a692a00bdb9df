//! Reaping: `belayerd` is a child subreaper, so every sandbox process whose parent dies (a
//! sandbox init after its helper exits, the processes of a removed or replaced instance, the
//! tree of a failed restore, the children of a killed exec helper) becomes its child, and
//! stays a zombie until it waits for it.
//!
//! **The rule.** The reaper waits for exactly two kinds of exited children:
//!
//! 1. a child whose pid lives in a nested pid namespace (`NSpid` in `/proc/PID/status` has more
//!    than one entry): only sandbox processes are there, and nothing else in the daemon waits
//!    for them except [`crate::sys::try_reap`] of a recorded init, which tolerates losing the
//!    race (a failure is then seen from the missing process, as after a daemon restart);
//! 2. a child in the process group of a CRIU run killed at its time limit
//!    ([`belayer_criu::reap_orphans`]): CRIU's orphaned helpers.
//!
//! Every other child (CRIU runs, helpers, memory servers: `std::process::Command` children in
//! the host pid namespace) is left to the code that spawned it and waits for its status; a
//! blanket `waitpid(-1)` would steal those statuses.
//!
//! The children are listed from `/proc/self/task/*/children` (each thread lists the children
//! it forked, and orphans land on any live thread). A child is pinned with a pidfd before its
//! status is read and reaped through that pidfd (`waitid(P_PIDFD)`), so a pid reused between
//! the read and the wait can never make the reaper wait for another process.

use std::os::fd::AsFd;

/// Reaps every exited child in a nested pid namespace, and CRIU's orphans; returns how many
/// were reaped. Never blocks.
pub(crate) fn reap_sandbox_zombies() -> usize {
    belayer_criu::reap_orphans();
    let mut reaped = 0;
    for pid in children() {
        if reap_if_nested_zombie(pid) {
            reaped += 1;
        }
    }
    reaped
}

/// The pids of the calling process's children, from every thread's `children` file.
fn children() -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for task in tasks.flatten() {
        let Ok(text) = std::fs::read_to_string(task.path().join("children")) else {
            continue;
        };
        pids.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<i32>().ok()),
        );
    }
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Whether `/proc/PID/status` says: a zombie whose pid is in more than one namespace.
fn is_nested_zombie(status: &str) -> bool {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
    };
    let zombie = field("State:").is_some_and(|s| s.starts_with('Z'));
    let nested = field("NSpid:").is_some_and(|s| s.split_whitespace().count() > 1);
    zombie && nested
}

fn reap_if_nested_zombie(pid: i32) -> bool {
    use rustix::process::{pidfd_open, waitid, Pid, PidfdFlags, WaitId, WaitIdOptions};
    let Some(p) = Pid::from_raw(pid) else {
        return false;
    };
    // The pidfd first: the status read next is of this process or of a later one with the
    // same pid (then this one is gone and the wait below finds nothing).
    let Ok(pidfd) = pidfd_open(p, PidfdFlags::empty()) else {
        return false;
    };
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    if !is_nested_zombie(&status) {
        return false;
    }
    matches!(
        waitid(
            WaitId::PidFd(pidfd.as_fd()),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG
        ),
        Ok(Some(_))
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nested_zombies_match() {
        let nested = "Name:\tsh\nState:\tZ (zombie)\nNSpid:\t4242\t1\n";
        let host = "Name:\tcriu\nState:\tZ (zombie)\nNSpid:\t4242\n";
        let alive = "Name:\tsh\nState:\tS (sleeping)\nNSpid:\t4242\t1\n";
        assert!(is_nested_zombie(nested));
        assert!(!is_nested_zombie(host));
        assert!(!is_nested_zombie(alive));
        assert!(!is_nested_zombie(""));
    }

    #[test]
    fn a_host_namespace_child_is_left_to_its_spawner() {
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id() as i32;
        // Wait until it is a zombie, then run the reaper: the status stays ours.
        while !std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .contains("State:\tZ")
        {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        reap_sandbox_zombies();
        assert!(child.wait().unwrap().success());
    }
}
