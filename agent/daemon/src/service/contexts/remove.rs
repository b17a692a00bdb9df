//! `ContextRemove`: a trajectory's log out of the directory, the open files, its owner's
//! usage and the table, under the trajectory's lock.
//!
//! A removal holds the trajectory's lock like an append or a lookup does, so it runs between
//! them, never inside one: an append or lookup that held the lock first is done with the file
//! (and its charge is part of what the removal releases); one that waited finds the entry
//! `Dead` and, as after a failed first append (`bury`), an append looks the trajectory up
//! again and starts a new log (record ids and prefixes from scratch), a lookup answers
//! `NotFound`. Every use of a log's file is under its trajectory's lock, and the file leaves
//! the open files before the entry leaves the table, so a new log of the same name never
//! meets the old file.

use belayer_ipc::Caller;

use super::names::{self, Key};
use super::{lock, ContextError, ContextLogs, Status};
use crate::service::access::may_act_on;

impl ContextLogs {
    /// Removes the log of `trajectory` for `caller` (root, or the trajectory's owner through
    /// its own namespace or `<name>@<uid>`), releasing its charge from the owner's budget;
    /// returns the bytes released (for a log not used since the start: its file size plus
    /// [`TRAJECTORY_CHARGE`](super::TRAJECTORY_CHARGE)). A later append starts a new log.
    ///
    /// Errors: [`ContextError::InvalidTrajectory`],
    /// [`UnknownTrajectory`](ContextError::UnknownTrajectory) (also for a trajectory the
    /// caller may not see, with the same message, and for one whose first append has not
    /// created its log yet), and, with the log left as it was,
    /// [`RemoveLog`](ContextError::RemoveLog), [`NotALogFile`](ContextError::NotALogFile) (a
    /// directory in place of the log), [`OpenDir`](ContextError::OpenDir).
    pub fn remove(&self, caller: &Caller, trajectory: &str) -> Result<u64, ContextError> {
        let unknown = || ContextError::UnknownTrajectory {
            trajectory: trajectory.to_owned(),
        };
        let id = names::parse(trajectory).ok_or_else(|| ContextError::invalid(trajectory))?;
        let owner = id.owner.unwrap_or(caller.cred.uid);
        if !may_act_on(caller, owner) {
            return Err(unknown());
        }
        let key = Key {
            owner,
            name: id.name.to_owned(),
        };
        loop {
            let slot = lock(&self.table)
                .trajectories
                .get(&key)
                .cloned()
                .ok_or_else(unknown)?;
            let mut t = lock(&slot);
            match t.status {
                // Out of the table since it was read (removed, or an append that created
                // nothing): whatever the table holds now is the trajectory.
                Status::Dead => continue,
                // An append that has not created the log yet (it waits for this lock).
                Status::New => return Err(unknown()),
                Status::OnDisk => {}
            }
            if !self.root(false)?.remove_log(&key)? {
                tracing::warn!(
                    owner,
                    trajectory = key.name,
                    "context log was gone already: dropping it from the table"
                );
            }
            lock(&self.files).remove(&key);
            let released = std::mem::take(&mut t.charged);
            self.release(owner, released);
            t.index = None;
            self.bury(&slot, &mut t);
            tracing::debug!(
                owner,
                trajectory = key.name,
                released,
                "context log removed"
            );
            return Ok(released);
        }
    }
}
