//! `libbelayer`: the C ABI of Belayer, for RL frameworks and inference engines that are not
//! written in Rust (the Python package in `python/` loads it with ctypes).
//!
//! It speaks the binary protocol of `belayerd` (crate `belayer-ipc`) and holds the worker-side
//! memory-server functions too (`belayer_mem_*`, `belayer_placeholder_*`,
//! `belayer_gpu_health_check`, module `memory`), so one library serves both. Modules, one per
//! resource: `status` (status codes, the per-thread last error, the panic guard), `types`,
//! `handles`, `convert`, `library`, `connection`, `sandbox`, `listing`, `exec`, `checkpoint`, `context`, `events`,
//! `transfer`, `memory`. The C header `include/belayer.h` is generated from this crate by cbindgen (see `tests/header.rs`, which fails when the checked-in header differs;
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
//! - `belayer-ipc`: the protocol, the client, and the memory-server worker client.
//! - `belayer-transfer`: the hardened tar packing and extraction of the file transfers.
#![warn(missing_docs)]

use std::ffi::c_int;

pub use crate::status::{
    belayer_last_error, BELAYER_E_ALREADY_EXISTS, BELAYER_E_BAD_HANDLE, BELAYER_E_BAD_REQUEST,
    BELAYER_E_BUSY, BELAYER_E_CHECKPOINT_FAILED, BELAYER_E_CONNECT, BELAYER_E_CORRUPT_CHECKPOINT,
    BELAYER_E_CUDA, BELAYER_E_EXEC_FAILED, BELAYER_E_INTERNAL, BELAYER_E_INVALID_ARGUMENT,
    BELAYER_E_INVALID_STATE, BELAYER_E_IN_USE, BELAYER_E_LAYOUT, BELAYER_E_MAP,
    BELAYER_E_NOT_FOUND, BELAYER_E_OWNER_GONE, BELAYER_E_PANIC, BELAYER_E_PERMISSION_DENIED,
    BELAYER_E_PROTOCOL, BELAYER_E_REFUSED, BELAYER_E_RESTORE_FAILED, BELAYER_E_RESTORE_TIMED_OUT,
    BELAYER_E_TIMEOUT, BELAYER_E_UNKNOWN_IMAGE, BELAYER_E_UNKNOWN_SANDBOX, BELAYER_E_UNSUPPORTED,
    BELAYER_OK,
};
pub use crate::status::{
    BELAYER_E_CORRUPT_IMAGE, BELAYER_E_IMAGE_CHANGED, BELAYER_E_NO_SPACE,
    BELAYER_E_REGISTRY_DENIED, BELAYER_E_REGISTRY_UNREACHABLE, BELAYER_E_TRANSFER_FAILED,
    BELAYER_E_TRANSFER_TIMED_OUT,
};
pub use memory::*;

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

mod checkpoint;
mod connection;
mod context;
mod convert;
mod events;
mod exec;
mod fork;
mod handles;
mod library;
mod listing;
mod memory;
mod sandbox;
mod status;
mod transfer;
mod types;

pub use checkpoint::*;
pub use connection::*;
pub use context::*;
pub use convert::status_of;
pub use events::*;
pub use exec::*;
pub use fork::*;
pub use library::*;
pub use listing::*;
pub use sandbox::*;
pub use transfer::*;
pub use types::*;

#[cfg(test)]
mod tests;
