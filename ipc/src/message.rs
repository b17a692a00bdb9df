//! The typed messages of the protocol: one [`Request`] enum, one [`Response`] enum and one
//! [`Event`] enum, each carried in an [`Envelope`] with a request id.
//!
//! Payloads are encoded with bincode 2 (`config::standard()`, serde mode). Adding a variant at
//! the end of an enum is a compatible change only together with a protocol version bump
//! (see `docs/protocol.md`).

use serde::{Deserialize, Serialize};

/// A message with the request id that ties a response to its request.
///
/// Clients pick ids; the server echoes the id of the request in its response. Events carry id 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Request id chosen by the client (0 for events).
    pub id: u64,
    /// The message itself.
    pub body: T,
}

/// Everything a client can ask of `belayerd`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Liveness probe; answered by [`Response::Pong`].
    Ping,
    /// Import a rootfs directory or a tar archive (plain, gzip or zstd) as the read-only image
    /// `name`, owned by the caller's uid.
    ///
    /// With `with_fd`, the source is the one descriptor attached to this request's frame
    /// (`SCM_RIGHTS`): a directory or a regular file the client opened with its own rights
    /// (`Client::import_image`). The daemon reads it with the caller's credentials (a
    /// directory is walked by a child process running as the caller's uid, gid and
    /// supplementary groups), so a client can import only what it can read itself. Without
    /// it, `source` is a host path the daemon opens itself, which only root (uid 0) may ask
    /// for; anyone else is answered [`ErrorCode::PermissionDenied`].
    ImportImage {
        /// Image name: `[A-Za-z0-9._-]{1,64}`.
        name: String,
        /// With `with_fd`: the client's name for the source (recorded, never opened).
        /// Without: absolute host path of a directory or a tar file.
        source: String,
        /// Whether the source rides on this frame as a descriptor.
        with_fd: bool,
    },
    /// List imported images.
    ListImages,
    /// Remove an image that no sandbox uses.
    RemoveImage {
        /// Image name.
        name: String,
    },
    /// Create and start a sandbox.
    CreateSandbox(SandboxSpec),
    /// List sandboxes.
    ListSandboxes,
    /// Describe one sandbox.
    InspectSandbox {
        /// Sandbox id.
        id: String,
    },
    /// Kill a sandbox and delete it with all its checkpoints.
    RemoveSandbox {
        /// Sandbox id.
        id: String,
    },
    /// Run one action (a shell command) in a sandbox.
    Exec(ExecRequest),
    /// Take a full checkpoint C_k of a sandbox at action boundary k (paper: full_checkpoint).
    Checkpoint(CheckpointRequest),
    /// Restore the sandbox from a ready checkpoint into a fresh instance (paper: full_restore):
    /// the ready one, or the one of boundary `prefix`.
    ///
    /// `prefix` names the latest checkpoint of boundary K on the ready checkpoint's own line
    /// (it and its ancestors: the history of the state the sandbox runs); a checkpoint on
    /// another branch is restored by name ([`Request::RestoreCheckpoint`]). Restoring C_K
    /// moves the ready pointer to C_K once the restore succeeded; the checkpoints taken after
    /// C_K stay, as another branch of the sandbox's tree of checkpoints, and the next
    /// checkpoint's parent is C_K (since protocol 11; before, they were dropped). A `prefix`
    /// with no checkpoint on that line is answered [`ErrorCode::NotFound`] naming it, and
    /// nothing is touched.
    Restore {
        /// Sandbox id.
        id: String,
        /// Also check the restored state against the checkpoint (upper layer re-captured and
        /// compared by digest; process list compared) and report it in
        /// [`RestoreInfo::validity`]. Costs one more upper-layer capture.
        verify: bool,
        /// Action boundary K of the ready checkpoint to restore (the latest one of that
        /// boundary, when several were taken at it); `None`: the ready checkpoint. Since
        /// protocol 9.
        prefix: Option<u64>,
    },
    /// List the ready checkpoints of a sandbox, oldest first.
    ListCheckpoints {
        /// Sandbox id.
        id: String,
    },
    /// Drop checkpoints: those older than `older_than_s` seconds, and/or those of sandboxes with
    /// rollout tag `tag`. The ready checkpoint of a live sandbox is kept unless `tag` matches.
    Gc {
        /// Minimum age in seconds of checkpoints to drop.
        older_than_s: Option<u64>,
        /// Rollout tag whose checkpoints are dropped.
        tag: Option<String>,
    },
    /// Daemon status: version, features, counts.
    Status,
    /// Feed the checkpoint policy of a sandbox one step's timing; the daemon takes a full
    /// checkpoint C_k when the policy says so (paper, Algorithm 1). Answered by
    /// [`Response::MaybeCheckpoint`].
    MaybeCheckpoint(MaybeCheckpointRequest),
    /// Append the LLM context L_k of `trajectory` at action boundary `prefix` to the
    /// trajectory's context log (under the daemon's state dir); a trajectory's first append
    /// creates it, owned by the caller. Answered by [`Response::Context`], or an error:
    /// [`ErrorCode::BadRequest`] (bad id, context over the daemon's size limit),
    /// [`ErrorCode::InvalidState`] (the owner's context budget is exhausted),
    /// [`ErrorCode::PermissionDenied`] (`<name>@<uid>` of another uid, for a non-root peer).
    ContextAppend {
        /// Trajectory id: a name of `[A-Za-z0-9._-]{1,128}` not starting with a dot (the
        /// caller's own trajectory of that name), or `<name>@<uid>` (uid's, for root and uid).
        trajectory: String,
        /// Action boundary k.
        prefix: u64,
        /// The context, opaque bytes.
        #[serde(with = "serde_bytes")]
        context: Vec<u8>,
    },
    /// Look up the context of `trajectory` at boundary `prefix` (`None`: the latest boundary).
    /// Answered by [`Response::Context`], or [`ErrorCode::NotFound`] (also for another uid's
    /// trajectory the caller may not see: answered exactly like an unknown one).
    ContextLookup {
        /// Trajectory id, as in [`Request::ContextAppend`].
        trajectory: String,
        /// Action boundary k, or `None` for the latest one.
        prefix: Option<u64>,
    },
    /// Turn this connection into an event stream: the daemon answers [`Response::Subscribed`],
    /// then sends [`Event`] frames (kind 3, id 0) until either side closes. The client sends
    /// nothing more on the connection.
    Subscribe,
    /// Remove the context log of `trajectory` with all its records, releasing what it was
    /// charged to its owner's context budget; a later [`Request::ContextAppend`] to it starts
    /// a new log. Answered by [`Response::Done`], or [`ErrorCode::NotFound`] (also for another
    /// uid's trajectory the caller may not see: answered exactly like an unknown one),
    /// [`ErrorCode::BadRequest`] (bad id). Since protocol 7.
    ContextRemove {
        /// Trajectory id, as in [`Request::ContextAppend`].
        trajectory: String,
    },
    /// Start an upload of a tar stream into a sandbox (see [`UploadRequest`] for where it
    /// goes). Answered by [`Response::TransferReady`], or an error before any data; then the
    /// client sends [`Request::UploadChunk`] frames (with this request's id) and, after the
    /// empty one that ends the stream, gets [`Response::Transferred`] or an error (sent once
    /// the daemon has read the rest of the stream). [`Request::TransferCancel`] instead of a
    /// chunk stops it. Since protocol 9.
    Upload(UploadRequest),
    /// One piece of an upload's tar stream, at most [`Response::TransferReady`]'s
    /// `chunk_bytes`; empty: the end of the stream. Valid only during an upload; anywhere else
    /// it is a `BadRequest`. Since protocol 9.
    UploadChunk {
        /// The bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Stops the transfer in progress on this connection: sent instead of the next upload
    /// chunk, or while download chunks arrive. The daemon stops the helper and answers the
    /// transfer with an error (`TransferFailed`); download chunks already on their way come
    /// first. Since protocol 9.
    TransferCancel,
    /// Download a file or directory of a sandbox as a tar stream: answered by
    /// [`Response::DownloadChunk`] frames, then [`Response::Transferred`] or an error (an
    /// error before any chunk when the transfer cannot start). Since protocol 9.
    Download(DownloadRequest),
    /// Pull an image from an OCI distribution registry: its layers go into the node's layer
    /// store (each stored once, by digest, shared by every image that has it) and the image
    /// is published under its name only once every layer is unpacked and verified. Answered
    /// by [`Response::Image`]. Since protocol 10.
    PullImage(PullRequest),
    /// Import an OCI image whose blobs ride on this frame as descriptors the client opened
    /// ([`OciImportRequest::layers`] index them): an `oci:DIR[:TAG]` layout or a
    /// `docker-archive:FILE`. Answered by [`Response::Image`]. Since protocol 10.
    ImportOci(OciImportRequest),
    /// Restore the sandbox from its checkpoint named `checkpoint` (a
    /// [`CheckpointInfo::checkpoint`] of [`Request::ListCheckpoints`], on any branch of its
    /// tree), as [`Request::Restore`] does with a prefix: it becomes the ready checkpoint and
    /// the next checkpoint is its child. A name that is not one of the sandbox's visible
    /// checkpoints is answered [`ErrorCode::NotFound`] naming it, and nothing is touched.
    /// Answered by [`Response::Restored`]. Since protocol 11.
    RestoreCheckpoint {
        /// Sandbox id.
        id: String,
        /// Also check the restored state against the checkpoint, as for `Restore`.
        verify: bool,
        /// The checkpoint's name, `c<seq>-k<prefix>`.
        checkpoint: String,
    },
    /// Fork `count` new sandboxes from one checkpoint of a sandbox (see
    /// [`crate::ForkRequest`]). Answered by [`Response::Forked`]. Since protocol 12.
    Fork(crate::fork::ForkRequest),
}

/// Everything `belayerd` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// Answer to [`Request::Ping`].
    Pong {
        /// Daemon version (`CARGO_PKG_VERSION`).
        version: String,
    },
    /// One image.
    Image(ImageInfo),
    /// All images.
    Images(Vec<ImageInfo>),
    /// One sandbox.
    Sandbox(SandboxInfo),
    /// All sandboxes.
    Sandboxes(Vec<SandboxInfo>),
    /// Result of an action.
    Exec(ExecResult),
    /// A checkpoint that was just published, or one listed.
    Checkpoint(CheckpointInfo),
    /// Ready checkpoints of a sandbox.
    Checkpoints(Vec<CheckpointInfo>),
    /// Result of a restore.
    Restored(RestoreInfo),
    /// Result of a garbage collection.
    Gc {
        /// Number of checkpoints removed.
        removed: u64,
        /// Bytes freed.
        bytes: u64,
    },
    /// Daemon status.
    Status(StatusInfo),
    /// The request succeeded and has nothing to return (a removal: [`Request::RemoveImage`],
    /// [`Request::RemoveSandbox`], [`Request::ContextRemove`]).
    Done,
    /// The request failed.
    Error(ErrorReply),
    /// Answer to [`Request::MaybeCheckpoint`].
    MaybeCheckpoint(MaybeCheckpointResult),
    /// A context record (answer to [`Request::ContextAppend`] and [`Request::ContextLookup`]).
    Context(ContextEntry),
    /// Answer to [`Request::Subscribe`]: events follow on this connection.
    Subscribed,
    /// Answer to [`Request::Upload`]: send the stream now. Since protocol 9.
    TransferReady {
        /// The most bytes one [`Request::UploadChunk`] may carry.
        chunk_bytes: u32,
    },
    /// One piece of a download's tar stream (at most a quarter of the frame limit, and
    /// 1 MiB). Since protocol 9.
    DownloadChunk {
        /// The bytes.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// The last answer of a finished upload or download. Since protocol 9.
    Transferred(TransferInfo),
    /// Answer to [`Request::Fork`]. Since protocol 12.
    Forked(crate::fork::ForkInfo),
}

/// Asynchronous notifications from the daemon.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    /// A sandbox lost its init or was killed from outside.
    SandboxFailed {
        /// Sandbox id.
        id: String,
        /// Human-readable cause.
        reason: String,
    },
    /// A checkpoint became ready (the ready pointer moved to `prefix`).
    CheckpointReady {
        /// Sandbox id.
        id: String,
        /// Action boundary k.
        prefix: u64,
    },
}

/// One action.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ExecRequest {
    /// Sandbox id.
    pub id: String,
    /// The command; a single element is run with `/bin/sh -c`.
    pub argv: Vec<String>,
    /// Working directory inside the sandbox (default `/`).
    pub cwd: Option<String>,
    /// Timeout in milliseconds; on expiry the action's process group is killed.
    pub timeout_ms: Option<u64>,
    /// Extra environment for this action.
    pub env: Vec<(String, String)>,
    /// Bytes of stdout and of stderr kept (default from the daemon config); with
    /// `merge_stderr`, bytes of the one merged stream.
    pub output_limit: Option<u64>,
    /// Bytes fed to the action's stdin (a sealed memfd the action cannot change); empty: the
    /// action's stdin is empty. At most the daemon's output limit (and a quarter of its frame
    /// maximum), else `BadRequest`. Since protocol 8.
    #[serde(with = "serde_bytes")]
    pub stdin: Vec<u8>,
    /// Stdout and stderr are one ordered stream, as on a terminal: everything comes back in
    /// `stdout` and `stderr` is empty. Since protocol 8.
    pub merge_stderr: bool,
}

/// Outcome of an action.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ExecResult {
    /// Exit code; 128 + signal when killed by a signal (shell convention).
    pub exit_code: i32,
    /// Terminating signal, if any.
    pub signal: Option<i32>,
    /// Captured stdout (at most the output limit).
    #[serde(with = "serde_bytes")]
    pub stdout: Vec<u8>,
    /// Captured stderr (at most the output limit).
    #[serde(with = "serde_bytes")]
    pub stderr: Vec<u8>,
    /// True when stdout or stderr was cut at the limit.
    pub truncated: bool,
    /// True when the timeout killed the action.
    pub timed_out: bool,
    /// Wall-clock duration in milliseconds.
    pub duration_ms: f64,
    /// Set when an infrastructure failure hit the action (a process killed from outside the
    /// sandbox, an OOM kill, the sandbox lost): the output is not the task's own behaviour and
    /// should be withheld from the model's context; recover instead.
    pub infra_fault: Option<InfraFault>,
    /// Whether the action changed the sandbox (files written, created or removed; processes
    /// left running or gone); `None` when the daemon cannot tell.
    pub dirty: Option<bool>,
}

/// An infrastructure failure seen during an action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InfraFault {
    /// What happened.
    pub kind: InfraFaultKind,
    /// Host pid of the process it hit, when known.
    pub pid: Option<i32>,
    /// The killing signal, when known.
    pub signal: Option<i32>,
}

/// Kinds of [`InfraFault`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InfraFaultKind {
    /// A fatal signal sent from outside the sandbox reached one of its processes.
    ExternalKill,
    /// The OOM killer killed a process of the sandbox.
    Oom,
    /// The sandbox init died: the whole sandbox is gone.
    SandboxLost,
}

impl InfraFaultKind {
    /// `external_kill`, `oom` or `sandbox_lost`.
    pub fn as_str(self) -> &'static str {
        match self {
            InfraFaultKind::ExternalKill => "external_kill",
            InfraFaultKind::Oom => "oom",
            InfraFaultKind::SandboxLost => "sandbox_lost",
        }
    }
}

/// Checkpoint stages at which a daemon started with test hooks can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailPoint {
    /// After the cgroup is frozen.
    AfterFreeze,
    /// After the upper layer was captured.
    AfterFsCapture,
    /// In the middle of the CRIU dump.
    DuringCriuDump,
    /// After everything is durable, before the directory rename.
    BeforeRename,
    /// After the rename, before the ready pointer moves.
    BeforePointerUpdate,
}

/// How a test hook fails a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestFault {
    /// Where.
    pub at: FailPoint,
    /// `true`: the daemon SIGKILLs itself there; `false`: the step returns an error.
    pub kill_daemon: bool,
}

/// A full checkpoint request (paper: full_checkpoint).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// Sandbox id.
    pub id: String,
    /// Action boundary k of the trajectory prefix.
    pub prefix: u64,
    /// The LLM context L_k, opaque bytes stored with the checkpoint.
    #[serde(with = "serde_bytes")]
    pub context: Vec<u8>,
    /// Test hook; refused unless the daemon runs with test hooks enabled.
    pub fault: Option<TestFault>,
}

/// Phase timings of a checkpoint, milliseconds.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CheckpointTimings {
    /// Freezing the cgroup until every task is frozen.
    pub freeze: f64,
    /// Capturing the upper layer (F_k).
    pub fs_capture: f64,
    /// Taking the upper layer's snapshot, in the frozen window after the capture (0 without
    /// one).
    #[serde(default)]
    pub upper_snapshot: f64,
    /// CRIU dump of the process tree (R_k).
    pub criu_dump: f64,
    /// fsync, rename, pointer update.
    pub publish: f64,
    /// Time the sandbox was frozen.
    pub frozen_total: f64,
    /// The whole request.
    pub total: f64,
}

/// A ready checkpoint C_k.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CheckpointInfo {
    /// Sandbox id.
    pub sandbox: String,
    /// Action boundary k.
    pub prefix: u64,
    /// Checkpoint name (directory name in the store).
    pub checkpoint: String,
    /// Total bytes of the checkpoint's artifacts.
    pub bytes: u64,
    /// blake3 of the stored LLM context, hex.
    pub context_digest: String,
    /// Phase timings.
    pub timings_ms: CheckpointTimings,
    /// Publication time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Name of the parent checkpoint in the sandbox's tree of checkpoints: the one that was
    /// ready when this one was taken (`None`: a root, taken from a fresh instance).
    pub parent: Option<String>,
    /// This is the sandbox's ready checkpoint (set in `ListCheckpoints` answers; a
    /// `Checkpoint` answer's new checkpoint is ready by definition).
    pub ready: bool,
}

/// Phase timings of a restore, milliseconds.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RestoreTimings {
    /// Killing and unmounting the failed instance.
    pub teardown: f64,
    /// Verifying the checkpoint's digests.
    pub verify: f64,
    /// Installing the captured upper layer into a fresh upper directory.
    pub fs_install: f64,
    /// Mounting the fresh root (a user namespace for the idmap, the idmapped image, the
    /// overlay) and checking every path of the CRIU images beneath it.
    pub mount: f64,
    /// CRIU restore of the process tree.
    pub criu_restore: f64,
    /// The whole request.
    pub total: f64,
}

/// Result of a restore (paper: full_restore).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RestoreInfo {
    /// Sandbox id.
    pub sandbox: String,
    /// Restored prefix k; `None` when there was no ready checkpoint and the sandbox restarted
    /// from the base image (k = 0).
    pub prefix: Option<u64>,
    /// The LLM context L_k recorded with the checkpoint (empty for k = 0).
    #[serde(with = "serde_bytes")]
    pub context: Vec<u8>,
    /// Host pid of the new init.
    pub init_pid: i32,
    /// Phase timings.
    pub timings_ms: RestoreTimings,
    /// Result of the validity check, when the request asked for it and a checkpoint was used.
    pub validity: Option<RestoreValidity>,
    /// The upper layer came back from the checkpoint's snapshot: every file the sandbox wrote
    /// keeps its inode number, mtime and ctime (only `st_dev`, the new overlay's, differs).
    /// `false`: F_k was materialized from its manifest into new inodes, or there was no
    /// checkpoint.
    pub inodes_kept: bool,
    /// Prefixes of checkpoints this restore dropped, oldest first. Since protocol 11 always
    /// empty: the checkpoints after a restored earlier one stay as a branch. Since
    /// protocol 9.
    pub dropped_prefixes: Vec<u64>,
}

/// Whether a restored sandbox matches what was recorded at checkpoint time.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RestoreValidity {
    /// The restored upper layer, captured again, has the checkpoint's digest.
    pub fs_matches: bool,
    /// The restored processes (pid in the sandbox, command) equal those recorded at checkpoint.
    pub processes_match: bool,
    /// Processes recorded at checkpoint time, `"<pid> <comm>"` sorted.
    pub expected_processes: Vec<String>,
    /// Processes found after the restore, same format.
    pub restored_processes: Vec<String>,
}

/// Daemon status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusInfo {
    /// Daemon version.
    pub version: String,
    /// Protocol version.
    pub protocol: u16,
    /// `criu --version` of the CRIU in use.
    pub criu: String,
    /// Cgroup layout in use (`v2`, or `hybrid` with the v1 controllers used).
    pub cgroup: String,
    /// Number of sandboxes.
    pub sandboxes: u64,
    /// Sandbox tracer in use: `bpf`, or `fallback` (pidfd/cgroup polling) with the reason.
    pub tracer: String,
}

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The request was malformed or its arguments invalid.
    BadRequest,
    /// No sandbox with that id.
    UnknownSandbox,
    /// No image with that name.
    UnknownImage,
    /// Name already taken.
    AlreadyExists,
    /// Thing in use (e.g. image used by a sandbox).
    InUse,
    /// The sandbox is not in a state that allows the request; or a `ContextAppend` would take
    /// its trajectory's owner past its context budget.
    InvalidState,
    /// A checkpoint failed verification (digest mismatch, bad manifest).
    CorruptCheckpoint,
    /// Taking a checkpoint failed; the previous one is still ready.
    CheckpointFailed,
    /// Restoring failed.
    RestoreFailed,
    /// Running an action failed (not the action's own non-zero exit).
    ExecFailed,
    /// The peer is not allowed to talk to the daemon.
    PermissionDenied,
    /// A kernel or tool feature is missing.
    Unsupported,
    /// Anything else on the daemon's side.
    Internal,
    /// The looked-up thing (e.g. a context record) does not exist.
    NotFound,
    /// The server is at a connection or event-stream limit (of the peer's uid, of non-root
    /// peers, or in total), or closed this idle connection to make room: the request was not
    /// handled; connect again later.
    Busy,
    /// A CRIU restore ran past its wall-clock limit (daemon config `criu_time_limit_base_ms`,
    /// `criu_time_limit_per_gib_ms`) and was killed with the half-restored tree; the sandbox is
    /// `failed`, its ready checkpoint untouched: restoring again may succeed.
    RestoreTimedOut,
    /// A file transfer failed: an archive member refused by the hardening rules (a `..` or
    /// absolute name, a device node, a symlink where a parent directory must be), the helper
    /// killed or stopped, the transfer cancelled. Since protocol 9.
    TransferFailed,
    /// The sandbox's disk limit (or its file system) was reached while a transfer wrote into
    /// it. Since protocol 9.
    NoSpace,
    /// A file transfer ran past its timeout and was stopped (what was extracted so far
    /// stays). Since protocol 9.
    TransferTimedOut,
    /// A registry could not be reached (connection refused, name unknown, timeout, TLS);
    /// the message names the reference. Since protocol 10.
    RegistryUnreachable,
    /// A registry refused the credentials (or asked for some and got none); the message
    /// names the reference. Since protocol 10.
    RegistryDenied,
    /// An image's content failed verification or was refused: a blob whose digest does not
    /// match, a truncated blob, a manifest naming a missing blob, a hostile layer (a `..`
    /// member, a write through a symlink, a device node). Nothing of it was kept. Since
    /// protocol 10.
    CorruptImage,
    /// A restore was refused: the sandbox's image now has another digest than the one its
    /// checkpoints were taken on. Since protocol 10.
    ImageChanged,
}

/// Where an upload goes (`docker cp` semantics): when `dest` is an existing directory of the
/// sandbox, the tree goes inside it under its own name; otherwise (one tree, `archive` false)
/// the tree becomes `dest`, whose parent must exist. `dest` is resolved inside the sandbox,
/// symlinks included (`RESOLVE_IN_ROOT`), and the stream is extracted there by a process of the
/// sandbox, confined like an action, so the writes count against the sandbox's disk limit and
/// the files belong to its root. Members are never created through a symlink.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct UploadRequest {
    /// Sandbox id.
    pub id: String,
    /// Absolute path inside the sandbox; a trailing `/` requires an existing directory.
    pub dest: String,
    /// The stream is an arbitrary archive (any number of top-level members) extracted into
    /// `dest`, which must be an existing directory. `false`: the stream holds one tree (every
    /// member under one top-level name), which may become `dest`.
    pub archive: bool,
    /// Timeout in milliseconds for the whole transfer; `None`: the daemon's exec timeout.
    pub timeout_ms: Option<u64>,
}

/// A download: the file, directory or symlink `src` of the sandbox as one tree (top-level
/// member: `src`'s last component), packed inside the sandbox by a process confined like an
/// action. Symlinks are archived as links, never followed; special files are left out.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DownloadRequest {
    /// Sandbox id.
    pub id: String,
    /// Absolute path inside the sandbox (resolved inside it, symlinks included, except the
    /// last component, which is archived as it is).
    pub src: String,
    /// Timeout in milliseconds for the whole transfer; `None`: the daemon's exec timeout.
    pub timeout_ms: Option<u64>,
}

/// The outcome of a finished transfer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TransferInfo {
    /// Members archived or created (files, directories, symlinks, hard links).
    pub files: u64,
    /// Bytes of regular file content.
    pub bytes: u64,
    /// Special files (devices, fifos, sockets) left out of a download.
    pub skipped: u64,
    /// Files of a download whose size changed while they were read (padded or cut to the
    /// size first seen).
    pub changed: u64,
    /// Wall-clock duration on the daemon's side, milliseconds.
    pub duration_ms: f64,
}

/// A typed error answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Machine-readable code.
    pub code: ErrorCode,
    /// Human-readable message with the context (ids, paths, causes).
    pub message: String,
}

pub use crate::rollout::{
    ContextEntry, DecisionInfo, MaybeCheckpointRequest, MaybeCheckpointResult, PolicySpec,
    MAX_RESPONSE_SAMPLES,
};

pub use crate::image::{
    BlobRange, ImageConfig, ImageInfo, LayerInfo, OciImportRequest, PullRequest,
    RegistryCredentials,
};
pub use crate::sandbox::{SandboxInfo, SandboxLimits, SandboxSpec, UsernsInfo, UsernsMode};
