//! Overlayfs for Belayer sandboxes: mounts, capture and restore of the upper layer, and
//! integrity digests.
//!
//! A sandbox's root is an overlay of a read-only image (the lower layers) and a private,
//! writable **upper directory**. Everything the sandbox changed lives in the upper layer,
//! so the file-system half F_k of a checkpoint is a capture of it. The crate holds two
//! forms of a captured upper layer.
//!
//! **The layer form ([`layer`]) is the production path**, the one checkpoints use (paper:
//! "Environment-state recovery"): an incremental, content-addressed manifest plus blobs in a
//! per-node store. [`layer::capture_layer`] runs while the sandbox cgroup is frozen and reads
//! only what changed since the previous capture, [`layer::materialize_layer`] recreates the
//! upper directory of the restored sandbox, and [`OverlayMount`] mounts it over the same
//! image. [`tree_digest`] lets tests prove that the merged view came back identical.
//! [`remove_tree`] deletes trees a sandbox wrote (instance, sandbox and checkpoint dirs)
//! without recursion, with a bounded number of fds, without following a symlink or leaving
//! the root's mount.
//!
//! **The tar form** is the older, self-contained one: a layer as one tar archive, with the
//! same hardening (format below). Its halves now serve other inputs:
//!
//! - Image import (the agent's `images` module and its `tree` helper process):
//!   [`archive_tree`] streams a tar of any directory fd (run it with the credentials of
//!   whoever the tree is read for), and [`install_image`] unpacks a tar stream with the
//!   hardened tree builder under the rules of a flat image (device nodes refused, those
//!   under `dev/` dropped, no whiteouts, no overlay attributes; see [`image`]). Their types
//!   ([`CaptureError`], [`CaptureStats`], [`InstallError`], [`InstallLimits`]) are shared
//!   with the layer form.
//! - Image layers: [`install_oci_layer`] unpacks one layer of a container image (a tar
//!   stream from a registry) with the same tree builder under the rules of an OCI layer
//!   (see [`oci_layer`]): `.wh.NAME` members become overlay whiteouts, `.wh..wh..opq`
//!   markers opaque directories, aufs bookkeeping is skipped, device nodes are refused, a
//!   repeated name replaces the earlier member. A stack of unpacked layers can be inspected
//!   through [`OverlayMount::mount_lowers_readonly`] (overlayfs without an upper directory;
//!   one layer alone is bind-mounted read-only).
//! - [`capture_upper`] / [`capture_upper_with_limits`] / [`install_upper`] (an upper
//!   directory to a tar file and back) are used only by this crate's own tests and its
//!   `capture` benchmark; no checkpoint path calls them.
//!
//! Modules: [`layer`] (the layer form); [`capture`] and [`install`] (the tar form's
//! writer and reader, on a tar file), [`image`] (tar streams into images), [`oci_layer`]
//! (tar streams of image layers into layer directories), with private
//! `format` (tar/PAX constants), `unpack` (the tar member reader) and `sink` (archive
//! outputs); `tree` (the hardened tree builder both forms install with), `walk` (the
//! bounded sorted walk every capture and digest uses), [`digest`], [`mount`], `idmap`
//! (idmapped lower layers), [`remove`] and `sys` (syscall wrappers).
//!
//! # What an upper layer contains (overlayfs, as root sees the upper directory)
//!
//! - Files, directories, symlinks, fifos, sockets created or modified through the merged
//!   view, with their owners, modes, times and extended attributes. Modifying a lower file
//!   first *copies it up* (whole file, metadata included).
//! - **Whiteouts**: deleting a lower entry leaves a character device 0:0 with the same
//!   name, which hides it. Overlayfs may hardlink all its whiteouts to one inode (whose
//!   other link lives in the work directory), so whiteouts often come as a hardlink group.
//! - **Opaque directories**: a directory carrying `trusted.overlay.opaque=y` hides the
//!   lower directory of the same name entirely (what `rm -r d; mkdir d` leaves).
//! - **Redirects** and origins: with `redirect_dir=on` a renamed lower directory becomes an
//!   upper directory with `trusted.overlay.redirect=<old path>`; `trusted.overlay.origin`
//!   (a file handle of the lower inode), `trusted.overlay.impure`, `.metacopy` and the
//!   root's `trusted.overlay.uuid` are further bookkeeping. All `trusted.overlay.*`
//!   attributes are archived and reinstalled verbatim (except the root's uuid), so the new
//!   mount over the same lower layers interprets the layer exactly as the old one did.
//!
//! # Archive format (the portable tar form)
//!
//! A tar stream written by the `tar` crate's [`Builder`](tar::Builder) from headers built
//! here: GNU headers (binary numeric fields for large uids), members in sorted pre-order
//! (bytewise by name, parents before children), the upper root first as `./`, directories
//! with a trailing `/`. Per member, when needed, one PAX extension header before it holds:
//! `path` / `linkpath` (names or targets over 100 bytes, bytes verbatim), `mtime`
//! (`seconds.nanoseconds`), and one `SCHILY.xattr.<name>` record per extended attribute
//! (`BELAYER.xattrhex.<hex name>` for names that are not UTF-8 or contain `=`). A second
//! and later link to an inode is a tar hardlink member naming the first. Whiteouts and
//! other device nodes are character/block members (install accepts only 0:0), fifos fifo
//! members; sockets are skipped (counted in [`CaptureStats::skipped_sockets`]). The stream ends with two zero blocks, which install checks for. Regular-file
//! content is copied by the kernel (`copy_file_range`) straight into the archive file.
//! Holes are archived as zeros (no sparse members).
//!
//! # Threat model
//!
//! The sandbox is hostile: it controls every name, link target, mode, owner, attribute and
//! byte in its upper layer, and the archive file could have been altered at rest.
//!
//! - **Capture never follows a symlink**: `upper` is opened `O_NOFOLLOW | O_DIRECTORY`,
//!   every entry is examined with `statx(AT_SYMLINK_NOFOLLOW)` and opened relative to its
//!   parent's fd with `O_NOFOLLOW`, symlinks are read with `readlinkat`, attributes of
//!   fd-less entries through `/proc/self/fd/<parent>/<name>` with `l*xattr`. A symlink to
//!   `/etc/shadow` is archived as a symlink, never as the shadow file. Paths longer than
//!   install accepts fail the capture rather than produce an unrestorable archive, and
//!   capture enforces the same [`InstallLimits`] (a 1 TiB sparse file costs the sandbox
//!   nothing but would be archived as zeros onto the host's disk).
//! - **Install never writes outside the target**: each parent directory is opened with
//!   `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
//!   RESOLVE_NO_XDEV)` from the target's fd, so `evil -> /tmp/x` followed by `evil/pwned`
//!   fails with `ELOOP`; each leaf is created relative to that fd with exclusive, no-follow
//!   calls (an existing name is a duplicate, never overwritten; an image layer replaces it
//!   by unlinking it first, never writing through it); hardlinks may only point
//!   at earlier non-directory members (never `/etc/shadow`); metadata is set through the
//!   new fd or with `AT_SYMLINK_NOFOLLOW`.
//! - **Rejected** with a typed [`InstallError`] naming the member: names that are empty,
//!   absolute, contain `.`/`..`/empty components or NUL, exceed 255 bytes per component or
//!   4096 in total; device nodes other than 0:0 character devices (a device node in the
//!   upper layer would give the sandbox raw access to host devices); extended attributes
//!   outside `user.`/`security.`/`trusted.`/POSIX ACLs; member types not produced by
//!   capture (GNU sparse, global PAX headers, ...); PAX `size` and `GNU.sparse.*` records
//!   (a second size would let two parsers disagree on the stream); oversized extension
//!   headers (memory exhaustion); data on non-regular members; more members, more bytes
//!   or a bigger file than [`InstallLimits`] (disk exhaustion); a missing end marker.
//! - **Every walk and removal is iterative and bounded**: the sorted walk shared by capture,
//!   digests and materialize keeps an explicit stack, at most [`MAX_WALK_DEPTH`] (2048)
//!   levels (no path deeper than that fits in 4096 bytes, so a deeper tree fails the capture
//!   with [`CaptureError::TooDeep`] or [`CaptureError::PathTooLong`] instead of exhausting
//!   fds), at most 16 directory fds whatever the depth (closed levels are re-opened as `..`
//!   and checked by device and inode), and at most `max_entries` names held in memory.
//!   [`remove_tree`] streams directories, holds at most 32 fds (deeper directories are
//!   renamed to the top of the tree), stops at mount points and other filesystems with
//!   [`RemoveError::Mount`], and copes with directories of mode 000 (overlayfs's
//!   `work/work`). A 30 000-deep chain or 10^6 files in one directory cost the daemon
//!   neither its stack nor its fds.
//! - What is *accepted* is what the sandbox could create itself: setuid/setgid files owned
//!   by any uid (they matter only to whoever can reach them, so upper directories must sit
//!   in a root-only directory on the host), and `trusted.overlay.*` attributes (redirects
//!   and origins only ever resolve inside the lower layers of the same mount).
//!
//! # Dependencies
//!
//! - `rustix`: safe wrappers for every syscall used (`openat2`, `statx`, `*at`, xattrs,
//!   `copy_file_range`, `pread`/`pwrite`, the new mount API, `umount2`), so the crate needs
//!   no `unsafe`.
//! - `tar`: the tar format (header layout, numeric fields, checksums, writing PAX blocks,
//!   iterating members); this crate builds every header itself and never uses the crate's
//!   path-following helpers (`append_path`, `append_dir_all`, `unpack`). PAX records are
//!   parsed here, by length: the crate's own parser splits on newlines, which extended
//!   attribute values may contain.
//! - `blake3`: fast cryptographic hashing for [`file_digest`], [`tree_digest`] and the
//!   content addresses of blobs; its `rayon` feature hashes a large blob (a page pack a
//!   restore verifies before CRIU reads it) on every core.
//! - `bincode` + `serde`: the layer-manifest encoding (compact, fast for 10^5 entries, with a
//!   decode limit for untrusted input).
//! - `zstd`: optional compression of blobs in the store.
//! - `thiserror`: the per-module error enums. `tracing`: structured logs.
//!
//! Minimum kernel: 5.6 (`openat2`); 6.8 for the new mount API with `lowerdir+` (older
//! kernels fall back to `mount(2)`). Implements the file-system half of the paper's
//! `full_checkpoint` (archive the writable layer while the sandbox is frozen) and
//! `full_restore` (install it into the fresh sandbox's upper directory before the processes
//! are restored).
#![warn(missing_docs)]

pub mod capture;
pub mod digest;
mod format;
mod idmap;
pub mod image;
pub mod install;
pub mod layer;
pub mod mount;
pub mod oci_layer;
pub mod remove;
mod sink;
mod sys;
mod tree;
mod unpack;
mod walk;

pub use capture::{
    archive_tree, capture_upper, capture_upper_with_limits, CaptureError, CaptureStats,
};
pub use digest::{
    file_digest, first_difference, metadata_fingerprint, tree_bytes, tree_digest, tree_listing,
    DigestError, DIGEST_MAX_NAMES,
};
pub use idmap::{AttachedTree, IdmappedTree};
pub use image::{install_image, ImageOptions, ImageStats};
pub use install::{install_upper, InstallError, InstallLimits, InstallStats};
pub use mount::{is_mountpoint, unmount, MountError, MountFailure, MountOptions, OverlayMount};
pub use oci_layer::{install_oci_layer, LayerOptions, LayerStats};
pub use remove::{
    remove_dir_all, remove_tree, remove_tree_with, RemoveError, RemoveOptions, RemoveStats,
};
pub use sys::SyscallError;
pub use walk::MAX_WALK_DEPTH;
