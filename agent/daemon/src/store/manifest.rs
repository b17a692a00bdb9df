//! The checkpoint manifest: what a checkpoint C_k contains and how to verify it.
//!
//! Stored as `manifest.json` in the checkpoint directory. Format version [`FORMAT_VERSION`];
//! a reader refuses other versions.

use std::path::{Component, Path};

use belayer_ipc::CheckpointTimings;
use serde::{Deserialize, Serialize};

/// Manifest format version written (3: R_k's pages files are page maps over page packs in
/// the node's blob store, [`super::pages`]; 2: F_k is a layer manifest `upper.layer` plus
/// blobs in the blob store, R_k's files as CRIU wrote them; 1 held an `upper.tar`).
pub const FORMAT_VERSION: u32 = 3;

/// The oldest manifest format version a reader accepts (2: it has no [`Manifest::memory`]
/// and its pages files are plain artifacts, restored as they are).
pub const OLDEST_FORMAT_VERSION: u32 = 2;

/// Name of the layer-manifest artifact (F_k) in a checkpoint directory.
pub const UPPER_LAYER: &str = "upper.layer";

/// One file of a checkpoint: its path relative to the checkpoint directory, size and blake3.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Artifact {
    /// Relative path, e.g. `upper.layer` or `criu/pages-1.img`.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// blake3 of the content, lowercase hex.
    pub digest: String,
}

impl Artifact {
    /// Whether `path` is a plain relative path that stays inside the checkpoint directory.
    pub fn path_is_safe(&self) -> bool {
        let p = Path::new(&self.path);
        !self.path.is_empty()
            && p.components().all(|c| matches!(c, Component::Normal(_)))
            && !self.path.contains('\0')
    }
}

/// The LLM context record L_k stored with a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextRecord {
    /// Record id: `<sandbox>/k<prefix>` (the context log of the rollout driver uses the same id).
    pub record: String,
    /// The artifact holding the bytes.
    pub artifact: Artifact,
}

/// Manifest of a checkpoint C_k = (F_k, R_k) with L_k.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`].
    pub format: u32,
    /// Sandbox id.
    pub sandbox: String,
    /// Action boundary k.
    pub prefix: u64,
    /// Checkpoint name (directory name).
    pub checkpoint: String,
    /// Sequence number within the sandbox (publication order).
    pub seq: u64,
    /// The checkpoint that was ready when this one was taken: the state this one descends
    /// from, its parent in the sandbox's tree of checkpoints (`None`: a root, taken from a
    /// fresh or image-restarted instance, or written before checkpoints recorded parents).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Image (lower layer) the upper layer belongs to.
    pub image: String,
    /// Sandbox instance that was dumped.
    pub instance: u32,
    /// L_k.
    pub context: ContextRecord,
    /// F_k: the layer manifest ([`UPPER_LAYER`]); its file data are blobs in the node's
    /// blob store.
    pub upper: Artifact,
    /// What the capture of F_k read and stored.
    pub layer: LayerSummary,
    /// R_k: the CRIU image files (with format 3, page maps `pages-<n>.pmap` in place of the
    /// pages files).
    pub criu: Vec<Artifact>,
    /// R_k's content-addressed memory pages ([`super::pages`]): the packs the page maps
    /// refer to and what this checkpoint stored anew. Absent in format 2 manifests and when
    /// no pages file was split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<super::pages::MemoryImages>,
    /// Bytes of `criu` that are hard links to the parent checkpoint's same files
    /// ([`super::share`]): stored once, not counted again in [`Manifest::bytes`]. Absent
    /// (0) from older manifests.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared_image_bytes: u64,
    /// Processes of the sandbox when it was frozen, `"<pid in the sandbox> <comm>"`, sorted.
    #[serde(default)]
    pub processes: Vec<String>,
    /// The sandbox pid namespace's `ns_last_pid` when it was frozen (see
    /// [`crate::sandbox::pid_counter`]); written back after a restore. Absent from manifests
    /// written before it was recorded, and when it could not be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns_last_pid: Option<i32>,
    /// R_k describes the sandbox's own network namespace (dumped bare with `--empty-ns net`:
    /// it was owned by the sandbox's user namespace), so the restore lets CRIU make it
    /// (`crate::sandbox::netns`); `false` (and absent from older manifests): R_k leaves the
    /// namespace out and the restore joins a fresh one. It must match R_k: CRIU restores
    /// into the namespace it runs in when the images leave it out.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub own_netns: bool,
    /// Digest of the image F_k lies over ([`crate::images::ImageMeta::digest`]): a restore
    /// refuses an image under the same name whose digest differs (the upper layer would be
    /// laid over other lower layers). Absent from older manifests and for images without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest: Option<String>,
    /// Subvolume id of the checkpoint's read-only upper snapshot (`upper.snap`, see
    /// [`super::snapshot`]), which a restore on this node installs instead of materializing
    /// F_k; absent when none was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_snapshot: Option<u64>,
    /// Bytes charged for the instance's upper layer when the snapshot was taken: its volume's
    /// referenced bytes, plus (simple quotas) those it had inherited. A restore from the
    /// snapshot inherits them; absent without a snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_bytes: Option<u64>,
    /// Host id range of the sandbox's user namespace when the checkpoint was taken: the ids
    /// of F_k's owners and of R_k's namespace maps. A restore refuses a checkpoint of another
    /// range than the sandbox's (a fork copies a checkpoint into its own range, see
    /// [`super::copy`]). Absent from older manifests and for `--userns=host` sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub userns: Option<crate::userns::IdRange>,
    /// `<sandbox>/<checkpoint>` this checkpoint was copied from by a fork; absent for a
    /// checkpoint the sandbox took itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<String>,
    /// Phase timings of the checkpoint, ms (publish and total are those known when written).
    pub timings_ms: CheckpointTimings,
    /// Publication time, ms since the Unix epoch.
    pub created_unix_ms: u64,
}

/// Summary of the upper-layer capture of a checkpoint (paper: incremental F_k).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LayerSummary {
    /// Entries in the upper layer.
    pub entries: u64,
    /// Bytes of file data in the layer (holes excluded).
    pub data_bytes: u64,
    /// Entries taken over from the previous capture without reading them.
    pub reused: u64,
    /// Bytes of file data read by this capture (the delta).
    pub bytes_read: u64,
    /// Blobs this checkpoint added to the store.
    pub new_blobs: u64,
    /// Bytes this checkpoint added to the store.
    pub new_blob_bytes: u64,
    /// Distinct blobs the layer refers to.
    pub blobs: u64,
    /// Paths deleted since the previous capture.
    pub removed: u64,
    /// Whether the capture was incremental (had a base manifest).
    pub incremental: bool,
}

impl Manifest {
    /// A manifest of sandbox `sb` on image `img` with the given identity and artifacts and
    /// nothing else (unit tests).
    #[cfg(test)]
    pub(crate) fn for_test(
        checkpoint: &str,
        seq: u64,
        prefix: u64,
        parent: Option<String>,
        context: Artifact,
        upper: Artifact,
    ) -> Manifest {
        Manifest {
            format: FORMAT_VERSION,
            sandbox: "sb".into(),
            prefix,
            checkpoint: checkpoint.into(),
            seq,
            parent,
            image: "img".into(),
            instance: 0,
            context: ContextRecord {
                record: format!("sb/k{prefix}"),
                artifact: context,
            },
            upper,
            layer: LayerSummary::default(),
            criu: vec![],
            memory: None,
            shared_image_bytes: 0,
            processes: vec![],
            ns_last_pid: None,
            own_netns: false,
            image_digest: None,
            upper_snapshot: None,
            upper_bytes: None,
            userns: None,
            forked_from: None,
            timings_ms: Default::default(),
            created_unix_ms: 0,
        }
    }

    /// Every artifact, context first.
    pub fn artifacts(&self) -> impl Iterator<Item = &Artifact> {
        std::iter::once(&self.context.artifact)
            .chain(std::iter::once(&self.upper))
            .chain(self.criu.iter())
    }

    /// Bytes this checkpoint added to disk: its artifacts (less those shared with its
    /// parent) plus its new blobs and new page packs.
    pub fn bytes(&self) -> u64 {
        self.artifacts().map(|a| a.bytes).sum::<u64>()
            - self
                .shared_image_bytes
                .min(self.criu.iter().map(|a| a.bytes).sum())
            + self.layer.new_blob_bytes
            + self.memory.as_ref().map_or(0, |m| m.new_bytes)
    }

    /// Bytes of R_k as CRIU reads them at restore: its files, with the pages files the page
    /// maps describe in place of the maps.
    pub fn criu_bytes(&self) -> u64 {
        let maps: u64 = self
            .criu
            .iter()
            .filter(|a| a.path.ends_with(super::pages::MAP_SUFFIX))
            .map(|a| a.bytes)
            .sum();
        self.criu.iter().map(|a| a.bytes).sum::<u64>() - maps
            + self.memory.as_ref().map_or(0, |m| m.bytes())
    }

    /// The wire description of this checkpoint (what `ListCheckpoints` and `Checkpoint`
    /// answer).
    pub fn info(&self) -> belayer_ipc::CheckpointInfo {
        belayer_ipc::CheckpointInfo {
            sandbox: self.sandbox.clone(),
            prefix: self.prefix,
            checkpoint: self.checkpoint.clone(),
            bytes: self.bytes(),
            context_digest: self.context.artifact.digest.clone(),
            timings_ms: self.timings_ms.clone(),
            created_unix_ms: self.created_unix_ms,
            parent: self.parent.clone(),
            ready: false,
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
