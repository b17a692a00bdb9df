//! The rollout router: a registry of engines (one slot per GPU, each engine registered with a
//! fresh worker epoch), load-aware routing, and a streaming proxy with token-level context
//! recovery.
//!
//! While a response streams the router records every token it forwarded and persists the whole
//! prefix every `token_interval` tokens (paper: k = 256) as a `TokenPrefix` record of the
//! LLM-context log. When the engine fails (connection lost, or its epoch fenced) the request
//! waits for the slot's replacement (a newer epoch) and resumes there with prompt + recorded
//! prefix (the in-memory record, which is never behind the log); if the slot is marked
//! unhealthy it moves to the least-loaded healthy slot. Tokens carry their index; the router
//! forwards only the next expected index, so the client sees every token exactly once and in
//! order, also in the conventional mode that regenerates from the start.
//!
//! Split brain: each slot has a fence (`RwLock<epoch>`). A token is forwarded only while the
//! forwarding thread holds the fence's read lock and the epoch is still its engine's;
//! registering a replacement takes the write lock, so once `register` returns no token of the
//! old epoch reaches a client.

mod serve;

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::engine::GenerateRequest;
use super::http;
use belayer_context::{ContextLog, Record};
pub use serve::stream_generate;

/// Why a router operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// No engine is registered under this slot with this epoch.
    #[error("unknown engine {gpu} epoch {epoch}")]
    UnknownEngine {
        /// Slot (GPU) name.
        gpu: String,
        /// Epoch asked for.
        epoch: u64,
    },
    /// No healthy engine became available in time.
    #[error("no healthy engine available within {waited_ms} ms")]
    NoEngine {
        /// How long the request waited, ms.
        waited_ms: u64,
    },
    /// Opening the context log failed.
    #[error("opening the context log failed")]
    ContextLog {
        /// The cause.
        #[source]
        source: belayer_context::ContextLogError,
    },
}

/// One slot as shown by `GET /engines`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SlotInfo {
    /// Slot (GPU) name.
    pub gpu: String,
    /// Engine address, when one is registered.
    pub addr: Option<String>,
    /// Current epoch (0 = none yet).
    pub epoch: u64,
    /// Whether the slot is in the pool.
    pub healthy: bool,
    /// Requests routed to it now.
    pub load: usize,
}

#[derive(Debug)]
struct Slot {
    addr: Option<String>,
    fence: Arc<RwLock<u64>>,
    healthy: bool,
    load: usize,
}

#[derive(Debug, Default)]
struct State {
    slots: BTreeMap<String, Slot>,
    next_epoch: u64,
    alerts: Vec<String>,
}

/// Router configuration.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Persist the prefix every this many tokens (paper: 256).
    pub token_interval: usize,
    /// Resume from the recorded prefix (`true`, Belayer) or regenerate from the start
    /// (`false`, conventional recovery).
    pub resume: bool,
    /// How long a request waits for an engine, ms.
    pub wait_ms: u64,
    /// LLM-context log (none = no persistence).
    pub context_log: Option<PathBuf>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            token_interval: belayer_context::DEFAULT_TOKEN_INTERVAL as usize,
            resume: true,
            wait_ms: 120_000,
            context_log: None,
        }
    }
}

/// Counters of a router.
#[derive(Debug, Default)]
pub struct Counters {
    /// Requests resumed after an engine failure.
    pub resumed: AtomicU64,
    /// Tokens dropped because their engine was fenced.
    pub fenced_tokens: AtomicU64,
    /// Tokens regenerated (duplicates skipped by index).
    pub regenerated_tokens: AtomicU64,
    /// Prefix records written to the context log.
    pub prefix_records: AtomicU64,
}

/// The router (shared by its connection threads and the worker supervisor).
#[derive(Debug)]
pub struct Router {
    state: Mutex<State>,
    changed: Condvar,
    log: Option<Mutex<ContextLog>>,
    config: RouterConfig,
    next_rid: AtomicU64,
    /// Counters.
    pub counters: Counters,
}

enum Outcome {
    Done,
    ClientGone,
    EngineLost,
}

impl Router {
    /// A router with no slots.
    ///
    /// Errors: [`RouterError::ContextLog`].
    pub fn new(config: RouterConfig) -> Result<Arc<Router>, RouterError> {
        let log = match &config.context_log {
            Some(p) => {
                let (log, _) =
                    ContextLog::open(p).map_err(|source| RouterError::ContextLog { source })?;
                Some(Mutex::new(log))
            }
            None => None,
        };
        Ok(Arc::new(Router {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            log,
            config,
            next_rid: AtomicU64::new(0),
            counters: Counters::default(),
        }))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `addr` as the engine of slot `gpu` with a new epoch (step 4 of the handover),
    /// fencing any previous engine of the slot; returns the epoch.
    pub fn register(&self, gpu: &str, addr: &str) -> u64 {
        let mut st = self.lock();
        st.next_epoch += 1;
        let epoch = st.next_epoch;
        let slot = st.slots.entry(gpu.to_owned()).or_insert_with(|| Slot {
            addr: None,
            fence: Arc::new(RwLock::new(0)),
            healthy: true,
            load: 0,
        });
        *slot.fence.write().unwrap_or_else(|e| e.into_inner()) = epoch;
        slot.addr = Some(addr.to_owned());
        tracing::info!(gpu, addr, epoch, "engine registered");
        drop(st);
        self.changed.notify_all();
        epoch
    }

    /// Unregisters the engine of `gpu` with `epoch` (fences it: its tokens are dropped from
    /// now on).
    ///
    /// Errors: [`RouterError::UnknownEngine`] when that engine is not the slot's current one.
    pub fn unregister(&self, gpu: &str, epoch: u64) -> Result<(), RouterError> {
        let mut st = self.lock();
        let unknown = || RouterError::UnknownEngine {
            gpu: gpu.to_owned(),
            epoch,
        };
        let fresh = st.next_epoch + 1;
        let slot = st.slots.get_mut(gpu).ok_or_else(unknown)?;
        let mut fence = slot.fence.write().unwrap_or_else(|e| e.into_inner());
        if *fence != epoch || slot.addr.is_none() {
            return Err(unknown());
        }
        // Epoch numbers are never reused; a fenced slot holds a number no engine has.
        *fence = fresh;
        drop(fence);
        slot.addr = None;
        st.next_epoch = fresh;
        tracing::info!(gpu, epoch, "engine unregistered");
        drop(st);
        self.changed.notify_all();
        Ok(())
    }

    /// Marks slot `gpu` unhealthy (it leaves the pool; its requests move to healthy slots) and
    /// raises an alert (`error` log, kept for `GET /engines`).
    pub fn mark_unhealthy(&self, gpu: &str, reason: &str) {
        let mut st = self.lock();
        if let Some(slot) = st.slots.get_mut(gpu) {
            slot.healthy = false;
            slot.addr = None;
            let mut fence = slot.fence.write().unwrap_or_else(|e| e.into_inner());
            *fence = u64::MAX;
        }
        let alert = format!("gpu {gpu} marked unhealthy: {reason}");
        tracing::error!(
            gpu,
            reason,
            "ALERT gpu marked unhealthy, manual intervention needed"
        );
        st.alerts.push(alert);
        drop(st);
        self.changed.notify_all();
    }

    /// The slots.
    pub fn slots(&self) -> Vec<SlotInfo> {
        let st = self.lock();
        st.slots
            .iter()
            .map(|(gpu, s)| SlotInfo {
                gpu: gpu.clone(),
                addr: s.addr.clone(),
                epoch: *s.fence.read().unwrap_or_else(|e| e.into_inner()),
                healthy: s.healthy,
                load: s.load,
            })
            .collect()
    }

    /// Alerts raised so far.
    pub fn alerts(&self) -> Vec<String> {
        self.lock().alerts.clone()
    }

    /// Picks the least-loaded healthy slot with an engine (waits up to the configured time);
    /// takes one unit of load on it.
    fn pick(&self) -> Result<String, RouterError> {
        let start = Instant::now();
        let wait = Duration::from_millis(self.config.wait_ms);
        let mut st = self.lock();
        loop {
            let best = st
                .slots
                .iter()
                .filter(|(_, s)| s.healthy && s.addr.is_some())
                .min_by_key(|(_, s)| s.load)
                .map(|(g, _)| g.clone());
            if let Some(g) = best {
                if let Some(s) = st.slots.get_mut(&g) {
                    s.load += 1;
                }
                return Ok(g);
            }
            let left = wait.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(RouterError::NoEngine {
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn release(&self, gpu: &str) {
        if let Some(s) = self.lock().slots.get_mut(gpu) {
            s.load = s.load.saturating_sub(1);
        }
    }

    /// Waits until slot `gpu` has an engine with an epoch other than `lost` (its replacement),
    /// or is unhealthy (then `None`).
    fn engine_of(&self, gpu: &str, lost: u64) -> Result<Option<(String, u64)>, RouterError> {
        let start = Instant::now();
        let wait = Duration::from_millis(self.config.wait_ms);
        let mut st = self.lock();
        loop {
            match st.slots.get(gpu) {
                None => return Ok(None),
                Some(s) if !s.healthy => return Ok(None),
                Some(s) => {
                    let epoch = *s.fence.read().unwrap_or_else(|e| e.into_inner());
                    if let (Some(addr), true) = (&s.addr, epoch != lost) {
                        return Ok(Some((addr.clone(), epoch)));
                    }
                }
            }
            let left = wait.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(RouterError::NoEngine {
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            st = self
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn fence_of(&self, gpu: &str) -> Option<Arc<RwLock<u64>>> {
        self.lock().slots.get(gpu).map(|s| Arc::clone(&s.fence))
    }

    fn persist(&self, rid: &str, tokens: &[u32]) {
        let Some(log) = &self.log else { return };
        let record = Record::TokenPrefix {
            trajectory: rid.to_owned(),
            request: rid.to_owned(),
            prefix: 0,
            tokens: tokens.to_vec(),
        };
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        match log.append(&record) {
            Ok(_) => {
                self.counters.prefix_records.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(rid, error = %e, "persisting token prefix failed"),
        }
    }

    /// Longest persisted token prefix of request `rid`.
    pub fn persisted_prefix(&self, rid: &str) -> Option<Vec<u32>> {
        let log = self.log.as_ref()?.lock().unwrap_or_else(|e| e.into_inner());
        match log.longest_token_prefix(rid, rid) {
            Ok(tokens) => tokens,
            Err(e) => {
                // Resuming from the start is correct, only slower.
                tracing::warn!(rid, error = %e, "reading the persisted token prefix failed");
                None
            }
        }
    }

    /// Streams one engine response into `sink`, forwarding only the next expected index while
    /// the engine's epoch holds.
    #[allow(clippy::too_many_arguments)]
    fn stream_from(
        &self,
        rid: &str,
        addr: &str,
        fence: &RwLock<u64>,
        epoch: u64,
        prompt: &[u32],
        target: usize,
        recorded: &mut Vec<u32>,
        sink: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Outcome {
        let base = if self.config.resume {
            recorded.len()
        } else {
            0
        };
        let mut input = prompt.to_vec();
        input.extend_from_slice(&recorded[..base]);
        let body = json!({
            "input_ids": input,
            "sampling_params": {"max_new_tokens": target - base},
            "stream": true,
        });
        let (status, mut reader) =
            match http::post(addr, "/generate", &body, Duration::from_millis(500)) {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(rid, addr, error = %e, "engine unreachable");
                    return Outcome::EngineLost;
                }
            };
        if status != 200 {
            return Outcome::EngineLost;
        }
        let _ = reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_millis(20)));
        let mut line = String::new();
        loop {
            // A partial line survives a timeout in `line` (read_line appends).
            match reader.read_line(&mut line) {
                Ok(0) => return Outcome::EngineLost,
                Ok(_) if !line.ends_with('\n') => return Outcome::EngineLost,
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if *fence.read().unwrap_or_else(|e| e.into_inner()) != epoch {
                        return Outcome::EngineLost;
                    }
                    continue;
                }
                Err(_) => return Outcome::EngineLost,
            }
            let v: serde_json::Value = match serde_json::from_str(line.trim()) {
                Ok(v) => v,
                Err(_) => return Outcome::EngineLost,
            };
            line.clear();
            if v.get("done").is_some() {
                return if recorded.len() == target {
                    Outcome::Done
                } else {
                    Outcome::EngineLost
                };
            }
            let (Some(index), Some(token)) = (
                v.get("index").and_then(|x| x.as_u64()),
                v.get("token").and_then(|x| x.as_u64()),
            ) else {
                return Outcome::EngineLost;
            };
            let global = base + index as usize;
            let guard = fence.read().unwrap_or_else(|e| e.into_inner());
            if *guard != epoch {
                self.counters.fenced_tokens.fetch_add(1, Ordering::Relaxed);
                return Outcome::EngineLost;
            }
            if global < recorded.len() {
                self.counters
                    .regenerated_tokens
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if global > recorded.len() {
                return Outcome::EngineLost;
            }
            let token = token as u32;
            if !sink(global, token) {
                return Outcome::ClientGone;
            }
            drop(guard);
            recorded.push(token);
            if recorded.len().is_multiple_of(self.config.token_interval) {
                self.persist(rid, recorded);
            }
        }
    }

    /// Runs request `req` to completion, feeding each token (index, id) exactly once and in
    /// order to `sink` (which returns `false` when the client is gone); returns the tokens.
    ///
    /// Errors: [`RouterError::NoEngine`].
    pub fn generate(
        &self,
        req: &GenerateRequest,
        sink: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<u32>, RouterError> {
        let rid = req
            .rid
            .clone()
            .unwrap_or_else(|| format!("r{}", self.next_rid.fetch_add(1, Ordering::Relaxed)));
        let target = req.sampling_params.max_new_tokens as usize;
        let mut recorded = Vec::with_capacity(target);
        let mut gpu = self.pick()?;
        let mut lost = 0u64;
        let result = loop {
            if recorded.len() == target {
                break Ok(());
            }
            let (addr, epoch) = match self.engine_of(&gpu, lost) {
                Ok(Some(e)) => e,
                Ok(None) => {
                    // The slot left the pool: redistribute to a healthy one.
                    self.release(&gpu);
                    gpu = self.pick()?;
                    lost = 0;
                    continue;
                }
                Err(e) => break Err(e),
            };
            let Some(fence) = self.fence_of(&gpu) else {
                continue;
            };
            if lost != 0 {
                self.counters.resumed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(rid, gpu, epoch, prefix = recorded.len(), "resuming request");
            }
            match self.stream_from(
                &rid,
                &addr,
                &fence,
                epoch,
                &req.input_ids,
                target,
                &mut recorded,
                sink,
            ) {
                Outcome::Done => break Ok(()),
                Outcome::ClientGone => break Ok(()),
                Outcome::EngineLost => {
                    lost = epoch;
                    // Wait for the failure to be handled (fence moved) unless it already was.
                    let st = self.lock();
                    let still = st
                        .slots
                        .get(&gpu)
                        .map(|s| *s.fence.read().unwrap_or_else(|e| e.into_inner()) == epoch)
                        .unwrap_or(false);
                    if still {
                        let _ = self
                            .changed
                            .wait_timeout(st, Duration::from_millis(5))
                            .unwrap_or_else(|e| e.into_inner());
                    }
                }
            }
        };
        self.release(&gpu);
        if !recorded.len().is_multiple_of(self.config.token_interval) && recorded.len() == target {
            self.persist(&rid, &recorded);
        }
        result.map(|()| recorded)
    }
}

#[cfg(test)]
mod tests;
