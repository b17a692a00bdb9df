//! The sandbox tracer as the agent uses it (crate `belayer-ebpf`): tracking each sandbox's
//! cgroup, handing tracer faults to a handler the daemon installs (it marks the sandbox failed
//! at once and publishes `Event::SandboxFailed` on its event bus), and the per-action verdict
//! of an exec ([`ActionProbe`]): infrastructure fault and dirtiness.
//!
//! Dirtiness: whether anything changed since the end of the sandbox's previous action (or,
//! for the first action after a restore, since CRIU's pre-resume stage, when the restored tree
//! is its checkpoint and no task of it runs yet: [`SandboxTracer::track_restored`]; for the
//! first action after a create or an adoption, since it was tracked with BPF and since the
//! action began with the fallback), so that what background processes do between two
//! actions counts for the next one. With BPF, an action is dirty when the sandbox's
//! file-modification counter moved or its set of processes changed (a process left running
//! or gone); the counter ignores writes to pipes, sockets, devices, memfds (the action's
//! stdout/stderr) and pseudo file systems, so the exec helper's own status line and cgroup
//! joins never count. With the fallback (no BPF), the file half compares a fingerprint of the
//! overlay upper layer (path, inode, mode, size, mtime, ctime of every entry): coarser and
//! slower on large upper layers, but exact for what a checkpoint captures. With both, an
//! action is also dirty when, at its end or at the end of the previous one, a process of the
//! sandbox held something through which files change without any syscall ([`held`]: a shared
//! writable file mapping, an io_uring, an AIO context; with BPF also a live process that ever
//! used io_uring or AIO): a step is never reported clean while a file may have changed. And
//! with both, an action is dirty when a process that was running before it began ran while it
//! ran ([`activity`]: a request to a server, a line into a FIFO, a trapped signal change only
//! that process's memory).
//!
//! Infrastructure faults: with BPF, the counters of external kills and OOM victims (kept by the
//! BPF programs, read synchronously, so nothing races the ring buffer); with the fallback, the
//! memory controller's `oom_kill` counter, and a fatal signal that ended the action's shell
//! without the timeout firing counts as an external kill (a kill of another process from
//! outside is not seen there). A dead init is `sandbox_lost` in both.

pub mod activity;
pub mod held;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use belayer_ebpf::{cgroup_id, Counters, Fault, Target, Tracer, TracerError, TracerKind};
use belayer_ipc::{InfraFault, InfraFaultKind};

use crate::cgroup::SandboxCgroup;
use crate::helper::exec::ActionStatus;
use crate::record::SandboxRecord;
use activity::{Activity, Ran};
use held::Writer;

/// Handles a fault of sandbox `id` (called from the tracer's thread).
type Handler = Box<dyn Fn(&str, &Fault) + Send + Sync>;

#[derive(Default)]
struct Shared {
    /// cgroup id → sandbox id.
    ids: Mutex<HashMap<u64, String>>,
    /// sandbox id → cgroup id.
    cgroups: Mutex<HashMap<String, u64>>,
    handler: OnceLock<Handler>,
    /// sandbox id → its state at the end of its last action.
    marks: Mutex<HashMap<String, Mark>>,
}

/// A sandbox's state at an action boundary: what the next action's verdict compares with.
#[derive(Debug, Clone)]
struct Mark {
    cgroup_id: u64,
    /// BPF file-modification counter (`None` without file counters).
    fs_writes: Option<u64>,
    /// Live processes.
    pids: Vec<i32>,
    /// Upper-layer fingerprint (fallback only).
    upper: Option<[u8; 32]>,
    /// A writer held then: files may have changed after the boundary without a syscall.
    held: Option<Writer>,
}

/// The agent's tracer: BPF or fallback, and the tracked sandboxes.
pub struct SandboxTracer {
    tracer: Tracer,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SandboxTracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxTracer")
            .field("tracer", &self.tracer)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SandboxTracer {
    /// Starts the tracer: BPF unless `no_bpf` or it cannot load (then the fallback, with one
    /// log line saying why).
    ///
    /// Errors: not even the fallback's thread could start.
    pub fn start(no_bpf: bool) -> Result<SandboxTracer, TracerError> {
        let shared: Arc<Shared> = Arc::default();
        let s = shared.clone();
        // Files of the agent's own mounts are never sandbox state.
        let own_ns = std::fs::metadata("/proc/self/ns/mnt")
            .map_or(0, |m| std::os::unix::fs::MetadataExt::ino(&m));
        let tracer = Tracer::builder()
            .force_fallback(no_bpf)
            .own_mount_ns(own_ns)
            .sandbox_pid_level(own_pid_level() + 1)
            .on_event(move |ev| {
                let Some(id) = lock(&s.ids).get(&ev.cgroup_id).cloned() else {
                    return;
                };
                tracing::warn!(sandbox = %id, fault = %ev.fault, "sandbox fault");
                if let Some(h) = s.handler.get() {
                    h(&id, &ev.fault);
                }
            })
            .start()?;
        Ok(SandboxTracer { tracer, shared })
    }

    /// Installs the function that handles faults (once; later calls are ignored).
    pub fn set_handler(&self, f: impl Fn(&str, &Fault) + Send + Sync + 'static) {
        let _ = self.shared.handler.set(Box::new(f));
    }

    /// BPF or fallback.
    pub fn kind(&self) -> TracerKind {
        self.tracer.kind()
    }

    /// `bpf`, or `fallback (<reason>)`.
    pub fn describe(&self) -> String {
        match self.tracer.fallback_reason() {
            None => self.kind().to_string(),
            Some(r) => format!("{} ({r})", self.kind()),
        }
    }

    /// Tracks the current instance of a running sandbox (replacing its earlier instance).
    /// Failures are logged: the sandbox then runs untraced (dirtiness unknown).
    pub fn track(&self, rec: &SandboxRecord) {
        self.untrack(&rec.id);
        let (Some(init_pid), Ok(cg)) = (rec.init_pid, SandboxCgroup::open(&rec.cgroup)) else {
            return;
        };
        self.track_parts(&rec.id, &cg, init_pid);
    }

    /// Tracks sandbox `sandbox` (replacing its earlier instance and forgetting its mark):
    /// its cgroup and init. Returns the cgroup id, `None` (logged) when it is not traced.
    fn track_parts(&self, sandbox: &str, cg: &SandboxCgroup, init_pid: i32) -> Option<u64> {
        self.untrack(sandbox);
        let Some(dir) = cg.v2_dir() else {
            tracing::warn!(sandbox, "no cgroup v2 directory: sandbox not traced");
            return None;
        };
        let id = match cgroup_id(dir) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(sandbox, error = %e, "cannot stat the sandbox cgroup");
                return None;
            }
        };
        let target = Target {
            cgroup_id: id,
            cgroup_dir: dir.to_path_buf(),
            init_pid,
            oom_events: cg.oom_events_file(),
        };
        // Registered before the tracer knows it, so no fault finds an unknown cgroup.
        lock(&self.shared.ids).insert(id, sandbox.to_string());
        lock(&self.shared.cgroups).insert(sandbox.to_string(), id);
        if let Err(e) = self.tracer.track(target) {
            tracing::warn!(sandbox, error = %e, "cannot trace sandbox");
            lock(&self.shared.ids).remove(&id);
            lock(&self.shared.cgroups).remove(sandbox);
            return None;
        }
        Some(id)
    }

    /// Stops tracing a sandbox (before the agent kills it itself, or when it is removed).
    pub fn untrack(&self, sandbox: &str) {
        lock(&self.shared.marks).remove(sandbox);
        if let Some(id) = lock(&self.shared.cgroups).remove(sandbox) {
            self.tracer.untrack(id);
            lock(&self.shared.ids).remove(&id);
        }
    }

    fn cgroup_of(&self, sandbox: &str) -> Option<u64> {
        lock(&self.shared.cgroups).get(sandbox).copied()
    }

    /// Counters of a traced sandbox (BPF only).
    pub fn counters(&self, sandbox: &str) -> Option<Counters> {
        self.tracer.counters(self.cgroup_of(sandbox)?)
    }

    /// Snapshot taken right before an action's helper starts: the faults counters now, and
    /// the base of the dirtiness verdict (the end of the previous action, else now).
    pub fn begin_action(
        &self,
        rec: &SandboxRecord,
        cgroup: &SandboxCgroup,
        upper: &Path,
    ) -> ActionProbe {
        let cg = self.cgroup_of(&rec.id);
        let counters = cg.and_then(|c| self.tracer.counters(c));
        let live = live_pids(cgroup, rec.init_pid);
        let base = cg.map(|c| {
            let mark = lock(&self.shared.marks)
                .get(&rec.id)
                .filter(|m| m.cgroup_id == c)
                .cloned();
            mark.unwrap_or_else(|| Mark {
                cgroup_id: c,
                // The counters started at 0 when the cgroup was tracked.
                fs_writes: counters.filter(|_| self.tracer.counts_files()).map(|_| 0),
                pids: live.clone(),
                upper: if self.tracer.counts_files() {
                    None
                } else {
                    upper_fingerprint(upper)
                },
                held: held::scan(&cgroup.pids().unwrap_or_default()),
            })
        });
        // The processes running before the action, the init among them (the image's shell,
        // which a sandbox process may drive, e.g. by ptrace), whose running during the
        // action is a change no file shows.
        let running = live;
        ActionProbe {
            cgroup_id: cg,
            oom_kills: cg.and_then(|c| self.tracer.oom_kills(c)),
            counters,
            activity: base.as_ref().map(|_| Activity::snapshot(&running)),
            base,
        }
    }

    /// Whether the sandbox changed since its last action boundary, without moving it: the
    /// file counter (without file counters, the upper layer's fingerprint), the set of
    /// processes and held writers, as an action's verdict reads them. What background
    /// processes did after the last action ended is not yet in any verdict; a
    /// `MaybeCheckpoint` asks this before it answers "clean". `None`: not traced, or (without
    /// file counters) no boundary yet.
    pub fn changed_since_mark(
        &self,
        rec: &SandboxRecord,
        cgroup: &SandboxCgroup,
        upper: &Path,
    ) -> Option<bool> {
        let c = self.cgroup_of(&rec.id)?;
        let counters = self.tracer.counters(c);
        let counts_files = self.tracer.counts_files();
        let mark = lock(&self.shared.marks)
            .get(&rec.id)
            .filter(|m| m.cgroup_id == c)
            .cloned();
        let files = match (&mark, counters) {
            (Some(m), Some(now)) if counts_files => Some(Some(now.fs_writes) != m.fs_writes),
            // No boundary yet: the counters started at 0 when the cgroup was tracked.
            (None, Some(now)) if counts_files => Some(now.fs_writes != 0),
            (Some(m), _) => match (m.upper, upper_fingerprint(upper)) {
                (Some(b), Some(a)) => Some(a != b),
                _ => None,
            },
            (None, _) => None,
        }?;
        let pids = live_pids(cgroup, rec.init_pid);
        let held = self.held_now(&cgroup.pids().unwrap_or_default(), counters.as_ref());
        let moved = mark
            .as_ref()
            .is_some_and(|m| m.pids != pids || m.held.is_some());
        Some(files || moved || held.is_some())
    }

    /// What [`SandboxTracer::track_restored`] needs from before CRIU starts: without file
    /// counters, the fingerprint of the upper layer CRIU restores the tree over.
    pub fn restore_baseline(&self, upper: &Path) -> RestoreBaseline {
        RestoreBaseline {
            upper: if self.tracer.counts_files() {
                None
            } else {
                upper_fingerprint(upper)
            },
        }
    }

    /// Tracks a restored instance at CRIU's pre-resume stage, while CRIU holds every task of
    /// the tree it rebuilt, and marks that moment as the sandbox's last action boundary: the
    /// first action after the restore is compared with the ready checkpoint's state as
    /// restored, so what the restored processes do after they resume (a background job's
    /// write, its exit) counts for that action. Failures are logged: the sandbox then runs
    /// untraced (dirtiness unknown). Returns whether it is traced.
    pub fn track_restored(
        &self,
        id: &str,
        cgroup: &SandboxCgroup,
        init_pid: i32,
        baseline: &RestoreBaseline,
    ) -> bool {
        let Some(c) = self.track_parts(id, cgroup, init_pid) else {
            return false;
        };
        let counters = self.tracer.counters(c);
        let counts_files = self.tracer.counts_files();
        // The restored tree only: CRIU and its action script are in the cgroup too.
        let pids = live_pids(cgroup, Some(init_pid));
        let held = self.held_now(&pids, counters.as_ref());
        let mark = Mark {
            cgroup_id: c,
            fs_writes: counters.filter(|_| counts_files).map(|a| a.fs_writes),
            pids,
            upper: baseline.upper,
            held,
        };
        lock(&self.shared.marks).insert(id.to_string(), mark);
        true
    }

    /// Whether one of `pids` holds a writer now (`/proc`), or the BPF count of live
    /// io_uring/AIO users is above 0.
    fn held_now(&self, pids: &[i32], after: Option<&Counters>) -> Option<Writer> {
        held::scan(pids).or_else(|| {
            after
                .filter(|a| a.async_procs > 0)
                .map(|a| Writer::AsyncIo {
                    processes: a.async_procs,
                })
        })
    }
}

/// The part of a restored sandbox's baseline read before CRIU starts
/// ([`SandboxTracer::restore_baseline`]).
#[derive(Debug, Clone, Default)]
pub struct RestoreBaseline {
    /// Upper-layer fingerprint (fallback only).
    upper: Option<[u8; 32]>,
}

/// What an action did, as far as the tracer can tell.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ActionVerdict {
    /// Infrastructure fault during the action.
    pub infra_fault: Option<InfraFault>,
    /// Whether the action changed the sandbox; `None` when unknown.
    pub dirty: Option<bool>,
}

/// The state of a sandbox before an action, compared after it by [`ActionProbe::finish`].
#[derive(Debug)]
pub struct ActionProbe {
    cgroup_id: Option<u64>,
    counters: Option<Counters>,
    oom_kills: Option<u64>,
    base: Option<Mark>,
    /// CPU use of the processes running before the action (taken with `base`).
    activity: Option<Activity>,
}

const FATAL: [i32; 6] = [
    libc::SIGKILL,
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGABRT,
];

impl ActionProbe {
    /// Compares with the state after the action (the helper already reaped).
    pub fn finish(
        self,
        tracer: &SandboxTracer,
        rec: &SandboxRecord,
        cgroup: &SandboxCgroup,
        upper: &Path,
        status: &ActionStatus,
    ) -> ActionVerdict {
        let Some(cg) = self.cgroup_id else {
            return ActionVerdict::default();
        };
        let after = tracer.tracer.counters(cg);
        let oom_after = tracer.tracer.oom_kills(cg);
        let pids = live_pids(cgroup, rec.init_pid);
        let init_alive = rec.init_alive();
        let oom = matches!((self.oom_kills, oom_after), (Some(b), Some(a)) if a > b);
        let infra_fault = if oom {
            Some(InfraFault {
                kind: InfraFaultKind::Oom,
                pid: after.map(|c| c.last_oom_pid as i32).filter(|p| *p > 0),
                signal: Some(libc::SIGKILL),
            })
        } else if let (Some(b), Some(a)) = (self.counters, after) {
            (a.external_kills > b.external_kills).then_some(InfraFault {
                kind: InfraFaultKind::ExternalKill,
                pid: Some(a.last_kill_pid as i32),
                signal: Some(a.last_kill_signal as i32),
            })
        } else {
            status
                .signal
                .filter(|s| FATAL.contains(s) && !status.timed_out)
                .map(|s| InfraFault {
                    kind: InfraFaultKind::ExternalKill,
                    pid: None,
                    signal: Some(s),
                })
        };
        let infra_fault = infra_fault.or_else(|| {
            (!init_alive).then_some(InfraFault {
                kind: InfraFaultKind::SandboxLost,
                pid: rec.init_pid,
                signal: None,
            })
        });
        let Some(base) = self.base else {
            return ActionVerdict {
                infra_fault,
                dirty: None,
            };
        };
        let counts_files = tracer.tracer.counts_files();
        let upper_after = if counts_files {
            None
        } else {
            upper_fingerprint(upper)
        };
        let files_changed = match (base.fs_writes, after) {
            (Some(b), Some(a)) if counts_files => Some(a.fs_writes != b),
            _ => match (base.upper, upper_after) {
                (Some(b), Some(a)) => Some(a != b),
                _ => None,
            },
        };
        let held = tracer.held_now(&cgroup.pids().unwrap_or_default(), after.as_ref());
        if let Some(w) = base.held.as_ref().or(held.as_ref()) {
            tracing::debug!(sandbox = %rec.id, writer = %w, "files may change without syscalls: step dirty");
        }
        let ran: Option<Ran> = self.activity.as_ref().and_then(Activity::ran_since);
        if let Some(r) = &ran {
            tracing::debug!(sandbox = %rec.id, activity = %r, "a process that was running before the action ran: step dirty");
        }
        if pids != base.pids {
            tracing::debug!(sandbox = %rec.id, before = ?base.pids, after = ?pids, "the set of processes changed: step dirty");
        }
        if files_changed == Some(true) {
            tracing::debug!(sandbox = %rec.id, "files changed: step dirty");
        }
        let certain = pids != base.pids || base.held.is_some() || held.is_some() || ran.is_some();
        let dirty = match files_changed {
            Some(f) => Some(f || certain),
            None => certain.then_some(true),
        };
        lock(&tracer.shared.marks).insert(
            rec.id.clone(),
            Mark {
                cgroup_id: cg,
                fs_writes: after.filter(|_| counts_files).map(|a| a.fs_writes),
                pids,
                upper: upper_after,
                held,
            },
        );
        ActionVerdict { infra_fault, dirty }
    }
}

/// The processes of the sandbox that are not dying: zombies and processes with a fatal signal
/// pending (sent by the action, not yet acted upon) are left out, so a kill is seen at once.
/// The init's own idle `sleep` (in the init's session, which no action joins: actions run in
/// sessions of their own) is left out too: it is started just after the init and replaced
/// every hour, and is not a change an action made.
fn live_pids(cgroup: &SandboxCgroup, init: Option<i32>) -> Vec<i32> {
    let fatal: u64 = FATAL.iter().map(|s| 1u64 << (s - 1)).sum();
    let mut pids = cgroup.pids().unwrap_or_default();
    pids.retain(|pid| {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            return false;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        let mask = |name: &str| {
            field(name)
                .and_then(|v| u64::from_str_radix(v, 16).ok())
                .unwrap_or(0)
        };
        // A zombie leader whose other threads live on (its main thread called
        // pthread_exit) is a live process.
        let threads = field("Threads:").and_then(|v| v.parse::<u32>().ok());
        if field("State:").is_some_and(|s| s.starts_with('Z') || s.starts_with('X'))
            && threads.is_none_or(|n| n <= 1)
        {
            return false;
        }
        // The agent's own tasks (CRIU while it restores the tree joins the cgroup from the
        // agent's pid namespace) are not the sandbox's.
        let depth = field("NSpid:").map(|v| v.split_whitespace().count() as u32);
        if depth.is_some_and(|d| d <= own_pid_level() + 1) {
            return false;
        }
        let sid = field("NSsid:")
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<i32>().ok());
        if init.is_some_and(|i| i != *pid && sid == Some(i)) {
            return false;
        }
        let pending = (mask("SigPnd:") | mask("ShdPnd:")) & fatal;
        let kill_bit = 1u64 << (libc::SIGKILL - 1);
        let handled = mask("SigBlk:") | mask("SigIgn:") | mask("SigCgt:");
        pending & (kill_bit | !handled) == 0
    });
    pids
}

/// The depth of the agent's own pid namespace (0: the initial one), from the `NSpid` line of
/// `/proc/self/status` (one pid per level); 0 when it cannot be read.
fn own_pid_level() -> u32 {
    static LEVEL: OnceLock<u32> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .map(|v| v.split_whitespace().count() as u32)
            })
            .map_or(0, |n| n.saturating_sub(1))
    })
}

/// Most directory entries the fingerprint walk holds at once; a wider directory makes the
/// fingerprint unknown (`None`) instead of costing the daemon memory.
const FINGERPRINT_MAX_NAMES: u64 = 1 << 20;

/// blake3 over (path, inode, mode, size, mtime, ctime) of every entry of the upper layer, in
/// sorted order, without following symlinks; `None` when the directory cannot be read, or
/// is deeper or wider than the bounded walk of the overlay crate allows
/// ([`belayer_overlay::metadata_fingerprint`]).
pub fn upper_fingerprint(upper: &Path) -> Option<[u8; 32]> {
    belayer_overlay::metadata_fingerprint(upper, FINGERPRINT_MAX_NAMES).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_sees_changes_not_reads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a"), "1").unwrap();
        let f0 = upper_fingerprint(dir.path()).unwrap();
        let _ = std::fs::read(dir.path().join("a")).unwrap();
        assert_eq!(upper_fingerprint(dir.path()).unwrap(), f0);
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let f1 = upper_fingerprint(dir.path()).unwrap();
        assert_ne!(f1, f0);
        std::fs::write(dir.path().join("d/b"), "2").unwrap();
        assert_ne!(upper_fingerprint(dir.path()).unwrap(), f1);
        assert!(upper_fingerprint(&dir.path().join("missing")).is_none());
    }
}
