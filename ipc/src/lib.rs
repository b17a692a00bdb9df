//! The compact binary protocol between `belayerd` and its clients.
//!
//! # Wire format
//!
//! Every message travels in one frame: a 16-byte header followed by the payload.
//!
//! | bytes | field | value |
//! |---|---|---|
//! | 0..4 | magic | `b"BLYR"` |
//! | 4..6 | protocol version | u16 little-endian, [`PROTOCOL_VERSION`] (12) |
//! | 6 | kind | 1 request, 2 response, 3 event, 4 memory request, 5 memory response ([`Kind`]) |
//! | 7 | flags | reserved, must be 0 |
//! | 8..12 | payload length | u32 little-endian, bytes, at most the maximum frame size ([`DEFAULT_MAX_FRAME`] = 16 MiB) |
//! | 12..16 | CRC32 | u32 little-endian, IEEE CRC32 of the payload bytes only |
//!
//! The payload is an [`Envelope`] (a request id and a [`Request`], [`Response`] or [`Event`])
//! encoded with bincode 2, `config::standard()` in serde mode (varint integers, little-endian).
//! A reader checks magic, version, kind, flags and length before it allocates anything for the
//! payload, checks the CRC, then decodes with a bincode byte limit derived from the maximum frame
//! size. Any failure is a typed [`FrameError`]. `docs/protocol.md` holds the full description,
//! the error behaviour and the versioning rules.
//!
//! # Transport
//!
//! [`Server`] binds a Unix stream socket (mode 0660, optional group), admits peers by their
//! kernel-checked credentials ([`PeerCred`], [`AccessPolicy`]: root, or members of one group)
//! and by its [`ConnectionLimits`] (connections and event streams in total and per uid, with a
//! share kept for root; frame, idle and send timeouts; a refused peer gets `Busy`), and serves
//! each admitted connection on its own thread through a [`Handler`], one request after the
//! other. A bad frame is answered with `Response::Error` (`BadRequest`, request id 0) and that
//! connection is closed; other connections are unaffected. [`Client`] is the blocking
//! counterpart. [`send_with_fds`] and [`recv_with_fds`] pass file descriptors (`SCM_RIGHTS`),
//! [`send_message`] and [`recv_message`] whole frames with descriptors; a request may carry
//! one ([`Client::call_with_fds`], [`Handler::handle_call`], which also gets the peer's
//! supplementary groups in [`Caller`]): an image source the client opened with its own
//! rights ([`Client::import_image`]);
//! [`send_event`] and [`recv_event`] frame events; `Request::Subscribe` turns a connection into
//! an event stream fed by [`Handler::subscribe`] and read with [`Client::subscribe`] /
//! [`Subscription`].
//!
//! # Memory servers
//!
//! [`memory`] holds the worker side of the memory servers that own model weights and the
//! KV-cache arena (paper: "State isolation"): the layout format and hash, the memory protocol
//! (frame kinds 4 and 5, region descriptors by `SCM_RIGHTS`), the client with leases and the
//! owner-alive check, mappings with unmap/remap at the same address, the host (memfd) and CUDA
//! (driver VMM, cargo feature `cuda`) backends and the GPU health check.
//!
//! # C ABI
//!
//! The whole C ABI (daemon client and memory-server worker side) is the `belayer-capi` crate
//! (`ipc/capi`), which builds `libbelayer.so`/`libbelayer.a` and the generated header
//! `belayer.h`; nothing here is `extern "C"`.
//!
//! # Dependencies
//!
//! - `bincode` (=2.0.1, serde mode): the payload encoding, compact and with a decode byte limit.
//! - `serde`: derives for the message types.
//! - `serde_bytes`: byte fields (action output, LLM context) encoded as one length-prefixed blob
//!   instead of element by element (same wire bytes, far faster).
//! - `crc32fast`: the payload checksum (SIMD-accelerated CRC32).
//! - `nix`: `SO_PEERCRED`, `sendmsg`/`recvmsg` with `SCM_RIGHTS`, `send` with `MSG_NOSIGNAL`,
//!   `poll`, `pipe2`.
//! - `libc`: `getsockopt(SO_PEERGROUPS)`, which nix does not wrap.
//! - `thiserror`: one typed error enum per module.
//! - `tracing`: structured logs of refused peers, bad frames and connection lifecycles.
//! - `blake3`: the layout hash.
//! - `toml`: layout files.
//! - `cudarc` (driver API only, loaded at run time, no toolkit needed to build), only with the
//!   cargo feature `cuda` (off by default): the CUDA VMM calls of the CUDA memory backend. The
//!   crates that map GPU memory turn it on (`belayer-workers`: memory servers, router, engine;
//!   `belayer-capi`; `belayer-bench`); the command-line client (`belayer-cli`) does not, so it
//!   links no CUDA code. Without the feature the protocol is the same and every CUDA operation
//!   answers `CudaError::NotBuilt` ([`memory::cuda`]).
//! - `nix` `mman`: fixed-address mappings inside a reservation (`MAP_FIXED`), which `memmap2`
//!   cannot place, so it is not used.
#![warn(missing_docs)]

pub mod fork;
pub mod frame;
pub mod image;
pub mod memory;
pub mod message;
pub mod names;
pub mod oci_source;
pub mod policy;
pub mod rollout;
pub mod sandbox;
pub mod state;
pub mod text;
pub mod transport;

pub use fork::{ForkInfo, ForkRequest};
pub use frame::{
    decode_frame, encode_frame, read_frame, read_raw_frame, recv_event, send_event, write_frame,
    FrameError, Header, Kind, Message, RawFrame, DEFAULT_MAX_FRAME, HEADER_LEN, MAGIC,
    PROTOCOL_VERSION,
};
pub use image::{
    valid_image_name, BlobRange, ImageConfig, LayerInfo, OciImportRequest, PullRequest,
    RegistryCredentials,
};
pub use message::{
    CheckpointInfo, CheckpointRequest, CheckpointTimings, ContextEntry, DecisionInfo, Envelope,
    ErrorCode, ErrorReply, Event, ExecRequest, ExecResult, FailPoint, ImageInfo, InfraFault,
    InfraFaultKind, MaybeCheckpointRequest, MaybeCheckpointResult, PolicySpec, Request, Response,
    RestoreInfo, RestoreTimings, RestoreValidity, SandboxInfo, SandboxLimits, SandboxSpec,
    StatusInfo, TestFault, UsernsInfo, UsernsMode,
};
pub use message::{DownloadRequest, TransferInfo, UploadRequest};
pub use transport::{
    bind_socket, open_image_source, peer_groups, proc_groups, recv_message, recv_message_by,
    recv_with_fds, send_message, send_with_fds, AccessPolicy, BindError, BoundSocket, Caller,
    Client, ClientError, ConnectionLimits, CredsError, FdPassError, Handler, LimitsError, PeerCred,
    Quota, Server, ServerConfig, ServerError, ServerHandle, ShutdownTrigger, Subscription,
    WireError, DEFAULT_SOCKET_MODE, MAX_FDS_PER_MESSAGE, MAX_REQUEST_FDS,
};
pub use transport::{chunk_bytes, Chunk, DownloadSource, LinkError, TransferLink, UploadSink};
pub use transport::{ServerCounts, ServerStats};

pub use policy::{BadDecisionReason, BadPolicyKind, DecisionReason, PolicyKind};
pub use state::{BadSandboxState, SandboxState};
pub use text::{command_line, parse_bytes, shell_quote};

/// Default socket path of `belayerd` (every client's default; `BELAYER_SOCKET` overrides it in
/// the command-line tools and the Python package).
pub const DEFAULT_SOCKET: &str = "/run/belayer/belayer.sock";

/// `err` and its chain of sources, joined with `": "` (for error replies, reports and log
/// fields).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
