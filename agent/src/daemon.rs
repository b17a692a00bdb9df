//! The daemon core: the sandbox registry and the protocol handler.
//!
//! [`Agent`] owns the [`Runtime`] and the sandboxes; it implements the protocol's
//! [`Handler`](belayer_ipc::Handler) so the socket server stays thin. At start it re-adopts the
//! sandboxes found in its state dir: sandboxes outlive a restart of `belayerd`. A sandbox caught
//! mid-checkpoint by a crash is thawed and its unpublished checkpoint discarded.

use std::collections::HashMap;
use std::fs;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use belayer_ipc::{
    Caller, ErrorCode, ErrorReply, Event, PeerCred, Request, Response, SandboxInfo, StatusInfo,
    PROTOCOL_VERSION,
};

use crate::cgroup::{CgroupLayout, SandboxCgroup};
use crate::config::Config;
use crate::images::ImageStore;
use crate::runtime::Runtime;
use crate::sandbox::{self, SandboxPaths, SandboxRecord, SandboxSlot, SandboxState};
use crate::store::CheckpointStore;
use crate::sys;

pub mod access;
mod image_api;
pub mod rollout_api;

use access::AccessError;
use rollout_api::{ContextLogs, EventBus, Policies};

/// Errors starting the agent.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// No usable CRIU.
    #[error(transparent)]
    Criu(#[from] belayer_criu::LocateError),
    /// No usable cgroup hierarchy.
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// The state dir cannot be used.
    #[error("cannot use state dir {path}")]
    StateDir {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Another agent holds the state dir.
    #[error("state dir {path} is in use by another belayerd")]
    Locked {
        /// The state dir.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The image store cannot be opened.
    #[error(transparent)]
    Images(#[from] crate::images::ImageError),
    /// A syscall failed.
    #[error(transparent)]
    Sys(#[from] sys::SyscallError),
    /// Not even the fallback sandbox tracer could start.
    #[error("cannot start the sandbox tracer")]
    Tracer(#[source] belayer_ebpf::TracerError),
    /// The helper binary could not be sealed into a memfd.
    #[error(transparent)]
    Helper(#[from] crate::helper::image::HelperImageError),
    /// The upper-layer blob store could not be opened.
    #[error("cannot open the blob store")]
    Blobs(#[source] belayer_overlay::layer::BlobError),
    /// The state dir cannot enforce the configured default disk limit.
    #[error(
        "state dir {path} cannot enforce default_disk_max_bytes = {bytes}: run scripts/setup.sh \
         (it loop-mounts a btrfs image at /var/lib/belayer), put the state dir on btrfs, or set \
         default_disk_max_bytes = 0 (no disk limit)"
    )]
    DiskQuota {
        /// The state dir.
        path: std::path::PathBuf,
        /// The configured default limit.
        bytes: u64,
        /// Why quotas are unavailable.
        #[source]
        source: crate::quota::QuotaError,
    },
}

/// Backing tmpfs of CRIU's kernel-feature cache.
pub const KDAT_DIR: &str = "/run/belayer/criu-kdat";

/// Mount point of the dump stage tmpfs (see [`crate::stage`]).
pub const DUMP_STAGE_DIR: &str = "/run/belayer/dump-stage";

/// The agent: runtime plus sandbox registry.
#[derive(Debug)]
pub struct Agent {
    /// Exclusive lock on `state_dir/belayerd.lock`, held for the agent's life.
    _lock: fs::File,
    rt: Runtime,
    sandboxes: Mutex<HashMap<String, Arc<SandboxSlot>>>,
    /// Subscribers of daemon events (`Request::Subscribe`, [`Agent::subscribe`]).
    events: EventBus,
    /// Checkpoint policy per sandbox (`Request::MaybeCheckpoint`).
    policies: Policies,
    /// Context log per trajectory (`Request::ContextAppend`/`ContextLookup`).
    contexts: ContextLogs,
    /// `(sandbox, instance)` pairs already announced as failed.
    failed_seen: Mutex<std::collections::HashSet<(String, u32)>>,
}

fn error(code: ErrorCode, e: &dyn std::error::Error) -> Response {
    let mut message = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        message.push_str(": ");
        message.push_str(&s.to_string());
        cur = s.source();
    }
    Response::Error(ErrorReply { code, message })
}

fn unknown(id: &str) -> Response {
    Response::Error(ErrorReply {
        code: ErrorCode::UnknownSandbox,
        message: format!("unknown sandbox {id}"),
    })
}

impl Agent {
    /// Validates `config`, locates CRIU, probes cgroups, becomes a child subreaper and
    /// re-adopts the sandboxes of the state dir.
    pub fn start(config: Config) -> Result<Arc<Agent>, StartError> {
        config.validate()?;
        let criu = belayer_criu::Criu::locate(config.criu.as_deref())?;
        // CRIU re-probes kernel features on every run (20-60 ms here) unless its cache sits on
        // a tmpfs; keep one mounted for the node's lifetime (shared by every agent).
        match criu.kdat_cache(std::path::Path::new(KDAT_DIR)) {
            Ok(cache) => {
                tracing::info!(mode = ?cache.mode(), "CRIU kernel-feature cache ready");
                cache.leak();
            }
            Err(e) => {
                tracing::warn!(error = %e, "no CRIU kernel-feature cache: every dump re-probes")
            }
        }
        CgroupLayout::detect()?;
        sys::set_child_subreaper()?;
        make_empty_dir().map_err(|source| StartError::StateDir {
            path: crate::helper::mount::EMPTY_DIR.into(),
            source,
        })?;
        fs::create_dir_all(config.state_dir.join("sandboxes")).map_err(|source| {
            StartError::StateDir {
                path: config.state_dir.clone(),
                source,
            }
        })?;
        // Sandbox content (setuid files in upper layers, memory images, LLM contexts) is
        // reachable through the state dir: only root may enter it.
        fs::set_permissions(
            &config.state_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .map_err(|source| StartError::StateDir {
            path: config.state_dir.clone(),
            source,
        })?;
        // One agent per state dir: a second one would adopt (and clean up after) sandboxes the
        // first is working on.
        let lock = lock_state_dir(&config.state_dir)?;
        let quota =
            crate::quota::open_state_quota(&config.state_dir, config.default_disk_max_bytes)
                .map_err(|source| StartError::DiskQuota {
                    path: config.state_dir.clone(),
                    bytes: config.default_disk_max_bytes,
                    source,
                })?;
        let images = ImageStore::open(&config.state_dir)?;
        let helper = crate::helper::image::HelperImage::beside_current_exe()?;
        let contexts = ContextLogs::new(&config.state_dir);
        let tracer =
            crate::trace::SandboxTracer::start(config.no_bpf).map_err(StartError::Tracer)?;
        let stage = match config.dump_stage_bytes {
            0 => None,
            bytes => match crate::stage::DumpStage::mount(
                std::path::Path::new(DUMP_STAGE_DIR),
                &config.state_dir,
                bytes,
            ) {
                Ok(stage) => Some(stage),
                Err(e) => {
                    tracing::warn!(error = %e, "no dump stage: CRIU writes images to the state dir while frozen");
                    None
                }
            },
        };
        let blobs = belayer_overlay::layer::BlobStore::open(&config.state_dir.join("blobs"))
            .map_err(StartError::Blobs)?
            .with_compression(config.blob_zstd_level);
        let pool = config.userns_pool();
        let agent = Arc::new(Agent {
            _lock: lock,
            events: EventBus::default(),
            policies: Policies::default(),
            contexts,
            failed_seen: Mutex::new(std::collections::HashSet::new()),
            rt: Runtime {
                config,
                images,
                criu,
                helper,
                userns: crate::userns::RangeAllocator::new(pool),
                tracer,
                blobs,
                stage,
                quota,
            },
            sandboxes: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&agent);
        agent.rt.tracer.set_handler(move |id, fault| {
            if let Some(agent) = weak.upgrade() {
                agent.on_fault(id, fault);
            }
        });
        agent.adopt();
        // Reading every checkpoint's layer manifest can take a while: serve meanwhile (the
        // store's lock keeps captures and the collection apart).
        let collector = Arc::downgrade(&agent);
        std::thread::spawn(move || {
            if let Some(agent) = collector.upgrade() {
                agent.collect_blobs();
            }
        });
        let weak = Arc::downgrade(&agent);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                let Some(agent) = weak.upgrade() else { break };
                agent.reap();
                agent.watch_failures();
            })
            .map_err(|source| StartError::StateDir {
                path: "reaper thread".into(),
                source,
            })?;
        Ok(agent)
    }

    /// The runtime.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<SandboxSlot>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn slot(&self, id: &str) -> Option<Arc<SandboxSlot>> {
        self.registry().get(id).cloned()
    }

    /// Sends `event` to every subscriber that may see its sandbox (clients of
    /// `Request::Subscribe`: root, or the sandbox's owner; [`subscribe`](Self::subscribe)
    /// callers: all).
    pub fn publish(&self, event: Event) {
        let id = match &event {
            Event::SandboxFailed { id, .. } | Event::CheckpointReady { id, .. } => id,
        };
        let owner = self.slot(id).map(|slot| slot.record().owner_uid);
        self.events.publish(event, owner);
    }

    /// A new event subscription: every event published from now on.
    pub fn subscribe(&self) -> std::sync::mpsc::Receiver<Event> {
        self.events.subscribe(None)
    }

    /// Removes a sandbox, untraced first: the removal's kills are the agent's own, not faults.
    fn remove_sandbox(&self, slot: &SandboxSlot) -> Result<(), sandbox::remove::RemoveError> {
        let (id, userns) = {
            let rec = slot.record();
            (rec.id.clone(), rec.userns)
        };
        self.rt.tracer.untrack(&id);
        sandbox::remove::remove(slot)?;
        if let Some(range) = userns {
            self.rt.userns.release(range);
        }
        Ok(())
    }

    /// Removes the blobs no checkpoint refers to any more: reference counts over the layer
    /// manifests of every published checkpoint of every sandbox plus the bases of the next
    /// incremental captures, taken under the blob store's exclusive lock. A checkpoint whose
    /// manifest cannot be read keeps nothing alive (it cannot be restored either); an old
    /// format checkpoint refers to no blobs. Returns the bytes freed.
    fn collect_blobs(&self) -> u64 {
        let slots: Vec<Arc<SandboxSlot>> = self.registry().values().cloned().collect();
        let result = self.rt.blobs.gc_with(|roots| {
            for slot in &slots {
                if let Some(base) = slot.any_layer_base() {
                    roots.add(&base);
                }
                let Ok(store) = CheckpointStore::open(&slot.paths.checkpoints()) else {
                    continue;
                };
                for name in store.names().unwrap_or_default() {
                    match store.load(&name).and_then(|m| store.load_layer(&m)) {
                        Ok(layer) => roots.add(&layer),
                        Err(e) => tracing::warn!(checkpoint = %name, error = %e, "checkpoint keeps no blobs"),
                    }
                }
            }
            Ok::<(), belayer_overlay::layer::BlobError>(())
        });
        match result {
            Ok(stats) => {
                if let Some(q) = &self.rt.quota {
                    // Qgroups of deleted instances that no longer share extents.
                    if let Err(e) = q.sweep_stale() {
                        tracing::debug!(error = %e, "stale qgroup sweep failed");
                    }
                }
                tracing::info!(
                    live = stats.live_blobs,
                    references = stats.references,
                    removed = stats.removed_blobs,
                    bytes = stats.removed_bytes,
                    "blob collection"
                );
                stats.removed_bytes
            }
            Err(e) => {
                tracing::warn!(error = %e, "blob collection failed");
                0
            }
        }
    }

    /// A fault the sandbox tracer saw (init exited, process killed from outside or by the OOM
    /// killer): marks a running sandbox failed at once and announces it (once per instance).
    fn on_fault(&self, id: &str, fault: &belayer_ebpf::Fault) {
        let Some(slot) = self.slot(id) else { return };
        if !slot.fail() {
            return;
        }
        let instance = slot.record().instance;
        let fresh = self
            .failed_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((id.to_string(), instance));
        if fresh {
            self.publish(Event::SandboxFailed {
                id: id.to_string(),
                reason: fault.to_string(),
            });
        }
    }

    /// Announces sandboxes whose init died (once per instance) and forgets the policies of
    /// removed sandboxes.
    fn watch_failures(&self) {
        let slots: Vec<Arc<SandboxSlot>> = self.registry().values().cloned().collect();
        for slot in &slots {
            let rec = slot.refresh();
            if rec.state != SandboxState::Failed {
                continue;
            }
            let fresh = self
                .failed_seen
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((rec.id.clone(), rec.instance));
            if fresh {
                self.publish(Event::SandboxFailed {
                    id: rec.id.clone(),
                    reason: format!("the init of instance {} is gone", rec.instance),
                });
            }
        }
        let live: std::collections::HashSet<String> = self.registry().keys().cloned().collect();
        self.policies.retain(|id| live.contains(id));
    }

    fn maybe_checkpoint(
        &self,
        caller: &Caller,
        req: belayer_ipc::MaybeCheckpointRequest,
    ) -> Response {
        let Some(slot) = self.slot_for(caller, &req.id) else {
            return unknown(&req.id);
        };
        let instance = slot.record().instance;
        let pending = match self.policies.decide(&req, instance) {
            Ok(p) => p,
            Err(e) => return error(ErrorCode::BadRequest, &e),
        };
        let decision = rollout_api::decision_info(&pending.decision);
        if !pending.decision.checkpoint {
            return Response::MaybeCheckpoint(belayer_ipc::MaybeCheckpointResult {
                checkpointed: false,
                decision,
                checkpoint: None,
            });
        }
        let started = std::time::Instant::now();
        let creq = belayer_ipc::CheckpointRequest {
            id: req.id.clone(),
            prefix: req.prefix,
            context: req.context,
            fault: None,
        };
        let result = sandbox::checkpoint::checkpoint(&self.rt, &slot, &creq);
        self.policies
            .checkpoint_done(&pending, started.elapsed().as_secs_f64(), result.is_ok());
        match result {
            Ok(info) => {
                self.publish(rollout_api::checkpoint_ready(&info));
                Response::MaybeCheckpoint(belayer_ipc::MaybeCheckpointResult {
                    checkpointed: true,
                    decision,
                    checkpoint: Some(info),
                })
            }
            Err(e) => error(e.code(), &e),
        }
    }

    /// Reaps exited sandbox inits (they are our children, directly or as subreaper).
    fn reap(&self) {
        let pids: Vec<i32> = self
            .registry()
            .values()
            .filter_map(|s| s.record().init_pid)
            .collect();
        for pid in pids {
            sys::try_reap(pid);
        }
    }

    /// Loads every sandbox of the state dir after a (re)start.
    fn adopt(&self) {
        let dir = self.rt.config.state_dir.join("sandboxes");
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let id = e.file_name().to_string_lossy().into_owned();
            if id.starts_with(sandbox::remove::TRASH_PREFIX) {
                // Removed, not yet deleted: finish in the background.
                let path = e.path();
                std::thread::spawn(move || sandbox::remove::delete_sandbox_dir(&path));
                continue;
            }
            let paths = SandboxPaths::new(&self.rt.config.state_dir, &id);
            let mut rec = match SandboxRecord::load(&paths) {
                Ok(r) => r,
                Err(err) => {
                    tracing::warn!(sandbox = %id, error = %err, "skipping sandbox with unreadable state");
                    continue;
                }
            };
            if let Some(range) = rec.userns {
                self.rt.userns.adopt(range);
            }
            // A crash between making an instance's volume and limiting it leaves no limit:
            // set it again.
            let inst = paths.instance(rec.instance);
            if self.rt.quota.is_some() && crate::quota::is_volume(&inst) {
                let limited =
                    crate::quota::Volume::open(&inst).and_then(|v| v.set_limit(rec.spec.disk_max));
                if let Err(err) = limited {
                    tracing::warn!(sandbox = %id, error = %err, "cannot re-apply the disk limit");
                }
            }
            // A checkpoint interrupted by a crash left no trace in the state file (that state
            // is never written), but maybe a CRIU dump still running and a frozen cgroup: let
            // the dump finish (it restores the freezer state it found when it exits), thaw,
            // and discard any unpublished checkpoint (below).
            if belayer_criu::abort_gated_dump(&paths.criu_work()) {
                tracing::info!(sandbox = %id, "told an orphaned CRIU dump to abort");
            }
            if let Ok(cg) = SandboxCgroup::open(&rec.cgroup) {
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
            // Instances other than the current one are leftovers of a restore the previous
            // daemon did not finish (or of an old instance it had not deleted yet).
            let stale: Vec<u32> = fs::read_dir(&paths.dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name();
                    name.to_str()?.strip_prefix("inst-")?.parse::<u32>().ok()
                })
                .filter(|n| *n != rec.instance)
                .collect();
            if !stale.is_empty() {
                tracing::info!(sandbox = %id, ?stale, "removing stale instances");
                let paths = paths.clone();
                std::thread::spawn(move || {
                    for n in stale {
                        sandbox::restore::retire_instance(&paths, n);
                    }
                });
            }
            if let Err(err) = rec.save(&paths) {
                tracing::warn!(sandbox = %id, error = %err, "cannot persist adopted state");
            }
            tracing::info!(sandbox = %id, state = rec.state.as_str(), "adopted sandbox");
            if rec.state == SandboxState::Running {
                self.rt.tracer.track(&rec);
            }
            self.registry()
                .insert(id, Arc::new(SandboxSlot::new(rec, paths)));
        }
    }

    fn ready_prefix(slot: &SandboxSlot) -> Option<u64> {
        let store = CheckpointStore::open(&slot.paths.checkpoints()).ok()?;
        let name = store.ready().ok()??;
        store.load(&name).ok().map(|m| m.prefix)
    }

    fn info(slot: &SandboxSlot) -> SandboxInfo {
        slot.info(Self::ready_prefix(slot))
    }

    fn gc(&self, caller: &Caller, older_than_s: Option<u64>, tag: Option<&str>) -> Response {
        if older_than_s.is_none() && tag.is_none() {
            return Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "gc needs --older-than or --tag".into(),
            });
        }
        let now = sys::now_unix_ms();
        let (mut removed, mut bytes) = (0u64, 0u64);
        for slot in self.slots_for(caller) {
            let _op = slot.lock_op();
            let rec = slot.record().clone();
            let Ok(store) = CheckpointStore::open(&slot.paths.checkpoints()) else {
                continue;
            };
            let tagged = tag.is_some() && rec.spec.tag.as_deref() == tag;
            let ready = store.ready().ok().flatten();
            let Ok(list) = store.list() else { continue };
            for m in list {
                let old =
                    older_than_s.is_some_and(|s| now.saturating_sub(m.created_unix_ms) >= s * 1000);
                let is_ready = ready.as_deref() == Some(m.checkpoint.as_str());
                if tagged || (old && !is_ready) {
                    if is_ready {
                        let _ = store.clear_ready();
                    }
                    if let Ok(b) = store.remove(&m.checkpoint) {
                        removed += 1;
                        bytes += b;
                    }
                }
            }
        }
        bytes += self.collect_blobs();
        tracing::info!(removed, bytes, "checkpoint gc");
        Response::Gc { removed, bytes }
    }

    fn status(&self, caller: &Caller) -> Response {
        Response::Status(StatusInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            protocol: PROTOCOL_VERSION,
            criu: self.rt.criu.version().to_string(),
            cgroup: CgroupLayout::detect()
                .map(|l| l.describe())
                .unwrap_or_default(),
            sandboxes: self.slots_for(caller).len() as u64,
            tracer: self.rt.tracer.describe(),
        })
    }

    /// Serves one request from `caller` with the descriptors `fds` attached to its frame
    /// (only `ImportImage` with `with_fd` takes one). Access is checked for every request by
    /// [`access::may_act_on`], through the lookups of [`access`].
    pub fn dispatch(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        if !matches!(request, Request::ImportImage { .. }) && !fds.is_empty() {
            let e = AccessError::Descriptors {
                got: fds.len(),
                expected: 0,
            };
            return error(e.code(), &e);
        }
        match request {
            Request::Ping => Response::Pong {
                version: env!("CARGO_PKG_VERSION").to_string(),
            },
            Request::Status => self.status(caller),
            Request::ImportImage {
                name,
                source,
                with_fd,
            } => self.import_image(caller, &name, source, with_fd, fds),
            Request::ListImages => match self.rt.images.list() {
                Ok(v) => Response::Images(v),
                Err(e) => error(ErrorCode::Internal, &e),
            },
            Request::RemoveImage { name } => self.remove_image(caller, &name),
            Request::CreateSandbox(spec) => {
                match sandbox::create::create(&self.rt, spec, caller.cred.uid) {
                    Ok(slot) => {
                        let slot = Arc::new(slot);
                        let info = Self::info(&slot);
                        self.registry().insert(info.id.clone(), slot);
                        Response::Sandbox(info)
                    }
                    Err(e) => error(e.code(), &e),
                }
            }
            Request::ListSandboxes => {
                let slots = self.slots_for(caller);
                let mut v: Vec<SandboxInfo> = slots.iter().map(|s| Self::info(s)).collect();
                v.sort_by_key(|i| i.created_unix_ms);
                Response::Sandboxes(v)
            }
            Request::InspectSandbox { id } => match self.slot_for(caller, &id) {
                Some(slot) => Response::Sandbox(Self::info(&slot)),
                None => unknown(&id),
            },
            Request::RemoveSandbox { id } => match self.slot_for(caller, &id) {
                Some(slot) => match self.remove_sandbox(&slot) {
                    Ok(()) => {
                        self.registry().remove(&id);
                        self.collect_blobs();
                        Response::Done
                    }
                    Err(e) => error(e.code(), &e),
                },
                None => unknown(&id),
            },
            Request::Exec(req) => match self.slot_for(caller, &req.id) {
                Some(slot) => match sandbox::exec::exec(&self.rt, &slot, &req) {
                    Ok(r) => Response::Exec(r),
                    Err(e) => error(e.code(), &e),
                },
                None => unknown(&req.id),
            },
            Request::Checkpoint(req) => match self.slot_for(caller, &req.id) {
                Some(slot) => match sandbox::checkpoint::checkpoint(&self.rt, &slot, &req) {
                    Ok(info) => {
                        self.publish(rollout_api::checkpoint_ready(&info));
                        Response::Checkpoint(info)
                    }
                    Err(e) => error(e.code(), &e),
                },
                None => unknown(&req.id),
            },
            Request::Restore { id, verify } => match self.slot_for(caller, &id) {
                Some(slot) => match sandbox::restore::restore(&self.rt, &slot, verify) {
                    Ok(info) => Response::Restored(info),
                    Err(e) => error(e.code(), &e),
                },
                None => unknown(&id),
            },
            Request::ListCheckpoints { id } => match self.slot_for(caller, &id) {
                Some(slot) => {
                    let list =
                        CheckpointStore::open(&slot.paths.checkpoints()).and_then(|s| s.list());
                    match list {
                        Ok(ms) => Response::Checkpoints(
                            ms.into_iter()
                                .map(|m| belayer_ipc::CheckpointInfo {
                                    sandbox: m.sandbox.clone(),
                                    prefix: m.prefix,
                                    bytes: m.bytes(),
                                    context_digest: m.context.artifact.digest.clone(),
                                    timings_ms: m.timings_ms.clone(),
                                    created_unix_ms: m.created_unix_ms,
                                    checkpoint: m.checkpoint,
                                })
                                .collect(),
                        ),
                        Err(e) => error(ErrorCode::Internal, &e),
                    }
                }
                None => unknown(&id),
            },
            Request::Gc { older_than_s, tag } => self.gc(caller, older_than_s, tag.as_deref()),
            Request::MaybeCheckpoint(req) => self.maybe_checkpoint(caller, req),
            Request::ContextAppend {
                trajectory,
                prefix,
                context,
            } => match self.contexts.append(&trajectory, prefix, context) {
                Ok(entry) => Response::Context(entry),
                Err(e) => Response::Error(e.reply()),
            },
            Request::ContextLookup { trajectory, prefix } => {
                match self.contexts.lookup(&trajectory, prefix) {
                    Ok(entry) => Response::Context(entry),
                    Err(e) => Response::Error(e.reply()),
                }
            }
            Request::Subscribe => Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "subscribe is served by the socket server, not dispatched".into(),
            }),
        }
    }
}

/// Makes [`crate::helper::mount::EMPTY_DIR`] (empty, root-owned, 0555) and its parent
/// traversable (0755), which sandboxes bind over the `/proc` directories they must not see.
fn make_empty_dir() -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::path::Path::new(crate::helper::mount::EMPTY_DIR);
    fs::create_dir_all(dir)?;
    if let Some(parent) = dir.parent() {
        fs::set_permissions(parent, fs::Permissions::from_mode(0o755))?;
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o555))?;
    if fs::read_dir(dir)?.next().is_some() {
        return Err(std::io::Error::other("not empty"));
    }
    Ok(())
}

/// Takes an exclusive, non-blocking `flock` on `state_dir/belayerd.lock`.
fn lock_state_dir(state_dir: &std::path::Path) -> Result<fs::File, StartError> {
    let path = state_dir.join("belayerd.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| StartError::StateDir {
            path: path.clone(),
            source,
        })?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(
        |e| StartError::Locked {
            path: state_dir.to_path_buf(),
            source: e.into(),
        },
    )?;
    Ok(file)
}

/// Waits (bounded) until no `criu dump --tree <pid>` process is left running.
fn wait_for_orphaned_dump(pid: i32, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    let tree = pid.to_string();
    let running = || {
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
    };
    while running() {
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

impl belayer_ipc::Handler for Agent {
    /// Requests without their supplementary groups: a directory import from a non-root peer
    /// is refused ([`AccessError::GroupsUnknown`]). The server calls
    /// [`handle_call`](belayer_ipc::Handler::handle_call).
    fn handle(&self, peer: &PeerCred, request: Request) -> Response {
        self.handle_call(&Caller::without_groups(*peer), request, Vec::new())
    }

    fn handle_call(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        let peer = &caller.cred;
        tracing::debug!(
            pid = peer.pid,
            uid = peer.uid,
            fds = fds.len(),
            ?request,
            "request"
        );
        self.dispatch(caller, request, fds)
    }

    fn subscribe(&self, peer: &PeerCred) -> Option<std::sync::mpsc::Receiver<Event>> {
        tracing::debug!(pid = peer.pid, uid = peer.uid, "event subscription");
        // Root sees every sandbox's events, anyone else only those of its own sandboxes.
        Some(self.events.subscribe((peer.uid != 0).then_some(peer.uid)))
    }
}
