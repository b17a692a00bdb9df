//! The handle registry: clients and subscriptions behind opaque 64-bit numbers, never reused.

use crate::status::Failure;
use belayer_ipc::{Client, Subscription};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::types::*;
use crate::*;

pub(crate) enum Entry {
    Client(Arc<Mutex<Client>>),
    Subscription(Arc<Mutex<Subscription>>),
}

/// Handle numbers are never reused, so a closed handle stays unknown.
pub(crate) static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);
pub(crate) static HANDLES: Mutex<Option<HashMap<u64, Entry>>> = Mutex::new(None);

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn register(entry: Entry) -> u64 {
    let handle = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
    lock(&HANDLES)
        .get_or_insert_with(HashMap::new)
        .insert(handle, entry);
    handle
}

pub(crate) fn bad_handle(kind: &str, handle: u64) -> Failure {
    Failure::new(
        BELAYER_E_BAD_HANDLE,
        format!("unknown {kind} handle {handle} (never issued, closed or freed)"),
    )
}

pub(crate) fn client_of(handle: BelayerClient) -> Result<Arc<Mutex<Client>>, Failure> {
    match lock(&HANDLES).as_ref().and_then(|m| m.get(&handle)) {
        Some(Entry::Client(c)) => Ok(Arc::clone(c)),
        _ => Err(bad_handle("client", handle)),
    }
}

pub(crate) fn subscription_of(
    handle: BelayerSubscription,
) -> Result<Arc<Mutex<Subscription>>, Failure> {
    match lock(&HANDLES).as_ref().and_then(|m| m.get(&handle)) {
        Some(Entry::Subscription(s)) => Ok(Arc::clone(s)),
        _ => Err(bad_handle("subscription", handle)),
    }
}

pub(crate) fn unregister(handle: u64, client: bool) -> Result<(), Failure> {
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
