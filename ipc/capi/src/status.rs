//! Shared machinery of `libbelayer`'s C ABI: status codes, the per-thread last error, the
//! panic guard and argument checks.
//!
//! Both halves of the C ABI use it: the memory-server functions (`belayer_mem_*`, in
//! [`crate::memory`]) and the daemon functions (`belayer_*`, the other modules).
//! Every exported function returns a status code ([`BELAYER_OK`] = 0, negative on failure)
//! computed by [`guard`]; on failure the message is kept per thread and returned by
//! [`belayer_last_error`]. No Rust panic crosses the boundary: a panic becomes
//! [`BELAYER_E_PANIC`].

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Success.
pub const BELAYER_OK: c_int = 0;
/// A pointer argument is null, a string is not UTF-8, or a value is out of range.
pub const BELAYER_E_INVALID_ARGUMENT: c_int = -1;
/// The server (daemon or memory server) could not be reached, or the connection failed
/// mid-call (the connection is then unusable: close it and connect again).
pub const BELAYER_E_CONNECT: c_int = -2;
/// The memory server refused the request (lease conflict, layout mismatch, ...).
pub const BELAYER_E_REFUSED: c_int = -3;
/// Mapping, unmapping, remapping or copying failed.
pub const BELAYER_E_MAP: c_int = -4;
/// The owner-alive check failed: the server process, its connection or its socket is gone.
pub const BELAYER_E_OWNER_GONE: c_int = -5;
/// A CUDA driver call failed, or no driver is present.
pub const BELAYER_E_CUDA: c_int = -6;
/// The layout file could not be read or is invalid.
pub const BELAYER_E_LAYOUT: c_int = -7;
/// A handle is unknown: never issued, already closed or freed, or of another kind.
pub const BELAYER_E_BAD_HANDLE: c_int = -8;
/// Waiting for an event timed out (not a failure of the subscription).
pub const BELAYER_E_TIMEOUT: c_int = -9;
/// The daemon answered something this library does not expect (version skew).
pub const BELAYER_E_PROTOCOL: c_int = -10;
/// Daemon: the request was malformed or its arguments invalid.
pub const BELAYER_E_BAD_REQUEST: c_int = -20;
/// Daemon: no sandbox with that id.
pub const BELAYER_E_UNKNOWN_SANDBOX: c_int = -21;
/// Daemon: no image with that name.
pub const BELAYER_E_UNKNOWN_IMAGE: c_int = -22;
/// Daemon: the name is already taken.
pub const BELAYER_E_ALREADY_EXISTS: c_int = -23;
/// Daemon: the thing is in use (e.g. an image used by a sandbox).
pub const BELAYER_E_IN_USE: c_int = -24;
/// Daemon: the sandbox is not in a state that allows the request.
pub const BELAYER_E_INVALID_STATE: c_int = -25;
/// Daemon: a checkpoint failed verification.
pub const BELAYER_E_CORRUPT_CHECKPOINT: c_int = -26;
/// Daemon: taking a checkpoint failed; the previous one is still ready.
pub const BELAYER_E_CHECKPOINT_FAILED: c_int = -27;
/// Daemon: restoring failed.
pub const BELAYER_E_RESTORE_FAILED: c_int = -28;
/// Daemon: running an action failed (not the action's own non-zero exit).
pub const BELAYER_E_EXEC_FAILED: c_int = -29;
/// Daemon: the peer is not allowed to talk to the daemon.
pub const BELAYER_E_PERMISSION_DENIED: c_int = -30;
/// Daemon: a kernel or tool feature is missing.
pub const BELAYER_E_UNSUPPORTED: c_int = -31;
/// Daemon: anything else on the daemon's side.
pub const BELAYER_E_INTERNAL: c_int = -32;
/// Daemon: the looked-up thing (e.g. a context record) does not exist.
pub const BELAYER_E_NOT_FOUND: c_int = -33;
/// Daemon: it is at a connection or event-stream limit, or closed an idle connection to make
/// room; the request was not handled (connect again later).
pub const BELAYER_E_BUSY: c_int = -34;
/// Daemon: a CRIU restore ran past its time limit and was killed; the sandbox is failed, its
/// ready checkpoint untouched (restoring again may succeed).
pub const BELAYER_E_RESTORE_TIMED_OUT: c_int = -35;
/// Daemon: a file transfer failed (an archive member refused by the hardening rules, the
/// helper killed, the transfer cancelled); on the host side of `belayer_upload` /
/// `belayer_download`: a source that cannot be read or a member refused on extraction.
pub const BELAYER_E_TRANSFER_FAILED: c_int = -36;
/// Daemon: the sandbox's disk limit was reached while a transfer wrote into it (or the host
/// file system filled while a download was extracted).
pub const BELAYER_E_NO_SPACE: c_int = -37;
/// Daemon: a file transfer ran past its timeout, or its helper made no progress for 30 s.
pub const BELAYER_E_TRANSFER_TIMED_OUT: c_int = -38;
/// Daemon: a registry could not be reached (refused, unknown host, timeout, TLS).
pub const BELAYER_E_REGISTRY_UNREACHABLE: c_int = -39;
/// Daemon: a registry refused the credentials (or asked for some).
pub const BELAYER_E_REGISTRY_DENIED: c_int = -40;
/// Daemon: an image's content failed verification or was refused (digest mismatch,
/// truncated blob, missing blob, hostile layer); nothing of it was kept.
pub const BELAYER_E_CORRUPT_IMAGE: c_int = -41;
/// Daemon: a restore was refused because the sandbox's image changed digest.
pub const BELAYER_E_IMAGE_CHANGED: c_int = -42;
/// An internal panic was caught.
pub const BELAYER_E_PANIC: c_int = -99;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `message` as this thread's last error (NUL bytes become spaces).
pub fn set_last_error(message: String) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = message);
}

/// A failure on its way to C: a status code (`BELAYER_E_*`) and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Status code returned to C.
    pub code: c_int,
    /// Message kept as the thread's last error.
    pub message: String,
}

impl Failure {
    /// A failure with `code` and `message`.
    pub fn new(code: c_int, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// [`BELAYER_E_INVALID_ARGUMENT`] naming the argument `what`.
    pub fn invalid(what: &str) -> Failure {
        Failure::new(
            BELAYER_E_INVALID_ARGUMENT,
            format!("invalid argument: {what}"),
        )
    }
}

/// Runs `body`, turning a failure or a panic into a status code and the thread's last error.
pub fn guard(body: impl FnOnce() -> Result<(), Failure>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => BELAYER_OK,
        Ok(Err(Failure { code, message })) => {
            set_last_error(message);
            code
        }
        Err(_) => {
            set_last_error("internal panic".to_owned());
            BELAYER_E_PANIC
        }
    }
}

/// Reads the NUL-terminated UTF-8 string argument `what`.
///
/// Errors: [`BELAYER_E_INVALID_ARGUMENT`] for a null pointer or invalid UTF-8.
///
/// # Safety
/// `ptr` is null or points at a NUL-terminated string valid for the call.
pub unsafe fn text<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::invalid(what));
    }
    // SAFETY: non-null, and the caller guarantees a NUL-terminated string alive for the call.
    unsafe { CStr::from_ptr(ptr) }.to_str().map_err(|_| {
        Failure::new(
            BELAYER_E_INVALID_ARGUMENT,
            format!("invalid argument: {what} is not UTF-8"),
        )
    })
}

/// Borrows the out-pointer argument `what` for writing.
///
/// Errors: [`BELAYER_E_INVALID_ARGUMENT`] for a null pointer.
///
/// # Safety
/// `ptr` is null or a valid, exclusive pointer for the call.
pub unsafe fn writable<'a, T>(ptr: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    // SAFETY: the caller guarantees a null or valid, exclusive pointer.
    unsafe { ptr.as_mut() }.ok_or_else(|| Failure::invalid(what))
}

/// The last error message of this thread (empty when none), valid until the next failing
/// call on this thread. Never null.
///
/// Thread-safety: any thread; each thread sees its own last error.
#[no_mangle]
pub extern "C" fn belayer_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_keeps_the_message_and_catches_panics() {
        assert_eq!(guard(|| Ok(())), BELAYER_OK);
        assert_eq!(
            guard(|| Err(Failure::new(BELAYER_E_BAD_HANDLE, "gone\0x"))),
            BELAYER_E_BAD_HANDLE
        );
        // SAFETY: belayer_last_error never returns null.
        let text = unsafe { CStr::from_ptr(belayer_last_error()) };
        assert_eq!(text.to_str().unwrap(), "gone x");
        assert_eq!(guard(|| panic!("boom")), BELAYER_E_PANIC);
    }

    #[test]
    fn text_rejects_null_and_invalid_utf8() {
        // SAFETY: null is allowed by the contract.
        let err = unsafe { text(std::ptr::null(), "name") }.unwrap_err();
        assert_eq!(err.code, BELAYER_E_INVALID_ARGUMENT);
        let bad = [0xffu8, 0xfe, 0];
        // SAFETY: a NUL-terminated byte string.
        let err = unsafe { text(bad.as_ptr().cast(), "name") }.unwrap_err();
        assert!(err.message.contains("not UTF-8"), "{}", err.message);
    }
}
