//! The C structs and handle types of the ABI (what `belayer.h` declares besides functions).

use std::ffi::{c_char, c_int};

/// Handle of a connection to `belayerd` (0 is never valid).
pub type BelayerClient = u64;
/// Handle of an event subscription (0 is never valid).
pub type BelayerSubscription = u64;

/// A byte buffer handed out by the library; free it with [`belayer_buf_free`]. `data` is
/// NULL when `len` is 0.
#[repr(C)]
#[derive(Debug)]
pub struct BelayerBuf {
    /// The bytes (owned by the library until freed).
    pub data: *mut u8,
    /// Number of bytes.
    pub len: usize,
}

/// Outcome of an action; free with [`belayer_exec_result_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerExecResult {
    /// Exit code; 128 + signal when killed by a signal.
    pub exit_code: i32,
    /// Terminating signal, 0 when none.
    pub signal: i32,
    /// True when the timeout killed the action.
    pub timed_out: bool,
    /// True when stdout or stderr was cut at the output limit.
    pub truncated: bool,
    /// Wall-clock duration, milliseconds.
    pub duration_ms: f64,
    /// Captured stdout.
    pub stdout_buf: BelayerBuf,
    /// Captured stderr (empty when the options merged it into stdout).
    pub stderr_buf: BelayerBuf,
}

/// What the daemon saw of an action besides its output ([`belayer_exec_with`]'s `verdict`):
/// plain values, nothing to free.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BelayerExecVerdict {
    /// `BELAYER_INFRA_FAULT_*`: an infrastructure failure hit the action (its output is not
    /// the task's own behaviour; recover instead); `BELAYER_INFRA_FAULT_NONE` (0) when none.
    pub infra_fault: c_int,
    /// Host pid of the process the fault hit, -1 when unknown or no fault.
    pub infra_fault_pid: i32,
    /// The fault's killing signal, 0 when unknown or no fault.
    pub infra_fault_signal: i32,
    /// `BELAYER_DIRTY_*`: whether the action changed the sandbox (-1 unknown, 0 clean,
    /// 1 changed).
    pub dirty: c_int,
}

/// Options of [`belayer_exec_with`]; zero (all fields 0 or NULL) means every default.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BelayerExecOptions {
    /// Working directory inside the sandbox, an absolute path; NULL: `/`.
    pub cwd: *const c_char,
    /// Extra environment: `env_len` NUL-terminated `KEY=VALUE` strings (KEY non-empty, split
    /// at the first `=`); NULL when `env_len` is 0.
    pub env: *const *const c_char,
    /// Number of entries of `env`.
    pub env_len: usize,
    /// Timeout in milliseconds; on expiry the action's process group is killed. 0: none (the
    /// daemon's default, if it has one).
    pub timeout_ms: u64,
    /// Bytes kept of stdout and of stderr (of the merged stream with `merge_stderr`); 0: the
    /// daemon's default.
    pub output_limit: u64,
    /// Non-zero: stdout and stderr are one ordered stream, as on a terminal: everything comes
    /// back in `stdout_buf`, `stderr_buf` is empty. (An integer, not a bool: any bit pattern
    /// a caller writes is valid.)
    pub merge_stderr: u32,
    /// Bytes fed to the action's stdin (`stdin_len` of them; the daemon bounds them, by
    /// default at 1 MiB); NULL when `stdin_len` is 0 (stdin reads end of file at once).
    pub stdin_data: *const u8,
    /// Number of bytes at `stdin_data`.
    pub stdin_len: usize,
}

/// A sandbox; free with [`belayer_sandbox_info_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerSandboxInfo {
    /// Sandbox id.
    pub id: *mut c_char,
    /// Image name.
    pub image: *mut c_char,
    /// `running`, `checkpointing`, `restoring`, `failed` or `stopped`.
    pub state: *mut c_char,
    /// Host pid of the init, -1 when not alive.
    pub init_pid: i32,
    /// Instance number: 0 for the original, +1 per restore.
    pub instance: u32,
    /// Whether a checkpoint is ready.
    pub has_ready_prefix: bool,
    /// Prefix k of the ready checkpoint (valid when `has_ready_prefix`).
    pub ready_prefix: u64,
    /// Host pids of every process of the sandbox.
    pub pids: *mut i32,
    /// Number of entries of `pids`.
    pub pids_len: usize,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
}

/// A published checkpoint; free with [`belayer_checkpoint_info_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerCheckpointInfo {
    /// Action boundary k.
    pub prefix: u64,
    /// Bytes of the checkpoint's artifacts.
    pub bytes: u64,
    /// Time the sandbox was frozen, milliseconds.
    pub frozen_ms: f64,
    /// Whole request, milliseconds.
    pub total_ms: f64,
    /// Checkpoint name in the store.
    pub name: *mut c_char,
    /// blake3 of the stored context, hex.
    pub context_digest: *mut c_char,
}

/// Result of a restore; free with [`belayer_restore_info_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerRestoreInfo {
    /// Whether a checkpoint was restored (false: restarted from the base image, k = 0).
    pub has_prefix: bool,
    /// Restored prefix k (0 when `has_prefix` is false).
    pub prefix: u64,
    /// The LLM context L_k recorded with the checkpoint (empty for k = 0).
    pub context: BelayerBuf,
    /// Host pid of the new init.
    pub init_pid: i32,
    /// Whole restore, milliseconds.
    pub total_ms: f64,
    /// Whether the restored state was checked against the checkpoint.
    pub verified: bool,
    /// The restored upper layer matches the checkpoint (valid when `verified`).
    pub fs_matches: bool,
    /// The restored processes match the checkpoint (valid when `verified`).
    pub processes_match: bool,
    /// The upper layer came back from the checkpoint's snapshot: files the sandbox wrote kept
    /// their inode numbers and times.
    pub inodes_kept: bool,
}

/// One step's timing for [`belayer_maybe_checkpoint`]; seconds. Negative values mean unset.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BelayerStep {
    /// d_t: wall-clock duration of the step (LLM response plus action).
    pub step_duration_s: f64,
    /// C_t: work a failure now would force to regenerate; negative: the daemon sums the step
    /// durations since the last checkpoint.
    pub regen_cost_s: f64,
    /// x: how long the next LLM response has already been running (usually 0).
    pub llm_elapsed_s: f64,
    /// This step's completed LLM response time, fed into the distribution of T; negative:
    /// none.
    pub llm_response_s: f64,
}

/// Checkpoint policy of a sandbox for [`belayer_maybe_checkpoint`]. Negative numbers and a
/// NULL `kind` mean "default".
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BelayerPolicy {
    /// `adaptive` (default), `always`, `never`, `every:N` or `restart`; NULL: adaptive.
    pub kind: *const c_char,
    /// Fixed failure probability per step, in [0, 1].
    pub failure_p: f64,
    /// Fail-stop rate per second (used when `failure_p` is negative).
    pub failure_rate_per_s: f64,
    /// A checkpoint longer than this, seconds, starts the cooldown.
    pub checkpoint_timeout_s: f64,
    /// Cooldown after a timed-out checkpoint, seconds.
    pub cooldown_s: f64,
}

/// What [`belayer_maybe_checkpoint`] decided and did (no heap memory: nothing to free).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct BelayerDecision {
    /// Whether a checkpoint was taken and published.
    pub checkpointed: bool,
    /// `BELAYER_REASON_*`.
    pub reason: c_int,
    /// p_t.
    pub p: f64,
    /// C_t, seconds.
    pub regen_cost_s: f64,
    /// c_t, seconds.
    pub c_s: f64,
    /// q(x; c_t).
    pub q: f64,
    /// p_t * C_t, seconds.
    pub benefit: f64,
    /// c_t * (1 - q), seconds.
    pub visible_cost: f64,
    /// Prefix of the published checkpoint (valid when `checkpointed`).
    pub checkpoint_prefix: u64,
    /// Bytes of the published checkpoint.
    pub checkpoint_bytes: u64,
    /// Frozen time of the checkpoint, milliseconds.
    pub checkpoint_frozen_ms: f64,
    /// Whole checkpoint, milliseconds.
    pub checkpoint_total_ms: f64,
}

/// An event; free with [`belayer_event_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerEvent {
    /// `BELAYER_EVENT_*`.
    pub kind: c_int,
    /// Sandbox id.
    pub sandbox: *mut c_char,
    /// Prefix k (`BELAYER_EVENT_CHECKPOINT_READY`), 0 otherwise.
    pub prefix: u64,
    /// Cause (`BELAYER_EVENT_SANDBOX_FAILED`), NULL otherwise.
    pub reason: *mut c_char,
}

/// `BelayerCreateOptions.userns`: the daemon's default (`private` unless configured).
pub const BELAYER_USERNS_DEFAULT: c_int = 0;
/// User namespace of its own: root inside is an unprivileged host uid.
pub const BELAYER_USERNS_PRIVATE: c_int = 1;
/// The host's user namespace (root only): root inside is host root.
pub const BELAYER_USERNS_HOST: c_int = 2;

/// Options of [`belayer_sandbox_create_with`]; zero (all fields 0 or NULL) means every
/// default. Limits left 0 get the daemon's defaults (`default_memory_max_bytes`,
/// `default_pids_max`, `default_cpus`, `default_disk_max_bytes`), which are also the ceilings
/// of a non-root caller.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct BelayerCreateOptions {
    /// Rollout tag (for `belayer_gc`), `[A-Za-z0-9._-]{1,64}`; NULL: none.
    pub tag: *const c_char,
    /// Environment of every action: `env_len` NUL-terminated `KEY=VALUE` strings (KEY
    /// non-empty, split at the first `=`); NULL when `env_len` is 0.
    pub env: *const *const c_char,
    /// Number of entries of `env`.
    pub env_len: usize,
    /// Working directory of every action: an absolute path inside the sandbox (not created:
    /// actions fail with `BELAYER_E_EXEC_FAILED` while it is missing); an action's own `cwd`
    /// overrides it. NULL: `/`.
    pub workdir: *const c_char,
    /// `memory.max` in bytes (at least 1 MiB); 0: the daemon's default.
    pub memory_max: u64,
    /// `pids.max` (at least 1); 0: the daemon's default.
    pub pids_max: u64,
    /// CPU bandwidth limit in CPUs (0.01 to 65536, e.g. 1.5); 0: the daemon's default.
    /// Negative or not finite: `BELAYER_E_INVALID_ARGUMENT`.
    pub cpus: f64,
    /// Bytes the sandbox's upper layer may allocate (at least 1 MiB); 0: the daemon's
    /// default.
    pub disk_max: u64,
    /// `BELAYER_USERNS_*`; any other value is `BELAYER_E_INVALID_ARGUMENT`.
    pub userns: c_int,
}

/// How a sandbox was created and what bounds it (the second half of a
/// [`BelayerSandboxEntry`]); freed with its entry.
#[repr(C)]
#[derive(Debug)]
pub struct BelayerSandboxConfig {
    /// Rollout tag, NULL when none.
    pub tag: *mut c_char,
    /// Default working directory of actions, NULL when none (`/`).
    pub workdir: *mut c_char,
    /// Environment of every action: `env_len` `KEY=VALUE` strings.
    pub env: *mut *mut c_char,
    /// Number of entries of `env`.
    pub env_len: usize,
    /// `memory.max` in bytes; 0: unlimited.
    pub memory_max: u64,
    /// `pids.max`; 0: unlimited.
    pub pids_max: u64,
    /// CPU bandwidth limit in CPUs; 0: unlimited.
    pub cpus: f64,
    /// Disk limit of the upper layer in bytes; 0: unlimited.
    pub disk_max: u64,
    /// `BELAYER_USERNS_PRIVATE` or `BELAYER_USERNS_HOST` (`BELAYER_USERNS_DEFAULT`: not
    /// reported).
    pub userns: c_int,
    /// The sandbox cgroup, a path below the cgroup mount (e.g. `/belayer/sb-…`).
    pub cgroup: *mut c_char,
}

/// A sandbox with its configuration ([`belayer_sandbox_inspect_with`], an item of
/// [`BelayerSandboxList`]); free with [`belayer_sandbox_entry_free`] (items of a list: with
/// the list).
#[repr(C)]
#[derive(Debug)]
pub struct BelayerSandboxEntry {
    /// State, pids, instance, ready prefix.
    pub info: BelayerSandboxInfo,
    /// Tag, env, workdir, limits, user namespace, cgroup.
    pub config: BelayerSandboxConfig,
}

/// The sandboxes of [`belayer_sandbox_list`], oldest first; free with
/// [`belayer_sandbox_list_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerSandboxList {
    /// `len` entries; NULL when `len` is 0.
    pub items: *mut BelayerSandboxEntry,
    /// Number of entries.
    pub len: usize,
}

/// A ready checkpoint as [`belayer_checkpoint_list`] lists it.
#[repr(C)]
#[derive(Debug)]
pub struct BelayerCheckpointEntry {
    /// Prefix, bytes, timings, name, context digest.
    pub info: BelayerCheckpointInfo,
    /// Publication time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
}

/// The ready checkpoints of a sandbox, oldest first ([`belayer_checkpoint_list`]); free
/// with [`belayer_checkpoint_list_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerCheckpointList {
    /// `len` entries; NULL when `len` is 0.
    pub items: *mut BelayerCheckpointEntry,
    /// Number of entries.
    pub len: usize,
}

/// What [`belayer_gc`] removed (plain values, nothing to free).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BelayerGcResult {
    /// Checkpoints removed.
    pub removed: u64,
    /// Bytes freed (checkpoint artifacts and blobs no checkpoint refers to any more).
    pub bytes: u64,
}

/// Outcome of a file transfer ([`belayer_upload`], [`belayer_download`] and their archive
/// forms): plain values, nothing to free.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BelayerTransferResult {
    /// Members created or archived (files, directories, symlinks, hard links).
    pub files: u64,
    /// Bytes of regular file content.
    pub bytes: u64,
    /// Special files (devices, fifos, sockets) left out of a download.
    pub skipped: u64,
    /// Files of a download whose size changed while they were read.
    pub changed: u64,
    /// The daemon's duration of the transfer, milliseconds.
    pub duration_ms: f64,
}
