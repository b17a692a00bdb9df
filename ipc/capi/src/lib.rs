//! `libbelayer`: the C ABI of Belayer, for RL frameworks and inference engines that are not
//! written in Rust (the Python package in `python/` loads it with ctypes).
//!
//! It speaks the binary protocol of `belayerd` (crate `belayer-ipc`) and re-exports the
//! worker-side memory-server functions (`belayer_mem_*`, `belayer_placeholder_*`,
//! `belayer_gpu_health_check`) of `belayer_ipc::memory::ffi`, so one library serves both.
//! The C header `include/belayer.h` is generated from this file and the ipc crate's FFI
//! modules by cbindgen (see `tests/header.rs`, which fails when the checked-in header differs;
//! `BELAYER_BLESS=1 cargo test -p belayer-capi --test header` rewrites it).
//!
//! # Conventions
//!
//! - Every function returns a status code: `BELAYER_OK` (0), or a negative `BELAYER_E_*`;
//!   on failure a message is kept per thread, read with `belayer_last_error()`. No Rust panic
//!   crosses the boundary (`BELAYER_E_PANIC`).
//! - Handles (`BelayerClient`, `BelayerSubscription`) are opaque 64-bit numbers from a
//!   registry, never pointers, and never reused: a closed, freed or made-up handle is
//!   answered with `BELAYER_E_BAD_HANDLE`, never a crash. 0 is never a valid handle.
//! - Strings in are NUL-terminated UTF-8 (`BELAYER_E_INVALID_ARGUMENT` otherwise); byte
//!   buffers in are `(pointer, length)`, the pointer may be NULL when the length is 0.
//! - Everything handed out is owned by the caller and freed with the matching function:
//!   `char *` with [`belayer_string_free`], [`BelayerBuf`] with [`belayer_buf_free`], result
//!   structs with their `*_free`. Out-structs are zeroed before any work, so freeing them
//!   after a failed call is safe; the free functions reset what they freed, so a second free
//!   is a no-op.
//! - Thread-safety: every function may be called from any thread. Calls on one client handle
//!   are serialized (one request at a time per connection); use one client per thread for
//!   parallel requests. A subscription is read by one thread at a time.
//!
//! # Dependencies
//!
//! - `belayer-ipc`: the protocol, the client, the shared FFI machinery
//!   (`belayer_ipc::ffi`) and the memory-server FFI.
#![warn(missing_docs)]

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use belayer_ipc::ffi::{
    belayer_last_error, BELAYER_E_ALREADY_EXISTS, BELAYER_E_BAD_HANDLE, BELAYER_E_BAD_REQUEST,
    BELAYER_E_BUSY, BELAYER_E_CHECKPOINT_FAILED, BELAYER_E_CONNECT, BELAYER_E_CORRUPT_CHECKPOINT,
    BELAYER_E_CUDA, BELAYER_E_EXEC_FAILED, BELAYER_E_INTERNAL, BELAYER_E_INVALID_ARGUMENT,
    BELAYER_E_INVALID_STATE, BELAYER_E_IN_USE, BELAYER_E_LAYOUT, BELAYER_E_MAP,
    BELAYER_E_NOT_FOUND, BELAYER_E_OWNER_GONE, BELAYER_E_PANIC, BELAYER_E_PERMISSION_DENIED,
    BELAYER_E_PROTOCOL, BELAYER_E_REFUSED, BELAYER_E_RESTORE_FAILED, BELAYER_E_RESTORE_TIMED_OUT,
    BELAYER_E_TIMEOUT, BELAYER_E_UNKNOWN_IMAGE, BELAYER_E_UNKNOWN_SANDBOX, BELAYER_E_UNSUPPORTED,
    BELAYER_OK,
};
pub use belayer_ipc::memory::ffi::*;

use belayer_ipc::ffi::{chain, guard, text, writable, Failure};
use belayer_ipc::{
    CheckpointInfo, CheckpointRequest, Client, ErrorCode, ErrorReply, Event, ExecRequest,
    FrameError, MaybeCheckpointRequest, PolicySpec, Request, Response, SandboxSpec, Subscription,
};

/// Version of this C ABI; bumped on every incompatible change of `belayer.h`. Compare it
/// with [`belayer_abi_version`] at run time to detect a header/library mismatch.
pub const BELAYER_ABI_VERSION: u32 = 1;

/// Default socket of `belayerd` (used when a socket path argument is NULL).
pub const BELAYER_DEFAULT_SOCKET: &str = "/run/belayer/belayer.sock";

/// Event kind: a sandbox lost its init or was killed from outside.
pub const BELAYER_EVENT_SANDBOX_FAILED: c_int = 1;
/// Event kind: a checkpoint became ready.
pub const BELAYER_EVENT_CHECKPOINT_READY: c_int = 2;

/// Decision reason: the expected benefit p*C exceeds the visible cost (adaptive, checkpoint).
pub const BELAYER_REASON_BENEFIT: c_int = 0;
/// Decision reason: the visible cost is at least the benefit (adaptive, skip).
pub const BELAYER_REASON_COST: c_int = 1;
/// Decision reason: within the cooldown after a timed-out checkpoint (adaptive, skip).
pub const BELAYER_REASON_COOLDOWN: c_int = 2;
/// Decision reason: policy `always`.
pub const BELAYER_REASON_ALWAYS: c_int = 3;
/// Decision reason: policy `never`.
pub const BELAYER_REASON_NEVER: c_int = 4;
/// Decision reason: policy `every:N`.
pub const BELAYER_REASON_EVERY_N: c_int = 5;
/// Decision reason: policy `restart`.
pub const BELAYER_REASON_RESTART: c_int = 6;
/// Decision reason: nothing changed since the last checkpoint (adaptive, skip).
pub const BELAYER_REASON_CLEAN: c_int = 7;
/// Decision reason: a reason this library does not know (newer daemon).
pub const BELAYER_REASON_UNKNOWN: c_int = -1;

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
    /// Captured stderr.
    pub stderr_buf: BelayerBuf,
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

// ---- handle registry ----------------------------------------------------------------------

enum Entry {
    Client(Arc<Mutex<Client>>),
    Subscription(Arc<Mutex<Subscription>>),
}

/// Handle numbers are never reused, so a closed handle stays unknown.
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);
static HANDLES: Mutex<Option<HashMap<u64, Entry>>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn register(entry: Entry) -> u64 {
    let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
    lock(&HANDLES)
        .get_or_insert_with(HashMap::new)
        .insert(handle, entry);
    handle
}

fn bad_handle(kind: &str, handle: u64) -> Failure {
    Failure::new(
        BELAYER_E_BAD_HANDLE,
        format!("unknown {kind} handle {handle} (never issued, closed or freed)"),
    )
}

fn client_of(handle: BelayerClient) -> Result<Arc<Mutex<Client>>, Failure> {
    match lock(&HANDLES).as_ref().and_then(|m| m.get(&handle)) {
        Some(Entry::Client(c)) => Ok(Arc::clone(c)),
        _ => Err(bad_handle("client", handle)),
    }
}

fn subscription_of(handle: BelayerSubscription) -> Result<Arc<Mutex<Subscription>>, Failure> {
    match lock(&HANDLES).as_ref().and_then(|m| m.get(&handle)) {
        Some(Entry::Subscription(s)) => Ok(Arc::clone(s)),
        _ => Err(bad_handle("subscription", handle)),
    }
}

fn unregister(handle: u64, client: bool) -> Result<(), Failure> {
    let mut handles = lock(&HANDLES);
    let map = handles.get_or_insert_with(HashMap::new);
    match map.get(&handle) {
        Some(Entry::Client(_)) if client => {}
        Some(Entry::Subscription(_)) if !client => {}
        _ => {
            return Err(bad_handle(
                if client { "client" } else { "subscription" },
                handle,
            ))
        }
    }
    map.remove(&handle);
    Ok(())
}

// ---- conversions --------------------------------------------------------------------------

/// Status code of a daemon error reply.
pub fn status_of(code: ErrorCode) -> c_int {
    match code {
        ErrorCode::BadRequest => BELAYER_E_BAD_REQUEST,
        ErrorCode::UnknownSandbox => BELAYER_E_UNKNOWN_SANDBOX,
        ErrorCode::UnknownImage => BELAYER_E_UNKNOWN_IMAGE,
        ErrorCode::AlreadyExists => BELAYER_E_ALREADY_EXISTS,
        ErrorCode::InUse => BELAYER_E_IN_USE,
        ErrorCode::InvalidState => BELAYER_E_INVALID_STATE,
        ErrorCode::CorruptCheckpoint => BELAYER_E_CORRUPT_CHECKPOINT,
        ErrorCode::CheckpointFailed => BELAYER_E_CHECKPOINT_FAILED,
        ErrorCode::RestoreFailed => BELAYER_E_RESTORE_FAILED,
        ErrorCode::ExecFailed => BELAYER_E_EXEC_FAILED,
        ErrorCode::PermissionDenied => BELAYER_E_PERMISSION_DENIED,
        ErrorCode::Unsupported => BELAYER_E_UNSUPPORTED,
        ErrorCode::Internal => BELAYER_E_INTERNAL,
        ErrorCode::NotFound => BELAYER_E_NOT_FOUND,
        ErrorCode::Busy => BELAYER_E_BUSY,
        ErrorCode::RestoreTimedOut => BELAYER_E_RESTORE_TIMED_OUT,
    }
}

fn reply_failure(reply: ErrorReply) -> Failure {
    Failure::new(status_of(reply.code), reply.message)
}

fn unexpected(what: &str, response: &Response) -> Failure {
    Failure::new(
        BELAYER_E_PROTOCOL,
        format!("unexpected answer to {what}: {response:?}"),
    )
}

/// Sends `request` on `handle`'s connection; a daemon error reply becomes its status code.
fn call(handle: BelayerClient, request: Request) -> Result<Response, Failure> {
    call_using(handle, |client| client.call(request))
}

/// Runs `exchange` on `handle`'s connection; a daemon error reply becomes its status code,
/// an image source this process cannot open `BELAYER_E_PERMISSION_DENIED` (no permission)
/// or `BELAYER_E_INVALID_ARGUMENT` (missing, not a directory or regular file).
fn call_using(
    handle: BelayerClient,
    exchange: impl FnOnce(&mut Client) -> Result<Response, belayer_ipc::ClientError>,
) -> Result<Response, Failure> {
    let client = client_of(handle)?;
    let mut client = lock(&client);
    match exchange(&mut client) {
        Ok(Response::Error(reply)) => Err(reply_failure(reply)),
        Ok(response) => Ok(response),
        Err(err @ belayer_ipc::ClientError::OpenSource { .. }) => {
            let denied = matches!(
                &err,
                belayer_ipc::ClientError::OpenSource { source, .. }
                    if source.kind() == std::io::ErrorKind::PermissionDenied
            );
            let code = if denied {
                BELAYER_E_PERMISSION_DENIED
            } else {
                BELAYER_E_INVALID_ARGUMENT
            };
            Err(Failure::new(code, chain(&err)))
        }
        Err(err) => {
            // A frame that arrives whole but does not decode means the two sides disagree on
            // the message types: a library and a daemon from different builds.
            let skew = matches!(
                &err,
                belayer_ipc::ClientError::Receive {
                    source: FrameError::Decode { .. } | FrameError::TrailingBytes { .. },
                    ..
                }
            );
            let (code, hint) = if skew {
                (
                    BELAYER_E_PROTOCOL,
                    " (libbelayer and belayerd come from different builds)",
                )
            } else {
                (BELAYER_E_CONNECT, "")
            };
            Err(Failure::new(
                code,
                format!(
                    "daemon at {}: {}{hint}",
                    client.path().display(),
                    chain(&err)
                ),
            ))
        }
    }
}

fn c_string(s: String, what: &str) -> Result<*mut c_char, Failure> {
    CString::new(s).map(CString::into_raw).map_err(|_| {
        Failure::new(
            BELAYER_E_PROTOCOL,
            format!("{what} from the daemon contains a NUL byte"),
        )
    })
}

fn buf(bytes: Vec<u8>) -> BelayerBuf {
    if bytes.is_empty() {
        return BelayerBuf::EMPTY;
    }
    let len = bytes.len();
    let data = Box::into_raw(bytes.into_boxed_slice()).cast::<u8>();
    BelayerBuf { data, len }
}

/// # Safety
/// `data` is null (then `len` must be 0) or points at `len` readable bytes for the call.
unsafe fn bytes_in<'a>(data: *const u8, len: usize, what: &str) -> Result<&'a [u8], Failure> {
    if data.is_null() {
        return if len == 0 {
            Ok(&[])
        } else {
            Err(Failure::invalid(what))
        };
    }
    // SAFETY: non-null; the caller guarantees `len` readable bytes alive for the call.
    Ok(unsafe { std::slice::from_raw_parts(data, len) })
}

/// # Safety
/// `ptr` is null or points at a NUL-terminated string valid for the call.
unsafe fn opt_text<'a>(ptr: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if ptr.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded from this function's contract.
        unsafe { text(ptr, what) }.map(Some)
    }
}

fn free_string(ptr: &mut *mut c_char) {
    if !ptr.is_null() {
        // SAFETY: every non-null string in a result struct came from CString::into_raw here,
        // and the pointer is reset below so it is freed once.
        drop(unsafe { CString::from_raw(*ptr) });
        *ptr = std::ptr::null_mut();
    }
}

impl BelayerBuf {
    const EMPTY: BelayerBuf = BelayerBuf {
        data: std::ptr::null_mut(),
        len: 0,
    };

    fn release(&mut self) {
        if !self.data.is_null() {
            let slice = std::ptr::slice_from_raw_parts_mut(self.data, self.len);
            // SAFETY: `data`/`len` came from Box::into_raw of a boxed slice in `buf`, and are
            // reset below so the slice is freed once.
            drop(unsafe { Box::from_raw(slice) });
        }
        *self = BelayerBuf::EMPTY;
    }
}

impl BelayerExecResult {
    const EMPTY: BelayerExecResult = BelayerExecResult {
        exit_code: 0,
        signal: 0,
        timed_out: false,
        truncated: false,
        duration_ms: 0.0,
        stdout_buf: BelayerBuf::EMPTY,
        stderr_buf: BelayerBuf::EMPTY,
    };
}

impl BelayerSandboxInfo {
    const EMPTY: BelayerSandboxInfo = BelayerSandboxInfo {
        id: std::ptr::null_mut(),
        image: std::ptr::null_mut(),
        state: std::ptr::null_mut(),
        init_pid: -1,
        instance: 0,
        has_ready_prefix: false,
        ready_prefix: 0,
        pids: std::ptr::null_mut(),
        pids_len: 0,
        created_unix_ms: 0,
    };
}

impl BelayerCheckpointInfo {
    const EMPTY: BelayerCheckpointInfo = BelayerCheckpointInfo {
        prefix: 0,
        bytes: 0,
        frozen_ms: 0.0,
        total_ms: 0.0,
        name: std::ptr::null_mut(),
        context_digest: std::ptr::null_mut(),
    };

    fn from_info(info: CheckpointInfo) -> Result<BelayerCheckpointInfo, Failure> {
        let name = c_string(info.checkpoint, "checkpoint name")?;
        let context_digest = match c_string(info.context_digest, "context digest") {
            Ok(d) => d,
            Err(e) => {
                free_string(&mut { name });
                return Err(e);
            }
        };
        Ok(BelayerCheckpointInfo {
            prefix: info.prefix,
            bytes: info.bytes,
            frozen_ms: info.timings_ms.frozen_total,
            total_ms: info.timings_ms.total,
            name,
            context_digest,
        })
    }
}

impl BelayerRestoreInfo {
    const EMPTY: BelayerRestoreInfo = BelayerRestoreInfo {
        has_prefix: false,
        prefix: 0,
        context: BelayerBuf::EMPTY,
        init_pid: -1,
        total_ms: 0.0,
        verified: false,
        fs_matches: false,
        processes_match: false,
        inodes_kept: false,
    };
}

impl BelayerEvent {
    const EMPTY: BelayerEvent = BelayerEvent {
        kind: 0,
        sandbox: std::ptr::null_mut(),
        prefix: 0,
        reason: std::ptr::null_mut(),
    };
}

fn reason_code(reason: &str) -> c_int {
    match reason {
        "benefit" => BELAYER_REASON_BENEFIT,
        "cost" => BELAYER_REASON_COST,
        "cooldown" => BELAYER_REASON_COOLDOWN,
        "always" => BELAYER_REASON_ALWAYS,
        "never" => BELAYER_REASON_NEVER,
        "every_n" => BELAYER_REASON_EVERY_N,
        "restart" => BELAYER_REASON_RESTART,
        "clean" => BELAYER_REASON_CLEAN,
        _ => BELAYER_REASON_UNKNOWN,
    }
}

fn opt_non_negative(v: f64) -> Option<f64> {
    (v >= 0.0).then_some(v)
}

// ---- library ------------------------------------------------------------------------------

/// The ABI version of the loaded library ([`BELAYER_ABI_VERSION`] of its build).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn belayer_abi_version() -> u32 {
    BELAYER_ABI_VERSION
}

/// The library's version string (static, never freed).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn belayer_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The name of status code `code` (e.g. `"BELAYER_E_BAD_HANDLE"`; static, never freed;
/// `"BELAYER_E_UNKNOWN"` for a code this library does not define).
///
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn belayer_status_name(code: c_int) -> *const c_char {
    let name: &'static str = match code {
        BELAYER_OK => "BELAYER_OK\0",
        BELAYER_E_INVALID_ARGUMENT => "BELAYER_E_INVALID_ARGUMENT\0",
        BELAYER_E_CONNECT => "BELAYER_E_CONNECT\0",
        BELAYER_E_REFUSED => "BELAYER_E_REFUSED\0",
        BELAYER_E_MAP => "BELAYER_E_MAP\0",
        BELAYER_E_OWNER_GONE => "BELAYER_E_OWNER_GONE\0",
        BELAYER_E_CUDA => "BELAYER_E_CUDA\0",
        BELAYER_E_LAYOUT => "BELAYER_E_LAYOUT\0",
        BELAYER_E_BAD_HANDLE => "BELAYER_E_BAD_HANDLE\0",
        BELAYER_E_TIMEOUT => "BELAYER_E_TIMEOUT\0",
        BELAYER_E_PROTOCOL => "BELAYER_E_PROTOCOL\0",
        BELAYER_E_BAD_REQUEST => "BELAYER_E_BAD_REQUEST\0",
        BELAYER_E_UNKNOWN_SANDBOX => "BELAYER_E_UNKNOWN_SANDBOX\0",
        BELAYER_E_UNKNOWN_IMAGE => "BELAYER_E_UNKNOWN_IMAGE\0",
        BELAYER_E_ALREADY_EXISTS => "BELAYER_E_ALREADY_EXISTS\0",
        BELAYER_E_IN_USE => "BELAYER_E_IN_USE\0",
        BELAYER_E_INVALID_STATE => "BELAYER_E_INVALID_STATE\0",
        BELAYER_E_CORRUPT_CHECKPOINT => "BELAYER_E_CORRUPT_CHECKPOINT\0",
        BELAYER_E_CHECKPOINT_FAILED => "BELAYER_E_CHECKPOINT_FAILED\0",
        BELAYER_E_RESTORE_FAILED => "BELAYER_E_RESTORE_FAILED\0",
        BELAYER_E_EXEC_FAILED => "BELAYER_E_EXEC_FAILED\0",
        BELAYER_E_PERMISSION_DENIED => "BELAYER_E_PERMISSION_DENIED\0",
        BELAYER_E_UNSUPPORTED => "BELAYER_E_UNSUPPORTED\0",
        BELAYER_E_INTERNAL => "BELAYER_E_INTERNAL\0",
        BELAYER_E_NOT_FOUND => "BELAYER_E_NOT_FOUND\0",
        BELAYER_E_BUSY => "BELAYER_E_BUSY\0",
        BELAYER_E_RESTORE_TIMED_OUT => "BELAYER_E_RESTORE_TIMED_OUT\0",
        BELAYER_E_PANIC => "BELAYER_E_PANIC\0",
        _ => "BELAYER_E_UNKNOWN\0",
    };
    name.as_ptr().cast()
}

/// Frees a string handed out by the library and sets `*s` to NULL. NULL and `*s == NULL`
/// are ignored.
///
/// # Safety
/// `s` is null or points at a pointer that is null or a string from this library not freed
/// yet.
#[no_mangle]
pub unsafe extern "C" fn belayer_string_free(s: *mut *mut c_char) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(s) = unsafe { s.as_mut() } {
        free_string(s);
    }
}

/// Frees the bytes of `buf` and resets it to `{NULL, 0}`. NULL is ignored.
///
/// # Safety
/// `buf` is null or points at a buffer filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_buf_free(buf: *mut BelayerBuf) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(buf) = unsafe { buf.as_mut() } {
        buf.release();
    }
}

// ---- connection ---------------------------------------------------------------------------

/// Connects to `belayerd` at `socket_path` (NULL: [`BELAYER_DEFAULT_SOCKET`]) and stores the
/// new client handle in `*out`. Close it with [`belayer_close`].
///
/// Errors: `BELAYER_E_INVALID_ARGUMENT`, `BELAYER_E_CONNECT`.
/// Thread-safety: any thread.
///
/// # Safety
/// `socket_path` is null or a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_connect(
    socket_path: *const c_char,
    out: *mut BelayerClient,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (path, out) = unsafe { (opt_text(socket_path, "socket_path")?, writable(out, "out")?) };
        *out = 0;
        let path = path.unwrap_or(BELAYER_DEFAULT_SOCKET);
        let client =
            Client::connect(path).map_err(|err| Failure::new(BELAYER_E_CONNECT, chain(&err)))?;
        *out = register(Entry::Client(Arc::new(Mutex::new(client))));
        Ok(())
    })
}

/// Closes a client handle (a call running on it from another thread finishes first).
///
/// Errors: `BELAYER_E_BAD_HANDLE` for an unknown or already closed handle.
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn belayer_close(client: BelayerClient) -> c_int {
    guard(|| unregister(client, true))
}

/// Liveness probe; stores the daemon's version in `*version` when `version` is not NULL
/// (free it with [`belayer_string_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `version` is null or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_ping(client: BelayerClient, version: *mut *mut c_char) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract (null allowed).
        let version = unsafe { version.as_mut() };
        match call(client, Request::Ping)? {
            Response::Pong { version: v } => {
                if let Some(out) = version {
                    *out = c_string(v, "version")?;
                }
                Ok(())
            }
            other => Err(unexpected("ping", &other)),
        }
    })
}

// ---- images and sandboxes -----------------------------------------------------------------

/// Imports the rootfs directory or tar archive (plain, gzip, zstd) at `source` as the
/// read-only image `name`, owned by the calling process's uid. The library opens `source`
/// itself, with this process's rights, and passes the descriptor to the daemon, which reads
/// only what this process may read (a directory is walked with its uid and groups). Device
/// nodes are refused, except under the source's top-level `/dev`, where they are left out.
///
/// Errors: daemon codes (`BELAYER_E_ALREADY_EXISTS`, `BELAYER_E_BAD_REQUEST` for a refused
/// entry such as a device node, `BELAYER_E_PERMISSION_DENIED` for an entry this process may
/// not read, ...), `BELAYER_E_PERMISSION_DENIED` or `BELAYER_E_INVALID_ARGUMENT` when
/// `source` cannot be opened here, `BELAYER_E_CONNECT`, `BELAYER_E_BAD_HANDLE`.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `name` and `source` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn belayer_image_import(
    client: BelayerClient,
    name: *const c_char,
    source: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (name, source) = unsafe { (text(name, "name")?, text(source, "source")?) };
        match call_using(client, |c| {
            c.import_image(name, std::path::Path::new(source))
        })? {
            Response::Image(_) => Ok(()),
            other => Err(unexpected("image import", &other)),
        }
    })
}

/// Creates and starts a sandbox from `image` with rollout tag `tag` (NULL: none); stores its
/// id in `*out_id` (free with [`belayer_string_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `image` is a NUL-terminated string, `tag` null or one; `out_id` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_create(
    client: BelayerClient,
    image: *const c_char,
    tag: *const c_char,
    out_id: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (image, tag, out) = unsafe {
            (
                text(image, "image")?,
                opt_text(tag, "tag")?,
                writable(out_id, "out_id")?,
            )
        };
        *out = std::ptr::null_mut();
        let spec = SandboxSpec {
            image: image.to_owned(),
            tag: tag.map(str::to_owned),
            ..Default::default()
        };
        match call(client, Request::CreateSandbox(spec))? {
            Response::Sandbox(info) => {
                *out = c_string(info.id, "sandbox id")?;
                Ok(())
            }
            other => Err(unexpected("sandbox create", &other)),
        }
    })
}

/// Describes sandbox `id` into `*out` (free with [`belayer_sandbox_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_inspect(
    client: BelayerClient,
    id: *const c_char,
    out: *mut BelayerSandboxInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // The caller's struct may hold garbage: overwrite without dropping.
        // SAFETY: `out` is valid for writes (checked non-null above, contract).
        unsafe { std::ptr::write(out, BelayerSandboxInfo::EMPTY) };
        let info = match call(client, Request::InspectSandbox { id: id.to_owned() })? {
            Response::Sandbox(info) => info,
            other => return Err(unexpected("sandbox inspect", &other)),
        };
        let mut result = BelayerSandboxInfo {
            init_pid: info.init_pid.unwrap_or(-1),
            instance: info.instance,
            has_ready_prefix: info.ready_prefix.is_some(),
            ready_prefix: info.ready_prefix.unwrap_or(0),
            created_unix_ms: info.created_unix_ms,
            ..BelayerSandboxInfo::EMPTY
        };
        let filled = (|| {
            result.id = c_string(info.id, "sandbox id")?;
            result.image = c_string(info.image, "image")?;
            result.state = c_string(info.state.as_str().to_owned(), "state")?;
            Ok(())
        })();
        if let Err(e) = filled {
            release_sandbox_info(&mut result);
            return Err(e);
        }
        if !info.pids.is_empty() {
            result.pids_len = info.pids.len();
            result.pids = Box::into_raw(info.pids.into_boxed_slice()).cast::<i32>();
        }
        *out = result;
        Ok(())
    })
}

fn release_sandbox_info(info: &mut BelayerSandboxInfo) {
    free_string(&mut info.id);
    free_string(&mut info.image);
    free_string(&mut info.state);
    if !info.pids.is_null() {
        let slice = std::ptr::slice_from_raw_parts_mut(info.pids, info.pids_len);
        // SAFETY: `pids`/`pids_len` came from Box::into_raw of a boxed slice in
        // belayer_sandbox_inspect and are reset below, so the slice is freed once.
        drop(unsafe { Box::from_raw(slice) });
    }
    *info = BelayerSandboxInfo::EMPTY;
}

/// Frees what [`belayer_sandbox_inspect`] stored in `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_info_free(info: *mut BelayerSandboxInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        release_sandbox_info(info);
    }
}

/// Kills sandbox `id` and deletes it with all its checkpoints.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_destroy(
    client: BelayerClient,
    id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let id = unsafe { text(id, "id")? };
        match call(client, Request::RemoveSandbox { id: id.to_owned() })? {
            Response::Done => Ok(()),
            other => Err(unexpected("sandbox destroy", &other)),
        }
    })
}

/// Runs one action, `command` with `/bin/sh -c`, in sandbox `id`, killed after `timeout_ms`
/// milliseconds (0: no timeout); stores the outcome in `*out` (free with
/// [`belayer_exec_result_free`]). A non-zero exit of the action is not a failure of the call.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `command` are NUL-terminated strings; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_exec(
    client: BelayerClient,
    id: *const c_char,
    command: *const c_char,
    timeout_ms: u64,
    out: *mut BelayerExecResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, command, out) = unsafe {
            (
                text(id, "id")?,
                text(command, "command")?,
                writable(out, "out")?,
            )
        };
        // SAFETY: `out` is valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerExecResult::EMPTY) };
        let req = ExecRequest {
            id: id.to_owned(),
            argv: vec![command.to_owned()],
            timeout_ms: (timeout_ms > 0).then_some(timeout_ms),
            ..Default::default()
        };
        match call(client, Request::Exec(req))? {
            Response::Exec(r) => {
                *out = BelayerExecResult {
                    exit_code: r.exit_code,
                    signal: r.signal.unwrap_or(0),
                    timed_out: r.timed_out,
                    truncated: r.truncated,
                    duration_ms: r.duration_ms,
                    stdout_buf: buf(r.stdout),
                    stderr_buf: buf(r.stderr),
                };
                Ok(())
            }
            other => Err(unexpected("exec", &other)),
        }
    })
}

/// Frees the buffers of `*result` and zeroes it. NULL is ignored.
///
/// # Safety
/// `result` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_exec_result_free(result: *mut BelayerExecResult) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(r) = unsafe { result.as_mut() } {
        r.stdout_buf.release();
        r.stderr_buf.release();
        *r = BelayerExecResult::EMPTY;
    }
}

// ---- checkpoints --------------------------------------------------------------------------

/// Takes a full checkpoint C_k of sandbox `id` at action boundary `prefix`, storing the LLM
/// context `context[0..context_len]` with it; describes it in `*out` when `out` is not NULL
/// (free with [`belayer_checkpoint_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `context` is null (with length 0) or points at
/// `context_len` bytes; `out` is null or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint(
    client: BelayerClient,
    id: *const c_char,
    prefix: u64,
    context: *const u8,
    context_len: usize,
    out: *mut BelayerCheckpointInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, context, mut out) = unsafe {
            (
                text(id, "id")?,
                bytes_in(context, context_len, "context")?,
                out.as_mut(),
            )
        };
        // The struct has no drop glue: overwriting garbage is fine.
        if let Some(o) = out.as_deref_mut() {
            *o = BelayerCheckpointInfo::EMPTY;
        }
        let req = CheckpointRequest {
            id: id.to_owned(),
            prefix,
            context: context.to_vec(),
            fault: None,
        };
        match call(client, Request::Checkpoint(req))? {
            Response::Checkpoint(info) => {
                if let Some(out) = out {
                    *out = BelayerCheckpointInfo::from_info(info)?;
                }
                Ok(())
            }
            other => Err(unexpected("checkpoint", &other)),
        }
    })
}

/// Frees the strings of `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint_info_free(info: *mut BelayerCheckpointInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        free_string(&mut info.name);
        free_string(&mut info.context_digest);
        *info = BelayerCheckpointInfo::EMPTY;
    }
}

/// Feeds the checkpoint policy of sandbox `id` the timing of the step that reached boundary
/// `prefix`; the daemon takes a full checkpoint (with `context`) when the policy says so.
/// `policy` (NULL: keep the sandbox's current one; default adaptive with p = 0.01 per step)
/// sets or replaces the policy. Stores the decision in `*out`.
///
/// Errors: as [`belayer_checkpoint`] when a checkpoint was attempted and failed;
/// `BELAYER_E_BAD_REQUEST` for an invalid policy.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `context` is null (with length 0) or points at
/// `context_len` bytes; `step` is a valid pointer; `policy` is null or valid (its `kind` null
/// or a NUL-terminated string); `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_maybe_checkpoint(
    client: BelayerClient,
    id: *const c_char,
    prefix: u64,
    context: *const u8,
    context_len: usize,
    step: *const BelayerStep,
    policy: *const BelayerPolicy,
    out: *mut BelayerDecision,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, context, step, policy, out) = unsafe {
            (
                text(id, "id")?,
                bytes_in(context, context_len, "context")?,
                step.as_ref().ok_or_else(|| Failure::invalid("step"))?,
                policy.as_ref(),
                writable(out, "out")?,
            )
        };
        *out = BelayerDecision::default();
        let policy = match policy {
            None => None,
            Some(p) => Some(PolicySpec {
                // SAFETY: forwarded from this function's contract.
                kind: unsafe { opt_text(p.kind, "policy.kind")? }.map(str::to_owned),
                failure_p: opt_non_negative(p.failure_p),
                failure_rate_per_s: opt_non_negative(p.failure_rate_per_s),
                checkpoint_timeout_s: opt_non_negative(p.checkpoint_timeout_s),
                cooldown_s: opt_non_negative(p.cooldown_s),
                ..Default::default()
            }),
        };
        let req = MaybeCheckpointRequest {
            id: id.to_owned(),
            prefix,
            context: context.to_vec(),
            step_duration_s: step.step_duration_s,
            regen_cost_s: opt_non_negative(step.regen_cost_s),
            llm_elapsed_s: step.llm_elapsed_s.max(0.0),
            llm_response_s: opt_non_negative(step.llm_response_s),
            policy,
        };
        match call(client, Request::MaybeCheckpoint(req))? {
            Response::MaybeCheckpoint(r) => {
                let d = &r.decision;
                let mut decision = BelayerDecision {
                    checkpointed: r.checkpointed,
                    reason: reason_code(d.reason.as_str()),
                    p: d.p,
                    regen_cost_s: d.regen_cost_s,
                    c_s: d.c_s,
                    q: d.q,
                    benefit: d.benefit,
                    visible_cost: d.visible_cost,
                    ..BelayerDecision::default()
                };
                if let Some(c) = &r.checkpoint {
                    decision.checkpoint_prefix = c.prefix;
                    decision.checkpoint_bytes = c.bytes;
                    decision.checkpoint_frozen_ms = c.timings_ms.frozen_total;
                    decision.checkpoint_total_ms = c.timings_ms.total;
                }
                *out = decision;
                Ok(())
            }
            other => Err(unexpected("maybe_checkpoint", &other)),
        }
    })
}

/// Restores sandbox `id` from its ready checkpoint into a fresh instance (from its base
/// image when none is ready), checking the restored state against the checkpoint when
/// `verify`; stores k and the LLM context L_k in `*out` (free with
/// [`belayer_restore_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_restore(
    client: BelayerClient,
    id: *const c_char,
    verify: bool,
    out: *mut BelayerRestoreInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerRestoreInfo::EMPTY) };
        match call(
            client,
            Request::Restore {
                id: id.to_owned(),
                verify,
            },
        )? {
            Response::Restored(r) => {
                *out = BelayerRestoreInfo {
                    has_prefix: r.prefix.is_some(),
                    prefix: r.prefix.unwrap_or(0),
                    init_pid: r.init_pid,
                    total_ms: r.timings_ms.total,
                    verified: r.validity.is_some(),
                    fs_matches: r.validity.as_ref().is_some_and(|v| v.fs_matches),
                    processes_match: r.validity.as_ref().is_some_and(|v| v.processes_match),
                    inodes_kept: r.inodes_kept,
                    context: buf(r.context),
                };
                Ok(())
            }
            other => Err(unexpected("restore", &other)),
        }
    })
}

/// Frees the context of `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_restore_info_free(info: *mut BelayerRestoreInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        info.context.release();
        *info = BelayerRestoreInfo::EMPTY;
    }
}

// ---- context log --------------------------------------------------------------------------

/// Appends the LLM context `data[0..len]` of `trajectory` at boundary `prefix` to its
/// context log (durable on return); stores the record id in `*out_record` when not NULL.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `trajectory` is a NUL-terminated string; `data` is null (with length 0) or points at
/// `len` bytes; `out_record` is null or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_context_append(
    client: BelayerClient,
    trajectory: *const c_char,
    prefix: u64,
    data: *const u8,
    len: usize,
    out_record: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (trajectory, data, out) = unsafe {
            (
                text(trajectory, "trajectory")?,
                bytes_in(data, len, "data")?,
                out_record.as_mut(),
            )
        };
        match call(
            client,
            Request::ContextAppend {
                trajectory: trajectory.to_owned(),
                prefix,
                context: data.to_vec(),
            },
        )? {
            Response::Context(entry) => {
                if let Some(out) = out {
                    *out = entry.record;
                }
                Ok(())
            }
            other => Err(unexpected("context append", &other)),
        }
    })
}

/// Looks up the context of `trajectory` at boundary `prefix` (negative: its latest
/// boundary); stores the boundary in `*out_prefix` (when not NULL) and the bytes in `*out`
/// (free with [`belayer_buf_free`]).
///
/// Errors: `BELAYER_E_NOT_FOUND` when there is no such record.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `trajectory` is a NUL-terminated string; `out_prefix` is null or valid; `out` is a valid
/// pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_context_lookup(
    client: BelayerClient,
    trajectory: *const c_char,
    prefix: i64,
    out_prefix: *mut u64,
    out: *mut BelayerBuf,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (trajectory, out_prefix, out) = unsafe {
            (
                text(trajectory, "trajectory")?,
                out_prefix.as_mut(),
                writable(out, "out")?,
            )
        };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerBuf::EMPTY) };
        match call(
            client,
            Request::ContextLookup {
                trajectory: trajectory.to_owned(),
                prefix: u64::try_from(prefix).ok(),
            },
        )? {
            Response::Context(entry) => {
                if let Some(p) = out_prefix {
                    *p = entry.prefix;
                }
                *out = buf(entry.context);
                Ok(())
            }
            other => Err(unexpected("context lookup", &other)),
        }
    })
}

// ---- events -------------------------------------------------------------------------------

/// Opens an event stream on a new connection to `belayerd` at `socket_path` (NULL: the
/// default socket); stores the subscription handle in `*out`. Events published from now on
/// (sandbox failed, checkpoint ready) are read with [`belayer_next_event`]. Free it with
/// [`belayer_unsubscribe`].
///
/// Thread-safety: any thread.
///
/// # Safety
/// `socket_path` is null or a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_subscribe(
    socket_path: *const c_char,
    out: *mut BelayerSubscription,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (path, out) = unsafe { (opt_text(socket_path, "socket_path")?, writable(out, "out")?) };
        *out = 0;
        let path = path.unwrap_or(BELAYER_DEFAULT_SOCKET);
        let client =
            Client::connect(path).map_err(|err| Failure::new(BELAYER_E_CONNECT, chain(&err)))?;
        let sub = client.subscribe().map_err(|err| match err {
            belayer_ipc::ClientError::SubscribeRefused { code, message } => {
                Failure::new(status_of(code), message)
            }
            other => Failure::new(BELAYER_E_CONNECT, chain(&other)),
        })?;
        *out = register(Entry::Subscription(Arc::new(Mutex::new(sub))));
        Ok(())
    })
}

/// Waits up to `timeout_ms` milliseconds (negative: forever) for the next event and stores
/// it in `*out` (free with [`belayer_event_free`]).
///
/// Errors: `BELAYER_E_TIMEOUT` when none came in time (the subscription stays usable),
/// `BELAYER_E_CONNECT` when the daemon closed the stream, `BELAYER_E_BAD_HANDLE`.
/// Thread-safety: any thread; one reader at a time per subscription.
///
/// # Safety
/// `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_next_event(
    subscription: BelayerSubscription,
    timeout_ms: i64,
    out: *mut BelayerEvent,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let out = unsafe { writable(out, "out")? };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerEvent::EMPTY) };
        let sub = subscription_of(subscription)?;
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        let event = lock(&sub)
            .next_event(timeout)
            .map_err(|err| Failure::new(BELAYER_E_CONNECT, chain(&err)))?
            .ok_or_else(|| {
                Failure::new(
                    BELAYER_E_TIMEOUT,
                    format!("no event within {timeout_ms} ms"),
                )
            })?;
        *out = match event {
            Event::SandboxFailed { id, reason } => {
                let sandbox = c_string(id, "sandbox id")?;
                let reason = c_string(reason, "reason").inspect_err(|_| {
                    free_string(&mut { sandbox });
                })?;
                BelayerEvent {
                    kind: BELAYER_EVENT_SANDBOX_FAILED,
                    sandbox,
                    prefix: 0,
                    reason,
                }
            }
            Event::CheckpointReady { id, prefix } => BelayerEvent {
                kind: BELAYER_EVENT_CHECKPOINT_READY,
                sandbox: c_string(id, "sandbox id")?,
                prefix,
                reason: std::ptr::null_mut(),
            },
        };
        Ok(())
    })
}

/// Frees the strings of `*event` and zeroes it. NULL is ignored.
///
/// # Safety
/// `event` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_event_free(event: *mut BelayerEvent) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(event) = unsafe { event.as_mut() } {
        free_string(&mut event.sandbox);
        free_string(&mut event.reason);
        *event = BelayerEvent::EMPTY;
    }
}

/// Closes a subscription (its connection; the daemon drops the stream).
///
/// Errors: `BELAYER_E_BAD_HANDLE` for an unknown or already closed handle.
/// Thread-safety: any thread.
#[no_mangle]
pub extern "C" fn belayer_unsubscribe(subscription: BelayerSubscription) -> c_int {
    guard(|| unregister(subscription, false))
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::ptr;

    use super::*;

    fn last_error() -> String {
        // SAFETY: never null; valid until the next failing call on this thread.
        unsafe { CStr::from_ptr(belayer_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn versions_and_status_names_are_static() {
        assert_eq!(belayer_abi_version(), BELAYER_ABI_VERSION);
        // SAFETY: static NUL-terminated strings.
        unsafe {
            assert_eq!(
                CStr::from_ptr(belayer_version()).to_str().unwrap(),
                env!("CARGO_PKG_VERSION")
            );
            assert_eq!(
                CStr::from_ptr(belayer_status_name(BELAYER_E_BAD_HANDLE))
                    .to_str()
                    .unwrap(),
                "BELAYER_E_BAD_HANDLE"
            );
            assert_eq!(
                CStr::from_ptr(belayer_status_name(12345)).to_str().unwrap(),
                "BELAYER_E_UNKNOWN"
            );
        }
    }

    #[test]
    fn unknown_handles_are_refused() {
        let mut r = BelayerExecResult::EMPTY;
        // SAFETY: valid strings and out-pointer.
        let rc = unsafe { belayer_exec(424242, c"sb".as_ptr(), c"true".as_ptr(), 0, &mut r) };
        assert_eq!(rc, BELAYER_E_BAD_HANDLE);
        assert!(last_error().contains("424242"), "{}", last_error());
        assert_eq!(belayer_close(0), BELAYER_E_BAD_HANDLE);
        assert_eq!(belayer_unsubscribe(7_000_000), BELAYER_E_BAD_HANDLE);
    }

    #[test]
    fn free_functions_accept_null_and_zeroed_structs_twice() {
        let mut b = buf(vec![1, 2, 3]);
        let mut s = CString::new("x").unwrap().into_raw();
        // SAFETY: filled by this library or zeroed; freed twice on purpose (second is no-op).
        unsafe {
            belayer_buf_free(&mut b);
            belayer_buf_free(&mut b);
            belayer_buf_free(ptr::null_mut());
            belayer_string_free(&mut s);
            belayer_string_free(&mut s);
            belayer_string_free(ptr::null_mut());
            belayer_exec_result_free(ptr::null_mut());
            belayer_sandbox_info_free(ptr::null_mut());
            belayer_checkpoint_info_free(ptr::null_mut());
            belayer_restore_info_free(ptr::null_mut());
            belayer_event_free(ptr::null_mut());
        }
        assert!(b.data.is_null() && s.is_null());
    }
}
