//! Adoption: after a (re)start, the sandboxes of the state dir are loaded again. Sandboxes
//! outlive `belayerd`; a checkpoint interrupted by a crash is finished off (an orphaned CRIU
//! dump told to abort, the cgroup thawed, unpublished checkpoints discarded), a dead init makes
//! the sandbox failed, stale instances and removed sandboxes are deleted in the background,
//! and user-namespace ranges and disk limits are taken up again. Children of a fork that
//! did not reach its commit point are removed; those of one that did are kept, and the
//! commit markers deleted once every such child's record says so
//! ([`crate::sandbox::fork`]).

use std::fs;
use std::sync::Arc;
use std::time::Duration;

use super::Agent;
use crate::cgroup::SandboxCgroup;
use crate::sandbox::{self, SandboxPaths, SandboxRecord, SandboxSlot, SandboxState};
use crate::store::CheckpointStore;

impl Agent {
    /// Loads every sandbox of the state dir after a (re)start.
    pub(super) fn adopt(&self) {
        let dir = self.rt.config.state_dir.join("sandboxes");
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        let mut ids = Vec::new();
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if id.starts_with(sandbox::remove::TRASH_PREFIX) {
                // Removed, not yet deleted: finish in the background.
                let path = e.path();
                std::thread::spawn(move || sandbox::remove::delete_sandbox_dir(&path));
                continue;
            }
            ids.push(id);
        }
        // Sandboxes are adopted in parallel: one caught mid-checkpoint waits for its orphaned
        // CRIU dump to end (up to 30 s), which must not hold up the others (nor the socket,
        // which opens after adoption).
        let next = std::sync::atomic::AtomicUsize::new(0);
        let markers_needed = std::sync::atomic::AtomicBool::new(false);
        let workers = ids.len().clamp(1, ADOPT_THREADS);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(id) = ids.get(i) else {
                        break;
                    };
                    if !self.adopt_one(id.clone()) {
                        markers_needed.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
        });
        if !markers_needed.into_inner() {
            let markers = sandbox::fork::markers_dir(&self.rt.config.state_dir);
            for e in fs::read_dir(&markers).into_iter().flatten().flatten() {
                let _ = fs::remove_file(e.path());
            }
        }
    }

    /// A child of fork `fork` found at adoption: kept (its mark cleared, `true`) when the
    /// fork committed; else removed with whatever of it exists (`None` returned on success;
    /// its range is not taken up again). A child that cannot be removed keeps its range and
    /// stays on disk for the next adoption to try again.
    fn adopt_fork_child(
        &self,
        rec: SandboxRecord,
        paths: &SandboxPaths,
        fork: &str,
    ) -> Option<SandboxRecord> {
        if sandbox::fork::is_committed(&self.rt.config.state_dir, fork) {
            let mut rec = rec;
            rec.pending_fork = None;
            return Some(rec);
        }
        let (id, userns) = (rec.id.clone(), rec.userns);
        let slot = SandboxSlot::new(rec, paths.clone());
        match sandbox::remove::remove(&slot) {
            Ok(()) => {
                tracing::info!(sandbox = %id, fork, "removed a child of an unfinished fork");
            }
            Err(err) => {
                tracing::error!(sandbox = %id, fork, error = %err, "cannot remove a child of an unfinished fork");
                if let Some(range) = userns {
                    self.rt.userns.adopt(range);
                }
            }
        }
        None
    }

    /// Adopts the sandbox `id` of the state dir (see the module docs). Returns `false` when
    /// a kept fork child's record could not be rewritten (the fork's marker must stay).
    fn adopt_one(&self, id: String) -> bool {
        let paths = SandboxPaths::new(&self.rt.config.state_dir, &id);
        let mut rec = match SandboxRecord::load(&paths) {
            Ok(r) => r,
            Err(crate::record::RecordError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound && id.starts_with("sb-") =>
            {
                // A creation killed before its record was written (records are written
                // atomically: none, or a whole one).
                sandbox::remove::remove_unrecorded(&paths, &self.rt.cgroup_rel(&id));
                return true;
            }
            Err(err) => {
                tracing::warn!(sandbox = %id, error = %err, "skipping sandbox with unreadable state");
                return true;
            }
        };
        let forked = rec.pending_fork.clone();
        if let Some(fork) = &forked {
            match self.adopt_fork_child(rec, &paths, fork) {
                Some(kept) => rec = kept,
                None => return true,
            }
        }
        if let Some(range) = rec.userns {
            self.rt.userns.adopt(range);
        }
        // A crash between making an instance's volume and limiting it leaves no limit:
        // set it again (a limit already there stays: a restore may have lowered it).
        let inst = paths.instance(rec.instance);
        if self.rt.quota.is_some() && crate::quota::is_volume(&inst) {
            let limited = crate::quota::Volume::open(&inst).and_then(|v| match v.usage() {
                Ok(u) if u.limit.is_some() => Ok(()),
                _ => v.set_limit(rec.spec.disk_max),
            });
            if let Err(err) = limited {
                tracing::warn!(sandbox = %id, error = %err, "cannot re-apply the disk limit");
            }
        }
        // A checkpoint interrupted by a crash left no trace in the state file (that state
        // is never written), but maybe a CRIU dump still running and a frozen cgroup: let
        // the dump finish (it restores the freezer state it found when it exits), thaw,
        // and discard any unpublished checkpoint (below).
        let dumping = rec.init_pid.is_some_and(dump_running);
        if dumping && belayer_criu::abort_gated_dump(&paths.criu_work()) {
            tracing::info!(sandbox = %id, "told an orphaned CRIU dump to abort");
        }
        if let Ok(cg) = SandboxCgroup::open(&rec.cgroup) {
            // The BPF allow-list stays attached across restarts; put it back if host root
            // took it away.
            match cg.ensure_device_filter(self.rt.config.device_filter) {
                Ok(false) => {}
                Ok(true) => {
                    tracing::warn!(sandbox = %id, "device allow-list was missing; attached again")
                }
                Err(err) => {
                    tracing::error!(sandbox = %id, error = %err, "cannot check the device allow-list")
                }
            }
            if cg.is_frozen().unwrap_or(false) {
                if let Some(pid) = rec.init_pid {
                    wait_for_orphaned_dump(pid, Duration::from_secs(30));
                }
                if let Err(err) = cg.thaw() {
                    tracing::warn!(sandbox = %id, error = %err, "cannot thaw adopted sandbox");
                }
            }
        }
        rec.state = match rec.state {
            // Written by daemons that persisted transient states.
            SandboxState::Checkpointing => SandboxState::Running,
            SandboxState::Restoring => SandboxState::Failed,
            s => s,
        };
        if let Ok(store) = CheckpointStore::open(&paths.checkpoints()) {
            match store.discard_unpublished() {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(sandbox = %id, removed = n, "discarded unpublished checkpoints")
                }
                Err(err) => {
                    tracing::warn!(sandbox = %id, error = %err, "cannot clean checkpoint store")
                }
            }
        }
        if rec.state == SandboxState::Running && !rec.init_alive() {
            rec.state = SandboxState::Failed;
        }
        if rec.state == SandboxState::Failed {
            reap_unmanaged_tree(&id, &rec.cgroup, &paths.criu_work());
        }
        // The images dir of a restore the previous daemon did not finish (its pages files
        // may be hard links to packs, which would outlive their collection).
        let images = paths.restore_images();
        if images.exists() {
            if let Err(err) = belayer_overlay::remove_dir_all(&images) {
                tracing::warn!(sandbox = %id, error = %err, "cannot remove a restore's images dir");
            }
        }
        // Instances other than the current one are leftovers of a restore the previous
        // daemon did not finish (or of an old instance it had not deleted yet).
        // A restore from now on takes a number past all of them
        // (`SandboxPaths::next_instance`), so their deletion cannot meet it.
        let stale: Vec<u32> = paths
            .instances()
            .into_iter()
            .filter(|n| *n != rec.instance)
            .collect();
        if !stale.is_empty() {
            tracing::info!(sandbox = %id, ?stale, "removing stale instances");
            let paths = paths.clone();
            std::thread::spawn(move || {
                for n in stale {
                    sandbox::instance::retire_instance(&paths, n);
                }
            });
        }
        let saved = rec.save(&paths);
        if let Err(err) = &saved {
            tracing::warn!(sandbox = %id, error = %err, "cannot persist adopted state");
        }
        tracing::info!(sandbox = %id, state = rec.state.as_str(), "adopted sandbox");
        if rec.state == SandboxState::Running {
            self.rt.tracer.track(&rec);
        }
        self.registry()
            .insert(id, Arc::new(SandboxSlot::new(rec, paths)));
        forked.is_none() || saved.is_ok()
    }
}

/// A failed sandbox has no process the daemon answers for: whatever its cgroup holds is the
/// tree of a restore the previous daemon did not finish (CRIU held at a stage, or about to
/// resume the tree when its action script's wait runs out), which would otherwise run
/// unmanaged on an instance about to be deleted. Kills it (`cgroup.kill`, bounded wait), then
/// tells a CRIU still waiting in its action script to stop waiting.
fn reap_unmanaged_tree(id: &str, cgroup: &str, criu_work: &std::path::Path) {
    if let Ok(cg) = SandboxCgroup::open(cgroup) {
        let pids = cg.pids().unwrap_or_default();
        if !pids.is_empty() {
            tracing::warn!(sandbox = %id, pids = pids.len(), "killing the processes of a failed sandbox (an interrupted restore)");
            if let Err(err) = cg.kill_all(Duration::from_secs(10)) {
                tracing::warn!(sandbox = %id, error = %err, "cannot kill the processes of a failed sandbox");
            }
        }
    }
    if belayer_criu::abort_held_restore(criu_work) {
        tracing::info!(sandbox = %id, "told an orphaned CRIU restore to stop waiting");
    }
}

/// Waits (bounded) until no `criu dump --tree <pid>` process is left running.
fn wait_for_orphaned_dump(pid: i32, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    while dump_running(pid) {
        if std::time::Instant::now() > deadline {
            tracing::warn!(
                pid,
                "a CRIU dump of this sandbox is still running; thawing anyway"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Sandboxes adopted at once at start-up.
const ADOPT_THREADS: usize = 16;

/// Whether a `criu dump --tree <pid>` process is running (a dump of the sandbox whose init is
/// `pid`, left by a daemon that died during a checkpoint).
fn dump_running(pid: i32) -> bool {
    let tree = pid.to_string();
    let Ok(entries) = fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        let Ok(cmdline) = fs::read(e.path().join("cmdline")) else {
            return false;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        args.get(1) == Some(&&b"dump"[..])
            && args
                .windows(2)
                .any(|w| w[0] == b"--tree" && w[1] == tree.as_bytes())
    })
}
