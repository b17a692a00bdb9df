//! Connections to `belayerd`: connect, close, ping.

use crate::status::{guard, writable};
use belayer_ipc::{Request, Response};
use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex};

use crate::convert::*;
use crate::handles::*;
use crate::types::*;

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
        let client = connect_to(path)?;
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
