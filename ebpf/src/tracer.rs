//! The public face of the tracer: [`TracerBuilder`] → [`Tracer`], a facade over the two
//! detectors (the BPF programs of `bpf`, or the pidfd/cgroup fallback of `fallback`; paper,
//! Figure 1). The [`Target`]s it watches, the [`Fault`]s it reports and the [`Counters`] it
//! keeps are defined in `types` and re-exported here.

use std::fmt;
use std::sync::Arc;

use crate::bpf::BpfTracer;
use crate::fallback::FallbackTracer;
use crate::types::read_oom_kills;
pub use crate::types::{cgroup_id, Counters, Fault, Target, TraceEvent, TracerError, TracerKind};
use crate::types::{Sink, Targets};

/// Builds a [`Tracer`]: `Tracer::builder().force_fallback(no_bpf).on_event(f).start()`.
pub struct TracerBuilder {
    force_fallback: bool,
    sink: Option<Sink>,
    own_mount_ns: u64,
    sandbox_pid_level: u32,
}

impl fmt::Debug for TracerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TracerBuilder")
            .field("force_fallback", &self.force_fallback)
            .field("own_mount_ns", &self.own_mount_ns)
            .field("sandbox_pid_level", &self.sandbox_pid_level)
            .finish_non_exhaustive()
    }
}

impl TracerBuilder {
    /// Skip BPF and run the fallback detector (`belayerd --no-bpf`).
    pub fn force_fallback(mut self, yes: bool) -> Self {
        self.force_fallback = yes;
        self
    }

    /// Files on the mounts of the mount namespace with this inode number (that of
    /// `/proc/self/ns/mnt`: the agent's own) are not sandbox state: writes to them by a
    /// ptraced task of a sandbox are not counted (CRIU seizes the tasks it dumps, and its
    /// parasite writes its log to a host file while it runs in them). Tasks that are not
    /// ptraced skip the check (it costs three probe reads; such writes then count, erring
    /// towards dirty). Unset (0): every file counts, as for tests whose processes live in the
    /// agent's own mount namespace.
    pub fn own_mount_ns(mut self, inode: u64) -> Self {
        self.own_mount_ns = inode;
        self
    }

    /// The depth of the sandboxes' pid namespaces (0 is the initial one): the tasks of a
    /// tracked cgroup in a shallower pid namespace are the agent's own and count neither
    /// file changes nor processes created (CRIU joins a sandbox's cgroup from the agent's
    /// pid namespace while it restores the tree; a sandbox cannot make such a task). Unset
    /// (0): every task counts, as for tests whose processes live in the agent's own pid
    /// namespace.
    pub fn sandbox_pid_level(mut self, level: u32) -> Self {
        self.sandbox_pid_level = level;
        self
    }

    /// The function that receives every fault (called from the tracer's own thread; keep it
    /// short).
    pub fn on_event(mut self, f: impl Fn(TraceEvent) + Send + Sync + 'static) -> Self {
        self.sink = Some(Arc::new(f));
        self
    }

    /// Loads and attaches the BPF programs, or starts the fallback when that fails (logging
    /// one line with the reason) or was asked for. Fails only when neither can start (no
    /// thread could be spawned).
    pub fn start(self) -> Result<Tracer, TracerError> {
        let sink = self.sink.unwrap_or_else(|| Arc::new(|_| {}));
        let targets: Targets = Arc::default();
        if !self.force_fallback {
            match BpfTracer::start(
                targets.clone(),
                sink.clone(),
                self.own_mount_ns,
                self.sandbox_pid_level,
            ) {
                Ok(bpf) => {
                    tracing::info!("sandbox tracer: BPF programs attached");
                    return Ok(Tracer {
                        inner: Inner::Bpf(Box::new(bpf)),
                        targets,
                        reason: None,
                    });
                }
                Err(e) => {
                    let reason = chain(&e);
                    tracing::warn!(
                        reason = %reason,
                        "sandbox tracer: BPF unavailable, using the pidfd/cgroup fallback \
                         (slower detection, no dirtiness counters)"
                    );
                    let fb = FallbackTracer::start(targets.clone(), sink)?;
                    return Ok(Tracer {
                        inner: Inner::Fallback(fb),
                        targets,
                        reason: Some(reason),
                    });
                }
            }
        }
        tracing::info!("sandbox tracer: BPF disabled, using the pidfd/cgroup fallback");
        let fb = FallbackTracer::start(targets.clone(), sink)?;
        Ok(Tracer {
            inner: Inner::Fallback(fb),
            targets,
            reason: Some("disabled".into()),
        })
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

enum Inner {
    Bpf(Box<BpfTracer>),
    Fallback(FallbackTracer),
}

/// The running tracer. Dropping it stops its thread and detaches the BPF programs.
pub struct Tracer {
    inner: Inner,
    targets: Targets,
    reason: Option<String>,
}

impl fmt::Debug for Tracer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracer")
            .field("kind", &self.kind())
            .field("reason", &self.reason)
            .finish_non_exhaustive()
    }
}

impl Tracer {
    /// A builder with BPF enabled and no event callback.
    pub fn builder() -> TracerBuilder {
        TracerBuilder {
            force_fallback: false,
            sink: None,
            own_mount_ns: 0,
            sandbox_pid_level: 0,
        }
    }

    /// BPF or fallback.
    pub fn kind(&self) -> TracerKind {
        match self.inner {
            Inner::Bpf(_) => TracerKind::Bpf,
            Inner::Fallback(_) => TracerKind::Fallback,
        }
    }

    /// Whether [`Counters::fs_writes`] is maintained: BPF on x86_64 (the object's syscall
    /// table); elsewhere file activity must be judged another way.
    pub fn counts_files(&self) -> bool {
        self.kind() == TracerKind::Bpf && cfg!(target_arch = "x86_64")
    }

    /// Why the fallback runs (`None` with BPF).
    pub fn fallback_reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// Starts watching a sandbox (replacing an earlier target with the same cgroup id and
    /// resetting its counters).
    ///
    /// Errors: the BPF map update or (fallback) the pidfd/`cgroup.events` open failed.
    pub fn track(&self, target: Target) -> Result<(), TracerError> {
        match &self.inner {
            Inner::Bpf(b) => b.track(target.cgroup_id)?,
            Inner::Fallback(f) => f.track(&target)?,
        }
        tracing::debug!(
            cgroup_id = target.cgroup_id,
            init_pid = target.init_pid,
            "tracking sandbox"
        );
        self.targets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(target.cgroup_id, target);
        Ok(())
    }

    /// Stops watching a cgroup (before the agent kills or removes it itself).
    pub fn untrack(&self, cgroup_id: u64) {
        self.targets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&cgroup_id);
        match &self.inner {
            Inner::Bpf(b) => b.untrack(cgroup_id),
            Inner::Fallback(f) => f.untrack(cgroup_id),
        }
    }

    /// The BPF counters of a tracked cgroup; `None` with the fallback or when not tracked.
    pub fn counters(&self, cgroup_id: u64) -> Option<Counters> {
        match &self.inner {
            Inner::Bpf(b) => b.counters(cgroup_id),
            Inner::Fallback(_) => None,
        }
    }

    /// OOM kills in a tracked sandbox: the BPF counter, or (fallback) the memory controller's
    /// `oom_kill` counter. `None` when unknown.
    pub fn oom_kills(&self, cgroup_id: u64) -> Option<u64> {
        match &self.inner {
            Inner::Bpf(b) => b.counters(cgroup_id).map(|c| c.oom_kills),
            Inner::Fallback(_) => {
                let path = self
                    .targets
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&cgroup_id)?
                    .oom_events
                    .clone()?;
                read_oom_kills(&path)
            }
        }
    }
}
