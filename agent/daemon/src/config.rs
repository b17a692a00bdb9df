//! Daemon configuration: a TOML file (`/etc/belayer/belayer.toml` by default) whose every field
//! can be overridden by flags; unknown keys are rejected.

use std::path::{Path, PathBuf};
use std::time::Duration;

use belayer_ipc::{ConnectionLimits, LimitsError};
use serde::Deserialize;

/// Default socket path.
pub const DEFAULT_SOCKET: &str = "/run/belayer/belayer.sock";
/// Default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/belayer";
/// Default configuration file.
pub const DEFAULT_CONFIG: &str = "/etc/belayer/belayer.toml";

/// Default [`Config::criu_kdat_dir`].
pub const DEFAULT_KDAT_DIR: &str = "/run/belayer/criu-kdat";

/// Default [`Config::dump_stage_dir`].
pub const DEFAULT_DUMP_STAGE_DIR: &str = "/run/belayer/dump-stage";
/// Default of [`Config::default_disk_max_bytes`]: 10 GiB.
pub const DEFAULT_DISK_MAX_BYTES: u64 = 10 << 30;
/// Default of [`Config::context_budget_bytes`], the context-log budget of a non-root uid: 1 GiB.
pub const DEFAULT_UID_BUDGET_BYTES: u64 = 1 << 30;

/// A fresh, unique path for the private state dir of an in-process agent (the embedded agent
/// of `belayer-bench`, the load and tracer benchmarks): `kind-<pid>-<hex>` under
/// `/var/lib/belayer/scratch`, on the state file system `scripts/setup.sh` mounts, so that
/// their sandboxes get disk quotas as the daemon's do. Not created here.
pub fn scratch_state_dir(kind: &str) -> PathBuf {
    Path::new(DEFAULT_STATE_DIR).join("scratch").join(format!(
        "{kind}-{}-{}",
        std::process::id(),
        crate::sys::random_hex(4)
    ))
}

/// Configuration of `belayerd`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Unix socket the daemon listens on.
    pub socket: PathBuf,
    /// Root of the daemon's state: images, sandboxes, checkpoints.
    pub state_dir: PathBuf,
    /// Path of the `criu` binary (default: located, see `belayer-criu`).
    pub criu: Option<PathBuf>,
    /// Group (gid) whose members may use the socket besides root.
    pub socket_gid: Option<u32>,
    /// Largest accepted protocol frame, bytes.
    pub max_frame_bytes: u32,
    /// Bytes of stdout and of stderr kept per action unless the request says otherwise.
    pub output_limit_bytes: u64,
    /// Default action timeout, seconds (0 = none).
    pub exec_timeout_s: u64,
    /// Registries (`HOST[:PORT]`) talked to over plain HTTP by `image pull`, besides the
    /// loopback ones (`localhost`, `127.0.0.1`, `[::1]`), which always are.
    pub insecure_registries: Vec<String>,
    /// How often `image pull` retries a registry request or a layer stream that failed
    /// (connection refused, timeout, 5xx), with exponential backoff.
    pub registry_retries: u32,
    /// Timeout of one registry request (connect and each read), seconds.
    pub registry_timeout_s: u64,
    /// Address (`IP:PORT`) of the Prometheus metrics endpoint (`GET /metrics`); `None`
    /// (the default): no endpoint.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Allow [`Self::metrics_listen`] on an address other than loopback (the metrics count
    /// sandboxes, images and failures; by default only this node may read them).
    pub metrics_allow_remote: bool,
    /// Longest wait for a cgroup to freeze, milliseconds.
    pub freeze_timeout_ms: u64,
    /// Wall-clock limit on every CRIU dump and restore, milliseconds: this base plus
    /// [`Self::criu_time_limit_per_gib_ms`] per GiB of memory the run moves (the sandbox's
    /// charged memory for a dump, the images for a restore). A run past it is killed with the
    /// tree it held: a dump fails with `DumpFailed` (the sandbox thawed), a restore with
    /// `RestoreTimedOut` (the ready checkpoint untouched, the sandbox `failed` and restorable).
    /// Default 60 000 (one minute), far above a healthy run (≈1 s per GiB).
    pub criu_time_limit_base_ms: u64,
    /// Milliseconds added to [`Self::criu_time_limit_base_ms`] per GiB moved. Default 4000.
    pub criu_time_limit_per_gib_ms: u64,
    /// Parent of the sandbox cgroups, relative to each cgroup hierarchy.
    pub cgroup_parent: String,
    /// Honour test-fault hooks in checkpoint requests (tests only).
    pub test_hooks: bool,
    /// `pids.max` of sandboxes whose spec sets none (a fork bomb must not exhaust the host's
    /// pids); 0 = unlimited.
    pub default_pids_max: u64,
    /// Disk limit, bytes, of sandboxes whose spec sets none (`disk_max`): what a sandbox
    /// instance's upper layer may allocate, enforced by the kernel (a btrfs qgroup, see
    /// [`crate::quota`]). Non-zero needs the state dir on btrfs: `belayerd` refuses to start
    /// otherwise ([`crate::service::StartError::DiskQuota`]). 0 = no default limit, logged as a
    /// warning at start. Default 10 GiB.
    pub default_disk_max_bytes: u64,
    /// Do not load the BPF sandbox tracer; use the pidfd/cgroup fallback (`--no-bpf`).
    pub no_bpf: bool,
    /// What enforces the sandboxes' device allow-list: `"auto"` (default: the v1 `devices`
    /// controller where the node mounts it, else a BPF program on the v2 cgroup), `"v1"` or
    /// `"bpf"`. A sandbox whose allow-list cannot be applied is not created.
    pub device_filter: crate::cgroup::DeviceFilter,
    /// zstd level for new upper-layer blobs (1 to 22, or negative for zstd's fast levels;
    /// others are refused at start); unset: stored uncompressed (restores copy them with
    /// `copy_file_range`). Compression runs after the sandbox is thawed.
    pub blob_zstd_level: Option<i32>,
    /// Directory of CRIU's kernel-feature cache (a small tmpfs `belayerd` mounts there, shared
    /// by every daemon of the node), default `/run/belayer/criu-kdat`.
    pub criu_kdat_dir: PathBuf,
    /// Mount point of the dump stage tmpfs (see `dump_stage_bytes`), default
    /// `/run/belayer/dump-stage`.
    pub dump_stage_dir: PathBuf,
    /// Bytes of the tmpfs (at `dump_stage_dir`) where CRIU writes a checkpoint's
    /// images while the sandbox is frozen, shared by concurrent checkpoints; 0: dump straight
    /// to the state dir. Memory is used only while dumps sit there.
    pub dump_stage_bytes: u64,
    /// Largest deleted-but-open file (allocated bytes; a sparse file counts its data only)
    /// a checkpoint copies into its CRIU images (`criu dump --ghost-limit`); a larger one
    /// fails the checkpoint (`CheckpointFailed`, naming the file) and the previous one stays
    /// ready. Ghost bytes are reserved in the dump stage with the sandbox's memory, so with
    /// a stage this must not exceed `dump_stage_bytes`. Default 256 MiB.
    pub criu_ghost_limit_bytes: u64,
    /// Take a read-only btrfs snapshot of the instance volume with every checkpoint (in the
    /// frozen window, after the capture), which a restore on this node installs instead of
    /// materializing F_k: files the sandbox wrote keep their inode numbers and times
    /// (`RestoreInfo::inodes_kept`). Needs quotas on the state dir (instances are volumes
    /// then). `false`: restores materialize F_k into new inodes. Default `true`.
    pub upper_snapshots: bool,
    /// `memory.max` of sandboxes whose spec sets none, bytes; 0 = unlimited. Output an
    /// action leaves to background writers is charged to the sandbox too.
    pub default_memory_max_bytes: u64,
    /// CPU bandwidth (in CPUs) of sandboxes whose spec sets none; 0 = unlimited.
    pub default_cpus: f64,
    /// Sandboxes one non-root socket peer may hold at once (root is not limited).
    pub max_sandboxes_per_uid: usize,
    /// User namespace of sandboxes whose spec sets none: `"private"` (each sandbox in its own
    /// user namespace, root inside an unprivileged host uid) or `"host"` (explicit opt-in to
    /// run sandbox root as host root).
    pub userns: String,
    /// First host uid/gid of the pool sandbox user namespaces map their ids to.
    pub userns_host_base: u32,
    /// Ids per sandbox (≥ 65536).
    pub userns_size: u32,
    /// Number of sandbox ranges in the pool (the most sandboxes with a private user
    /// namespace at once).
    pub userns_count: u32,
    /// Socket connections served at once, all peers together (each holds a thread). When
    /// full, an idle connection is closed to make room, else the newcomer gets `Busy`.
    pub max_connections: usize,
    /// Socket connections one non-root peer uid may hold at once (root has no per-uid cap).
    pub max_connections_per_uid: usize,
    /// Of `max_connections`, how many only root may take.
    pub root_reserved_connections: usize,
    /// Event streams (`Subscribe`) served at once, all peers together (each is also one of
    /// the connections).
    pub max_subscriptions: usize,
    /// Event streams one non-root peer uid may hold at once.
    pub max_subscriptions_per_uid: usize,
    /// Of `max_subscriptions`, how many only root may take.
    pub root_reserved_subscriptions: usize,
    /// Time for a request frame from its first byte to its last, milliseconds.
    pub frame_timeout_ms: u64,
    /// A connection with no request for this long is closed, seconds (event streams and
    /// requests being handled are exempt).
    pub idle_timeout_s: u64,
    /// Time for a client to take one response or event frame, milliseconds; a subscriber
    /// that stops reading is dropped after it.
    pub send_timeout_ms: u64,
    /// Bytes of LLM-context data (`ContextAppend`) one non-root uid may keep on the state disk;
    /// 0 = unlimited. Each record counts its bytes plus 4 KiB and each trajectory 16 KiB (its
    /// file's metadata and the daemon's index of it), so the budget also bounds the daemon's
    /// memory for that uid's logs (see `daemon::contexts`). An append past it is refused with
    /// `InvalidState`. Default 1 GiB.
    pub context_budget_bytes: u64,
    /// The same budget for root's trajectories; 0 (default) = unlimited.
    pub context_root_budget_bytes: u64,
    /// Largest context one `ContextAppend` may carry, bytes (bigger ones: `BadRequest`); at
    /// most, and by default, [`belayer_context::MAX_CONTEXT_BYTES`] (64 MiB less 1 KiB). A
    /// request is also bounded by `max_frame_bytes`.
    pub context_max_bytes: u64,
    /// Memory servers `belayerd` starts and restarts (`[[memory_server]]` tables).
    #[serde(rename = "memory_server")]
    pub memory_servers: Vec<belayer_workers::memory::supervise::SupervisedServer>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            socket: PathBuf::from(DEFAULT_SOCKET),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            criu: None,
            socket_gid: None,
            max_frame_bytes: 16 << 20,
            output_limit_bytes: 1 << 20,
            exec_timeout_s: 0,
            insecure_registries: Vec::new(),
            registry_retries: 3,
            registry_timeout_s: 30,
            metrics_listen: None,
            metrics_allow_remote: false,
            freeze_timeout_ms: 10_000,
            criu_time_limit_base_ms: 60_000,
            criu_time_limit_per_gib_ms: 4_000,
            cgroup_parent: "belayer".to_string(),
            test_hooks: false,
            default_pids_max: 4096,
            default_disk_max_bytes: DEFAULT_DISK_MAX_BYTES,
            no_bpf: false,
            device_filter: crate::cgroup::DeviceFilter::Auto,
            blob_zstd_level: None,
            criu_kdat_dir: PathBuf::from(DEFAULT_KDAT_DIR),
            dump_stage_dir: PathBuf::from(DEFAULT_DUMP_STAGE_DIR),
            dump_stage_bytes: 8 << 30,
            criu_ghost_limit_bytes: belayer_criu::DEFAULT_GHOST_LIMIT_BYTES,
            upper_snapshots: true,
            default_memory_max_bytes: 8 << 30,
            default_cpus: 4.0,
            max_sandboxes_per_uid: 256,
            userns: "private".to_string(),
            userns_host_base: 1 << 30,
            userns_size: 65536,
            userns_count: 4096,
            max_connections: 256,
            max_connections_per_uid: 32,
            root_reserved_connections: 32,
            max_subscriptions: 64,
            max_subscriptions_per_uid: 8,
            root_reserved_subscriptions: 8,
            frame_timeout_ms: 10_000,
            idle_timeout_s: 3600,
            send_timeout_ms: 10_000,
            context_budget_bytes: DEFAULT_UID_BUDGET_BYTES,
            context_root_budget_bytes: 0,
            context_max_bytes: belayer_context::MAX_CONTEXT_BYTES,
            memory_servers: Vec::new(),
        }
    }
}

/// Configuration errors.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config {path}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML for [`Config`].
    #[error("invalid config {path}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("invalid config value {field}: {reason}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// The socket connection limits are unusable.
    #[error("invalid config: socket connection limits")]
    Limits {
        /// Which value and why.
        #[source]
        source: LimitsError,
    },
}

impl Config {
    /// The pool of host id ranges for sandbox user namespaces.
    pub fn userns_pool(&self) -> crate::userns::IdPool {
        crate::userns::IdPool {
            host_base: self.userns_host_base,
            size: self.userns_size,
            count: self.userns_count,
        }
    }

    /// Loads `path`; a missing file at the default location yields the defaults.
    pub fn load(path: &Path, required: bool) -> Result<Config, ConfigError> {
        match std::fs::read_to_string(path) {
            Ok(text) => toml::from_str(&text).map_err(|source| ConfigError::Parse {
                path: path.to_path_buf(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => {
                Ok(Config::default())
            }
            Err(source) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// The wall-clock limit on one CRIU run that moves `bytes` of memory:
    /// `criu_time_limit_base_ms` plus `criu_time_limit_per_gib_ms` per whole GiB.
    pub fn criu_time_limit(&self, bytes: u64) -> Duration {
        let per_gib = (bytes >> 30).saturating_mul(self.criu_time_limit_per_gib_ms);
        Duration::from_millis(self.criu_time_limit_base_ms.saturating_add(per_gib))
    }

    /// The socket server's connection quotas and timeouts from the `max_connections*`,
    /// `*_subscriptions*` and `*_timeout_*` keys.
    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits::default()
            .connections(
                self.max_connections,
                self.max_connections_per_uid,
                self.root_reserved_connections,
            )
            .subscriptions(
                self.max_subscriptions,
                self.max_subscriptions_per_uid,
                self.root_reserved_subscriptions,
            )
            .frame_timeout(Duration::from_millis(self.frame_timeout_ms))
            .idle_timeout(Duration::from_secs(self.idle_timeout_s))
            .send_timeout(Duration::from_millis(self.send_timeout_ms))
    }

    /// Checks value ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.state_dir.is_absolute() {
            return Err(ConfigError::Invalid {
                field: "state_dir",
                reason: "must be absolute",
            });
        }
        if !self.socket.is_absolute() {
            return Err(ConfigError::Invalid {
                field: "socket",
                reason: "must be absolute",
            });
        }
        if self.max_frame_bytes < 4096 {
            return Err(ConfigError::Invalid {
                field: "max_frame_bytes",
                reason: "below 4096",
            });
        }
        if self.cgroup_parent.is_empty()
            || self
                .cgroup_parent
                .split('/')
                .any(|c| c.is_empty() || c == "." || c == "..")
        {
            return Err(ConfigError::Invalid {
                field: "cgroup_parent",
                reason: "not a relative path",
            });
        }
        if self.dump_stage_bytes > 0 && self.criu_ghost_limit_bytes > self.dump_stage_bytes {
            return Err(ConfigError::Invalid {
                field: "criu_ghost_limit_bytes",
                reason: "above dump_stage_bytes",
            });
        }
        if let Some(level) = self.blob_zstd_level {
            if !zstd::compression_level_range().contains(&level) || level == 0 {
                return Err(ConfigError::Invalid {
                    field: "blob_zstd_level",
                    reason: "not a zstd level (1 to 22, or negative for the fast levels)",
                });
            }
        }
        // Both get a tmpfs mounted on them (and the stage's empty dirs are removed): each must
        // be its own dir, apart from the other and from the state dir.
        let apart = |a: &Path, b: &Path| !a.starts_with(b) && !b.starts_with(a);
        for (field, dir) in [
            ("criu_kdat_dir", &self.criu_kdat_dir),
            ("dump_stage_dir", &self.dump_stage_dir),
        ] {
            if !dir.is_absolute() || dir.parent().is_none() {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must be an absolute path below /",
                });
            }
            if !apart(dir, &self.state_dir) {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must be apart from state_dir (neither inside the other)",
                });
            }
        }
        if !apart(&self.criu_kdat_dir, &self.dump_stage_dir) {
            return Err(ConfigError::Invalid {
                field: "dump_stage_dir",
                reason: "must be apart from criu_kdat_dir",
            });
        }
        if !matches!(self.userns.as_str(), "private" | "host") {
            return Err(ConfigError::Invalid {
                field: "userns",
                reason: "must be \"private\" or \"host\"",
            });
        }
        let pool_end = u64::from(self.userns_host_base)
            + u64::from(self.userns_size) * u64::from(self.userns_count);
        if self.userns_size < 65536
            || self.userns_count == 0
            || self.userns_host_base < 65536
            || pool_end > u64::from(u32::MAX)
        {
            return Err(ConfigError::Invalid {
                field: "userns_host_base",
                reason:
                    "the pool needs ranges of ≥ 65536 ids above host id 65535 and below 2^32 - 1",
            });
        }
        if !self.default_cpus.is_finite()
            || self.default_cpus < 0.0
            || (self.default_cpus > 0.0
                && crate::cgroup::CpuMax::from_cpus(self.default_cpus).is_none())
        {
            return Err(ConfigError::Invalid {
                field: "default_cpus",
                reason: "must be 0 (unlimited) or between 0.01 and 65536",
            });
        }
        if self.default_memory_max_bytes != 0 && self.default_memory_max_bytes < (1 << 20) {
            return Err(ConfigError::Invalid {
                field: "default_memory_max_bytes",
                reason: "must be 0 (unlimited) or at least 1 MiB",
            });
        }
        if self.default_disk_max_bytes != 0
            && self.default_disk_max_bytes < crate::quota::MIN_DISK_LIMIT
        {
            return Err(ConfigError::Invalid {
                field: "default_disk_max_bytes",
                reason: "below 1 MiB (0 = no limit)",
            });
        }
        if self.context_max_bytes == 0
            || self.context_max_bytes > belayer_context::MAX_CONTEXT_BYTES
        {
            return Err(ConfigError::Invalid {
                field: "context_max_bytes",
                reason: "must be between 1 and 64 MiB less 1 KiB (what one log record holds)",
            });
        }
        if let Some(addr) = self.metrics_listen {
            if !addr.ip().is_loopback() && !self.metrics_allow_remote {
                return Err(ConfigError::Invalid {
                    field: "metrics_listen",
                    reason: "not a loopback address: set metrics_allow_remote = true to serve \
                             metrics beyond this node",
                });
            }
        }
        if self.freeze_timeout_ms == 0 {
            return Err(ConfigError::Invalid {
                field: "freeze_timeout_ms",
                reason: "must be > 0",
            });
        }
        if self.criu_time_limit_base_ms == 0 {
            return Err(ConfigError::Invalid {
                field: "criu_time_limit_base_ms",
                reason: "must be > 0",
            });
        }
        self.connection_limits()
            .validate()
            .map_err(|source| ConfigError::Limits { source })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
