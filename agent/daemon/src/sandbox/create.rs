//! `create`: a new sandbox, and the shared steps that bring up an instance (also used by
//! restore): user namespace, overlay mount (the image idmapped into the sandbox's id range,
//! `nodev,nosuid`), cgroup, init.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use belayer_ipc::{ErrorCode, SandboxSpec, UsernsMode};
use belayer_overlay::{MountOptions, OverlayMount};

use super::image_config::apply_image_config;
use super::instance::make_instance_dir;
use super::{RecordError, SandboxPaths, SandboxRecord, SandboxSlot, SandboxState};
use crate::cgroup::{CgroupError, CpuMax, SandboxCgroup};
use crate::helper::init::{SECCOMP_FD, USERNS_FD};
use crate::helper::HELPER_ARG;
use crate::images::{valid_tag as valid_name, ImageError};
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
    /// The user namespace could not be made (or no id range is free).
    #[error(transparent)]
    Userns(#[from] crate::userns::UsernsError),
    /// The disk limit is invalid, cannot be enforced here, or its volume could not be made.
    #[error(transparent)]
    Quota(#[from] crate::quota::QuotaError),
    /// Preparing the fresh upper layer (its owner, its `/dev`) failed.
    #[error("cannot prepare the fresh upper layer {path}")]
    Chown {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl CreateError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            CreateError::InvalidSpec(_) => ErrorCode::BadRequest,
            CreateError::Image(ImageError::Unknown(_)) => ErrorCode::UnknownImage,
            CreateError::Image(ImageError::InvalidName(_)) => ErrorCode::BadRequest,
            CreateError::Userns(crate::userns::UsernsError::PoolExhausted { .. }) => {
                ErrorCode::InvalidState
            }
            CreateError::Quota(
                crate::quota::QuotaError::InvalidLimit { .. }
                | crate::quota::QuotaError::Unavailable { .. },
            ) => ErrorCode::BadRequest,
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

/// The longest working directory a spec may name (`PATH_MAX`).
pub const WORKDIR_MAX: usize = 4096;

/// Checks a working directory from a client (a spec's `workdir`, an action's `cwd`): an
/// absolute path of at most [`WORKDIR_MAX`] bytes without NUL. It is resolved by `chdir`
/// inside the sandbox's mount namespace and root, so `..` and symlinks stay in the sandbox.
pub(crate) fn valid_dir(dir: &str) -> bool {
    dir.starts_with('/') && dir.len() <= WORKDIR_MAX && !dir.contains('\0')
}

/// Creates and starts a sandbox from `spec`, owned by `owner_uid` (the peer that asked).
/// Limits the spec leaves open get the daemon's defaults (`default_pids_max`,
/// `default_memory_max_bytes`, `default_cpus`, `default_disk_max_bytes`, `userns`).
pub fn create(
    rt: &Runtime,
    mut spec: SandboxSpec,
    owner_uid: u32,
) -> Result<SandboxSlot, CreateError> {
    if spec.pids_max.is_none() && rt.config.default_pids_max > 0 {
        spec.pids_max = Some(rt.config.default_pids_max);
    }
    if spec.memory_max.is_none() && rt.config.default_memory_max_bytes > 0 {
        spec.memory_max = Some(rt.config.default_memory_max_bytes);
    }
    if spec.cpus.is_none() && rt.config.default_cpus > 0.0 {
        spec.cpus = Some(rt.config.default_cpus);
    }
    if spec.userns.is_none() {
        spec.userns = Some(if rt.config.userns == "host" {
            UsernsMode::Host
        } else {
            UsernsMode::Private
        });
    }
    // The limit the sandbox keeps for life (restores make their volumes with it).
    spec.disk_max = crate::quota::resolve_limit(spec.disk_max, rt.config.default_disk_max_bytes)?;
    if spec.cpus.is_some_and(|c| CpuMax::from_cpus(c).is_none()) {
        return Err(CreateError::InvalidSpec(
            "cpus must be between 0.01 and 65536".into(),
        ));
    }
    let (lowers, image) = rt.images.lowers(&spec.image)?;
    apply_image_config(&mut spec, &image)?;
    if let Some((k, _)) = spec.env.iter().find(|(k, v)| !valid_env(k, v)) {
        return Err(CreateError::InvalidSpec(format!(
            "bad environment variable {k:?}"
        )));
    }
    if let Some(dir) = spec.workdir.as_deref().filter(|d| !valid_dir(d)) {
        return Err(CreateError::InvalidSpec(format!(
            "workdir {:?} must be an absolute path of at most {WORKDIR_MAX} bytes without NUL",
            dir.chars().take(64).collect::<String>()
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
    let userns = match spec.userns {
        Some(UsernsMode::Host) => None,
        _ => Some(rt.userns.reserve()?),
    };
    let mut rec = SandboxRecord {
        cgroup: rt.cgroup_rel(&id),
        id,
        spec,
        state: SandboxState::Running,
        instance: 0,
        init_pid: None,
        init_start_time: None,
        created_unix_ms: sys::now_unix_ms(),
        userns,
        owner_uid,
        inherited_bytes: 0,
        image_digest: image.digest.clone(),
        pending_fork: None,
    };
    let result = (|| {
        CheckpointStore::create(&paths.checkpoints())?;
        make_instance_dir(rt, &paths, 0, rec.spec.disk_max)?;
        let up = Instance::prepare(rt, &rec, &paths, 0, &lowers)?;
        let (pid, start) = up.spawn_init(rt, &rec, &paths)?;
        wait_init_settled(pid, INIT_SETTLE_MAX);
        rec.init_pid = Some(pid);
        rec.init_start_time = Some(start);
        rec.save(&paths)?;
        Ok(())
    })();
    match result {
        Ok(()) => {
            tracing::info!(sandbox = %rec.id, image = %rec.spec.image, pid = ?rec.init_pid, "sandbox created");
            rt.tracer.track(&rec);
            let slot = SandboxSlot::new(rec, paths);
            slot.changes.mark_clean();
            Ok(slot)
        }
        Err(e) => {
            // An init that started is killed with its cgroup before anything of it is given
            // back; one that cannot be killed keeps its dir and its id range (never shared).
            if rec.init_pid.is_some() && !discard_started(&rec, &paths) {
                return Err(e);
            }
            super::remove::delete_sandbox_dir(&paths.dir);
            if let Some(range) = rec.userns {
                rt.userns.release(range);
            }
            Err(e)
        }
    }
}

/// Kills the init of a creation that failed after it started (its record could not be
/// saved), removes the cgroup, reaps it and unmounts the root. Returns whether the tree is
/// gone.
/// Longest a create waits for the new init to settle ([`wait_init_settled`]).
const INIT_SETTLE_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits until the init has started its idle `sleep` and sleeps itself waiting for it, or
/// `max` passes. The dirtiness verdict of an action counts the init running during the action
/// ([`crate::trace`]); an init still starting its script (on a loaded host this can outlast
/// the create) would make the first action look dirty. Past `max` the create goes on: the
/// verdict then errs towards dirty, never towards clean.
fn wait_init_settled(pid: i32, max: std::time::Duration) {
    let deadline = std::time::Instant::now() + max;
    let settled = || {
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        let sleeping = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('S'))
            })
            .unwrap_or(false);
        !children.trim().is_empty() && sleeping
    };
    while !settled() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn discard_started(rec: &SandboxRecord, paths: &SandboxPaths) -> bool {
    if let Ok(cg) = SandboxCgroup::open(&rec.cgroup) {
        if let Err(e) = cg
            .kill_all(std::time::Duration::from_secs(10))
            .and_then(|()| cg.remove())
        {
            tracing::error!(sandbox = %rec.id, error = %e,
                            "cannot kill the init of a failed creation; its dir and id range stay reserved");
            return false;
        }
    }
    if let Some(pid) = rec.init_pid {
        sys::try_reap(pid);
    }
    if let Err(e) = belayer_overlay::unmount(&paths.merged(0)) {
        tracing::warn!(sandbox = %rec.id, error = %e, "cannot unmount the root of a failed creation");
    }
    true
}

/// A freshly mounted overlay and cgroup for instance n, torn down on drop unless kept.
#[derive(Debug)]
pub(crate) struct Instance {
    mount: Option<OverlayMount>,
    cgroup: Option<SandboxCgroup>,
    /// A user namespace with the sandbox's map: the idmap of the lower layer, and the
    /// namespace the init enters (a restore lets CRIU make its own from the images).
    userns: Option<std::sync::Arc<crate::userns::UserNamespace>>,
    n: u32,
}

impl Instance {
    /// Creates the instance dirs (keeping an already installed upper dir, else handing a
    /// new one to the sandbox's root), mounts the overlay over `lower` (idmapped into the
    /// sandbox's range, `nodev,nosuid`) and creates the cgroup with the record's limits.
    pub(crate) fn prepare(
        rt: &Runtime,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        n: u32,
        lowers: &[PathBuf],
    ) -> Result<Instance, CreateError> {
        let mut instance = Self::mount_only(rt, rec, paths, n, lowers)?;
        instance.create_cgroup(rt, rec)?;
        Ok(instance)
    }

    /// Like [`Self::prepare`] without the cgroup, which a restore creates with
    /// [`Self::create_cgroup`] only once the old instance's cgroup is gone: the new root can
    /// be mounted and checked while the old instance still stands.
    pub(crate) fn mount_only(
        rt: &Runtime,
        rec: &SandboxRecord,
        paths: &SandboxPaths,
        n: u32,
        lowers: &[PathBuf],
    ) -> Result<Instance, CreateError> {
        let upper = paths.upper(n);
        // Fresh: missing or empty (a restore without checkpoint makes an empty one); an
        // installed layer brings its own root owner and `/dev`.
        let fresh_upper = fs::read_dir(&upper).map_or(true, |mut d| d.next().is_none());
        for d in [&upper, &paths.work(n), &paths.merged(n)] {
            fs::create_dir_all(d).map_err(|source| CreateError::Dirs {
                path: d.to_path_buf(),
                source,
            })?;
        }
        let userns = rec
            .userns
            .map(|range| rt.userns.namespace(range))
            .transpose()?;
        if fresh_upper {
            // The root of the merged tree is the upper dir: it must belong to the sandbox's
            // root as the image's root does (host root, seen through the idmap).
            let owner = rec.userns.map_or(0, |r| r.host_base);
            std::os::unix::fs::chown(&upper, Some(owner), Some(owner))
                .and_then(|()| crate::helper::mount::dev_skeleton(&upper, owner))
                .map_err(|source| CreateError::Chown {
                    path: upper.clone(),
                    source,
                })?;
        }
        let opts = MountOptions {
            idmap: userns.as_deref().map(std::os::fd::AsFd::as_fd),
            nodev: true,
            nosuid: true,
            // Decodable file handles: CRIU resolves inotify watches through them.
            nfs_export: true,
        };
        let lowers: Vec<&Path> = lowers.iter().map(PathBuf::as_path).collect();
        let mount =
            OverlayMount::mount_with(&lowers, &upper, &paths.work(n), &paths.merged(n), &opts)?;
        Ok(Instance {
            mount: Some(mount),
            cgroup: None,
            userns,
            n,
        })
    }

    /// Creates the instance's cgroup with the record's limits and the daemon's device
    /// allow-list (`device_filter`). Shared by creation and restore: a restored instance gets a
    /// fresh cgroup with the same allow-list. An allow-list that cannot be applied fails
    /// ([`CgroupError::DeviceFilterUnavailable`], [`CgroupError::DeviceProgram`]): no sandbox
    /// runs without it.
    pub(crate) fn create_cgroup(
        &mut self,
        rt: &Runtime,
        rec: &SandboxRecord,
    ) -> Result<(), CreateError> {
        let limits = rec.limits(rt.config.device_filter);
        self.cgroup = Some(SandboxCgroup::create(&rec.cgroup, &limits)?);
        Ok(())
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
        let mut cmd = Command::new(rt.helper.exec_path());
        cmd.arg(HELPER_ARG)
            .arg("init")
            .arg("--root")
            .arg(paths.merged(self.n))
            .arg("--hostname")
            .arg(&rec.id)
            .arg("--userns")
            .arg(if self.userns.is_some() {
                "private"
            } else {
                "host"
            });
        cmd.arg("--seccomp-fd").arg(SECCOMP_FD.to_string());
        let userns_fd = self
            .userns
            .as_ref()
            .map(|ns| std::os::fd::AsFd::as_fd(ns.as_ref()).as_raw_fd());
        let seccomp_fd = rt.seccomp.as_fd().as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only calls fcntl and
        // dup2 (async-signal-safe); both fds stay open in the parent until spawn returns.
        // Each is first copied above both targets, so no move overwrites a later source and
        // none is a no-op that would keep close-on-exec.
        unsafe {
            cmd.pre_exec(move || {
                let moves = [(userns_fd, USERNS_FD), (Some(seccomp_fd), SECCOMP_FD)];
                let mut staged = [(-1, 0); 2];
                for (slot, (src, target)) in staged.iter_mut().zip(moves) {
                    if let Some(src) = src {
                        let copy = libc::fcntl(src, libc::F_DUPFD_CLOEXEC, 64);
                        if copy < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        *slot = (copy, target);
                    }
                }
                for (copy, target) in staged {
                    if copy >= 0 && libc::dup2(copy, target) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
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
        self.userns.take();
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
