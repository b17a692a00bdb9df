//! `Gc`: checkpoints dropped by age or by rollout tag, whole branches at a time.
//!
//! A sandbox's checkpoints form a tree ([`crate::store`]); its **line** is the ready
//! checkpoint and its ancestors, the history of the state it runs now. With `older_than_s`,
//! a checkpoint of the line older than that goes unless it is the ready one (as before
//! branches); a **branch** off the line (a subtree whose root's parent is on the line or
//! gone) goes whole when its newest checkpoint is older, and stays whole otherwise, so gc
//! never leaves half of an abandoned branch. With a matching tag, every checkpoint goes.

use std::collections::{HashMap, HashSet};

use belayer_ipc::{Caller, ErrorCode, ErrorReply, Response};

use super::Agent;
use crate::store::{CheckpointStore, Manifest};
use crate::sys;

/// The names among `list` that gc removes: see the module docs. `line`: the ready
/// checkpoint and its ancestors; `old(m)`: `m` is older than the asked age.
pub(crate) fn doomed(
    list: &[Manifest],
    line: &HashSet<String>,
    ready: Option<&str>,
    tagged: bool,
    old: impl Fn(&Manifest) -> bool,
) -> Vec<String> {
    if tagged {
        return list.iter().map(|m| m.checkpoint.clone()).collect();
    }
    let by_name: HashMap<&str, &Manifest> =
        list.iter().map(|m| (m.checkpoint.as_str(), m)).collect();
    // The root of the branch an off-line checkpoint belongs to (parents have lower sequence
    // numbers, so the walk ends).
    let branch_of = |m: &Manifest| -> String {
        let mut cur = m;
        while let Some(parent) = cur.parent.as_deref().and_then(|p| by_name.get(p)) {
            if line.contains(&parent.checkpoint) || parent.seq >= cur.seq {
                break;
            }
            cur = parent;
        }
        cur.checkpoint.clone()
    };
    let mut branches: HashMap<String, (bool, Vec<String>)> = HashMap::new();
    let mut out = Vec::new();
    for m in list {
        if line.contains(&m.checkpoint) {
            if old(m) && ready != Some(m.checkpoint.as_str()) {
                out.push(m.checkpoint.clone());
            }
            continue;
        }
        let entry = branches.entry(branch_of(m)).or_insert((true, Vec::new()));
        entry.0 &= old(m);
        entry.1.push(m.checkpoint.clone());
    }
    for (all_old, names) in branches.into_values() {
        if all_old {
            out.extend(names);
        }
    }
    out
}

impl Agent {
    /// `Gc { older_than_s, tag }` over the caller's sandboxes; then the blob collection.
    pub(super) fn gc(
        &self,
        caller: &Caller,
        older_than_s: Option<u64>,
        tag: Option<&str>,
    ) -> Response {
        if older_than_s.is_none() && tag.is_none() {
            return Response::Error(ErrorReply {
                code: ErrorCode::BadRequest,
                message: "gc needs --older-than or --tag".into(),
            });
        }
        let now = sys::now_unix_ms();
        let old = |m: &Manifest| {
            older_than_s
                .is_some_and(|s| now.saturating_sub(m.created_unix_ms) >= s.saturating_mul(1000))
        };
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
            let line: HashSet<String> = ready
                .as_deref()
                .map(|r| {
                    store
                        .ancestry(r)
                        .into_iter()
                        .map(|m| m.checkpoint)
                        .collect()
                })
                .unwrap_or_default();
            for name in doomed(&list, &line, ready.as_deref(), tagged, old) {
                if ready.as_deref() == Some(name.as_str()) {
                    if let Err(e) = store.clear_ready() {
                        // Removing it would leave `READY` naming nothing.
                        tracing::warn!(sandbox = %rec.id, error = %e, "gc keeps the ready checkpoint");
                        continue;
                    }
                    // No ready checkpoint holds this state any more.
                    slot.changes.forget();
                }
                if let Ok(b) = store.remove(&name) {
                    removed += 1;
                    bytes += b;
                }
            }
        }
        bytes += self.collect_blobs();
        tracing::info!(removed, bytes, "checkpoint gc");
        Response::Gc { removed, bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Artifact;

    fn m(name: &str, seq: u64, parent: Option<&str>, created: u64) -> Manifest {
        let artifact = Artifact {
            path: "x".into(),
            bytes: 0,
            digest: String::new(),
        };
        Manifest {
            created_unix_ms: created,
            ..Manifest::for_test(
                name,
                seq,
                seq,
                parent.map(Into::into),
                artifact.clone(),
                artifact,
            )
        }
    }

    #[test]
    fn branches_go_whole_and_the_line_keeps_its_ready_checkpoint() {
        // c1 ─ c2 ─ c3 ─ c6 (ready)      line: c1 c2 c3 c6
        //       └─ c4 ─ c5               branch of c4: old c4, new c5 → kept whole
        //  └─ c7 ─ c8                    branch of c7: both old → dropped whole
        let list = [
            m("c1", 1, None, 0),
            m("c2", 2, Some("c1"), 0),
            m("c3", 3, Some("c2"), 0),
            m("c4", 4, Some("c2"), 0),
            m("c5", 5, Some("c4"), 100),
            m("c6", 6, Some("c3"), 0),
            m("c7", 7, Some("c1"), 0),
            m("c8", 8, Some("c7"), 0),
        ];
        let line: HashSet<String> = ["c1", "c2", "c3", "c6"].map(String::from).into();
        let old = |m: &Manifest| m.created_unix_ms < 50;
        let mut gone = doomed(&list, &line, Some("c6"), false, old);
        gone.sort();
        assert_eq!(gone, ["c1", "c2", "c3", "c7", "c8"]);
        // Nothing old: nothing goes; a matching tag: everything.
        assert!(doomed(&list, &line, Some("c6"), false, |_| false).is_empty());
        assert_eq!(doomed(&list, &line, Some("c6"), true, |_| false).len(), 8);
        // A branch whose root's parent was removed is still one branch.
        let rest = &list[3..5];
        assert!(doomed(rest, &line, Some("c6"), false, old).is_empty());
    }
}
