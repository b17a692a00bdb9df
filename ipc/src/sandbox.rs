//! Sandboxes in the protocol: the parameters of a new one ([`SandboxSpec`], carried by
//! `Request::CreateSandbox` and kept in the daemon's record of the sandbox) and what clients see
//! of one ([`SandboxInfo`], answered by `InspectSandbox` and `ListSandboxes`). Part of the
//! messages of [`crate::message`], which re-exports them; encoded like them.

use serde::{Deserialize, Serialize};

/// Parameters of a new sandbox.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Image name (the lower layer).
    pub image: String,
    /// `memory.max` in bytes; `None` = unlimited.
    pub memory_max: Option<u64>,
    /// `pids.max`; `None` = unlimited.
    pub pids_max: Option<u64>,
    /// Environment of every action, `(key, value)`.
    pub env: Vec<(String, String)>,
    /// Rollout tag, used by `gc --tag` to drop a rollout's checkpoints.
    pub tag: Option<String>,
    /// CPU bandwidth limit in CPUs (e.g. `1.5`); `None` = the daemon's default.
    pub cpus: Option<f64>,
    /// User namespace of the sandbox; `None` = the daemon's default (private).
    pub userns: Option<UsernsMode>,
    /// Disk limit in bytes: what the sandbox's upper layer may allocate, enforced by the kernel
    /// (writes past it fail with `EDQUOT` inside the sandbox); `None` = the daemon's
    /// `default_disk_max_bytes`. A sandbox cannot ask for no limit where the daemon sets one;
    /// values below 1 MiB are refused. Absent from state files written before protocol 3.
    #[serde(default)]
    pub disk_max: Option<u64>,
    /// Working directory of every action inside the sandbox: an absolute path of at most
    /// 4096 bytes without NUL (else `BadRequest`), resolved inside the sandbox's root like an
    /// action's `cwd`, which overrides it.
    /// `None`: `/`. Not created: when it does not exist (or is no directory) in the sandbox,
    /// every action without its own `cwd` fails with `ExecFailed` naming the
    /// `chdir`, as a bad `cwd` does. Kept across restores. Since protocol 9; absent from
    /// state files written before.
    #[serde(default)]
    pub workdir: Option<String>,
    /// User every action runs as inside the sandbox: `uid` or `uid:gid` (numbers, resolved by
    /// nobody: the ids are used as given). `None`: the image's configured user
    /// ([`crate::ImageConfig::user_ids`]), else root. Since protocol 10; absent from state files
    /// written before.
    #[serde(default)]
    pub user: Option<String>,
}

/// Which user namespace a sandbox runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UsernsMode {
    /// Its own user namespace: root inside is an unprivileged host uid of a range of its
    /// own (the default).
    Private,
    /// The host's user namespace: root inside is host root, confined only by capabilities,
    /// seccomp and the mount namespace. An explicit opt-in (`--userns=host`).
    Host,
}

impl UsernsMode {
    /// `"private"` or `"host"`.
    pub fn as_str(self) -> &'static str {
        match self {
            UsernsMode::Private => "private",
            UsernsMode::Host => "host",
        }
    }
}

/// The user namespace of a sandbox as clients see it (`sandbox inspect --json`: `"userns"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsernsInfo {
    /// `private` or `host`.
    pub mode: String,
    /// `(inside, outside, count)` lines of the init's `uid_map`.
    pub uid_map: Vec<[u32; 3]>,
    /// `(inside, outside, count)` lines of the init's `gid_map`.
    pub gid_map: Vec<[u32; 3]>,
}

/// A sandbox as seen by clients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// Stable sandbox id (kept across restores).
    pub id: String,
    /// Image name.
    pub image: String,
    /// Lifecycle state (its name on the wire: `running`, `checkpointing`, `restoring`,
    /// `failed`).
    pub state: crate::SandboxState,
    /// Host pid of the sandbox init, when alive.
    pub init_pid: Option<i32>,
    /// Host pids of every process in the sandbox cgroup.
    pub pids: Vec<i32>,
    /// The sandbox cgroup (path below the cgroup mount, e.g. `/belayer/sb-…`).
    pub cgroup: String,
    /// Prefix k of the ready checkpoint, if any.
    pub ready_prefix: Option<u64>,
    /// Instance number: 0 for the original, +1 on every restore.
    pub instance: u32,
    /// Rollout tag.
    pub tag: Option<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The user namespace (id maps of the init when it runs, else the recorded range).
    pub userns: Option<UsernsInfo>,
    /// The limits in force (the spec's, with the daemon's defaults filled in at creation).
    /// Since protocol 9.
    pub limits: SandboxLimits,
    /// Environment of every action, `(key, value)`, as created. Since protocol 9.
    pub env: Vec<(String, String)>,
    /// Default working directory of actions ([`SandboxSpec::workdir`]); `None`: `/`. Since
    /// protocol 9.
    pub workdir: Option<String>,
    /// `(uid, gid)` actions run as inside the sandbox (from the spec's `user`, else the
    /// image's config); `None`: root. Since protocol 10.
    pub user: Option<(u32, u32)>,
    /// Digest of the image the sandbox was created on ([`crate::ImageInfo::digest`]). Since
    /// protocol 10.
    pub image_digest: Option<String>,
}

/// The resource limits of a sandbox ([`SandboxInfo::limits`]); `None`: unlimited.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SandboxLimits {
    /// `memory.max` in bytes.
    pub memory_max: Option<u64>,
    /// `pids.max`: processes and threads at once.
    pub pids_max: Option<u64>,
    /// CPU bandwidth in CPUs (`cpu.max` quota over period).
    pub cpus: Option<f64>,
    /// Bytes the upper layer may allocate.
    pub disk_max: Option<u64>,
}
