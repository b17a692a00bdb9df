//! `create`: a new sandbox, and the shared steps that bring up an instance (also used by
//! restore): overlay mount, cgroup, init.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};

use belayer_ipc::{ErrorCode, SandboxSpec};
use belayer_overlay::OverlayMount;

use super::{RecordError, SandboxPaths, SandboxRecord, SandboxSlot, SandboxState};
use crate::cgroup::{CgroupError, SandboxCgroup};
use crate::helper::HELPER_ARG;
use crate::images::{valid_name, ImageError};
use crate::runtime::Runtime;
use crate::store::{CheckpointStore, StoreError};
use crate::sys;

/// Errors of sandbox creation (and of bringing up a fresh instance).
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// The spec is invalid.
    #[error("invalid sandbox spec: {0}")]
    InvalidSpec(String),
    /// The image does not exist.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// Making the sandbox directories failed.
    #[error("cannot create sandbox directory {path}")]
    Dirs {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Mounting the overlay root failed.
    #[error("cannot mount the sandbox root")]
    Mount(#[from] belayer_overlay::MountError),
    /// Creating the cgroup failed.
    #[error("cannot create the sandbox cgroup")]
    Cgroup(#[from] CgroupError),
    /// Starting the init helper failed.
    #[error("cannot start the sandbox init helper")]
    SpawnInit(#[source] std::io::Error),
    /// The init helper reported an error.
    #[error("sandbox init failed: {0}")]
    Init(String),
    /// Persisting state failed.
    #[error(transparent)]
    Record(#[from] RecordError),
    /// Opening the checkpoint store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl CreateError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            CreateError::InvalidSpec(_) => ErrorCode::BadRequest,
            CreateError::Image(ImageError::Unknown(_)) => ErrorCode::UnknownImage,
            CreateError::Image(ImageError::InvalidName(_)) => ErrorCode::BadRequest,
            _ => ErrorCode::Internal,
        }
    }
}

/// Checks an environment variable pair.
pub(crate) fn valid_env(key: &str, value: &str) -> bool {
    !key.is_empty()
        && !key.contains('=')
        && !key.contains('\0')
        && !value.contains('\0')
        && key.bytes().all(|b| b.is_ascii_graphic())
}

/// Creates and starts a sandbox from `spec`, owned by `owner_uid` (the peer that asked).
pub fn create(
    rt: &Runtime,
    mut spec: SandboxSpec,
    owner_uid: u32,
) -> Result<SandboxSlot, CreateError> {
    if spec.pids_max.is_none() && rt.config.default_pids_max > 0 {
        spec.pids_max = Some(rt.config.default_pids_max);
    }
    let lower = rt.images.rootfs(&spec.image)?;
    if let Some((k, _)) = spec.env.iter().find(|(k, v)| !valid_env(k, v)) {
        return Err(CreateError::InvalidSpec(format!(
            "bad environment variable {k:?}"
        )));
    }
    if let Some(tag) = spec.tag.as_deref().filter(|t| !valid_name(t)) {
        return Err(CreateError::InvalidSpec(format!("bad tag {tag:?}")));
    }
    if spec.pids_max == Some(0) || spec.memory_max.is_some_and(|m| m < (1 << 20)) {
        return Err(CreateError::InvalidSpec(
            "limits too small (pids ≥ 1, memory ≥ 1 MiB)".into(),
        ));
    }
    let id = format!("sb-{}", sys::random_hex(6));
    let paths = SandboxPaths::new(&rt.config.state_dir, &id);
    fs::create_dir_all(&paths.dir).map_err(|source| CreateError::Dirs {
        path: paths.dir.clone(),
        source,
    })?;
    let mut rec = SandboxRecord {
        cgroup: rt.cgroup_rel(&id),
        id,
        spec,
        state: SandboxState::Running,
        instance: 0,
        init_pid: None,
        init_start_time: None,
        created_unix_ms: sys::now_unix_ms(),
        owner_uid,
    };
    let result = (|| {
        CheckpointStore::open(&paths.checkpoints())?;
        let up = Instance::prepare(rt, &rec, &paths, 0, &lower)?;
        let (pid, start) = up.spawn_init(rt, &rec, &paths)?;
        rec.init_pid = Some(pid);
        rec.init_start_time = Some(start);
        rec.save(&paths)?;
        Ok(())
    })();
    match result {
        Ok(()) => {
            tracing::info!(sandbox = %rec.id, image = %rec.spec.image, pid = ?rec.init_pid, "sandbox created");
            rt.tracer.track(&rec);
            Ok(SandboxSlot::new(rec, paths))
        }
        Err(e) => {
            let _ = fs::remove_dir_all(&paths.dir);
            Err(e)
        }
    }
}

/// A freshly mounted overlay and cgroup for instance n, torn down on drop unless kept.
#[derive(Debug)]
pub(crate) struct Instance {
    mount: Option<OverlayMount>,
    cgroup: Option<SandboxCgroup>,
    n: u32,
}

impl Instance {
    /// Creates the instance dirs (keeping an already installed upper dir), mounts the overlay
    /// over `lower` and creates the cgroup with the record's limits.
    pub(crate) fn prepare(
        rt: &Runtime,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        n: u32,
        lower: &Path,
    ) -> Result<Instance, CreateError> {
        let _ = rt;
        for d in [paths.upper(n), paths.work(n), paths.merged(n)] {
            fs::create_dir_all(&d).map_err(|source| CreateError::Dirs {
                path: d.clone(),
                source,
            })?;
        }
        let mount = OverlayMount::mount(lower, &paths.upper(n), &paths.work(n), &paths.merged(n))?;
        let cgroup = SandboxCgroup::create(&rec.cgroup, &rec.limits())?;
        Ok(Instance {
            mount: Some(mount),
            cgroup: Some(cgroup),
            n,
        })
    }

    /// The cgroup.
    pub(crate) fn cgroup(&self) -> &SandboxCgroup {
        self.cgroup
            .as_ref()
            .expect("instance cgroup present until kept")
    }

    /// Starts the sandbox init through the `init` helper; on success the instance is kept.
    pub(crate) fn spawn_init(
        mut self,
        rt: &Runtime,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
    ) -> Result<(i32, u64), CreateError> {
        let mut cmd = Command::new(&rt.helper_exe);
        cmd.arg(HELPER_ARG)
            .arg("init")
            .arg("--root")
            .arg(paths.merged(self.n))
            .arg("--hostname")
            .arg(&rec.id);
        for f in self.cgroup().procs_files() {
            cmd.arg("--procs").arg(f);
        }
        for (k, v) in &rec.spec.env {
            cmd.arg("--env").arg(format!("{k}={v}"));
        }
        let out = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(CreateError::SpawnInit)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let pid: i32 = match (out.status.success(), stdout.trim().parse()) {
            (true, Ok(pid)) => pid,
            _ => {
                let stderr = String::from_utf8_lossy(&out.stderr);
                return Err(CreateError::Init(stderr.trim().to_string()));
            }
        };
        let start = sys::process_start_time(pid)
            .ok_or_else(|| CreateError::Init(format!("init {pid} exited right after start")))?;
        self.keep();
        Ok((pid, start))
    }

    /// Keeps the mount and cgroup alive beyond this guard.
    pub(crate) fn keep(&mut self) {
        if let Some(m) = self.mount.take() {
            m.leak();
        }
        self.cgroup.take();
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        if let Some(cg) = self.cgroup.take() {
            let _ = cg.kill_all(std::time::Duration::from_secs(5));
            if let Err(e) = cg.remove() {
                tracing::warn!(error = %e, "cannot remove cgroup of a failed instance");
            }
        }
        // The OverlayMount guard unmounts itself.
        self.mount.take();
    }
}
