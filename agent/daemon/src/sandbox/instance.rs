//! The directory-level lifecycle of a sandbox's instances, shared by create, restore and
//! remove: make an instance dir (a quota-limited volume), tear the current instance down
//! (kill, reap, remove its cgroup), retire an old instance (unmount, delete).

use std::time::{Duration, Instant};

use super::{SandboxPaths, SandboxSlot};
use crate::cgroup::{CgroupError, SandboxCgroup};
use crate::runtime::Runtime;
use crate::sys;

/// Makes the directory of instance `n` (replacing a stale one): a btrfs volume limited to
/// `limit` (the sandbox's `spec.disk_max`, resolved at creation; a restore sets it later), which
/// the kernel enforces on everything the instance writes (`EDQUOT` inside the sandbox past it).
pub(crate) fn make_instance_dir(
    rt: &Runtime,
    paths: &SandboxPaths,
    n: u32,
    limit: Option<u64>,
) -> Result<(), crate::quota::QuotaError> {
    let dir = paths.instance(n);
    crate::quota::remove_instance_dir(&dir)?;
    crate::quota::make_instance_dir(rt.quota.as_ref(), &dir, limit)?;
    Ok(())
}

/// Kills every process of the current instance, reaps the init, unmounts its root and removes
/// its cgroup. Safe to call on an instance that is already gone.
pub(crate) fn teardown(slot: &SandboxSlot) -> Result<(), CgroupError> {
    let rec = slot.record().clone();
    let t = Instant::now();
    match SandboxCgroup::open(&rec.cgroup) {
        Ok(cg) => {
            cg.kill_all(Duration::from_secs(10))?;
            cg.remove()?;
            tracing::debug!(sandbox = %rec.id, ms = t.elapsed().as_secs_f64() * 1000.0, "teardown: killed, cgroup removed");
        }
        Err(e) => tracing::debug!(sandbox = %rec.id, error = %e, "no cgroup to tear down"),
    }
    // The cgroup is empty, so the init is dead: reap it if it is our child (after a daemon
    // restart its new parent does).
    if let Some(pid) = rec.init_pid {
        sys::try_reap(pid);
    }
    Ok(())
}

/// Unmounts the root of instance `n` and deletes its directories. A lazy unmount waits for an
/// RCU grace period (about 100 ms here), so restore hands this to a background thread: the old
/// instance is garbage once its processes are dead.
pub(crate) fn retire_instance(paths: &SandboxPaths, n: u32) {
    let dir = paths.instance(n);
    if !dir.exists() {
        // Never made (a fork child's instance 0).
        return;
    }
    let merged = paths.merged(n);
    if let Err(e) = belayer_overlay::unmount(&merged) {
        tracing::warn!(path = %merged.display(), error = %e, "cannot unmount old root");
    }
    if let Err(e) = crate::quota::remove_instance_dir(&dir) {
        tracing::warn!(path = %dir.display(), error = %e, "cannot remove old instance");
    }
}
