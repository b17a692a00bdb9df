//! Errors of the image store ([`ImageError`]).

use std::path::PathBuf;

use belayer_overlay::InstallError;

use super::registry;

/// Image errors.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The name is not `[A-Za-z0-9._-]{1,64}` or starts with a dot.
    #[error("invalid image name {0:?}")]
    InvalidName(String),
    /// An image of that name exists.
    #[error("image {0} already exists")]
    AlreadyExists(String),
    /// No image of that name.
    #[error("unknown image {0}")]
    Unknown(String),
    /// The source cannot be opened or examined, or is neither a directory nor a regular
    /// file.
    #[error("cannot read image source {path}")]
    Source {
        /// Source path or label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The `tree` helper could not be started or waited for.
    #[error("running the tree helper for {path} failed")]
    Helper {
        /// Source label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Walking the source directory with the caller's credentials failed (typically an
    /// entry the caller may not read); nothing was imported.
    #[error("reading image source {path} as uid {uid} failed: {message}")]
    ReadTree {
        /// Source label.
        path: PathBuf,
        /// The uid the tree was read as.
        uid: u32,
        /// Whether the cause is an entry that uid may not read (`EACCES`/`EPERM`).
        denied: bool,
        /// The helper's report (the failed call and the entry).
        message: String,
    },
    /// Setting up decompression of an archive failed.
    #[error("decompressing {path} failed")]
    Decompress {
        /// Archive label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The tar stream was refused or could not be unpacked (a device node outside `/dev`, a
    /// whiteout, a hostile name, a truncated stream, ...): the cause names the entry.
    #[error("unpacking {path} failed")]
    Unpack {
        /// Source label.
        path: PathBuf,
        /// Cause.
        #[source]
        source: InstallError,
    },
    /// The unpacked tree has no `/bin/sh`, which every sandbox init needs.
    #[error("image source {0} has no /bin/sh")]
    NoShell(PathBuf),
    /// Writing the image store failed.
    #[error("image store operation on {path} failed")]
    Store {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// An OCI image's manifest or config is unusable (not JSON of the expected shape, a
    /// media type that is not an image, no layers, a digest in an unaccepted form, not a
    /// linux image, more layers than a stack may hold).
    #[error("image {image}: bad {what}: {reason}")]
    BadOci {
        /// Image name.
        image: String,
        /// `manifest` or `config`.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A blob's bytes do not hash to the digest the manifest (or config) names, or their
    /// size differs: a tampered, truncated or swapped blob. Nothing of it was kept.
    #[error("image {image}: {what} {expected} does not match its content ({got}, {bytes} bytes)")]
    DigestMismatch {
        /// Image name.
        image: String,
        /// `config`, `layer N` or `uncompressed layer N`.
        what: String,
        /// The digest named by the manifest or config.
        expected: String,
        /// The digest of what was read.
        got: String,
        /// Bytes read.
        bytes: u64,
    },
    /// Reading a blob failed (a client's file, a registry stream cut after its retries).
    #[error("image {image}: reading {what} {digest} failed")]
    BlobRead {
        /// Image name.
        image: String,
        /// `config` or `layer N`.
        what: String,
        /// Its digest.
        digest: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A layer was refused by the hardened unpacker (a `..` or absolute member, a write
    /// through a symlink, a device node, an overlay attribute, a cut stream).
    #[error("image {image}: layer {index} ({digest}) refused")]
    LayerRefused {
        /// Image name.
        image: String,
        /// Layer index, 0 = bottom-most.
        index: usize,
        /// Its digest.
        digest: String,
        /// Cause.
        #[source]
        source: Box<InstallError>,
    },
    /// A layer an image names is not in the layer store (the store was damaged by hand).
    #[error("image {image}: layer {diff_id} is missing from the layer store")]
    LayerMissing {
        /// Image name.
        image: String,
        /// The layer's uncompressed digest.
        diff_id: String,
    },
    /// The request's descriptors do not match its blob list.
    #[error("image {image}: {reason}")]
    BadBlobs {
        /// Image name.
        image: String,
        /// What is wrong.
        reason: String,
    },
    /// The registry step of a pull failed.
    #[error("pulling {reference} failed")]
    Registry {
        /// The reference.
        reference: String,
        /// Cause.
        #[source]
        source: Box<registry::RegistryError>,
    },
    /// Mounting the layer stack to inspect the image (its `/bin/sh`, its user) failed.
    #[error("image {image}: inspecting the layer stack failed")]
    Inspect {
        /// Image name.
        image: String,
        /// Cause.
        #[source]
        source: belayer_overlay::MountError,
    },
}
