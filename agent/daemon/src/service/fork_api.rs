//! `Fork`: the checks for who asks (access to the source, the spec rights and limits of
//! every child, the per-uid cap for all of them, the image), then the fork itself
//! ([`crate::sandbox::fork`]) and the children entering the registry.
//!
//! Children being restored are not in the registry (no client sees or acts on them until
//! the fork is done) but are held in [`Forking`], which the blob collection walks too: their
//! copies refer to the blobs the source's checkpoint does, and the source may be removed
//! meanwhile.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use belayer_ipc::{Caller, ForkInfo, ForkRequest, Response};

use super::{error, unknown, Agent};
use crate::sandbox::fork::{self, ForkError};
use crate::sandbox::restore::Choice;
use crate::sandbox::SandboxSlot;

/// Children of forks in flight, with their fork's id.
#[derive(Debug, Default)]
pub(super) struct Forking(Mutex<Vec<(String, Arc<SandboxSlot>)>>);

impl Forking {
    /// The children, locked.
    fn lock(&self) -> MutexGuard<'_, Vec<(String, Arc<SandboxSlot>)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every child now.
    pub(super) fn slots(&self) -> Vec<Arc<SandboxSlot>> {
        self.lock().iter().map(|(_, s)| s.clone()).collect()
    }

    fn hold(&self, fork: &str, child: &Arc<SandboxSlot>) {
        self.lock().push((fork.to_string(), child.clone()));
    }

    fn forget(&self, fork: &str) {
        self.lock().retain(|(f, _)| f != fork);
    }
}

impl Agent {
    /// `Fork(req)` for `caller`: refused like `count` creations of the source's spec would
    /// be, else forked and every child registered (owned by the caller).
    pub(super) fn fork_sandbox(&self, caller: &Caller, req: &ForkRequest) -> Response {
        let started = Instant::now();
        let Some(source) = self.slot_for(caller, &req.id) else {
            return unknown(&req.id);
        };
        let count = req.count;
        if let Err(e) = fork::check_count(count) {
            return error(e.code(), &e);
        }
        let uid = caller.cred.uid;
        let spec = source.record().spec.clone();
        let in_flight = match self.admit(caller, &spec, count, "refused a fork") {
            Ok(f) => f,
            Err(r) => return *r,
        };
        let choice = match (&req.checkpoint, req.prefix) {
            (Some(name), _) => Choice::Named(name.clone()),
            (None, prefix) => Choice::prefix(prefix),
        };
        let result = self.fork_children(&source, &choice, req, uid);
        match &result {
            Ok(info) => info
                .children
                .iter()
                .for_each(|c| self.metrics.restore(Ok(c))),
            // One refused or failed fork is one failed restore, whatever its count.
            Err(e) => self.metrics.restore(Err(e.code())),
        }
        drop(in_flight);
        match result {
            Ok(mut info) => {
                info.total_ms = started.elapsed().as_secs_f64() * 1000.0;
                tracing::info!(sandbox = %req.id, fork = %info.fork, count, total_ms = info.total_ms, "forked");
                Response::Forked(info)
            }
            Err(e) => {
                tracing::warn!(sandbox = %req.id, error = %belayer_ipc::error_chain(&e), "fork failed");
                error(e.code(), &e)
            }
        }
    }

    fn fork_children(
        &self,
        source: &SandboxSlot,
        choice: &Choice,
        req: &ForkRequest,
        uid: u32,
    ) -> Result<ForkInfo, ForkError> {
        let fork_id = fork::new_fork_id();
        let spec = fork::ForkSpec {
            fork: &fork_id,
            choice,
            count: req.count,
            owner_uid: uid,
        };
        let hold = |child: &Arc<SandboxSlot>| self.forking.hold(&fork_id, child);
        let prepared = match fork::prepare(&self.rt, source, spec, &hold) {
            Ok(p) => p,
            Err(e) => {
                self.forking.forget(&fork_id);
                return Err(e);
            }
        };
        let done = fork::restore_children(&self.rt, &prepared, req.verify)
            .and_then(|infos| fork::commit(&self.rt, &prepared).map(|()| infos));
        let infos = match done {
            Ok(infos) => infos,
            Err(e) => {
                fork::discard(&self.rt, &prepared.children);
                self.forking.forget(&fork_id);
                return Err(e);
            }
        };
        {
            let mut registry = self.registry();
            for child in &prepared.children {
                let id = child.record().id.clone();
                registry.insert(id, child.clone());
            }
        }
        self.forking.forget(&fork_id);
        let children = infos
            .into_iter()
            .map(|mut r| {
                r.context = Vec::new();
                r
            })
            .collect();
        Ok(ForkInfo {
            fork: prepared.fork.clone(),
            source: req.id.clone(),
            checkpoint: prepared.checkpoint.clone(),
            prefix: prepared.prefix,
            context: prepared.context.clone(),
            children,
            total_ms: 0.0,
        })
    }
}
