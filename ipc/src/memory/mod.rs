//! Memory servers' worker side and wire format (paper: "State isolation", "Shadow-worker
//! preparation").
//!
//! Model weights and the KV-cache arena are owned by memory servers (`belayer memory-server`,
//! in the agent crate) that run no inference and outlive every worker. A worker connects to a
//! server's socket, attaches to its layout and receives one file descriptor per region by
//! `SCM_RIGHTS`, maps them, and so survives nothing but itself: when it dies, the allocations
//! stay, and a shadow worker maps them at once.
//!
//! - [`layout`]: the TOML layout (named regions, the KV arena), its validation, placement and
//!   hash;
//! - [`message`]: [`MemRequest`] (frame kind 4) and [`MemResponse`] (frame kind 5), leases
//!   ([`LeaseMode`]), and sending/receiving them with descriptors;
//! - [`client`]: [`MemClient`]: attach, detach, flush, weights version, worker registration,
//!   owner-alive check;
//! - [`mapping`]: [`Mapping`] (an attached layout in one address range, with unmap/remap at the
//!   same address) and [`Placeholder`] (worker-local buffers that give their memory back on
//!   standby and keep their address);
//! - [`host`]: the host backend (sealed memfds, fixed-address mappings);
//! - [`cuda`]: the CUDA backend (driver VMM calls through cudarc, loaded at run time; cargo
//!   feature `cuda`), with the GPU health check;
//!
//! Backends: [`Backend::Host`] works everywhere; [`Backend::Cuda`] needs a build with the
//! `cuda` feature (else [`cuda::CudaError::NotBuilt`]) and an NVIDIA driver (else
//! [`cuda::CudaError::NoDriver`]).

pub mod client;
pub mod cuda;
pub mod host;
pub mod layout;
pub mod mapping;
pub mod message;
pub mod placeholder;

pub use client::{MemClient, MemClientError, OwnerError};
pub use layout::{Layout, LayoutError, Placement, RegionKind, RegionPlacement, Role};
pub use mapping::{MapError, Mapping, RegionView};
pub use message::{
    AttachInfo, AttachRequest, Backend, LeaseMode, MemErrorCode, MemErrorReply, MemRequest,
    MemResponse, RegionDesc, ServerInfo, WireError,
};
pub use placeholder::Placeholder;
