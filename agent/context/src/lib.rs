//! The LLM-context log L_k (paper: "LLM context recovery").
//!
//! One append-only file per rollout (or per trajectory) holding, per trajectory, the LLM context at
//! every action boundary k ([`Record::Boundary`]) and, while a response streams, its token prefix
//! every [`DEFAULT_TOKEN_INTERVAL`] tokens ([`Record::TokenPrefix`]). A checkpoint C_k stores the
//! [`RecordId`] and [`record_digest`] of the boundary record of k in its manifest; recovery reloads
//! that context with [`ContextLog::boundary`], and a resumed request continues from
//! [`ContextLog::longest_token_prefix`].
//!
//! File format (version [`FORMAT_VERSION`]): a 12-byte header (8-byte magic `BLYCTXL\0`, then the
//! format version as u32 little endian), then frames
//! `[u32 LE payload length][u32 LE crc32 of payload][payload]`, where the payload is one
//! [`Record`] encoded with bincode 2 (serde mode, standard config) of at most
//! [`MAX_RECORD_BYTES`]. [`ContextLog::open`] keeps every complete frame and truncates the file at
//! the first torn, short or CRC-bad one ([`Recovery`]).
//!
//! Contexts are not kept in memory: a log's [`LogIndex`] holds where each record lies and the
//! digest of each boundary (about 100 bytes a record, whatever its size), and a lookup reads
//! the record back with one `pread`, checking its crc32. [`ContextLog`] is one writer's open
//! log (the rollout driver's, the router's); the daemon keeps a [`LogIndex`] per trajectory and
//! opens and closes the files itself, so that it never holds a descriptor per trajectory.

mod encode;
mod frame;
mod index;
mod log;
pub use log::flock_exclusive;
mod record;

use std::path::PathBuf;

pub use encode::EncodedRecord;
pub use frame::{FORMAT_VERSION, FRAME_HEADER_BYTES, HEADER_BYTES, MAX_RECORD_BYTES};
pub use index::{BoundaryRef, LogIndex};
pub use log::{ContextLog, Damage, Durability, Recovery};
pub use record::{record_digest, Record, RecordId};

/// Token interval between two [`Record::TokenPrefix`] records of a streaming response (paper: the
/// router updates the preserved prefix every 256 tokens).
pub const DEFAULT_TOKEN_INTERVAL: u32 = 256;

/// Largest context one [`Record::Boundary`] holds, bytes: [`MAX_RECORD_BYTES`] less room for
/// the rest of the record (variant, a trajectory id of up to 128 bytes, prefix, lengths; at most
/// about 150 bytes), so a context of this size always fits whatever its trajectory.
pub const MAX_CONTEXT_BYTES: u64 = MAX_RECORD_BYTES as u64 - 1024;

/// Errors of the context log.
#[derive(Debug, thiserror::Error)]
pub enum ContextLogError {
    /// Opening (or creating) the log file failed.
    #[error("open context log {path}")]
    Open {
        /// Log file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Another open log (in this or another process) holds the file's exclusive lock.
    #[error("context log {path} is locked by another writer")]
    Locked {
        /// Log file.
        path: PathBuf,
    },
    /// Taking the file's exclusive lock (`flock`) failed for another reason.
    #[error("flock context log {path}")]
    Lock {
        /// Log file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading the log file on open failed.
    #[error("read context log {path}")]
    Read {
        /// Log file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Writing the header of a new log failed.
    #[error("write header of context log {path}")]
    WriteHeader {
        /// Log file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The file does not start with the context-log magic.
    #[error("{path} is not a context log (bad header)")]
    BadHeader {
        /// Log file.
        path: PathBuf,
    },
    /// The file has a format version this build does not read.
    #[error("context log {path} has format version {found}, this build reads {supported}")]
    UnsupportedVersion {
        /// Log file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// A frame with a valid CRC does not decode as a [`Record`] (written by an incompatible build).
    #[error("decode record at offset {offset} of context log {path}")]
    Decode {
        /// Log file.
        path: PathBuf,
        /// Byte offset of the frame.
        offset: u64,
        /// Cause.
        #[source]
        source: bincode::error::DecodeError,
    },
    /// Reading a record back (`pread`) failed.
    #[error("read record at offset {offset} of context log {path}")]
    ReadRecord {
        /// Log file.
        path: PathBuf,
        /// Byte offset of the frame.
        offset: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The frame at an indexed offset is no longer the record the index names (short, CRC-bad
    /// or another record): the file was changed or damaged behind the log.
    #[error("record at offset {offset} of context log {path} changed behind the log")]
    RecordChanged {
        /// Log file.
        path: PathBuf,
        /// Byte offset of the frame.
        offset: u64,
    },
    /// Truncating a damaged tail (on open) or a failed append failed.
    #[error("truncate context log {path} to {len} bytes")]
    Truncate {
        /// Log file.
        path: PathBuf,
        /// Length it was truncated to, bytes.
        len: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Encoding a record failed.
    #[error("encode context record")]
    Encode {
        /// Cause.
        #[source]
        source: bincode::error::EncodeError,
    },
    /// An encoded record exceeds [`MAX_RECORD_BYTES`].
    #[error("context record of {bytes} bytes exceeds the maximum of {max} bytes")]
    RecordTooLarge {
        /// Encoded payload size, bytes.
        bytes: u64,
        /// [`MAX_RECORD_BYTES`].
        max: u64,
    },
    /// Writing a record failed (the file is cut back to its previous end).
    #[error("append to context log {path} at offset {offset}")]
    Append {
        /// Log file.
        path: PathBuf,
        /// Offset the frame was written at.
        offset: u64,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `fsync` of the log (or of its directory after creation) failed.
    #[error("fsync context log {path}")]
    Sync {
        /// File or directory synced.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}
