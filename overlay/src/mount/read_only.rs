//! Read-only merged views of a stack of image layers, to inspect an image before it is
//! published: [`OverlayMount::mount_lowers_readonly`].
//!
//! Overlayfs mounts lower layers without an upper directory read-only, but refuses a single
//! lower layer without one ("at least 2 lowerdir are needed while upperdir nonexistent", up
//! to at least Linux 6.18). One layer is therefore shown through a bind mount instead: a
//! detached clone of the layer's mount (`open_tree(OPEN_TREE_CLONE)`, without the mounts
//! below it) made read-only, `nodev` and `nosuid` (`mount_setattr`) before it is attached
//! with `move_mount`, so it is never reachable writable. The first refusal is remembered for
//! the life of the process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::Errno;
use rustix::mount::MoveMountFlags;

use super::{mount_fsopen, mount_legacy, Layers, MountError, MountFailure, MountOptions};
use super::{NewApiError, OverlayMount};
use crate::sys::{Call, SyscallError};

/// Set once overlayfs refused a single lower layer without an upper directory.
static SINGLE_LOWER_REFUSED: AtomicBool = AtomicBool::new(false);

impl OverlayMount {
    /// Mounts the merged view of `lowers` (top-most first) at `target`, an existing
    /// directory: overlayfs without an upper directory, read-only, `nodev`, `nosuid`.
    /// Whiteouts and opaque directories of the layers apply as in a sandbox's root. A single
    /// layer, which overlayfs refuses to mount alone, is bind-mounted instead (read-only,
    /// `nodev`, `nosuid`, without the mounts below it); it shows its whiteouts as the 0:0
    /// character devices they are. Dropping the guard detaches the mount.
    ///
    /// Errors: [`MountError::NoLowerLayer`]; [`MountError::Mount`] with the layers, the
    /// failed step and its errno (upper and work empty); [`MountError::UnsupportedPath`]
    /// on kernels without the new mount API only.
    pub fn mount_lowers_readonly(
        lowers: &[&Path],
        target: &Path,
    ) -> Result<OverlayMount, MountError> {
        let fail = |source: SyscallError, kernel_log: Vec<String>| {
            MountError::Mount(Box::new(MountFailure {
                target: target.to_path_buf(),
                lowers: lowers.iter().map(|l| l.to_path_buf()).collect(),
                upper: PathBuf::new(),
                work: PathBuf::new(),
                kernel_log,
                source,
            }))
        };
        let single = match lowers {
            [] => {
                return Err(MountError::NoLowerLayer {
                    target: target.to_path_buf(),
                })
            }
            [layer] => Some(*layer),
            _ => None,
        };
        let bind = |layer: &Path| {
            bind_read_only(layer, target).map_err(|source| fail(source, Vec::new()))?;
            tracing::debug!(target = %target.display(), layer = %layer.display(), "bind-mounted one layer read-only");
            Ok(OverlayMount {
                target: target.to_path_buf(),
                leaked: false,
            })
        };
        if let Some(layer) = single {
            if SINGLE_LOWER_REFUSED.load(Ordering::Relaxed) {
                return bind(layer);
            }
        }
        let opts = MountOptions {
            nodev: true,
            nosuid: true,
            ..MountOptions::default()
        };
        let layers = Layers { lowers, trees: &[] };
        let mounted = match mount_fsopen(&layers, None, target, &opts) {
            Ok(()) => Ok(()),
            Err(NewApiError::Unsupported) => mount_legacy(lowers, None, target, &opts)
                .map_err(|e| e.into_mount_error(target, |source| fail(source, Vec::new()))),
            Err(NewApiError::Failed { source, log }) => Err(fail(source, log)),
        };
        match (mounted, single) {
            (Ok(()), _) => {}
            (Err(MountError::Mount(failure)), Some(layer))
                if failure.source.errno() == Some(Errno::INVAL.raw_os_error()) =>
            {
                tracing::debug!(kernel = ?failure.kernel_log, "overlayfs refuses a single lower layer without an upper one");
                SINGLE_LOWER_REFUSED.store(true, Ordering::Relaxed);
                return bind(layer);
            }
            (Err(err), _) => return Err(err),
        }
        tracing::debug!(target = %target.display(), layers = lowers.len(), "mounted layers read-only");
        Ok(OverlayMount {
            target: target.to_path_buf(),
            leaked: false,
        })
    }
}

/// Attaches a read-only, `nodev`, `nosuid` clone of the mount at `layer` at `target`.
fn bind_read_only(layer: &Path, target: &Path) -> Result<(), SyscallError> {
    let tree = crate::idmap::read_only_clone(layer)?;
    rustix::mount::move_mount(
        &tree,
        c"",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .call("move_mount(read-only layer)")
}
