//! Conversions between the protocol and the C structs: status codes, strings and buffers handed out, text and bytes taken in, and the free functions' helpers.

use crate::status::{text, Failure};
use belayer_ipc::error_chain;
use belayer_ipc::{CheckpointInfo, Client, ErrorCode, ErrorReply, FrameError, Request, Response};
use std::ffi::{c_char, c_int, CString};

use crate::handles::*;
use crate::types::*;
use crate::*;

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
        ErrorCode::TransferFailed => BELAYER_E_TRANSFER_FAILED,
        ErrorCode::NoSpace => BELAYER_E_NO_SPACE,
        ErrorCode::TransferTimedOut => BELAYER_E_TRANSFER_TIMED_OUT,
        ErrorCode::RegistryUnreachable => BELAYER_E_REGISTRY_UNREACHABLE,
        ErrorCode::RegistryDenied => BELAYER_E_REGISTRY_DENIED,
        ErrorCode::CorruptImage => BELAYER_E_CORRUPT_IMAGE,
        ErrorCode::ImageChanged => BELAYER_E_IMAGE_CHANGED,
    }
}

pub(crate) fn reply_failure(reply: ErrorReply) -> Failure {
    Failure::new(status_of(reply.code), reply.message)
}

pub(crate) fn unexpected(what: &str, response: &Response) -> Failure {
    Failure::new(
        BELAYER_E_PROTOCOL,
        format!("unexpected answer to {what}: {response:?}"),
    )
}

/// Sends `request` on `handle`'s connection; a daemon error reply becomes its status code.
pub(crate) fn call(handle: BelayerClient, request: Request) -> Result<Response, Failure> {
    call_using(handle, |client| client.call(request))
}

/// Runs `exchange` on `handle`'s connection; a daemon error reply becomes its status code,
/// an image source this process cannot open `BELAYER_E_PERMISSION_DENIED` (no permission)
/// or `BELAYER_E_INVALID_ARGUMENT` (missing, not a directory or regular file).
pub(crate) fn call_using(
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
            Err(Failure::new(code, error_chain(&err)))
        }
        Err(err) => Err(connection_failure(&client, &err)),
    }
}

/// The failure of a call on `client` that did not get an answer: `BELAYER_E_PROTOCOL` for
/// version skew, else `BELAYER_E_CONNECT`.
pub(crate) fn connection_failure(client: &Client, err: &belayer_ipc::ClientError) -> Failure {
    // A frame that arrives whole but does not decode means the two sides disagree on the
    // message types: a library and a daemon from different builds.
    let skew = matches!(
        err,
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
    Failure::new(
        code,
        format!(
            "daemon at {}: {}{hint}",
            client.path().display(),
            error_chain(err)
        ),
    )
}

pub(crate) fn c_string(s: String, what: &str) -> Result<*mut c_char, Failure> {
    CString::new(s).map(CString::into_raw).map_err(|_| {
        Failure::new(
            BELAYER_E_PROTOCOL,
            format!("{what} from the daemon contains a NUL byte"),
        )
    })
}

pub(crate) fn buf(bytes: Vec<u8>) -> BelayerBuf {
    if bytes.is_empty() {
        return BelayerBuf::EMPTY;
    }
    let len = bytes.len();
    let data = Box::into_raw(bytes.into_boxed_slice()).cast::<u8>();
    BelayerBuf { data, len }
}

/// # Safety
/// `data` is null (then `len` must be 0) or points at `len` readable bytes for the call.
pub(crate) unsafe fn bytes_in<'a>(
    data: *const u8,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
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
pub(crate) unsafe fn opt_text<'a>(
    ptr: *const c_char,
    what: &str,
) -> Result<Option<&'a str>, Failure> {
    if ptr.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded from this function's contract.
        unsafe { text(ptr, what) }.map(Some)
    }
}

pub(crate) fn free_string(ptr: &mut *mut c_char) {
    if !ptr.is_null() {
        // SAFETY: every non-null string in a result struct came from CString::into_raw here,
        // and the pointer is reset below so it is freed once.
        drop(unsafe { CString::from_raw(*ptr) });
        *ptr = std::ptr::null_mut();
    }
}

impl BelayerBuf {
    pub(crate) const EMPTY: BelayerBuf = BelayerBuf {
        data: std::ptr::null_mut(),
        len: 0,
    };

    pub(crate) fn release(&mut self) {
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
    pub(crate) const EMPTY: BelayerExecResult = BelayerExecResult {
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
    pub(crate) const EMPTY: BelayerSandboxInfo = BelayerSandboxInfo {
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
    pub(crate) const EMPTY: BelayerCheckpointInfo = BelayerCheckpointInfo {
        prefix: 0,
        bytes: 0,
        frozen_ms: 0.0,
        total_ms: 0.0,
        name: std::ptr::null_mut(),
        context_digest: std::ptr::null_mut(),
    };

    pub(crate) fn from_info(info: CheckpointInfo) -> Result<BelayerCheckpointInfo, Failure> {
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
    pub(crate) const EMPTY: BelayerRestoreInfo = BelayerRestoreInfo {
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
    pub(crate) const EMPTY: BelayerEvent = BelayerEvent {
        kind: 0,
        sandbox: std::ptr::null_mut(),
        prefix: 0,
        reason: std::ptr::null_mut(),
    };
}

pub(crate) fn reason_code(reason: &str) -> c_int {
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

pub(crate) fn opt_non_negative(v: f64) -> Option<f64> {
    (v >= 0.0).then_some(v)
}

/// A connection to the daemon at `path` (`None`: [`BELAYER_DEFAULT_SOCKET`]).
///
/// Errors: `BELAYER_E_CONNECT` with the cause.
pub(crate) fn connect_to(path: Option<&str>) -> Result<Client, Failure> {
    Client::connect(path.unwrap_or(BELAYER_DEFAULT_SOCKET))
        .map_err(|err| Failure::new(BELAYER_E_CONNECT, error_chain(&err)))
}

/// Leaks `items` as a C array (`(NULL, 0)` when empty).
pub(crate) fn array<T>(items: Vec<T>) -> (*mut T, usize) {
    if items.is_empty() {
        return (std::ptr::null_mut(), 0);
    }
    let len = items.len();
    (Box::into_raw(items.into_boxed_slice()).cast::<T>(), len)
}

/// Takes back an array of [`array`] and reset `(items, len)`.
///
/// # Safety
/// `(items, len)` came from [`array`] (or is `(NULL, _)`), and is not used afterwards.
pub(crate) unsafe fn take_array<T>(items: &mut *mut T, len: &mut usize) -> Vec<T> {
    if items.is_null() {
        *len = 0;
        return Vec::new();
    }
    let slice = std::ptr::slice_from_raw_parts_mut(*items, *len);
    *items = std::ptr::null_mut();
    *len = 0;
    // SAFETY: from Box::into_raw of a boxed slice of this length (contract); reset above.
    unsafe { Box::from_raw(slice) }.into_vec()
}
