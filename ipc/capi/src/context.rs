//! The per-trajectory context logs L_k: append, look up and remove.

use crate::status::{guard, text, writable};
use belayer_ipc::{Request, Response};
use std::ffi::{c_char, c_int};

use crate::convert::*;
use crate::types::*;

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

/// Removes the context log of `trajectory` with all its records, giving what it was charged
/// back to its owner's context budget; a later [`belayer_context_append`] to it starts a new
/// log.
///
/// Errors: `BELAYER_E_NOT_FOUND` when there is no such trajectory (also for another uid's,
/// which this process may not see), `BELAYER_E_BAD_REQUEST` for an invalid id,
/// `BELAYER_E_INTERNAL` when the daemon cannot remove the file, `BELAYER_E_CONNECT`,
/// `BELAYER_E_BAD_HANDLE`.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `trajectory` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn belayer_context_remove(
    client: BelayerClient,
    trajectory: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let trajectory = unsafe { text(trajectory, "trajectory")? };
        match call(
            client,
            Request::ContextRemove {
                trajectory: trajectory.to_owned(),
            },
        )? {
            Response::Done => Ok(()),
            other => Err(unexpected("context remove", &other)),
        }
    })
}
