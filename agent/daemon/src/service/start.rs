//! Starting the agent: configuration, CRIU, cgroups, the state dir and its lock, the sealed
//! helper, disk quotas, the tracer, the dump stage, the blob store; then adoption and the
//! background threads.

use std::collections::HashMap;
use std::fs;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::contexts::{ContextLimits, ContextLogs};
use super::rollout_api::{EventBus, Policies};
use super::Agent;
use crate::cgroup::CgroupLayout;
use crate::config::Config;
use crate::images::ImageStore;
use crate::runtime::Runtime;
use crate::sys;

/// Errors starting the agent.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// No usable CRIU.
    #[error(transparent)]
    Criu(#[from] belayer_criu::LocateError),
    /// No usable cgroup hierarchy.
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    /// The state dir cannot be used.
    #[error("cannot use state dir {path}")]
    StateDir {
        /// Path.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Another agent holds the state dir.
    #[error("state dir {path} is in use by another belayerd")]
    Locked {
        /// The state dir.
        path: std::path::PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The image store cannot be opened.
    #[error(transparent)]
    Images(#[from] crate::images::ImageError),
    /// A syscall failed.
    #[error(transparent)]
    Sys(#[from] sys::SyscallError),
    /// Not even the fallback sandbox tracer could start.
    #[error("cannot start the sandbox tracer")]
    Tracer(#[source] belayer_ebpf::TracerError),
    /// The helper binary could not be sealed into a memfd.
    #[error(transparent)]
    Helper(#[from] crate::helper::image::HelperImageError),
    /// The sandbox seccomp filter could not be compiled or sealed.
    #[error(transparent)]
    Seccomp(#[from] crate::helper::seccomp::SeccompError),
    /// The upper-layer blob store could not be opened.
    #[error("cannot open the blob store")]
    Blobs(#[source] belayer_overlay::layer::BlobError),
    /// The state dir cannot enforce the configured default disk limit.
    #[error(
        "state dir {path} cannot enforce default_disk_max_bytes = {bytes}: run scripts/setup.sh \
         (it loop-mounts a btrfs image at /var/lib/belayer), put the state dir on btrfs, or set \
         default_disk_max_bytes = 0 (no disk limit)"
    )]
    DiskQuota {
        /// The state dir.
        path: std::path::PathBuf,
        /// The configured default limit.
        bytes: u64,
        /// Why quotas are unavailable (boxed: the error type stays small).
        #[source]
        source: Box<crate::quota::QuotaError>,
    },
}

impl Agent {
    /// Validates `config`, locates CRIU, probes cgroups, becomes a child subreaper and
    /// re-adopts the sandboxes of the state dir.
    pub fn start(config: Config) -> Result<Arc<Agent>, StartError> {
        config.validate()?;
        let criu = belayer_criu::Criu::locate(config.criu.as_deref())?;
        // CRIU re-probes kernel features on every run (20-60 ms here) unless its cache sits on
        // a tmpfs; keep one mounted for the node's lifetime (shared by every agent).
        match criu.kdat_cache(&config.criu_kdat_dir) {
            Ok(cache) => {
                tracing::info!(mode = ?cache.mode(), "CRIU kernel-feature cache ready");
                cache.leak();
            }
            Err(e) => {
                tracing::warn!(error = %e, "no CRIU kernel-feature cache: every dump re-probes")
            }
        }
        CgroupLayout::detect()?;
        // Sandboxes are refused while their device allow-list cannot be applied; the daemon
        // still starts, to adopt and serve the sandboxes it has.
        match config.device_filter.prepare() {
            Ok(filter) => tracing::info!(?filter, "sandbox device allow-list"),
            Err(err) => tracing::error!(
                error = %err,
                "no sandbox device allow-list on this node: sandbox creation will fail"
            ),
        }
        sys::set_child_subreaper()?;
        make_empty_dir().map_err(|source| StartError::StateDir {
            path: crate::helper::mount::EMPTY_DIR.into(),
            source,
        })?;
        fs::create_dir_all(config.state_dir.join("sandboxes")).map_err(|source| {
            StartError::StateDir {
                path: config.state_dir.clone(),
                source,
            }
        })?;
        // Sandbox content (setuid files in upper layers, memory images, LLM contexts) is
        // reachable through the state dir: only root may enter it.
        fs::set_permissions(
            &config.state_dir,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .map_err(|source| StartError::StateDir {
            path: config.state_dir.clone(),
            source,
        })?;
        // One agent per state dir: a second one would adopt (and clean up after) sandboxes the
        // first is working on.
        let lock = lock_state_dir(&config.state_dir)?;
        let quota =
            crate::quota::open_state_quota(&config.state_dir, config.default_disk_max_bytes)
                .map_err(|source| StartError::DiskQuota {
                    path: config.state_dir.clone(),
                    bytes: config.default_disk_max_bytes,
                    source: Box::new(source),
                })?;
        let images = ImageStore::open(&config.state_dir)?;
        let helper = crate::helper::image::HelperImage::beside_current_exe()?;
        let seccomp = crate::helper::seccomp::sealed::SealedFilter::compile()?;
        let contexts = ContextLogs::open(&config.state_dir, ContextLimits::from_config(&config));
        let tracer =
            crate::trace::SandboxTracer::start(config.no_bpf).map_err(StartError::Tracer)?;
        let stage = match config.dump_stage_bytes {
            0 => None,
            bytes => match crate::stage::DumpStage::mount(
                &config.dump_stage_dir,
                &config.state_dir,
                bytes,
            ) {
                Ok(stage) => Some(stage),
                Err(e) => {
                    tracing::warn!(error = %e, "no dump stage: CRIU writes images to the state dir while frozen");
                    None
                }
            },
        };
        let blobs = belayer_overlay::layer::BlobStore::open(&config.state_dir.join("blobs"))
            .map_err(StartError::Blobs)?
            .with_compression(config.blob_zstd_level);
        let pool = config.userns_pool();
        let agent = Arc::new(Agent {
            _lock: lock,
            events: EventBus::default(),
            policies: Policies::default(),
            contexts,
            failed_seen: Mutex::new(std::collections::HashSet::new()),
            creating: Default::default(),
            forking: Default::default(),
            metrics: crate::metrics::Metrics::new(
                env!("CARGO_PKG_VERSION"),
                belayer_ipc::PROTOCOL_VERSION,
                criu.version().to_string().as_str(),
            ),
            store_sizes: Default::default(),
            rt: Runtime {
                config,
                images,
                criu,
                helper,
                seccomp,
                userns: crate::userns::RangeAllocator::new(pool),
                tracer,
                blobs,
                stage,
                quota,
            },
            sandboxes: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&agent);
        agent.rt.tracer.set_handler(move |id, fault| {
            if let Some(agent) = weak.upgrade() {
                agent.on_fault(id, fault);
            }
        });
        agent.adopt();
        // Reading every checkpoint's layer manifest can take a while: serve meanwhile (the
        // store's lock keeps captures and the collection apart).
        let collector = Arc::downgrade(&agent);
        std::thread::spawn(move || {
            if let Some(agent) = collector.upgrade() {
                agent.collect_blobs();
            }
        });
        let weak = Arc::downgrade(&agent);
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                let Some(agent) = weak.upgrade() else { break };
                agent.reap();
                agent.watch_failures();
            })
            .map_err(|source| StartError::StateDir {
                path: "reaper thread".into(),
                source,
            })?;
        Ok(agent)
    }
}

/// Makes [`crate::helper::mount::EMPTY_DIR`] (empty, root-owned, 0555) and its parent
/// traversable (0755), which sandboxes bind over the `/proc` directories they must not see.
fn make_empty_dir() -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::path::Path::new(crate::helper::mount::EMPTY_DIR);
    fs::create_dir_all(dir)?;
    if let Some(parent) = dir.parent() {
        fs::set_permissions(parent, fs::Permissions::from_mode(0o755))?;
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o555))?;
    if fs::read_dir(dir)?.next().is_some() {
        return Err(std::io::Error::other("not empty"));
    }
    Ok(())
}

/// How long a start waits for the state dir's lock: a predecessor killed a moment ago may
/// still have forked children (not yet exec'd, or dying with it) holding its descriptor.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Takes an exclusive `flock` on `state_dir/belayerd.lock`, waiting up to [`LOCK_WAIT`].
fn lock_state_dir(state_dir: &std::path::Path) -> Result<fs::File, StartError> {
    let path = state_dir.join("belayerd.lock");
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|source| StartError::StateDir {
            path: path.clone(),
            source,
        })?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(e)
                if e == rustix::io::Errno::WOULDBLOCK && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => {
                return Err(StartError::Locked {
                    path: state_dir.to_path_buf(),
                    source: e.into(),
                })
            }
        }
    }
}
