//! Memory servers: independent owners of model weights and of the KV-cache arena (paper:
//! "State isolation"; DESIGN.md "Processes").
//!
//! A memory server (`belayer memory-server --role weights|kv --device cuda:N|host --layout
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
//! - [`cli`]: the `memory-server` subcommand;
//! - [`bench`](mod@bench): `belayer bench memory` (attach, unmap, remap and flush timings).
//!
//! belayerd does not start memory servers by itself yet; [`process::ServerProcess`] is the
//! piece a supervisor uses.

pub mod alloc;
pub mod bench;
pub mod cli;
pub mod lease;
pub mod process;
pub mod server;
pub mod supervise;

pub use server::{MemoryServer, MemoryServerConfig, MemoryServerError};
