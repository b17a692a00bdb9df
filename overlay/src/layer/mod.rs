//! Incremental, content-addressed capture of upper layers (paper: "Environment-state
//! recovery": F_k of a full checkpoint, captured in the frozen window).
//!
//! A captured layer is a [`LayerManifest`] plus blobs in a per-node [`BlobStore`]. The
//! capture of checkpoint k reads only what changed since the manifest of the previous ready
//! checkpoint of the same upper directory, so its cost follows the change, not the layer:
//! an agent that installed 500 MB of packages early pays for them once.
//!
//! # Format (version [`LAYER_FORMAT_VERSION`])
//!
//! The manifest file is [`MANIFEST_MAGIC`] (`BLYRLAYR`), the version as a little-endian
//! u32, then a bincode 2 encoding (standard configuration: varint integers, length-prefixed
//! sequences) of [`LayerManifest`]:
//!
//! - `captured_at`: wall-clock start of the capture, `(seconds, nanoseconds)`;
//! - `entries`: every entry of the upper directory in sorted pre-order (bytewise by name,
//!   parents before children), the root first with an empty path. Each [`LayerEntry`] has the
//!   path (components joined by `/`), [`EntryKind`] (directory; regular file with apparent
//!   size, data extents and blob; symlink target; hardlink target = the first path of the
//!   inode in this order; whiteout with its device numbers, which must be 0:0; fifo), mode
//!   bits (`0o7777`), uid, gid, mtime `(seconds, nanoseconds)`, extended attributes
//!   (`user.`, `security.`, `trusted.` including `trusted.overlay.opaque`/`redirect`/
//!   `origin`/..., POSIX ACLs; the root's `trusted.overlay.uuid` is left out), and the
//!   [`StatKey`] (inode, size, mtime, ctime) read when captured;
//! - `removed`: paths of the base manifest that are gone (deletions since then);
//! - `base`: the [`content_digest`](LayerManifest::content_digest) of the base manifest.
//!
//! A blob holds the bytes of a file's data extents back to back and is named by their
//! blake3 ([`BlobId`]); holes are not stored, so sparse files stay sparse. Blobs live in the
//! store as `ab/<64 hex>` (or `<64 hex>.zst` when the store compresses with zstd) and are
//! shared by every checkpoint of every sandbox on the node: equal files (the same package
//! installed by two sandboxes of one image) are stored once. Unix sockets are not captured.
//!
//! # Incremental capture and its key
//!
//! An entry is taken over from the base manifest without being opened when its inode
//! number, size, mtime and ctime all equal the base's and its ctime is older than the base
//! capture time minus a racy window ([`LayerCaptureOptions::racy_window`]). The sandbox can
//! set mtime but not ctime; every write, truncate, chmod, chown, xattr change, link or
//! rename moves the ctime, so a same-size, same-mtime rewrite is still seen. Inode reuse
//! after a delete gets a new ctime too. The base of the first capture after a restore is
//! the manifest re-keyed to the restored inodes ([`materialize_layer`] returns it).
//!
//! # Restore
//!
//! [`materialize_layer`] creates every entry in a fresh upper directory and fills regular files
//! from their blobs with `copy_file_range`, which shares extents (a reflink) on filesystems that
//! can (XFS, btrfs) and copies in the kernel elsewhere; compressed blobs are decompressed. A
//! blob is never hardlinked into an upper directory: the sandbox may write its files, and a
//! hardlink would let it rewrite the blob under every checkpoint that refers to it.
//!
//! # Threat model
//!
//! As for the archive format ([`crate::capture`], [`crate::install`]): capture never
//! follows a symlink and refuses device nodes other than whiteouts; the manifest and blobs
//! are untrusted when restored: every entry is checked before it is created, everything is
//! created beneath the target with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` and
//! exclusive no-follow calls, blobs are re-hashed while copied (by default), and limits
//! ([`InstallLimits`](crate::InstallLimits)) bound entries, data per file, data in total and
//! apparent sizes.

pub(crate) mod blobs;
mod capture;
mod extents;
mod idshift;
pub(crate) mod manifest;
mod materialize;
mod packs;
mod warm;

pub use blobs::{BlobBatch, BlobError, BlobStore, GcRoots, GcStats, StoreLease, PARALLEL_HASH_MIN};
pub use capture::{
    capture_layer, capture_layer_rereading, layer_digest, LayerCaptureOptions, LayerStats,
    PendingLayer, INLINE_MAX_BYTES,
};
pub use extents::{MAX_EXTENTS_PER_FILE, MAX_HOLE_AMPLIFICATION};
pub use idshift::{IdShift, IdShiftError};
pub use manifest::{
    BlobId, EntryKind, Extent, LayerEntry, LayerManifest, ManifestError, StatKey,
    LAYER_FORMAT_VERSION, MANIFEST_MAGIC, MAX_MANIFEST_BYTES,
};
pub use materialize::{materialize_layer, MaterializeOptions};
pub use packs::{PackRange, PackWriter, PACK_MODE};
pub use warm::warm_layer;
