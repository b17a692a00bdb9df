//! The daemon's per-trajectory LLM-context logs (paper: L_k) behind `ContextAppend`,
//! `ContextLookup` and `ContextRemove`, one [`crate::context`] log file per trajectory under
//! `<state dir>/contexts`, safe to offer to hostile socket clients:
//!
//! - **Ownership**: a trajectory belongs to the uid of the peer that created it, and every uid
//!   has its own namespace of trajectory names (module `names`: the directory of a log records
//!   its owner; logs older than ownership are root's). A request names a trajectory of the
//!   caller's namespace, or of uid's as `<name>@<uid>`, which [`may_act_on`] admits for root
//!   and uid only. So another peer's trajectory answers exactly like an unknown one: a lookup
//!   finds nothing (`NotFound`, the same message), a plain append makes the caller's own
//!   trajectory of that name, an append to `<name>@<other uid>` is refused whether or not it
//!   exists, and a removal ([`ContextLogs::remove`], module `remove`) finds nothing.
//! - **Descriptors**: at most [`MAX_OPEN_LOGS`] log files are open (least recently used out,
//!   reopened on demand), plus one per request in flight and the directory's.
//! - **Memory**: a [`LogIndex`] per trajectory (offsets and digests, about 100 bytes a record),
//!   never a context; a lookup reads its record with one `pread`. A trajectory is scanned on
//!   its first use after a start, not at start (a start only lists the logs).
//! - **Disk**: every uid has a byte budget ([`ContextLimits`]); each record is charged its
//!   frame plus [`RECORD_CHARGE`] and each trajectory [`TRAJECTORY_CHARGE`], so the budget also
//!   bounds the daemon's memory for the uid's logs (index and table: under 6% of it). An
//!   append past it is refused ([`ContextError::BudgetExhausted`]), as is a context above the
//!   size limit. The listing at start charges a log its file size; a uid's first append after
//!   a start scans its other logs first, so the budget is checked against their exact charge.
//!   A removal releases all that its log was charged.
//! - **Hostile files**: everything under the directory is opened beneath it, never through a
//!   symlink, and must be a regular file (module `dir`); a removal unlinks the entry beneath
//!   the directory and never follows it; a damaged log is cut at its first bad frame, a log
//!   that does not decode is an `Internal` error for its own trajectory only.

mod dir;
mod error;
mod files;
mod limits;
mod names;
mod remove;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use belayer_ipc::{Caller, ContextEntry};

pub use self::error::ContextError;
pub use self::limits::{
    ContextLimits, DEFAULT_UID_BUDGET_BYTES, MAX_OPEN_LOGS, RECORD_CHARGE, TRAJECTORY_CHARGE,
};

use self::dir::ContextsDir;
use self::files::OpenLogs;
use self::names::Key;
use super::access::may_act_on;
use belayer_context::{Durability, EncodedRecord, LogIndex, HEADER_BYTES};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a trajectory's log stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    /// In the table for an append that has not created its file yet.
    New,
    /// Its log file exists.
    OnDisk,
    /// Taken out of the table (an append that created nothing, or a removal): look it up
    /// again.
    Dead,
}

#[derive(Debug)]
struct Trajectory {
    key: Key,
    status: Status,
    /// The log's index; `None` until the log is first used after a start (it is charged as
    /// its file size until then).
    index: Option<LogIndex>,
    /// Bytes charged to the owner's budget for it.
    charged: u64,
}

#[derive(Debug, Default)]
struct Table {
    trajectories: HashMap<Key, Arc<Mutex<Trajectory>>>,
    /// Bytes charged per uid (the sum of its trajectories' `charged`, plus appends in flight).
    usage: HashMap<u32, u64>,
    /// Uids with logs from before the start whose charges are still their file sizes.
    unsettled: HashSet<u32>,
}

/// The context logs of every trajectory, with their owners, open files and budgets.
///
/// Locks, in the order they are taken: `settling` (only while a uid's logs are settled),
/// one lock per trajectory (held for the whole of an append, lookup or removal, so one
/// trajectory's I/O never waits for another's; never two at once), then briefly the table,
/// the directory or the open files.
#[derive(Debug)]
pub struct ContextLogs {
    dir: PathBuf,
    /// The contexts directory, once it exists.
    root: Mutex<Option<Arc<ContextsDir>>>,
    limits: ContextLimits,
    table: Mutex<Table>,
    files: Mutex<OpenLogs<Key>>,
    settling: Mutex<()>,
}

impl ContextLogs {
    /// The logs under `state_dir/contexts`: lists the logs there with their owners and
    /// charges each its file size (each is scanned on first use). A directory that cannot be
    /// opened or read (a symlink, say) is logged and its logs stay unknown (an append to one
    /// of them takes it over, or fails as the directory does).
    pub fn open(state_dir: &Path, limits: ContextLimits) -> Self {
        let dir = state_dir.join("contexts");
        let mut table = Table::default();
        let root = match ContextsDir::open(&dir, false) {
            Ok(root) => root.map(Arc::new),
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot open the context log dir");
                None
            }
        };
        match root.as_deref().map(ContextsDir::list).transpose() {
            Ok(found) => {
                for f in found.into_iter().flatten() {
                    // Saturating: a planted (sparse) file may claim any size.
                    let charged = TRAJECTORY_CHARGE.saturating_add(f.bytes);
                    let used = table.usage.entry(f.key.owner).or_default();
                    *used = used.saturating_add(charged);
                    table.unsettled.insert(f.key.owner);
                    let t = Trajectory {
                        key: f.key.clone(),
                        status: Status::OnDisk,
                        index: None,
                        charged,
                    };
                    table.trajectories.insert(f.key, Arc::new(Mutex::new(t)));
                }
                tracing::info!(
                    dir = %dir.display(),
                    trajectories = table.trajectories.len(),
                    "context logs found"
                );
            }
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "cannot list the context logs")
            }
        }
        let files = OpenLogs::new(limits.max_open_logs);
        ContextLogs {
            dir,
            root: Mutex::new(root),
            limits,
            table: Mutex::new(table),
            files: Mutex::new(files),
            settling: Mutex::new(()),
        }
    }

    /// Appends the context of `trajectory` at boundary `prefix` for `caller` (durable on
    /// return; the trajectory is created, owned by the caller, on its first append).
    ///
    /// Errors: [`ContextError::InvalidTrajectory`],
    /// [`ForeignNamespace`](ContextError::ForeignNamespace),
    /// [`ContextTooLarge`](ContextError::ContextTooLarge),
    /// [`BudgetExhausted`](ContextError::BudgetExhausted), and I/O errors of the log.
    pub fn append(
        &self,
        caller: &Caller,
        trajectory: &str,
        prefix: u64,
        context: Vec<u8>,
    ) -> Result<ContextEntry, ContextError> {
        let id = names::parse(trajectory).ok_or_else(|| ContextError::invalid(trajectory))?;
        let owner = id.owner.unwrap_or(caller.cred.uid);
        if !may_act_on(caller, owner) {
            return Err(ContextError::ForeignNamespace {
                uid: caller.cred.uid,
                trajectory: trajectory.to_owned(),
            });
        }
        let max = self.limits.max_context_bytes;
        if context.len() as u64 > max {
            return Err(ContextError::ContextTooLarge {
                bytes: context.len() as u64,
                max,
            });
        }
        let record = EncodedRecord::boundary(id.name, prefix, &context)?;
        let digest = record.digest().unwrap_or_default();
        let key = Key {
            owner,
            name: id.name.to_owned(),
        };
        self.settle(owner);
        let record_id = loop {
            let slot = self.slot_or_insert(&key);
            let mut t = lock(&slot);
            if t.status == Status::Dead {
                continue;
            }
            break self.append_locked(&slot, &mut t, record)?;
        };
        Ok(ContextEntry {
            trajectory: trajectory.to_owned(),
            prefix,
            context,
            record: record_id,
            digest,
        })
    }

    /// The context of `trajectory` at `prefix` (`None`: its latest boundary) for `caller`.
    ///
    /// Errors: [`ContextError::InvalidTrajectory`], [`NotFound`](ContextError::NotFound) (also
    /// for a trajectory the caller may not see), and I/O errors of the log.
    pub fn lookup(
        &self,
        caller: &Caller,
        trajectory: &str,
        prefix: Option<u64>,
    ) -> Result<ContextEntry, ContextError> {
        let not_found = || ContextError::NotFound {
            trajectory: trajectory.to_owned(),
            prefix,
        };
        let id = names::parse(trajectory).ok_or_else(|| ContextError::invalid(trajectory))?;
        let owner = id.owner.unwrap_or(caller.cred.uid);
        if !may_act_on(caller, owner) {
            return Err(not_found());
        }
        let key = Key {
            owner,
            name: id.name.to_owned(),
        };
        let slot = lock(&self.table)
            .trajectories
            .get(&key)
            .cloned()
            .ok_or_else(not_found)?;
        let mut t = lock(&slot);
        if t.status != Status::OnDisk {
            return Err(not_found());
        }
        let (file, index) = self.index(&mut t)?;
        let (k, b) = match prefix {
            Some(k) => (k, index.boundary(id.name, k).ok_or_else(not_found)?),
            None => index.latest_boundary(id.name).ok_or_else(not_found)?,
        };
        let context = index.read_context(&file, id.name, k, &b)?;
        Ok(ContextEntry {
            trajectory: trajectory.to_owned(),
            prefix: k,
            context,
            record: b.id().0,
            digest: b.digest(),
        })
    }

    /// Bytes charged to `uid`'s budget.
    pub fn usage(&self, uid: u32) -> u64 {
        lock(&self.table).usage.get(&uid).copied().unwrap_or(0)
    }

    /// Log files held open now (at most [`ContextLimits::max_open_logs`]).
    pub fn open_files(&self) -> usize {
        lock(&self.files).len()
    }

    fn slot_or_insert(&self, key: &Key) -> Arc<Mutex<Trajectory>> {
        let mut table = lock(&self.table);
        let slot = table.trajectories.entry(key.clone()).or_insert_with(|| {
            Arc::new(Mutex::new(Trajectory {
                key: key.clone(),
                status: Status::New,
                index: None,
                charged: 0,
            }))
        });
        Arc::clone(slot)
    }

    /// Scans every log of `uid` listed at start and not used since, once, so that its charge
    /// is exact before `uid`'s budget is checked (a log's file size leaves out the per-record
    /// charges). A log that does not scan keeps its file-size charge (and is logged).
    fn settle(&self, uid: u32) {
        if self.limits.budget(uid).is_none() || !lock(&self.table).unsettled.contains(&uid) {
            return;
        }
        let _settling = lock(&self.settling);
        let pending: Vec<_> = {
            let table = lock(&self.table);
            if !table.unsettled.contains(&uid) {
                return;
            }
            table
                .trajectories
                .iter()
                .filter(|(k, _)| k.owner == uid)
                .map(|(_, slot)| Arc::clone(slot))
                .collect()
        };
        for slot in pending {
            let mut t = lock(&slot);
            if t.status == Status::OnDisk && t.index.is_none() {
                if let Err(e) = self.index(&mut t) {
                    tracing::warn!(
                        owner = uid,
                        trajectory = t.key.name,
                        error = %e,
                        "context log does not scan: charged its file size"
                    );
                }
            }
        }
        lock(&self.table).unsettled.remove(&uid);
    }

    fn append_locked(
        &self,
        slot: &Arc<Mutex<Trajectory>>,
        t: &mut Trajectory,
        record: EncodedRecord,
    ) -> Result<u64, ContextError> {
        let owner = t.key.owner;
        let record_charge = record.frame_bytes() + RECORD_CHARGE;
        if t.status == Status::New {
            let file_charge = TRAJECTORY_CHARGE + HEADER_BYTES;
            if let Err(e) = self.reserve(owner, file_charge + record_charge) {
                self.bury(slot, t);
                return Err(e);
            }
            match self.create(t) {
                Ok(true) => {
                    t.charged = t.charged.saturating_add(file_charge);
                    return self.write(t, record, record_charge);
                }
                // Taken over (now on disk, not scanned): appended to like any other below.
                Ok(false) => self.release(owner, file_charge + record_charge),
                Err(e) => {
                    self.release(owner, file_charge + record_charge);
                    self.bury(slot, t);
                    return Err(e);
                }
            }
        }
        // Scanned first, so the budget is checked against what the log really holds.
        self.index(t)?;
        self.reserve(owner, record_charge)?;
        self.write(t, record, record_charge)
    }

    /// Appends `record` to the on-disk log of `t`, whose `record_charge` is reserved: kept on
    /// success, released on failure.
    fn write(
        &self,
        t: &mut Trajectory,
        record: EncodedRecord,
        record_charge: u64,
    ) -> Result<u64, ContextError> {
        let owner = t.key.owner;
        let appended = self.index(t).and_then(|(file, index)| {
            index
                .append(&file, record, Durability::EveryRecord)
                .map_err(ContextError::from)
        });
        match appended {
            Ok(id) => {
                t.charged = t.charged.saturating_add(record_charge);
                Ok(id.0)
            }
            Err(e) => {
                self.release(owner, record_charge);
                Err(e)
            }
        }
    }

    /// Charges `bytes` to `uid` if its budget allows.
    fn reserve(&self, uid: u32, bytes: u64) -> Result<(), ContextError> {
        let mut table = lock(&self.table);
        let used = table.usage.entry(uid).or_default();
        if let Some(budget) = self.limits.budget(uid) {
            if used.saturating_add(bytes) > budget {
                return Err(ContextError::BudgetExhausted {
                    uid,
                    used: *used,
                    needed: bytes,
                    budget,
                });
            }
        }
        *used = used.saturating_add(bytes);
        Ok(())
    }

    fn release(&self, uid: u32, bytes: u64) {
        let mut table = lock(&self.table);
        if let Some(used) = table.usage.get_mut(&uid) {
            *used = used.saturating_sub(bytes);
        }
    }

    /// Sets the charge of `t` to `bytes`, adjusting its owner's usage.
    fn recharge(&self, t: &mut Trajectory, bytes: u64) {
        let mut table = lock(&self.table);
        let used = table.usage.entry(t.key.owner).or_default();
        *used = used.saturating_sub(t.charged).saturating_add(bytes);
        t.charged = bytes;
    }

    /// Takes a trajectory that never got a file, or whose file was removed, out of the table.
    fn bury(&self, slot: &Arc<Mutex<Trajectory>>, t: &mut Trajectory) {
        t.status = Status::Dead;
        let mut table = lock(&self.table);
        if table
            .trajectories
            .get(&t.key)
            .is_some_and(|s| Arc::ptr_eq(s, slot))
        {
            table.trajectories.remove(&t.key);
        }
    }

    /// The open file and index of an on-disk trajectory's log; the log is scanned (and
    /// charged what it holds) on its first use.
    fn index<'t>(
        &self,
        t: &'t mut Trajectory,
    ) -> Result<(Arc<File>, &'t mut LogIndex), ContextError> {
        let file = self.file(&t.key)?;
        let index = match t.index {
            Some(ref mut index) => index,
            None => {
                let path = names::path(&self.dir, &t.key);
                let (index, recovery) = LogIndex::scan(&file, &path)?;
                if recovery.truncated_bytes > 0 {
                    tracing::warn!(
                        owner = t.key.owner,
                        trajectory = t.key.name,
                        truncated = recovery.truncated_bytes,
                        "context log tail cut"
                    );
                }
                self.recharge(t, charge_of(&index));
                t.index.insert(index)
            }
        };
        Ok((file, index))
    }

    /// Creates a new trajectory's log (`true`; its file is kept open), or finds that a file
    /// of that name exists after all (`false`; one the listing at start missed), which is then
    /// taken over: on disk, charged [`TRAJECTORY_CHARGE`] until it is scanned.
    fn create(&self, t: &mut Trajectory) -> Result<bool, ContextError> {
        let root = self.root(true)?;
        let path = names::path(&self.dir, &t.key);
        let Some(file) = root.create_log(&t.key)? else {
            tracing::warn!(
                path = %path.display(),
                "context log missing from the table exists: taking it over"
            );
            t.status = Status::OnDisk;
            t.index = None;
            self.recharge(t, TRAJECTORY_CHARGE);
            return Ok(false);
        };
        let file = Arc::new(file);
        let index = LogIndex::create(&file, &path)?;
        lock(&self.files).insert(t.key.clone(), Arc::clone(&file));
        t.status = Status::OnDisk;
        t.index = Some(index);
        Ok(true)
    }

    /// The contexts directory, opened (and, with `create`, created) on first need.
    fn root(&self, create: bool) -> Result<Arc<ContextsDir>, ContextError> {
        let mut root = lock(&self.root);
        if let Some(r) = root.as_ref() {
            return Ok(Arc::clone(r));
        }
        match ContextsDir::open(&self.dir, create)? {
            Some(opened) => Ok(Arc::clone(root.insert(Arc::new(opened)))),
            None => Err(ContextError::OpenDir {
                path: self.dir.clone(),
                source: std::io::ErrorKind::NotFound.into(),
            }),
        }
    }

    /// The open file of `key`'s log, opened (and kept among the open ones) if it is not.
    fn file(&self, key: &Key) -> Result<Arc<File>, ContextError> {
        if let Some(file) = lock(&self.files).get(key) {
            return Ok(file);
        }
        let file = Arc::new(self.root(false)?.open_log(key)?);
        lock(&self.files).insert(key.clone(), Arc::clone(&file));
        Ok(file)
    }
}

/// What a loaded log is charged: the trajectory, its bytes, and the per-record charge.
fn charge_of(index: &LogIndex) -> u64 {
    TRAJECTORY_CHARGE
        .saturating_add(index.size_bytes())
        .saturating_add((index.len() as u64).saturating_mul(RECORD_CHARGE))
}

#[cfg(test)]
mod tests;
