//! Shared resources of the agent that every sandbox verb uses.

use belayer_criu::Criu;

use crate::config::Config;
use crate::images::ImageStore;

/// Configuration plus the located tools; created once at daemon start.
#[derive(Debug)]
pub struct Runtime {
    /// Daemon configuration.
    pub config: Config,
    /// Image store.
    pub images: ImageStore,
    /// The CRIU in use.
    pub criu: Criu,
    /// The helper binary, sealed in a memfd (see [`crate::helper::image`]).
    pub helper: crate::helper::image::HelperImage,
    /// The sandbox seccomp filter, compiled once and sealed in a memfd for the exec helpers
    /// (see [`crate::helper::seccomp::sealed`]).
    pub seccomp: crate::helper::seccomp::sealed::SealedFilter,
    /// The sandbox tracer (BPF or fallback): fault detection and per-action verdicts.
    pub tracer: crate::trace::SandboxTracer,
    /// The node's upper-layer blob store (`state_dir/blobs`), shared by every checkpoint of
    /// every sandbox.
    pub blobs: belayer_overlay::layer::BlobStore,
    /// The tmpfs CRIU dumps into while a sandbox is frozen (`None`: disabled or unavailable).
    pub stage: Option<crate::stage::DumpStage>,
    /// Host id ranges of sandbox user namespaces.
    pub userns: crate::userns::RangeAllocator,
    /// Disk quotas of the state dir (`None` only when `default_disk_max_bytes` is 0 and the
    /// state dir has none): instance dirs are made with [`crate::quota::make_instance_dir`].
    pub quota: Option<crate::quota::QuotaFs>,
}

impl Runtime {
    /// Cgroup path of sandbox `id`, relative to each hierarchy root.
    pub fn cgroup_rel(&self, id: &str) -> String {
        format!("{}/{}", self.config.cgroup_parent, id)
    }
}
