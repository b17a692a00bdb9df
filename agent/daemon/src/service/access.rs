//! Who may see and act on what: the daemon's one access rule and the refusals it gives.
//!
//! Every sandbox ([`SandboxRecord::owner_uid`](crate::sandbox::SandboxRecord)) and image
//! ([`ImageMeta::owner_uid`](crate::images::ImageMeta)) records the uid of the peer that
//! created it. Root (uid 0) sees and acts on everything. Any other peer (a member of the
//! socket group) sees and acts only on its own sandboxes (exec, checkpoint, maybe-checkpoint,
//! restore, inspect, remove, list checkpoints; the list, gc and its event stream are limited
//! to them) and removes only its own images. Another peer's sandbox is answered exactly like
//! an unknown id, so sandbox ids cannot be probed. Images stay visible to all (any peer may
//! create sandboxes from them).
//!
//! Paths the daemon would open itself are root-only: `ImportImage` without a descriptor is
//! refused for anyone else, who passes the source as a descriptor opened with its own
//! rights; a directory is then read with the peer's uid, gid and supplementary groups (see
//! [`crate::images::import`]), which needs the groups from `SO_PEERGROUPS`. Likewise a
//! sandbox in the host's user namespace (its root is host root) is root-only ([`check_spec`]).

use std::sync::Arc;

use belayer_ipc::{Caller, ErrorCode};

use super::Agent;
use crate::images::Credentials;
use crate::sandbox::SandboxSlot;

/// Whether `caller` may see and act on something created by `owner_uid`.
pub fn may_act_on(caller: &Caller, owner_uid: u32) -> bool {
    caller.is_root() || caller.cred.uid == owner_uid
}

impl Agent {
    /// The sandbox `id` if `caller` may see it ([`may_act_on`]); `None` both when it does not
    /// exist and when it belongs to someone else, so the two are answered alike. Every verb on
    /// one sandbox looks it up here.
    pub(super) fn slot_for(&self, caller: &Caller, id: &str) -> Option<Arc<SandboxSlot>> {
        self.slot(id)
            .filter(|slot| may_act_on(caller, slot.record().owner_uid))
    }

    /// The sandboxes `caller` may see (list, gc, status).
    pub(super) fn slots_for(&self, caller: &Caller) -> Vec<Arc<SandboxSlot>> {
        self.registry()
            .values()
            .filter(|slot| may_act_on(caller, slot.record().owner_uid))
            .cloned()
            .collect()
    }
}

/// The credentials to read a source with on behalf of `caller`.
///
/// Errors: [`AccessError::GroupsUnknown`] for a non-root caller whose supplementary groups
/// the kernel did not report (reading with fewer groups could wrongly refuse, with more
/// wrongly allow; neither is guessed).
pub fn credentials(caller: &Caller) -> Result<Credentials, AccessError> {
    if caller.is_root() {
        return Ok(Credentials {
            uid: 0,
            gid: caller.cred.gid,
            groups: caller.groups.clone().unwrap_or_default(),
        });
    }
    match &caller.groups {
        Some(groups) => Ok(Credentials {
            uid: caller.cred.uid,
            gid: caller.cred.gid,
            groups: groups.clone(),
        }),
        None => Err(AccessError::GroupsUnknown {
            uid: caller.cred.uid,
        }),
    }
}

/// Checks a sandbox spec from `caller`: only root may ask for the host's user namespace
/// (`UsernsMode::Host`), whose sandbox root is host root. A spec that leaves the mode open gets
/// the daemon's configured default, whoever asks (the operator's choice).
///
/// Errors: [`AccessError::HostUsernsNeedsRoot`].
pub fn check_spec(caller: &Caller, spec: &belayer_ipc::SandboxSpec) -> Result<(), AccessError> {
    if !caller.is_root() && spec.userns == Some(belayer_ipc::UsernsMode::Host) {
        return Err(AccessError::HostUsernsNeedsRoot {
            uid: caller.cred.uid,
        });
    }
    Ok(())
}

/// What a non-root peer's sandboxes may ask for: the daemon's defaults are their ceilings
/// (a peer cannot give itself more memory, tasks, CPU or disk than the operator configured
/// for every sandbox), and each uid holds at most `max_sandboxes_per_uid` sandboxes. Root is
/// not limited. Errors: [`AccessError::OverLimit`], [`AccessError::TooManySandboxes`].
pub fn check_limits(
    caller: &Caller,
    spec: &belayer_ipc::SandboxSpec,
    config: &crate::config::Config,
    held: usize,
) -> Result<(), AccessError> {
    if caller.is_root() {
        return Ok(());
    }
    let uid = caller.cred.uid;
    let over = |limit: &'static str, asked: f64, max: f64| {
        (max > 0.0 && asked > max).then_some(AccessError::OverLimit {
            uid,
            limit,
            asked,
            max,
        })
    };
    let checks = [
        spec.memory_max.and_then(|m| {
            over(
                "memory_max",
                m as f64,
                config.default_memory_max_bytes as f64,
            )
        }),
        spec.pids_max
            .and_then(|p| over("pids_max", p as f64, config.default_pids_max as f64)),
        spec.cpus.and_then(|c| over("cpus", c, config.default_cpus)),
        spec.disk_max
            .and_then(|d| over("disk_max", d as f64, config.default_disk_max_bytes as f64)),
    ];
    if let Some(e) = checks.into_iter().flatten().next() {
        return Err(e);
    }
    if held >= config.max_sandboxes_per_uid {
        return Err(AccessError::TooManySandboxes {
            uid,
            max: config.max_sandboxes_per_uid,
        });
    }
    Ok(())
}

/// Why a request is refused for who sent it (or for what it carries).
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    /// `ImportImage` without a descriptor from a non-root peer.
    #[error(
        "uid {uid} may not import from a host path the daemon opens itself (root only): pass \
         the source as a descriptor opened with your own rights (belayer image import, \
         libbelayer and the Python package do)"
    )]
    HostPathNeedsRoot {
        /// The peer's uid.
        uid: u32,
    },
    /// A non-root peer asked for a sandbox in the host's user namespace (sandbox root as host
    /// root): that runs processes with more rights than the peer's own.
    #[error("uid {uid} may not create a sandbox in the host's user namespace (its root is host root; root only)")]
    HostUsernsNeedsRoot {
        /// The peer's uid.
        uid: u32,
    },
    /// The kernel did not report the peer's supplementary groups (`SO_PEERGROUPS`).
    #[error("the supplementary groups of uid {uid} are unknown (no SO_PEERGROUPS): cannot read a directory with its rights")]
    GroupsUnknown {
        /// The peer's uid.
        uid: u32,
    },
    /// Removing an image imported by someone else.
    #[error("image {name} belongs to uid {owner}; uid {uid} may not remove it")]
    NotImageOwner {
        /// Image name.
        name: String,
        /// Its owner.
        owner: u32,
        /// The peer's uid.
        uid: u32,
    },
    /// A non-root peer asked for more than the daemon's default for every sandbox.
    #[error("uid {uid} may not ask for {limit} = {asked} (the ceiling for non-root clients is the daemon's default, {max})")]
    OverLimit {
        /// The peer's uid.
        uid: u32,
        /// Which limit.
        limit: &'static str,
        /// What was asked.
        asked: f64,
        /// The ceiling.
        max: f64,
    },
    /// A non-root peer holds its maximum number of sandboxes.
    #[error("uid {uid} already holds {max} sandboxes (max_sandboxes_per_uid)")]
    TooManySandboxes {
        /// The peer's uid.
        uid: u32,
        /// The maximum.
        max: usize,
    },
    /// The image was imported by another (non-root) peer.
    #[error("image {name} was imported by uid {owner}: only root's images are shared (import your own copy under another name)")]
    ForeignImage {
        /// Image name.
        name: String,
        /// Its owner.
        owner: u32,
    },
    /// The image's metadata (its owner) cannot be read: only root may use it.
    #[error("the owner of image {name} cannot be read: only root may use it")]
    ImageOwnerUnknown {
        /// Image name.
        name: String,
    },
    /// The request carries another number of descriptors than it takes.
    #[error("the request carries {got} descriptors, it takes {expected}")]
    Descriptors {
        /// Descriptors received.
        got: usize,
        /// Descriptors the request takes.
        expected: usize,
    },
}

impl AccessError {
    /// The wire error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            AccessError::Descriptors { .. } => ErrorCode::BadRequest,
            _ => ErrorCode::PermissionDenied,
        }
    }
}

#[cfg(test)]
mod tests {
    use belayer_ipc::PeerCred;

    use super::*;

    fn caller(uid: u32, groups: Option<Vec<u32>>) -> Caller {
        Caller {
            cred: PeerCred {
                pid: 1,
                uid,
                gid: uid,
            },
            groups,
        }
    }

    #[test]
    fn root_acts_on_everything_others_on_their_own() {
        assert!(may_act_on(&caller(0, None), 1000));
        assert!(may_act_on(&caller(1000, None), 1000));
        assert!(!may_act_on(&caller(1000, None), 0));
        assert!(!may_act_on(&caller(1000, None), 1001));
    }

    #[test]
    fn credentials_need_the_groups_of_a_non_root_peer() {
        assert!(matches!(
            credentials(&caller(1000, None)),
            Err(AccessError::GroupsUnknown { uid: 1000 })
        ));
        let c = credentials(&caller(1000, Some(vec![4, 27]))).unwrap();
        assert_eq!((c.uid, c.gid, c.groups), (1000, 1000, vec![4, 27]));
        assert_eq!(credentials(&caller(0, None)).unwrap().uid, 0);
    }
}
