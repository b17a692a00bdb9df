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

use belayer_ipc::{
    Caller, ErrorCode, ErrorReply, Event, PeerCred, Request, Response, SandboxInfo, StatusInfo,
    PROTOCOL_VERSION,
};

use crate::cgroup::CgroupLayout;
use crate::runtime::Runtime;
use crate::sandbox::{self, SandboxSlot, SandboxState};
use crate::store::CheckpointStore;

pub mod access;
mod adopt;
mod brief;
pub mod contexts;
mod create_api;
mod fork_api;
mod gc;
mod image_api;
mod metrics_api;
mod reap;
pub mod rollout_api;
mod start;
mod transfer_api;
mod verbs;

pub use start::StartError;

use access::AccessError;
use contexts::ContextLogs;
use rollout_api::{EventBus, Policies};

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
    /// Context log per trajectory, owned by its creator (`Request::ContextAppend`,
    /// `ContextLookup`, `ContextRemove`).
    contexts: ContextLogs,
    /// Creations in flight (counted against per-uid caps, holding their image).
    creating: create_api::Creating,
    /// Children of forks being restored (their blobs are live).
    forking: fork_api::Forking,
    /// `(sandbox, instance)` pairs already announced as failed.
    failed_seen: Mutex<std::collections::HashSet<(String, u32)>>,
    /// Prometheus metric families (served by [`crate::metrics::http`] when configured).
    metrics: crate::metrics::Metrics,
    /// Store sizes for the metrics, measured at most every few seconds.
    store_sizes: metrics_api::StoreSizes,
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
    /// manifests and the page packs of every published checkpoint of every sandbox plus the
    /// bases of the next incremental captures, taken under the blob store's exclusive lock. A checkpoint whose
    /// manifest cannot be read keeps nothing alive (it cannot be restored either); an old
    /// format checkpoint refers to no blobs. Returns the bytes freed.
    fn collect_blobs(&self) -> u64 {
        let result = self.rt.blobs.gc_with(|roots| {
            // The sandboxes are listed under the exclusive lock: a sandbox created before it
            // whose checkpoint was published meanwhile (its lease released) is in the list,
            // and its blobs live.
            let mut slots: Vec<Arc<SandboxSlot>> = self.registry().values().cloned().collect();
            slots.extend(self.forking.slots());
            for slot in &slots {
                if let Some(base) = slot.any_layer_base() {
                    roots.add(&base);
                }
                let Ok(store) = CheckpointStore::open(&slot.paths.checkpoints()) else {
                    continue;
                };
                for name in store.names().unwrap_or_default() {
                    let m = match store.load(&name) {
                        Ok(m) => m,
                        Err(e) => {
                            tracing::warn!(checkpoint = %name, error = %e, "checkpoint keeps no blobs");
                            continue;
                        }
                    };
                    // Its page packs live even when its layer does not load.
                    for pack in m.memory.iter().flat_map(|mem| mem.pack_ids()) {
                        roots.add_blob(pack);
                    }
                    match store.load_layer(&m) {
                        Ok(layer) => roots.add(&layer),
                        Err(e) => tracing::warn!(checkpoint = %name, error = %e, "checkpoint keeps no blobs of its layer"),
                    }
                }
            }
            Ok::<(), belayer_overlay::layer::BlobError>(())
        });
        match result {
            Ok(stats) => {
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
            self.metrics.infra_fault(fault.kind());
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
                // Seen by the reaper, not the tracer (which counts its own faults).
                self.metrics.infra_fault("init_gone");
                self.publish(Event::SandboxFailed {
                    id: rec.id.clone(),
                    reason: format!("the init of instance {} is gone", rec.instance),
                });
            }
        }
        let live: std::collections::HashSet<String> = self.registry().keys().cloned().collect();
        self.policies.retain(|id| live.contains(id));
    }

    /// Reaps exited sandbox processes and CRIU's orphans (our children, directly or as
    /// subreaper); see [`reap`] for the rule.
    fn reap(&self) {
        reap::reap_sandbox_zombies();
    }

    fn ready_prefix(slot: &SandboxSlot) -> Option<u64> {
        let store = CheckpointStore::open(&slot.paths.checkpoints()).ok()?;
        let name = store.ready().ok()??;
        store.load(&name).ok().map(|m| m.prefix)
    }

    fn info(slot: &SandboxSlot) -> SandboxInfo {
        slot.info(Self::ready_prefix(slot))
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
    /// (only `ImportImage` with `with_fd` takes one, `ImportOci` one per blob file). Access is checked for every request by
    /// [`access::may_act_on`], through the lookups of [`access`].
    pub fn dispatch(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        if !matches!(request, Request::ImportImage { .. } | Request::ImportOci(_))
            && !fds.is_empty()
        {
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
            } => {
                let answer = self.import_image(caller, &name, source, with_fd, fds);
                self.store_sizes.images_changed();
                answer
            }
            Request::ListImages => match self.rt.images.list() {
                Ok(v) => Response::Images(v),
                Err(e) => error(ErrorCode::Internal, &e),
            },
            Request::RemoveImage { name } => {
                let answer = self.remove_image(caller, &name);
                self.store_sizes.images_changed();
                answer
            }
            Request::PullImage(req) => self.counted_pull(self.pull_image(caller, &req)),
            Request::ImportOci(req) => self.counted_pull(self.import_oci(caller, req, fds)),
            Request::CreateSandbox(spec) => self.create_sandbox(caller, spec),
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
            Request::Exec(req) => self.exec_action(caller, &req),
            Request::Checkpoint(req) => self.checkpoint_now(caller, &req),
            Request::Restore { id, verify, prefix } => {
                let choice = sandbox::restore::Choice::prefix(prefix);
                self.restore_now(caller, &id, verify, choice)
            }
            Request::RestoreCheckpoint {
                id,
                verify,
                checkpoint,
            } => {
                let choice = sandbox::restore::Choice::Named(checkpoint);
                self.restore_now(caller, &id, verify, choice)
            }
            Request::Fork(req) => self.fork_sandbox(caller, &req),
            Request::ListCheckpoints { id } => match self.slot_for(caller, &id) {
                Some(slot) => {
                    let list =
                        CheckpointStore::open(&slot.paths.checkpoints()).and_then(|s| s.infos());
                    match list {
                        Ok(infos) => Response::Checkpoints(infos),
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
            } => match self.contexts.append(caller, &trajectory, prefix, context) {
                Ok(entry) => Response::Context(entry),
                Err(e) => Response::Error(e.reply()),
            },
            Request::ContextLookup { trajectory, prefix } => {
                match self.contexts.lookup(caller, &trajectory, prefix) {
                    Ok(entry) => Response::Context(entry),
                    Err(e) => Response::Error(e.reply()),
                }
            }
            Request::ContextRemove { trajectory } => {
                match self.contexts.remove(caller, &trajectory) {
                    Ok(_released) => Response::Done,
                    Err(e) => Response::Error(e.reply()),
                }
            }
            Request::Subscribe => Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "subscribe is served by the socket server, not dispatched".into(),
            }),
            Request::Upload(_) | Request::Download(_) => Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "transfers are streamed by the socket server, not dispatched".into(),
            }),
            Request::UploadChunk { .. } | Request::TransferCancel => Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "no upload in progress on this connection".into(),
            }),
        }
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
            request = %brief::Brief(&request),
            "request"
        );
        self.dispatch(caller, request, fds)
    }

    fn transfer(
        &self,
        caller: &Caller,
        request: Request,
        link: &mut belayer_ipc::TransferLink<'_>,
    ) -> Response {
        let peer = &caller.cred;
        tracing::debug!(pid = peer.pid, uid = peer.uid, request = %brief::Brief(&request), "transfer");
        Agent::transfer(self, caller, request, link)
    }

    fn subscribe(&self, peer: &PeerCred) -> Option<std::sync::mpsc::Receiver<Event>> {
        tracing::debug!(pid = peer.pid, uid = peer.uid, "event subscription");
        // Root sees every sandbox's events, anyone else only those of its own sandboxes.
        Some(self.events.subscribe((peer.uid != 0).then_some(peer.uid)))
    }
}
