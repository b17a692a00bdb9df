//! Library-level functions: ABI and library versions, status names, freeing strings and buffers.

use std::ffi::{c_char, c_int};

use crate::convert::*;
use crate::types::*;
use crate::*;

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
        BELAYER_E_TRANSFER_FAILED => "BELAYER_E_TRANSFER_FAILED\0",
        BELAYER_E_NO_SPACE => "BELAYER_E_NO_SPACE\0",
        BELAYER_E_TRANSFER_TIMED_OUT => "BELAYER_E_TRANSFER_TIMED_OUT\0",
        BELAYER_E_REGISTRY_UNREACHABLE => "BELAYER_E_REGISTRY_UNREACHABLE\0",
        BELAYER_E_REGISTRY_DENIED => "BELAYER_E_REGISTRY_DENIED\0",
        BELAYER_E_CORRUPT_IMAGE => "BELAYER_E_CORRUPT_IMAGE\0",
        BELAYER_E_IMAGE_CHANGED => "BELAYER_E_IMAGE_CHANGED\0",
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
