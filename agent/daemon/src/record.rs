//! What the daemon remembers about a sandbox: its record (`state.json`), its lifecycle state
//! and the paths of its directory. Below [`crate::sandbox`] (which re-exports all of it) so that
//! the tracer and the runtime can name a sandbox without depending on the verbs.

pub mod state;

use std::fs;
use std::path::{Path, PathBuf};

use belayer_ipc::SandboxSpec;
use serde::{Deserialize, Serialize};
pub use state::SandboxState;

use crate::cgroup::{CpuMax, DeviceFilter, Limits};
use crate::sys;
use crate::userns::IdRange;

/// What the daemon remembers about a sandbox (`state.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// Sandbox id, `sb-<12 hex>`.
    pub id: String,
    /// Creation parameters (image, limits, env, tag).
    pub spec: SandboxSpec,
    /// Lifecycle state.
    pub state: SandboxState,
    /// Current instance number.
    pub instance: u32,
    /// Host pid of the init of the current instance.
    pub init_pid: Option<i32>,
    /// Start time (clock ticks since boot) of that init, to detect pid reuse.
    pub init_start_time: Option<u64>,
    /// Cgroup path relative to each hierarchy root.
    pub cgroup: String,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Host id range of the sandbox's user namespace; `None`: the host's user namespace
    /// (`--userns=host`, or a sandbox made before user namespaces).
    #[serde(default)]
    pub userns: Option<IdRange>,
    /// Uid of the peer that created it: only it and root see and act on it. Records written
    /// before this field existed belong to root.
    #[serde(default)]
    pub owner_uid: u32,
    /// Bytes of the current instance's upper layer that are charged to earlier volumes, not
    /// to its own qgroup (simple quotas: what a restore shared into it; 0 under full qgroups,
    /// which charge shared extents to every volume): its disk limit is the sandbox's minus
    /// these (see `sandbox::restore::upper`). 0 for a fresh instance.
    #[serde(default)]
    pub inherited_bytes: u64,
    /// Digest of the image at creation ([`crate::images::ImageMeta::digest`]): checkpoints
    /// record it and a restore refuses an image whose digest changed. `None` for records
    /// written before it existed, or images without one.
    #[serde(default)]
    pub image_digest: Option<String>,
    /// Set while the sandbox is a child of a fork that has not finished (the fork's id): an
    /// adoption removes such a sandbox unless the fork's commit marker exists
    /// ([`crate::sandbox::fork`]). Absent once the fork is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_fork: Option<String>,
}

/// Errors shared by the sandbox verbs.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Writing or reading `state.json` failed.
    #[error("cannot {op} sandbox state {path}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `state.json` is not valid.
    #[error("invalid sandbox state {path}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Paths of one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    /// `state_dir/sandboxes/<id>`.
    pub dir: PathBuf,
}

impl SandboxPaths {
    /// Paths of sandbox `id` under `state_dir`.
    pub fn new(state_dir: &Path, id: &str) -> Self {
        Self {
            dir: state_dir.join("sandboxes").join(id),
        }
    }
    /// `state.json`.
    pub fn state_file(&self) -> PathBuf {
        self.dir.join("state.json")
    }
    /// Directory of instance `n`.
    pub fn instance(&self, n: u32) -> PathBuf {
        self.dir.join(format!("inst-{n}"))
    }
    /// Overlay upper dir of instance `n`.
    pub fn upper(&self, n: u32) -> PathBuf {
        self.instance(n).join("upper")
    }
    /// Overlay work dir of instance `n`.
    pub fn work(&self, n: u32) -> PathBuf {
        self.instance(n).join("work")
    }
    /// Overlay mount point (the sandbox root) of instance `n`.
    pub fn merged(&self, n: u32) -> PathBuf {
        self.instance(n).join("merged")
    }
    /// Checkpoint store.
    pub fn checkpoints(&self) -> PathBuf {
        self.dir.join("checkpoints")
    }
    /// Scratch dir for CRIU logs (kept out of the checkpoint so its digests stay valid).
    pub fn criu_work(&self) -> PathBuf {
        self.dir.join("criu-work")
    }
    /// The images dir a restore hands CRIU when R_k's pages are content-addressed: R_k's
    /// files linked in and its pages files assembled from page packs
    /// ([`crate::store::pages::assemble`]); removed once CRIU is done.
    pub fn restore_images(&self) -> PathBuf {
        self.dir.join("criu-images")
    }
    /// The numbers of the instance dirs (`inst-<n>`) on disk, in no order: the current
    /// instance's, and any an interrupted restore or a retirement under way left. Empty when
    /// the sandbox dir cannot be read.
    pub fn instances(&self) -> Vec<u32> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name();
                let digits = name.to_str()?.strip_prefix("inst-")?;
                // Only the names `instance(n)` makes (`inst-05` or `inst-+5` is not instance 5).
                let n: u32 = digits.parse().ok()?;
                (n.to_string() == digits).then_some(n)
            })
            .collect()
    }
    /// The number a new instance of a sandbox whose current instance is `current` takes: one
    /// past every instance dir on disk, so that it never names a stale dir another thread may
    /// still be deleting (a retirement spawned by an adoption or by a failed restore).
    /// Saturates at `u32::MAX` (four billion restores).
    pub fn next_instance(&self, current: u32) -> u32 {
        self.instances()
            .into_iter()
            .fold(current, u32::max)
            .saturating_add(1)
    }
}

impl SandboxRecord {
    /// Writes `state.json` atomically (temp file, fsync, rename). A transient state is
    /// written as what it will be after a crash: `checkpointing` as `running` (adoption
    /// thaws a frozen cgroup), `restoring` as `failed`.
    pub fn save(&self, paths: &SandboxPaths) -> Result<(), RecordError> {
        let path = paths.state_file();
        let tmp = paths.dir.join(".state.json.tmp");
        let mut durable = self.clone();
        durable.state = match self.state {
            SandboxState::Checkpointing => SandboxState::Running,
            SandboxState::Restoring => SandboxState::Failed,
            s => s,
        };
        let json = serde_json::to_vec_pretty(&durable).unwrap_or_default();
        let err = |source| RecordError::Io {
            op: "write",
            path: path.clone(),
            source,
        };
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&json)?;
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(err(e));
        }
        fs::rename(&tmp, &path).map_err(err)
    }

    /// Reads `state.json`.
    pub fn load(paths: &SandboxPaths) -> Result<SandboxRecord, RecordError> {
        let path = paths.state_file();
        let bytes = fs::read(&path).map_err(|source| RecordError::Io {
            op: "read",
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| RecordError::Parse { path, source })
    }

    /// Cgroup limits from the spec (defaults were filled in at creation). The device
    /// allow-list is always on, enforced by `devices` (the daemon's `device_filter`).
    pub fn limits(&self, devices: DeviceFilter) -> Limits {
        Limits {
            memory_max: self.spec.memory_max,
            pids_max: self.spec.pids_max,
            cpu: self.spec.cpus.and_then(CpuMax::from_cpus),
            devices: Some(devices),
        }
    }

    /// Whether the init of the current instance is alive (same pid, same start time).
    pub fn init_alive(&self) -> bool {
        match (self.init_pid, self.init_start_time) {
            (Some(pid), Some(start)) => sys::process_matches(pid, start),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(workdir: Option<&str>) -> SandboxRecord {
        SandboxRecord {
            id: "sb-000000000001".into(),
            spec: SandboxSpec {
                image: "busybox".into(),
                workdir: workdir.map(str::to_owned),
                ..Default::default()
            },
            state: SandboxState::Running,
            instance: 2,
            init_pid: Some(42),
            init_start_time: Some(7),
            cgroup: "belayer/sb-000000000001".into(),
            created_unix_ms: 1,
            userns: None,
            owner_uid: 0,
            inherited_bytes: 0,
            pending_fork: None,
            image_digest: None,
        }
    }

    #[test]
    fn the_workdir_survives_a_save_and_old_records_load_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let paths = SandboxPaths::new(dir.path(), "sb-000000000001");
        fs::create_dir_all(&paths.dir).unwrap();
        let rec = record(Some("/srv/task"));
        rec.save(&paths).unwrap();
        assert_eq!(SandboxRecord::load(&paths).unwrap(), rec);

        // A record written before protocol 9 (and 3): no `workdir`, no `disk_max` in the spec.
        let mut old: serde_json::Value = serde_json::to_value(record(None)).unwrap();
        let spec = old["spec"].as_object_mut().unwrap();
        spec.remove("workdir");
        spec.remove("disk_max");
        fs::write(paths.state_file(), serde_json::to_vec(&old).unwrap()).unwrap();
        let loaded = SandboxRecord::load(&paths).unwrap();
        assert_eq!(loaded.spec.workdir, None);
        assert_eq!(loaded, record(None));
    }
}
