//! Daemon events: subscribe, next event, free, unsubscribe.

use crate::status::{guard, writable, Failure};
use belayer_ipc::error_chain;
use belayer_ipc::Event;
use std::ffi::{c_char, c_int};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::convert::*;
use crate::handles::*;
use crate::types::*;
use crate::*;

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
        let client = connect_to(path)?;
        let sub = client.subscribe().map_err(|err| match err {
            belayer_ipc::ClientError::SubscribeRefused { code, message } => {
                Failure::new(status_of(code), message)
            }
            other => Failure::new(BELAYER_E_CONNECT, error_chain(&other)),
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
            .map_err(|err| Failure::new(BELAYER_E_CONNECT, error_chain(&err)))?
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
