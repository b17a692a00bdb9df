//! `CreateSandbox`: the checks for who asks (spec rights, limit ceilings, per-uid cap, image
//! ownership) and the creations in flight.
//!
//! A creation takes seconds, and its sandbox enters the registry only at the end. Creations in
//! flight are therefore recorded ([`Creating`]) from the moment their checks pass: they count
//! against their uid's `max_sandboxes_per_uid` (so parallel requests cannot overshoot it) and
//! hold their image against removal (so an image cannot be removed, and another one imported
//! under its name, between the ownership check and the mount).

use std::sync::{Mutex, MutexGuard};

use belayer_ipc::{Caller, Response, SandboxSpec};

use super::{access, error, Agent};

/// Creations in flight: `(owner uid, image name)` each.
#[derive(Debug, Default)]
pub(super) struct Creating(Mutex<Vec<(u32, String)>>);

impl Creating {
    /// The list, locked (always after the registry when both are held).
    pub(super) fn lock(&self) -> MutexGuard<'_, Vec<(u32, String)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Creations in flight (one, or a fork's children); they leave the list on drop.
pub(super) struct InFlight<'a> {
    creating: &'a Creating,
    entries: Vec<(u32, String)>,
}

impl<'a> InFlight<'a> {
    /// Adds `entries` to `list` (the locked `creating`) and holds them until dropped.
    pub(super) fn many(
        creating: &'a Creating,
        list: &mut Vec<(u32, String)>,
        entries: impl IntoIterator<Item = (u32, String)>,
    ) -> InFlight<'a> {
        let entries: Vec<(u32, String)> = entries.into_iter().collect();
        list.extend(entries.iter().cloned());
        InFlight { creating, entries }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut list = self.creating.lock();
        for entry in &self.entries {
            if let Some(i) = list.iter().position(|e| e == entry) {
                list.swap_remove(i);
            }
        }
    }
}

impl Agent {
    /// `CreateSandbox(spec)` for `caller`: refused with `PermissionDenied` past its rights
    /// ([`access::check_spec`], [`access::check_limits`], the image owner), else created,
    /// registered and described.
    pub(super) fn create_sandbox(&self, caller: &Caller, spec: SandboxSpec) -> Response {
        let uid = caller.cred.uid;
        let in_flight = match self.admit(caller, &spec, 1, "refused a sandbox spec") {
            Ok(f) => f,
            Err(r) => return *r,
        };
        let created = crate::sandbox::create::create(&self.rt, spec, uid);
        match created {
            Ok(slot) => {
                let slot = std::sync::Arc::new(slot);
                let info = Self::info(&slot);
                self.registry().insert(info.id.clone(), slot);
                drop(in_flight);
                Response::Sandbox(info)
            }
            Err(e) => error(e.code(), &e),
        }
    }

    /// Admits `count` creations of `spec` for `caller` (its rights, its per-uid cap counting
    /// the sandboxes it holds and those being made, the image): held in the in-flight list
    /// until the returned guard drops. Refused: the `PermissionDenied` (or other) answer, boxed,
    /// logged as `what`.
    pub(super) fn admit(
        &self,
        caller: &Caller,
        spec: &SandboxSpec,
        count: u32,
        what: &str,
    ) -> Result<InFlight<'_>, Box<Response>> {
        let uid = caller.cred.uid;
        let registry = self.registry();
        let mut creating = self.creating.lock();
        let held = registry
            .values()
            .filter(|s| s.record().owner_uid == uid)
            .count()
            + creating.iter().filter(|(u, _)| *u == uid).count();
        let last = held + (count.max(1) as usize) - 1;
        let checked = access::check_spec(caller, spec)
            .and_then(|()| access::check_limits(caller, spec, &self.rt.config, last))
            .and_then(|()| self.check_image_use(caller, &spec.image));
        if let Err(e) = checked {
            tracing::warn!(uid, pid = caller.cred.pid, error = %e, "{what}");
            return Err(Box::new(error(e.code(), &e)));
        }
        let entries = (0..count).map(|_| (uid, spec.image.clone()));
        Ok(InFlight::many(&self.creating, &mut creating, entries))
    }
}
