//! The messages of `Fork` (since protocol 12): N new sandboxes restored from one
//! checkpoint C_K of a sandbox that keeps running (paper §"Environment-state recovery";
//! GRPO samples several trajectories from one set-up, tree search branches at a step).

use serde::{Deserialize, Serialize};

use crate::message::RestoreInfo;

/// `Fork`: `count` children of sandbox `id`, each restored from its checkpoint C_K into an
/// instance of its own (own namespaces, cgroup, upper layer, limits, user-namespace id
/// range), with its own copy of C_K as its ready checkpoint (sharing the original's blobs
/// and CRIU images on disk). The source keeps running and its checkpoints do not change.
/// All or nothing: when any child cannot be restored, none stays and the error names it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ForkRequest {
    /// Source sandbox id.
    pub id: String,
    /// C_K: the latest checkpoint of boundary K on the ready checkpoint's line; `None` (and
    /// no `checkpoint`): the ready checkpoint.
    pub prefix: Option<u64>,
    /// C_K by name, on any branch (takes precedence over `prefix`).
    pub checkpoint: Option<String>,
    /// Children to make, 1 to 256 (and within the caller's `max_sandboxes_per_uid`).
    pub count: u32,
    /// Check each child's restored state against the checkpoint, as `Restore` does.
    pub verify: bool,
}

/// Answer to [`ForkRequest`]: [`crate::Response::Forked`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ForkInfo {
    /// The fork's id, `fk-<12 hex>` (in the daemon's log and each child's checkpoint).
    pub fork: String,
    /// Source sandbox id.
    pub source: String,
    /// The checkpoint forked from (`c<seq>-k<K>`).
    pub checkpoint: String,
    /// Its action boundary K.
    pub prefix: u64,
    /// L_K, the LLM context recorded with C_K (every child regenerates from it).
    #[serde(with = "serde_bytes")]
    pub context: Vec<u8>,
    /// Each child's restore, in order: its sandbox id (`sandbox`), init pid, timings and,
    /// with `verify`, validity. `prefix` is K and `context` is left empty (it is `context`).
    pub children: Vec<RestoreInfo>,
    /// Wall-clock time from the request until every child ran, ms.
    pub total_ms: f64,
}
