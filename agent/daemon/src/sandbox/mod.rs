//! Sandboxes: one per trajectory, each with its own namespaces, cgroup and overlayfs root over
//! a read-only image (paper: "Environment-state recovery").
//!
//! On disk, `state_dir/sandboxes/<id>/`:
//! - `state.json`: the [`SandboxRecord`], rewritten (temp + fsync + rename) when a durable
//!   part of it changes, *before* the change is committed in memory ([`SandboxSlot::commit`]):
//!   a full disk fails the verb and loses nothing. Transient states (`checkpointing`,
//!   `restoring`) live in memory only; after a crash the adoption pass infers them;
//! - `inst-<n>/{upper,work,merged}`: the overlay of instance n (a restore makes one numbered
//!   past every `inst-` dir on disk);
//! - `checkpoints/`: the [`crate::store::CheckpointStore`].
//!
//! One verb per file: [`create`], [`exec`], [`checkpoint`], [`restore`], [`remove`]; the
//! instance steps they share are in [`instance`]. Verbs of one sandbox are serialised by
//! [`SandboxSlot::op`] (actions and checkpoints are mutually exclusive: the "state agreement"
//! invariant); inspection only takes the record lock.

pub mod caps;
pub mod changes;
pub mod checkpoint;
pub mod create;
pub mod exec;
pub mod fork;
mod ghosts;
mod helper_cmd;
mod image_config;
pub mod instance;
pub mod net_lock;
pub mod netns;
pub mod pid_counter;
pub mod remove;
pub mod restore;
pub mod transfer;
pub mod unrestorable;
mod watches;

use std::fs;
use std::sync::{Arc, Mutex, MutexGuard};

use belayer_ipc::{SandboxInfo, SandboxLimits, UsernsInfo};
use belayer_overlay::layer::LayerManifest;

pub use crate::record::{state, RecordError, SandboxPaths, SandboxRecord, SandboxState};

use crate::cgroup::SandboxCgroup;
use crate::sys;
use crate::userns::IdRange;

/// Marks `rec` failed in memory and, unless the sandbox is being removed (`removed`, read
/// under the same record lock as the removal sets it), on disk.
fn mark_failed(rec: &mut SandboxRecord, paths: &SandboxPaths, removed: bool) {
    rec.state = SandboxState::Failed;
    if removed {
        tracing::debug!(sandbox = %rec.id, "sandbox being removed; failed state not persisted");
        return;
    }
    match rec.save(paths) {
        Ok(()) => {}
        // Removed meanwhile (its dir renamed away): nothing to persist.
        Err(RecordError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            tracing::debug!(sandbox = %rec.id, "sandbox removed; failed state not persisted")
        }
        Err(e) => {
            tracing::error!(sandbox = %rec.id, error = %e, "cannot persist the failed state (adoption will find the dead init)")
        }
    }
}

/// The processes of a sandbox as `"<pid in the sandbox> <comm>"`, sorted (tasks of the
/// daemon's pid namespace in its cgroup left out): the process-list
/// half of the validity check of a restore (CRIU restores the same pids inside the sandbox's
/// pid namespace).
pub fn process_list(cgroup: &SandboxCgroup) -> Vec<String> {
    let mut out: Vec<String> = cgroup
        .pids()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let field = |name: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_string())
            };
            // Tasks of the daemon's own pid namespace (CRIU and its action script, which
            // join the cgroup while they restore the tree) are not the sandbox's.
            let nspids = field("NSpid:")?;
            let nspid = nspids.split_whitespace().skip(1).last()?.to_string();
            Some(format!("{nspid} {}", field("Name:")?))
        })
        .collect();
    out.sort();
    out
}

/// Whether a task of the sandbox waits in `vfork` for its child to exec or exit (its kernel
/// stack, `/proc/<pid>/stack`, says so). Such a task cannot be seized by CRIU while frozen.
pub fn in_vfork(cgroup: &SandboxCgroup) -> bool {
    cgroup.pids().unwrap_or_default().into_iter().any(|pid| {
        std::fs::read_to_string(format!("/proc/{pid}/stack"))
            .is_ok_and(|stack| stack.contains("vfork"))
    })
}

/// Inode numbers of the files that processes of the sandbox map shared and writable (`rw?s` in
/// `/proc/<pid>/maps`). Writes through such a mapping to a page that is already dirty move
/// neither mtime nor ctime, so an incremental capture must read these files every time.
pub fn shared_writable_inodes(cgroup: &SandboxCgroup) -> std::collections::HashSet<u64> {
    let mut out = std::collections::HashSet::new();
    for pid in cgroup.pids().unwrap_or_default() {
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
            continue;
        };
        for line in maps.lines() {
            let mut fields = line.split_whitespace();
            let perms = fields.nth(1).unwrap_or("");
            let inode = fields.nth(2).and_then(|i| i.parse::<u64>().ok());
            if perms.as_bytes().get(1) == Some(&b'w') && perms.as_bytes().get(3) == Some(&b's') {
                if let Some(ino) = inode.filter(|i| *i != 0) {
                    out.insert(ino);
                }
            }
        }
    }
    out
}

/// A sandbox held by the daemon: the verb lock and the record.
#[derive(Debug)]
pub struct SandboxSlot {
    /// Held for the whole of a verb (exec, checkpoint, restore, remove).
    pub op: Mutex<()>,
    rec: Mutex<SandboxRecord>,
    /// Paths.
    pub paths: SandboxPaths,
    /// Base of the next incremental upper-layer capture: the layer manifest of the last
    /// checkpoint or restore of instance `.0`, keyed to that instance's inodes.
    layer_base: Mutex<Option<(u32, Arc<LayerManifest>)>>,
    /// Output memfds of recent actions, which processes the actions left in the background
    /// may still write to: emptied at the start of every later verb ([`Self::drain_outputs`]).
    outputs: Mutex<std::collections::VecDeque<fs::File>>,
    /// Set (under the record lock) by a removal right before it renames the sandbox dir away:
    /// from then on nothing writes `state.json` ([`Self::commit`] fails, a failure is kept in
    /// memory only), so no writer can race the deletion of the dir.
    removed: std::sync::atomic::AtomicBool,
    /// Whether the sandbox changed since its ready checkpoint (what the policy's clean-step
    /// skip reads); unknown for an adopted sandbox.
    pub changes: changes::Changes,
}

/// How many recent actions' output memfds a sandbox keeps emptying.
const KEPT_OUTPUTS: usize = 32;

impl SandboxSlot {
    /// Wraps a record.
    pub fn new(rec: SandboxRecord, paths: SandboxPaths) -> Self {
        Self {
            op: Mutex::new(()),
            rec: Mutex::new(rec),
            paths,
            layer_base: Mutex::new(None),
            outputs: Mutex::new(std::collections::VecDeque::new()),
            removed: std::sync::atomic::AtomicBool::new(false),
            changes: changes::Changes::unknown(),
        }
    }

    /// The base for an incremental capture of instance `instance`, if one is known.
    pub fn layer_base(&self, instance: u32) -> Option<Arc<LayerManifest>> {
        let base = self.layer_base.lock().unwrap_or_else(|p| p.into_inner());
        base.as_ref()
            .filter(|(n, _)| *n == instance)
            .map(|(_, m)| m.clone())
    }

    /// The base for an incremental capture, whichever instance it belongs to.
    pub fn any_layer_base(&self) -> Option<Arc<LayerManifest>> {
        let base = self.layer_base.lock().unwrap_or_else(|p| p.into_inner());
        base.as_ref().map(|(_, m)| m.clone())
    }

    /// Records the base for the next incremental capture (`None`: capture fully next time).
    pub fn set_layer_base(&self, base: Option<(u32, Arc<LayerManifest>)>) {
        *self.layer_base.lock().unwrap_or_else(|p| p.into_inner()) = base;
    }

    /// Keeps an action's output memfd: a background writer the action left keeps writing
    /// into it after the answer went out, and nobody reads that.
    pub fn keep_output(&self, memfd: fs::File) {
        let mut outputs = self.outputs.lock().unwrap_or_else(|p| p.into_inner());
        if outputs.len() == KEPT_OUTPUTS {
            outputs.pop_front();
        }
        outputs.push_back(memfd);
    }

    /// Empties the kept output memfds (`ftruncate` to 0): what background writers wrote since
    /// the last verb is dropped, so their output holds no more memory than one verb's worth
    /// (the pages are charged to the sandbox's memory limit meanwhile) and checkpoints do not
    /// carry it. Writers are not disturbed: their next write lands at their own offset.
    pub fn drain_outputs(&self) {
        let outputs = self.outputs.lock().unwrap_or_else(|p| p.into_inner());
        for f in outputs.iter() {
            let _ = f.set_len(0);
        }
    }

    /// Locks the record.
    pub fn record(&self) -> MutexGuard<'_, SandboxRecord> {
        self.rec.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the sandbox removed, under the record lock: every later record write is refused
    /// ([`Self::commit`]) or kept in memory (a failure); a write under way has finished. Call
    /// right before the sandbox dir is renamed away; `false` again if that rename failed.
    pub fn mark_removed(&self, removed: bool) {
        let _rec = self.record();
        self.removed
            .store(removed, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`Self::mark_removed`] was called.
    pub fn is_removed(&self) -> bool {
        self.removed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Locks the verb lock.
    pub fn lock_op(&self) -> MutexGuard<'_, ()> {
        self.op.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Re-checks the init; a dead init turns a running sandbox into `Failed` (and is reaped).
    /// Returns a copy of the refreshed record.
    pub fn refresh(&self) -> SandboxRecord {
        let mut rec = self.record();
        if rec.state == SandboxState::Running && !rec.init_alive() {
            if let Some(pid) = rec.init_pid {
                sys::try_reap(pid);
            }
            tracing::warn!(sandbox = %rec.id, "sandbox init is gone: marking failed");
            mark_failed(&mut rec, &self.paths, self.is_removed());
        }
        rec.clone()
    }

    /// Marks a running sandbox failed (in memory at once, since a failed instance must not
    /// take actions whatever the disk says; then on disk, where a write that fails is logged:
    /// the adoption pass finds the dead init anyway). Returns whether it was running.
    pub fn fail(&self) -> bool {
        let mut rec = self.record();
        if rec.state != SandboxState::Running {
            return false;
        }
        mark_failed(&mut rec, &self.paths, self.is_removed());
        // A failed instance is not its ready state, whatever the last verdicts said.
        self.changes.forget();
        true
    }

    /// Sets a transient state (`checkpointing`, `restoring`) or returns from one to
    /// `running`, in memory only: these never need a disk write, so a full disk cannot wedge
    /// a sandbox in them.
    pub fn set_transient(&self, state: SandboxState) {
        self.record().state = state;
    }

    /// Applies `change` to a copy of the record, saves the copy, and only then makes it the
    /// record: when the save fails (a full disk), memory and disk keep the old record and
    /// the caller's verb fails with the error.
    pub fn commit(&self, change: impl FnOnce(&mut SandboxRecord)) -> Result<(), RecordError> {
        let mut rec = self.record();
        if self.is_removed() {
            return Err(RecordError::Io {
                op: "write",
                path: self.paths.state_file(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        let mut next = rec.clone();
        change(&mut next);
        next.save(&self.paths)?;
        *rec = next;
        Ok(())
    }

    /// The user namespace as clients see it: the maps of the running init, else the
    /// recorded range.
    fn userns_info(rec: &SandboxRecord) -> UsernsInfo {
        let recorded = |r: Option<IdRange>| match r {
            Some(r) => vec![[0, r.host_base, r.size]],
            None => vec![[0, 0, u32::MAX]],
        };
        let live = rec
            .init_pid
            .filter(|_| rec.init_alive())
            .and_then(crate::userns::maps_of);
        let (uid_map, gid_map) =
            live.unwrap_or_else(|| (recorded(rec.userns), recorded(rec.userns)));
        UsernsInfo {
            mode: if rec.userns.is_some() {
                "private"
            } else {
                "host"
            }
            .to_string(),
            uid_map,
            gid_map,
        }
    }

    /// Client view.
    pub fn info(&self, ready_prefix: Option<u64>) -> SandboxInfo {
        let rec = self.refresh();
        let pids = SandboxCgroup::open(&rec.cgroup)
            .and_then(|cg| cg.pids())
            .unwrap_or_default();
        SandboxInfo {
            id: rec.id.clone(),
            image: rec.spec.image.clone(),
            state: rec.state,
            init_pid: rec.init_pid.filter(|_| rec.init_alive()),
            pids,
            cgroup: format!("/{}", rec.cgroup),
            ready_prefix,
            instance: rec.instance,
            tag: rec.spec.tag.clone(),
            created_unix_ms: rec.created_unix_ms,
            userns: Some(Self::userns_info(&rec)),
            limits: SandboxLimits {
                memory_max: rec.spec.memory_max,
                pids_max: rec.spec.pids_max,
                cpus: rec.spec.cpus,
                disk_max: rec.spec.disk_max,
            },
            env: rec.spec.env.clone(),
            workdir: rec.spec.workdir.clone(),
            user: rec.spec.user.as_deref().and_then(exec::parse_user),
            image_digest: rec.image_digest.clone(),
        }
    }
}

/// Wall-clock limit on one CRIU run that moves `bytes` of memory (the sandbox's charged
/// memory for a dump, the CRIU images for a restore): by default 60 s plus 4 s per GiB
/// (config `criu_time_limit_base_ms`, `criu_time_limit_per_gib_ms`), far above what a healthy
/// run takes (≈1 s per GiB here) and far below forever. A run past it is killed (see
/// `belayer_criu::DumpRequest::time_limit`): a tree that dies while CRIU holds it otherwise
/// stalls CRIU and the sandbox's operation lock for good.
pub(crate) fn criu_time_limit(config: &crate::config::Config, bytes: u64) -> std::time::Duration {
    config.criu_time_limit(bytes)
}
