//! Why mounting, unmounting or inspecting mounts failed: [`MountError`], with the details of
//! a failed overlay mount in [`MountFailure`].

use std::io;
use std::path::{Path, PathBuf};

use crate::sys::SyscallError;

/// Why mounting, unmounting or inspecting mounts failed.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// The overlay mount failed: the paths, the failed call with its errno, and what
    /// overlayfs logged about it.
    #[error(transparent)]
    Mount(Box<MountFailure>),
    /// No lower layer was given.
    #[error("mounting overlay at {target} failed: no lower layer given")]
    NoLowerLayer {
        /// The mount point.
        target: PathBuf,
    },
    /// The kernel only offers `mount(2)` with an option string, and a layer path holds a
    /// character that string cannot carry.
    #[error("mounting overlay at {target} failed: layer path {path} contains `,`, `:` or `\\`, which this kernel's mount(2) options cannot carry")]
    UnsupportedPath {
        /// The mount point.
        target: PathBuf,
        /// The offending layer path.
        path: PathBuf,
    },
    /// `umount2(MNT_DETACH)` failed (other than for "not a mount point").
    #[error("unmounting {target} failed")]
    Unmount {
        /// The mount point.
        target: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// `/proc/self/mountinfo` could not be read.
    #[error("reading /proc/self/mountinfo failed")]
    ReadMountinfo {
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The path to check could not be resolved.
    #[error("resolving {path} failed")]
    Resolve {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Details of a failed overlay mount.
#[derive(Debug, thiserror::Error)]
#[error(
    "mounting overlay at {target} (lower {lowers:?}{}) failed{}",
    dirs_text(upper, work),
    log_suffix(kernel_log)
)]
pub struct MountFailure {
    /// The mount point.
    pub target: PathBuf,
    /// Lower layers, top-most first.
    pub lowers: Vec<PathBuf>,
    /// The upper directory (empty for a read-only mount of lower layers alone).
    pub upper: PathBuf,
    /// The work directory (empty for a read-only mount of lower layers alone).
    pub work: PathBuf,
    /// Messages the kernel queued on the filesystem context for this attempt (new mount
    /// API only), e.g. `"overlay: Unknown parameter 'x'"`. Overlayfs reports most other
    /// failures (unresolvable layers, bad work directory) only to the kernel log (`dmesg`).
    pub kernel_log: Vec<String>,
    /// The failed call and its errno.
    #[source]
    pub source: SyscallError,
}

fn dirs_text(upper: &Path, work: &Path) -> String {
    if upper.as_os_str().is_empty() {
        ", read-only".to_owned()
    } else {
        format!(", upper {}, work {}", upper.display(), work.display())
    }
}

fn log_suffix(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!(" (kernel: {})", log.join("; "))
    }
}
