//! Unit tests of the C ABI's conversions and handle registry.

use std::ffi::CStr;
use std::ptr;

use super::*;
use crate::convert::buf;
use std::ffi::CString;

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
