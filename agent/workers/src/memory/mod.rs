//! Memory servers: independent owners of model weights and of the KV-cache arena (paper:
//! "State isolation"; DESIGN.md "Processes").
//!
//! A memory server (`belayer-memd --role weights|kv --device cuda:N|host --layout
//! FILE --socket PATH`) allocates the regions of a layout, runs no inference and outlives every
//! worker. Workers attach over the server's own socket with the memory protocol of
//! `belayer_ipc::memory` (frame kinds 4 and 5) and receive the regions' descriptors by
//! `SCM_RIGHTS`; a worker crash leaves the allocations intact, so a shadow worker maps them at
//! once ("Shadow-worker preparation").
//!
//! - [`server`]: [`MemoryServer`]: allocation, socket, peer admission, worker registry, leases,
//!   KV flush, weights version;
//! - [`alloc`]: the allocations per backend (sealed memfds, or exported CUDA VMM allocations);
//! - [`lease`]: the lease table (many readers, one writer, or one exclusive holder per region);
//! - [`process`]: a memory server as a supervised child process;
//! - [`cli`]: the `belayer-memd` command line;
//! - [`supervise`]: the servers `belayerd` starts from its config (`[[memory_server]]`) and
//!   starts again when they die.
//!
//! `belayer-bench memory` measures attach, unmap, remap and flush.

pub mod alloc;
pub mod cli;
pub mod lease;
pub mod process;
pub mod server;
pub mod supervise;

pub use server::{MemoryServer, MemoryServerConfig, MemoryServerError};

use belayer_ipc::memory::{Backend, Role};

/// Parses a memory device argument: `host` or `cuda:N` (the one parser of every command line
/// and config entry that names a device).
///
/// Errors: the message of [`belayer_ipc::memory::message::BadDevice`].
pub fn parse_device(s: &str) -> Result<Backend, String> {
    s.parse()
        .map_err(|e: belayer_ipc::memory::message::BadDevice| e.to_string())
}

/// Parses a memory-server role argument: `weights` or `kv`.
///
/// Errors: the message of the layout error naming the accepted roles.
pub fn parse_role(s: &str) -> Result<Role, String> {
    s.parse()
        .map_err(|e: belayer_ipc::memory::LayoutError| e.to_string())
}
