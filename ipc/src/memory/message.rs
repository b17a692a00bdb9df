//! The memory-server protocol: [`MemRequest`] (frame kind 4) and [`MemResponse`] (frame kind
//! 5), and the helpers that move them with their file descriptors.
//!
//! A memory server speaks these on its own socket, in the same frames as the daemon protocol
//! (magic, version, length, CRC32, bincode payload in an [`Envelope`]). A response to
//! [`MemRequest::Attach`] carries one region descriptor per region, and the regions' file
//! descriptors travel by `SCM_RIGHTS` on the first byte of the response frame, in region order;
//! when there are more than [`MAX_FDS_PER_MESSAGE`] of them, the rest follow in
//! [`MemResponse::MoreFds`] frames with the same request id. See `docs/protocol.md`.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::layout::{RegionPlacement, Role};
use crate::frame::{Kind, Message};
use crate::transport::MAX_FDS_PER_MESSAGE;

/// Where a memory server's allocations live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Backend {
    /// Host shared memory (memfd), for machines without a GPU and for CI.
    Host,
    /// CUDA device memory (VMM allocations exported as POSIX file descriptors).
    Cuda {
        /// CUDA device ordinal, as the process sees it (`CUDA_VISIBLE_DEVICES` applies).
        device: i32,
    },
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backend::Host => f.write_str("host"),
            Backend::Cuda { device } => write!(f, "cuda:{device}"),
        }
    }
}

/// A `--device` value that is neither `host` nor `cuda:N`.
#[derive(Debug, thiserror::Error)]
#[error("device {text:?} is neither \"host\" nor \"cuda:N\"")]
pub struct BadDevice {
    /// The text given.
    pub text: String,
}

impl FromStr for Backend {
    type Err = BadDevice;

    /// Parses `host` or `cuda:N` (N a non-negative ordinal).
    fn from_str(s: &str) -> Result<Backend, BadDevice> {
        if s == "host" {
            return Ok(Backend::Host);
        }
        s.strip_prefix("cuda:")
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|n| *n >= 0)
            .map(|device| Backend::Cuda { device })
            .ok_or_else(|| BadDevice { text: s.to_owned() })
    }
}

/// The kind of lease an attachment holds on each of its regions.
///
/// Conflicts, per region: `Read` conflicts with `Exclusive`; `Write` conflicts with `Write` and
/// `Exclusive`; `Exclusive` conflicts with everything. So a region has any number of readers
/// and at most one writer, and an `Exclusive` holder is the only holder ("many readers or one
/// writer"). Leases belong to the connection that took them and end with
/// [`MemRequest::Detach`] or when the connection closes (e.g. the worker dies).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LeaseMode {
    /// Shared read access. On the host backend the regions arrive as read-only descriptors,
    /// so the kernel refuses writable mappings; on the CUDA backend every mapping is made
    /// read-write and the read lease is advisory ([`Mapping::write`] still refuses).
    ///
    /// [`Mapping::write`]: super::mapping::Mapping::write
    Read,
    /// Write access, at most one writer per region; readers may stay attached (serving worker
    /// on the KV arena, with a shadow worker mapped read-only beside it).
    Write,
    /// Write access with no other lease of any kind (e.g. the weight-update path).
    Exclusive,
}

impl LeaseMode {
    /// Whether a lease of mode `self` and one of mode `other` held by another attachment may
    /// not coexist on one region.
    pub fn conflicts_with(self, other: LeaseMode) -> bool {
        use LeaseMode::*;
        matches!(
            (self, other),
            (Exclusive, _) | (_, Exclusive) | (Write, Write)
        )
    }

    /// Whether the mode allows writing.
    pub fn writes(self) -> bool {
        !matches!(self, LeaseMode::Read)
    }
}

/// What a worker asks for when it attaches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachRequest {
    /// Worker id (`[A-Za-z0-9._-]{1,128}`), checked against the server's registry.
    pub worker: String,
    /// Layout hash of the worker's copy of the layout (64 hex digits,
    /// [`Layout::hash`](super::layout::Layout::hash)); a mismatch is refused.
    pub layout_hash: String,
    /// Lease to take on every region attached.
    pub mode: LeaseMode,
    /// Region names to attach; empty = every region.
    pub regions: Vec<String>,
}

/// One attached region, as described to the worker. Its descriptor is the fd at the same
/// position as this entry in [`AttachInfo::regions`].
pub type RegionDesc = RegionPlacement;

/// The answer to an attach: everything a worker needs to map the regions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachInfo {
    /// Attachment id, unique for the server's lifetime (for [`MemRequest::Detach`]).
    pub attachment: u64,
    /// The server's role.
    pub role: Role,
    /// Where the memory lives.
    pub backend: Backend,
    /// The server's layout hash.
    pub layout_hash: String,
    /// The weights version counter at attach time.
    pub version: u64,
    /// Placement granularity, bytes.
    pub granularity: u64,
    /// Size of the whole layout's address range, bytes (what the worker reserves).
    pub total: u64,
    /// Lease taken on every region listed.
    pub mode: LeaseMode,
    /// The attached regions, in layout order, with their offsets in the layout's range.
    pub regions: Vec<RegionDesc>,
}

/// What a memory server says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerInfo {
    /// The server's role.
    pub role: Role,
    /// Where the memory lives.
    pub backend: Backend,
    /// Layout hash.
    pub layout_hash: String,
    /// Weights version counter.
    pub version: u64,
    /// Server process id (in the server's pid namespace).
    pub pid: i32,
    /// Number of regions.
    pub regions: u32,
    /// Bytes allocated (sum of mapped sizes).
    pub bytes: u64,
    /// Attachments alive now.
    pub attachments: u32,
}

/// Everything a client can ask of a memory server (frame kind 4).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemRequest {
    /// Liveness and identity; answered by [`MemResponse::Pong`].
    Ping,
    /// Take leases and receive the regions' descriptors; answered by
    /// [`MemResponse::Attached`] (plus fds).
    Attach(AttachRequest),
    /// Release the leases of an attachment of this connection; answered by `Done`.
    Detach {
        /// Attachment id.
        attachment: u64,
    },
    /// Zero a KV-arena region (paper: the shadow worker flushes the KV-cache pool on
    /// handover). Allowed when no other connection holds a write lease on it; answered by
    /// [`MemResponse::Flushed`].
    Flush {
        /// Region name.
        region: String,
    },
    /// Bump the weights version counter; the connection must hold a write lease on at least
    /// one region of a weights server. Answered by [`MemResponse::Version`].
    BumpVersion,
    /// Read the weights version counter; answered by [`MemResponse::Version`].
    Version,
    /// Register worker id `worker` for peers of uid `uid` (root peers only); answered by
    /// `Done`.
    RegisterWorker {
        /// Worker id.
        worker: String,
        /// The uid its peers must have.
        uid: u32,
    },
}

/// Everything a memory server answers (frame kind 5).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemResponse {
    /// Answer to [`MemRequest::Ping`].
    Pong(ServerInfo),
    /// Answer to [`MemRequest::Attach`]; the region fds ride on this frame (up to
    /// [`MAX_FDS_PER_MESSAGE`]) and on the `MoreFds` frames after it.
    Attached(AttachInfo),
    /// Carries the next `count` region fds of an attach, starting at region index `first`.
    MoreFds {
        /// Index (in [`AttachInfo::regions`]) of the first fd attached to this frame.
        first: u32,
        /// Number of fds attached to this frame.
        count: u32,
    },
    /// A region was zeroed.
    Flushed {
        /// Region name.
        region: String,
        /// Bytes zeroed.
        bytes: u64,
    },
    /// The weights version counter.
    Version {
        /// Current version.
        version: u64,
    },
    /// Success with nothing to return.
    Done,
    /// Failure.
    Error(MemErrorReply),
}

/// Machine-readable reason of a [`MemResponse::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemErrorCode {
    /// Malformed frame or request; the connection is closed (id 0).
    BadRequest,
    /// The peer's credentials are not admitted (id 0, connection closed), or a root-only
    /// request came from another uid.
    PermissionDenied,
    /// The worker id is not registered, or registered for another uid.
    UnknownWorker,
    /// The worker's layout hash differs from the server's.
    LayoutMismatch,
    /// No region of that name.
    UnknownRegion,
    /// No attachment of that id on this connection.
    UnknownAttachment,
    /// Another attachment holds a conflicting lease.
    LeaseConflict,
    /// The request needs a write lease this connection does not hold.
    NoLease,
    /// The request does not apply to this server (e.g. flushing a weights region).
    Unsupported,
    /// The server failed (e.g. a driver call).
    Internal,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemErrorReply {
    /// What went wrong.
    pub code: MemErrorCode,
    /// Human-readable detail with the context.
    pub message: String,
}

impl Message for MemRequest {
    const KIND: Kind = Kind::MemRequest;
}

impl Message for MemResponse {
    const KIND: Kind = Kind::MemResponse;
}

pub use crate::transport::wire::{recv_message, send_message, WireError};

/// Sends `fds` after an attach response: the first [`MAX_FDS_PER_MESSAGE`] ride on the
/// response frame itself, the rest on [`MemResponse::MoreFds`] frames with the same `id`.
///
/// Errors: those of [`send_message`].
pub fn send_attached<S: AsFd>(
    socket: &S,
    id: u64,
    info: AttachInfo,
    fds: &[BorrowedFd<'_>],
    max_frame: u32,
) -> Result<(), WireError> {
    let mut chunks = fds.chunks(MAX_FDS_PER_MESSAGE);
    let first = chunks.next().unwrap_or(&[]);
    send_message(socket, id, MemResponse::Attached(info), first, max_frame)?;
    let mut index = first.len();
    for chunk in chunks {
        let body = MemResponse::MoreFds {
            first: index as u32,
            count: chunk.len() as u32,
        };
        send_message(socket, id, body, chunk, max_frame)?;
        index += chunk.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;
    use crate::frame::{encode_frame, FrameError, DEFAULT_MAX_FRAME};
    use crate::memory::layout::RegionKind;
    use crate::message::Envelope;

    fn info(regions: usize) -> AttachInfo {
        AttachInfo {
            attachment: 3,
            role: Role::Kv,
            backend: Backend::Cuda { device: 1 },
            layout_hash: "ab".repeat(32),
            version: 7,
            granularity: 4096,
            total: 4096 * regions as u64,
            mode: LeaseMode::Write,
            regions: (0..regions)
                .map(|i| RegionDesc {
                    name: format!("r{i}"),
                    kind: if i == 0 {
                        RegionKind::KvArena {
                            block_size: 64,
                            block_count: 64,
                        }
                    } else {
                        RegionKind::Plain
                    },
                    offset: 4096 * i as u64,
                    size: 4000,
                    mapped_size: 4096,
                })
                .collect(),
        }
    }

    #[test]
    fn every_request_and_response_round_trips_over_a_socket() {
        let requests = [
            MemRequest::Ping,
            MemRequest::Attach(AttachRequest {
                worker: "w0".to_owned(),
                layout_hash: "cd".repeat(32),
                mode: LeaseMode::Exclusive,
                regions: vec!["a".to_owned()],
            }),
            MemRequest::Detach { attachment: 9 },
            MemRequest::Flush {
                region: "kv".to_owned(),
            },
            MemRequest::BumpVersion,
            MemRequest::Version,
            MemRequest::RegisterWorker {
                worker: "w1".to_owned(),
                uid: 1000,
            },
        ];
        let responses = vec![
            MemResponse::Pong(ServerInfo {
                role: Role::Weights,
                backend: Backend::Host,
                layout_hash: "ef".repeat(32),
                version: 2,
                pid: 42,
                regions: 3,
                bytes: 1 << 30,
                attachments: 1,
            }),
            MemResponse::Attached(info(2)),
            MemResponse::MoreFds {
                first: 253,
                count: 1,
            },
            MemResponse::Flushed {
                region: "kv".to_owned(),
                bytes: 4096,
            },
            MemResponse::Version { version: 5 },
            MemResponse::Done,
            MemResponse::Error(MemErrorReply {
                code: MemErrorCode::LeaseConflict,
                message: "held".to_owned(),
            }),
        ];
        let (a, b) = UnixStream::pair().unwrap();
        for (i, request) in requests.iter().enumerate() {
            send_message(&a, i as u64, request.clone(), &[], DEFAULT_MAX_FRAME).unwrap();
            let (got, fds) = recv_message::<MemRequest, _>(&b, DEFAULT_MAX_FRAME, 0).unwrap();
            assert_eq!((got.id, &got.body), (i as u64, request));
            assert!(fds.is_empty());
        }
        for response in responses {
            send_message(&b, 1, response.clone(), &[], DEFAULT_MAX_FRAME).unwrap();
            let (got, _) = recv_message::<MemResponse, _>(&a, DEFAULT_MAX_FRAME, 0).unwrap();
            assert_eq!(got.body, response);
        }
        drop(b);
        match recv_message::<MemResponse, _>(&a, DEFAULT_MAX_FRAME, 0) {
            Err(err) => assert!(err.is_disconnect(), "{err:?}"),
            Ok(other) => panic!("{other:?}"),
        }
    }

    #[test]
    fn many_fds_are_split_over_more_fds_frames() {
        let (a, b) = UnixStream::pair().unwrap();
        let files: Vec<std::fs::File> = (0..300).map(|_| tempfile::tempfile().unwrap()).collect();
        let writer = std::thread::spawn(move || {
            send_attached(&a, 11, info(300), &fds_of(&files), DEFAULT_MAX_FRAME).unwrap();
            files
        });
        let (first, fds1) = recv_message::<MemResponse, _>(&b, DEFAULT_MAX_FRAME, 300).unwrap();
        assert_eq!(first.id, 11);
        assert!(matches!(first.body, MemResponse::Attached(_)));
        assert_eq!(fds1.len(), MAX_FDS_PER_MESSAGE);
        let (more, fds2) = recv_message::<MemResponse, _>(&b, DEFAULT_MAX_FRAME, 300).unwrap();
        assert_eq!(
            more.body,
            MemResponse::MoreFds {
                first: 253,
                count: 47
            }
        );
        assert_eq!(fds2.len(), 47);
        writer.join().unwrap();
    }

    fn fds_of(files: &[std::fs::File]) -> Vec<BorrowedFd<'_>> {
        files.iter().map(|f| f.as_fd()).collect()
    }

    #[test]
    fn a_daemon_request_is_not_a_memory_request() {
        let (a, b) = UnixStream::pair().unwrap();
        let frame = encode_frame(
            &Envelope {
                id: 1,
                body: crate::message::Request::Ping,
            },
            DEFAULT_MAX_FRAME,
        )
        .unwrap();
        std::io::Write::write_all(&mut &a, &frame).unwrap();
        match recv_message::<MemRequest, _>(&b, DEFAULT_MAX_FRAME, 0) {
            Err(WireError::Frame {
                source: FrameError::UnexpectedKind { expected, got },
            }) => {
                assert_eq!(expected, Kind::MemRequest);
                assert_eq!(got, Kind::Request);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn devices_parse() {
        assert_eq!("host".parse::<Backend>().unwrap(), Backend::Host);
        assert_eq!(
            "cuda:3".parse::<Backend>().unwrap(),
            Backend::Cuda { device: 3 }
        );
        for bad in ["cuda", "cuda:", "cuda:-1", "gpu:0", "cuda:x"] {
            assert!(bad.parse::<Backend>().is_err(), "{bad}");
        }
        assert_eq!(Backend::Cuda { device: 2 }.to_string(), "cuda:2");
    }

    #[test]
    fn lease_conflicts_follow_the_table() {
        use LeaseMode::*;
        let table = [
            (Read, Read, false),
            (Read, Write, false),
            (Read, Exclusive, true),
            (Write, Write, true),
            (Write, Exclusive, true),
            (Exclusive, Exclusive, true),
        ];
        for (a, b, conflict) in table {
            assert_eq!(a.conflicts_with(b), conflict, "{a:?} {b:?}");
            assert_eq!(b.conflicts_with(a), conflict, "{b:?} {a:?}");
        }
        assert!(!Read.writes() && Write.writes() && Exclusive.writes());
    }
}
