//! Capability sets a CRIU restore can rebuild, checked while the tree is frozen for a dump.
//!
//! CRIU's restorer rebuilds each task's credentials in a fixed order: it trims the bounding
//! set first (`PR_CAPBSET_DROP`), then `capset`s the effective, permitted and inheritable
//! sets, then raises the ambient ones. The kernel (`cap_capset`) refuses a new inheritable set
//! that is not within the caller's *old inheritable set ∪ bounding set*. A restorer in the
//! host user namespace starts with CRIU's inheritable set, which `belayer-criu` raises to
//! CRIU's full permitted set, so every dumped inheritable set fits. But a restorer in a
//! sandbox's user namespace starts as that namespace's creator, whose inheritable set the
//! kernel empties (`set_cred_user_ns`): there, a task whose inheritable set holds a capability
//! its bounding set lacks (a sandbox may raise a permitted capability into its inheritable set
//! and then drop it from its bounding set) cannot be restored by CRIU 4.2 at all: `capset`
//! fails ("Unable to restore capabilities") and CRIU then hangs in `wait4`. Such a checkpoint
//! is refused when taken, so the previous one stays ready and restorable.

/// One task's capability sets from `/proc/PID/status` (bit masks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskCaps {
    /// `CapInh`.
    pub inheritable: u64,
    /// `CapBnd`.
    pub bounding: u64,
}

impl TaskCaps {
    /// Parses the `CapInh` and `CapBnd` lines of a `/proc/PID/status` text.
    pub fn parse(status: &str) -> Option<TaskCaps> {
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        };
        Some(TaskCaps {
            inheritable: field("CapInh:")?,
            bounding: field("CapBnd:")?,
        })
    }

    /// Inheritable capabilities outside the bounding set (what a restorer without an
    /// inheritable set of its own cannot `capset`).
    pub fn unrestorable(&self) -> u64 {
        self.inheritable & !self.bounding
    }
}

/// The first task among `pids` (host pids of a frozen sandbox in its own user namespace)
/// whose inheritable set holds capabilities outside its bounding set: `(pid, those bits)`.
pub fn first_unrestorable(pids: &[i32]) -> Option<(i32, TaskCaps)> {
    pids.iter().find_map(|&pid| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let caps = TaskCaps::parse(&status)?;
        (caps.unrestorable() != 0).then_some((pid, caps))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inheritable_outside_the_bounding_set_is_found() {
        let ok = TaskCaps::parse("CapInh:\t0000000000000001\nCapBnd:\t00000000a00425fb\n").unwrap();
        assert_eq!(ok.unrestorable(), 0);
        let bad =
            TaskCaps::parse("CapInh:\t0000000000000100\nCapBnd:\t00000000a00424fb\n").unwrap();
        assert_eq!(bad.unrestorable(), 0x100);
        assert!(TaskCaps::parse("Name:\tsh\n").is_none());
    }

    #[test]
    fn this_process_is_restorable() {
        let pid = std::process::id() as i32;
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let caps = TaskCaps::parse(&status).unwrap();
        assert_eq!(
            first_unrestorable(&[pid]).is_some(),
            caps.unrestorable() != 0
        );
    }
}
