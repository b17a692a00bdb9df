//! File transfer between a host and a Belayer sandbox: one hardened tar implementation for
//! both sides.
//!
//! The daemon's `exec` helper runs [`unpack`] (uploads) and [`pack`] (downloads) *inside* the
//! sandbox, confined like an action; the CLI and `libbelayer` run them on the host, on the
//! user's own paths ([`host`]). Sandbox content is hostile on both sides: extraction resolves
//! every parent beneath the destination without following symlinks and never writes through
//! one ([`unpack`]); packing never follows a symlink and archives exactly what it opened
//! ([`pack`]); where the tree lands follows `docker cp` and is decided by
//! [`resolve_destination`] on whichever side extracts.
//!
//! Modules: `name` (member names), `place` (sources, destinations, path resolution),
//! `unpack`, `pack`, `error`, `host` (host paths over a [`belayer_ipc::Client`]).
//!
//! # Dependencies
//!
//! - `tar`: reading and writing the tar format (GNU long names, PAX, checksums); only its
//!   parser and writer are used, never its own `unpack` (which resolves paths through
//!   symlinks of the target tree).
//! - `rustix`: safe wrappers of the `*at` calls and `openat2` every step is made with.
//! - `thiserror`: the typed [`TransferError`].
//! - `belayer-ipc`: the client the [`host`] functions stream through.
//!
//! Minimum kernel: 5.6 (`openat2`).
#![warn(missing_docs)]

mod error;
pub mod host;
pub mod name;
mod pack;
mod place;
mod unpack;

pub use error::{ErrorClass, TransferError};
pub use pack::{pack, MAX_DEPTH};
pub use place::{resolve_destination, resolve_source, Destination, Resolution, Source};
pub use unpack::{unpack, unpack_tree};

/// What a pack or an unpack did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Members archived or created (files, directories, symlinks, hard links).
    pub files: u64,
    /// Bytes of regular file content.
    pub bytes: u64,
    /// Special files (devices, fifos, sockets) left out of an archive.
    pub skipped: u64,
    /// Files whose size changed while they were archived (padded or cut to the size first
    /// seen).
    pub changed: u64,
}

#[cfg(test)]
mod tests;
