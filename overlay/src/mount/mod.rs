//! Overlayfs mounts as guards: [`OverlayMount`] unmounts (lazily) on drop.
//!
//! Mounting uses the new mount API (`fsopen("overlay")`, one `fsconfig("lowerdir+")` per
//! lower layer, `fsconfig("upperdir")`, `fsconfig("workdir")`, `fsmount`, `move_mount`), so
//! layer paths need no escaping and a failure names the exact step (`fsconfig(upperdir)`,
//! `fsconfig(create)`, ...) with its errno.
//! Kernels older than 6.8 (no `lowerdir+`) or without `fsopen` get a classic `mount(2)`
//! with an option string instead, which cannot carry paths containing `,`, `:` or `\`.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::io::Errno;
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags, MountFlags, MoveMountFlags};

use crate::idmap::{AttachedTree, IdmappedTree};
use crate::sys::{Call, SyscallError};

mod error;
pub(crate) mod points;
mod read_only;

pub use error::{MountError, MountFailure};
pub use points::{is_mountpoint, unmount};

/// Options of an overlay mount beyond its layers.
#[derive(Debug, Clone, Copy, Default)]
pub struct MountOptions<'a> {
    /// Present every lower layer through this user namespace's id map (an nsfs fd, see
    /// [`crate::idmap`]): files owned by host uid 0 appear owned by the namespace's root.
    /// The layers are also mounted read-only, `nodev` and `nosuid`.
    pub idmap: Option<BorrowedFd<'a>>,
    /// `nodev`: device nodes on the overlay cannot be opened.
    pub nodev: bool,
    /// `nosuid`: set-user-id and set-group-id bits and file capabilities are ignored.
    pub nosuid: bool,
    /// `index=on,nfs_export=on`: file handles of the overlay's inodes can be opened again
    /// (`open_by_handle_at`), which is how CRIU finds the path of an inotify or fanotify
    /// watch; without it overlayfs hands out handles it cannot decode and CRIU refuses
    /// the watch ("Can't dump that handle"). Copy-ups then also record an index entry in
    /// the work dir (`work/index`), and a hard-linked lower file copied up stays one inode.
    pub nfs_export: bool,
}

/// A mounted overlay; dropping it detaches the mount (`umount2(target, MNT_DETACH)`)
/// unless it was [leaked](OverlayMount::leak).
#[derive(Debug)]
pub struct OverlayMount {
    target: PathBuf,
    leaked: bool,
}

impl OverlayMount {
    /// Mounts overlayfs at `target` with `lowerdir=lower`, `upperdir=upper`,
    /// `workdir=work`. All must exist; `upper` and `work` must be on the same filesystem
    /// and `work` must be empty (or hold only overlayfs's own work state).
    ///
    /// Errors: [`MountError::Mount`] with the paths, the failed step and its errno (details
    /// such as "failed to resolve" go to `dmesg`); [`MountError::UnsupportedPath`] on old
    /// kernels only.
    pub fn mount(
        lower: &Path,
        upper: &Path,
        work: &Path,
        target: &Path,
    ) -> Result<OverlayMount, MountError> {
        Self::mount_layers(&[lower], upper, work, target)
    }

    /// Like [`mount`](OverlayMount::mount) with several lower layers, top-most first.
    pub fn mount_layers(
        lowers: &[&Path],
        upper: &Path,
        work: &Path,
        target: &Path,
    ) -> Result<OverlayMount, MountError> {
        Self::mount_with(lowers, upper, work, target, &MountOptions::default())
    }

    /// Like [`mount_layers`](OverlayMount::mount_layers) with [`MountOptions`]: idmapped
    /// lower layers (Linux ≥ 5.19), `nodev`, `nosuid`. Kernels whose overlayfs takes no
    /// layer fds (before 6.13) get each idmapped layer attached for the duration of the
    /// mount at `<target>.lower-<i>` (a sibling of the mount point, which must therefore sit
    /// in a directory only root can enter).
    pub fn mount_with(
        lowers: &[&Path],
        upper: &Path,
        work: &Path,
        target: &Path,
        opts: &MountOptions<'_>,
    ) -> Result<OverlayMount, MountError> {
        if lowers.is_empty() {
            return Err(MountError::NoLowerLayer {
                target: target.to_path_buf(),
            });
        }
        let fail = |source, kernel_log| {
            MountError::Mount(Box::new(MountFailure {
                target: target.to_path_buf(),
                lowers: lowers.iter().map(|l| l.to_path_buf()).collect(),
                upper: upper.to_path_buf(),
                work: work.to_path_buf(),
                kernel_log,
                source,
            }))
        };
        let trees = match opts.idmap {
            Some(userns) => lowers
                .iter()
                .map(|l| IdmappedTree::new(l, userns))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| fail(source, Vec::new()))?,
            None => Vec::new(),
        };
        let layers = Layers {
            lowers,
            trees: &trees,
        };
        let dirs = Some((upper, work));
        match mount_fsopen(&layers, dirs, target, opts) {
            Ok(()) => {}
            Err(NewApiError::Unsupported) => {
                let attached = layers
                    .attach_all(target)
                    .map_err(|source| fail(source, Vec::new()))?;
                let paths: Vec<PathBuf> = match &attached {
                    Some(a) => a.iter().map(|t| t.target().to_path_buf()).collect(),
                    None => lowers.iter().map(|l| l.to_path_buf()).collect(),
                };
                let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
                mount_legacy(&refs, dirs, target, opts)
                    .map_err(|e| e.into_mount_error(target, |source| fail(source, Vec::new())))?
            }
            Err(NewApiError::Failed { source, log }) => return Err(fail(source, log)),
        }
        tracing::debug!(target = %target.display(), upper = %upper.display(), "mounted overlay");
        Ok(OverlayMount {
            target: target.to_path_buf(),
            leaked: false,
        })
    }

    /// The mount point.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Keeps the overlay mounted after this guard is dropped; returns the mount point.
    pub fn leak(mut self) -> PathBuf {
        self.leaked = true;
        std::mem::take(&mut self.target)
    }

    /// Detaches the mount now, reporting failure (dropping the guard only logs it).
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.leaked = true;
        unmount(&self.target).map(|_| ())
    }
}

impl Drop for OverlayMount {
    fn drop(&mut self) {
        if self.leaked {
            return;
        }
        if let Err(err) = unmount(&self.target) {
            tracing::warn!(target = %self.target.display(), error = %err, "detaching overlay failed");
        }
    }
}

enum NewApiError {
    /// No `fsopen`, or no `lowerdir+`: use `mount(2)`.
    Unsupported,
    Failed {
        source: SyscallError,
        log: Vec<String>,
    },
}

/// Set once the kernel has refused `fsopen` or `lowerdir+`, so later mounts go straight to
/// `mount(2)`.
static NEW_API_UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// The lower layers of one mount: paths, and their idmapped clones when asked for.
struct Layers<'a> {
    lowers: &'a [&'a Path],
    trees: &'a [IdmappedTree],
}

impl Layers<'_> {
    /// Attaches every idmapped tree at `<target>.lower-<i>`; `None` without idmapping.
    fn attach_all(&self, target: &Path) -> Result<Option<Vec<AttachedTree>>, SyscallError> {
        if self.trees.is_empty() {
            return Ok(None);
        }
        let mut attached = Vec::with_capacity(self.trees.len());
        for (i, tree) in self.trees.iter().enumerate() {
            let mut name = target.as_os_str().to_owned();
            name.push(format!(".lower-{i}"));
            let at = PathBuf::from(name);
            match std::fs::create_dir(&at) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    let _ = unmount(&at);
                }
                Err(e) => return Err(SyscallError::new("mkdir(idmapped layer)", e)),
            }
            attached.push(tree.attach(&at)?);
        }
        Ok(Some(attached))
    }
}

/// The upper and work directories of a writable overlay; `None` mounts the lower layers
/// alone, read-only.
type UpperDirs<'a> = Option<(&'a Path, &'a Path)>;

fn mount_fsopen(
    layers: &Layers<'_>,
    dirs: UpperDirs<'_>,
    target: &Path,
    opts: &MountOptions<'_>,
) -> Result<(), NewApiError> {
    let lowers = layers.lowers;
    if NEW_API_UNSUPPORTED.load(Ordering::Relaxed) {
        return Err(NewApiError::Unsupported);
    }
    let fs = match rustix::mount::fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC) {
        Ok(fs) => fs,
        Err(Errno::NOSYS) => {
            NEW_API_UNSUPPORTED.store(true, Ordering::Relaxed);
            return Err(NewApiError::Unsupported);
        }
        Err(errno) => {
            return Err(NewApiError::Failed {
                source: SyscallError::new("fsopen", errno),
                log: Vec::new(),
            })
        }
    };
    let failed = |fs: &OwnedFd, call: &'static str, errno: Errno| NewApiError::Failed {
        source: SyscallError::new(call, errno),
        log: read_fs_log(fs),
    };
    // Idmapped layers go in as fds when overlayfs takes them, else attached at paths for
    // the duration of this mount (detached when it returns: the overlay holds the layers).
    let mut by_path: Vec<PathBuf> = lowers.iter().map(|l| l.to_path_buf()).collect();
    if !layers.trees.is_empty() {
        let by_fd = layers
            .trees
            .iter()
            .try_for_each(|t| rustix::mount::fsconfig_set_fd(&fs, "lowerdir+", t.as_fd()));
        match by_fd {
            Ok(()) => by_path.clear(),
            Err(_) => {
                // Start over: a context that took some layers cannot drop them again.
                return mount_fsopen_attached(layers, dirs, target, opts);
            }
        }
    }
    for (i, lower) in by_path.iter().enumerate() {
        if let Err(errno) = rustix::mount::fsconfig_set_string(&fs, "lowerdir+", lower) {
            let log = read_fs_log(&fs);
            if i == 0
                && errno == Errno::INVAL
                && log.iter().any(|l| l.contains("Unknown parameter"))
            {
                NEW_API_UNSUPPORTED.store(true, Ordering::Relaxed);
                return Err(NewApiError::Unsupported);
            }
            return Err(NewApiError::Failed {
                source: SyscallError::new("fsconfig(lowerdir+)", errno),
                log,
            });
        }
    }
    if let Some((upper, work)) = dirs {
        rustix::mount::fsconfig_set_string(&fs, "upperdir", upper)
            .map_err(|e| failed(&fs, "fsconfig(upperdir)", e))?;
        rustix::mount::fsconfig_set_string(&fs, "workdir", work)
            .map_err(|e| failed(&fs, "fsconfig(workdir)", e))?;
    }
    if opts.nfs_export {
        for key in ["index", "nfs_export"] {
            rustix::mount::fsconfig_set_string(&fs, key, "on")
                .map_err(|e| failed(&fs, "fsconfig(index, nfs_export)", e))?;
        }
    }
    rustix::mount::fsconfig_create(&fs).map_err(|e| failed(&fs, "fsconfig(create)", e))?;
    let mut attrs = MountAttrFlags::empty();
    if dirs.is_none() {
        attrs |= MountAttrFlags::MOUNT_ATTR_RDONLY;
    }
    if opts.nodev {
        attrs |= MountAttrFlags::MOUNT_ATTR_NODEV;
    }
    if opts.nosuid {
        attrs |= MountAttrFlags::MOUNT_ATTR_NOSUID;
    }
    let mnt = rustix::mount::fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, attrs)
        .map_err(|e| failed(&fs, "fsmount", e))?;
    rustix::mount::move_mount(
        mnt.as_fd(),
        c"",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|e| failed(&fs, "move_mount", e))
}

/// [`mount_fsopen`] with every idmapped layer attached at a path (overlayfs before 6.13).
fn mount_fsopen_attached(
    layers: &Layers<'_>,
    dirs: UpperDirs<'_>,
    target: &Path,
    opts: &MountOptions<'_>,
) -> Result<(), NewApiError> {
    let attached = layers
        .attach_all(target)
        .map_err(|source| NewApiError::Failed {
            source,
            log: Vec::new(),
        })?
        .unwrap_or_default();
    let paths: Vec<PathBuf> = attached.iter().map(|t| t.target().to_path_buf()).collect();
    let refs: Vec<&Path> = paths.iter().map(PathBuf::as_path).collect();
    let plain = Layers {
        lowers: &refs,
        trees: &[],
    };
    let result = mount_fsopen(&plain, dirs, target, opts);
    drop(attached);
    result
}

/// Drains the messages the kernel queued on a filesystem context fd ("e overlayfs: ...").
fn read_fs_log(fs: &OwnedFd) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    while let Ok(n) = rustix::io::read(fs, &mut buf) {
        if n == 0 {
            break;
        }
        let text = String::from_utf8_lossy(&buf[..n]);
        let text = text.trim_end();
        // Each message starts with its level: "e " error, "w " warning, "i " info.
        out.push(text.get(2..).unwrap_or(text).to_owned());
    }
    out
}

enum LegacyError {
    UnsupportedPath(PathBuf),
    Failed(SyscallError),
}

impl LegacyError {
    fn into_mount_error(
        self,
        target: &Path,
        failed: impl FnOnce(SyscallError) -> MountError,
    ) -> MountError {
        match self {
            LegacyError::UnsupportedPath(path) => MountError::UnsupportedPath {
                target: target.to_path_buf(),
                path,
            },
            LegacyError::Failed(source) => failed(source),
        }
    }
}

fn mount_legacy(
    lowers: &[&Path],
    dirs: UpperDirs<'_>,
    target: &Path,
    opts: &MountOptions<'_>,
) -> Result<(), LegacyError> {
    let all = lowers
        .iter()
        .copied()
        .chain(dirs.into_iter().flat_map(|(upper, work)| [upper, work]));
    for path in all {
        if path
            .as_os_str()
            .as_bytes()
            .iter()
            .any(|b| matches!(b, b',' | b':' | b'\\'))
        {
            return Err(LegacyError::UnsupportedPath(path.to_path_buf()));
        }
    }
    let mut data = b"lowerdir=".to_vec();
    let lower_list: Vec<&[u8]> = lowers.iter().map(|l| l.as_os_str().as_bytes()).collect();
    data.extend_from_slice(&lower_list.join(&b':'));
    if let Some((upper, work)) = dirs {
        data.extend_from_slice(b",upperdir=");
        data.extend_from_slice(upper.as_os_str().as_bytes());
        data.extend_from_slice(b",workdir=");
        data.extend_from_slice(work.as_os_str().as_bytes());
    }
    if opts.nfs_export {
        data.extend_from_slice(b",index=on,nfs_export=on");
    }
    let data = CString::new(data)
        .map_err(|_| LegacyError::UnsupportedPath(PathBuf::from(OsStr::new("<path with NUL>"))))?;
    let mut flags = MountFlags::empty();
    if dirs.is_none() {
        flags |= MountFlags::RDONLY;
    }
    if opts.nodev {
        flags |= MountFlags::NODEV;
    }
    if opts.nosuid {
        flags |= MountFlags::NOSUID;
    }
    rustix::mount::mount("overlay", target, "overlay", flags, data.as_c_str())
        .call("mount")
        .map_err(LegacyError::Failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_mount_refuses_unrepresentable_paths() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        let bad = p.join("a,b");
        match mount_legacy(&[bad.as_path()], Some((p, p)), p, &MountOptions::default()) {
            Err(LegacyError::UnsupportedPath(path)) => assert_eq!(path, bad),
            _ => panic!("expected UnsupportedPath"),
        }
    }
}
