//! The mount tree of a sandbox, built by its init in its fresh mount namespace.
//!
//! DESIGN.md invariant "Confinement": runc's masked and read-only paths, a private `/dev`,
//! no host device reachable. Nothing in the sandbox can undo a mask: its processes hold no
//! `CAP_SYS_ADMIN` (not even in the bounding set) and seccomp refuses every mount call
//! (`mount`, `umount2`, `move_mount`, `open_tree`, `fsopen`, ... and namespace creation);
//! the mounts copied from the host's tree are moreover locked by the kernel (a mount
//! namespace owned by a less privileged user namespace). Starting from that copy:
//! 1. make everything private, bind the overlay root onto itself (`pivot_root` needs a mount
//!    that is not locked) and enter it;
//! 2. mount a fresh `proc` (`nosuid,nodev,noexec`), then mask its host-revealing files with
//!    the host's `/dev/null` bound read-only ([`MASKED_FILES`]), cover its host-revealing directories with
//!    the empty directory [`EMPTY_DIR`] bound read-only ([`MASKED_DIRS`]), and make the
//!    host-settings trees read-only ([`READ_ONLY`]);
//! 3. bind the host's harmless character devices ([`crate::cgroup::ALLOWED_DEVICES`]; a user
//!    namespace cannot `mknod`) read-only over their placeholders in the sandbox's own `/dev`, an opaque
//!    directory of its upper layer made with the instance ([`dev_skeleton`]: placeholders, the
//!    `/dev/fd`, `/dev/std*` links, `/dev/shm`);
//! 4. `pivot_root` and detach the old root, so no host path remains reachable.
//!
//! CRIU dumps this tree as it is and rebuilds it at restore. Every mount is a bind of a host
//! file or of the empty directory [`EMPTY_DIR`] (external mounts: nothing to copy), or the
//! `proc` instance; no tmpfs, whose content CRIU would archive with `tar` in every frozen
//! window (≈8 ms each here). `/dev` lives in the upper layer instead, so what a sandbox keeps
//! in `/dev/shm` is captured incrementally with the rest of its files and counts against its
//! disk quota.

use std::fs;
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{umask, Mode};
use nix::unistd::{chdir, pivot_root};

use crate::sys::SyscallError;

/// Files of `/proc` that reveal host-wide state and are covered with `/dev/null` (runc's
/// defaults plus slab, vmalloc, iomem and the kernel config).
pub const MASKED_FILES: &[&str] = &[
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/slabinfo",
    "proc/vmallocinfo",
    "proc/iomem",
    "proc/ioports",
    "proc/config.gz",
    "proc/kallsyms",
    "proc/sysrq-trigger",
];

/// Directories of `/proc` covered with a read-only bind of [`EMPTY_DIR`] (runc's defaults).
pub const MASKED_DIRS: &[&str] = &["proc/acpi", "proc/asound", "proc/scsi"];

/// An empty, root-owned, mode 0555 host directory (made by `belayerd` at start) that masks
/// directories; a bind of it costs CRIU nothing to dump or restore.
pub const EMPTY_DIR: &str = "/run/belayer/empty";

/// The entries of a fresh upper layer's `/dev`: `(name, kind)`; placeholders are empty files
/// the devices are bound over.
pub const DEV_LINKS: &[(&str, &str)] = &[
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// Trees of `/proc` made read-only (runc's defaults): host-wide kernel settings.
pub const READ_ONLY: &[&str] = &["proc/bus", "proc/fs", "proc/irq", "proc/sys"];

const NONE: Option<&str> = None;

/// The host paths a sandbox's mount tree binds (its devices, `/dev/null` over masked files,
/// [`EMPTY_DIR`] over masked directories) and whether each is a directory: what a restore may
/// bind again (`belayer_criu::validate_restore_paths_allowing`).
pub fn host_binds() -> Vec<(String, bool)> {
    crate::cgroup::ALLOWED_DEVICES
        .iter()
        .map(|(_, _, name)| (format!("/dev/{name}"), false))
        .chain(std::iter::once((EMPTY_DIR.to_string(), true)))
        .collect()
}

/// Builds the sandbox root at `root` (the merged overlay dir, as seen before `pivot_root`)
/// and enters it; see the module docs. Runs in pid 1 of the sandbox's pid namespace, whose
/// cwd is already `root` (entered by host root: the sandbox's root could not traverse the
/// root-only state dir above it).
pub(crate) fn build_root(root: &Path) -> Result<(), SyscallError> {
    let what = root.display().to_string();
    let name = root
        .file_name()
        .ok_or_else(|| SyscallError::new("chdir", what.clone(), nix::errno::Errno::EINVAL))?;
    mount(NONE, "/", NONE, MsFlags::MS_REC | MsFlags::MS_PRIVATE, NONE)
        .map_err(|e| SyscallError::new("mount", "/ rprivate", e))?;
    mount(
        Some("."),
        ".",
        NONE,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        NONE,
    )
    .map_err(|e| SyscallError::new("mount", format!("{what} rbind"), e))?;
    // Onto the new bind (a lookup of the name crosses to the top-most mount on it).
    chdir("..").map_err(|e| SyscallError::new("chdir", format!("{what}/.."), e))?;
    chdir(name).map_err(|e| SyscallError::new("chdir", what.clone(), e))?;
    umask(Mode::empty());
    ensure_dir("proc", 0o555)?;
    mount(
        Some("proc"),
        "proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        NONE,
    )
    .map_err(|e| SyscallError::new("mount", "/proc", e))?;
    mask_proc()?;
    build_dev()?;
    pivot_root(".", ".").map_err(|e| SyscallError::new("pivot_root", what, e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| SyscallError::new("umount2", "old root", e))?;
    chdir("/").map_err(|e| SyscallError::new("chdir", "/", e))?;
    Ok(())
}

/// Masks and read-only binds of `proc` (relative to the new root, which is the cwd). The host's
/// `/dev/null` is still reachable as `/dev/null` here: the old root is detached only later.
fn mask_proc() -> Result<(), SyscallError> {
    for file in MASKED_FILES {
        if fs::symlink_metadata(file).is_ok() {
            bind_device("/dev/null", file)?;
        }
    }
    for dir in MASKED_DIRS {
        if fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            bind_read_only(EMPTY_DIR, dir)?;
        }
    }
    for dir in READ_ONLY {
        if fs::symlink_metadata(dir).is_ok() {
            bind_read_only(dir, dir)?;
        }
    }
    Ok(())
}

/// Binds `source` onto `target` (recursively) and makes the bind read-only, `nosuid`,
/// `nodev`, `noexec`.
fn bind_read_only(source: &str, target: &str) -> Result<(), SyscallError> {
    bind_remounted(source, target, MsFlags::MS_REC, MsFlags::MS_NODEV)
}

/// Binds `source` on `target` (with `bind_flags`, e.g. `MS_REC`), then remounts the bind
/// read-only, `nosuid`, `noexec` and `extra` (e.g. `MS_NODEV`).
fn bind_remounted(
    source: &str,
    target: &str,
    bind_flags: MsFlags,
    extra: MsFlags,
) -> Result<(), SyscallError> {
    mount(
        Some(source),
        target,
        NONE,
        MsFlags::MS_BIND | bind_flags,
        NONE,
    )
    .map_err(|e| SyscallError::new("mount", format!("{source} on /{target}"), e))?;
    let remount = MsFlags::MS_REMOUNT
        | MsFlags::MS_BIND
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NOEXEC
        | extra;
    mount(NONE, target, NONE, remount, NONE)
        .map_err(|e| SyscallError::new("mount", format!("/{target} read-only"), e))
}

/// Binds the allowed host devices over their placeholders in the sandbox's `/dev` (made by
/// [`dev_skeleton`]; each must be a plain file there, never a symlink), read-only.
fn build_dev() -> Result<(), SyscallError> {
    for (_, _, name) in crate::cgroup::ALLOWED_DEVICES {
        let node = format!("dev/{name}");
        let plain = fs::symlink_metadata(&node).is_ok_and(|m| m.file_type().is_file());
        if !plain {
            return Err(SyscallError::new(
                "mount",
                format!("/{node} (no device placeholder)"),
                nix::errno::Errno::ENOENT,
            ));
        }
        bind_device(&format!("/dev/{name}"), &node)?;
    }
    Ok(())
}

/// Binds the host device node `source` onto `target`, read-only, `nosuid`, `noexec`: the node
/// is the host's inode, so its times, mode and owner are not the sandbox's to change (reads
/// and writes of the device itself are unaffected).
fn bind_device(source: &str, target: &str) -> Result<(), SyscallError> {
    bind_remounted(source, target, MsFlags::empty(), MsFlags::empty())
}

/// Makes `/dev` of a fresh upper layer (host side, before the overlay is mounted): an opaque
/// directory (the image's `/dev` never shows through) owned by `owner` (the sandbox's root)
/// with a placeholder file per allowed device, the `/dev/fd` and `/dev/std*` links and a
/// world-writable, sticky `/dev/shm`.
pub fn dev_skeleton(upper: &Path, owner: u32) -> std::io::Result<()> {
    use std::os::unix::fs::{chown, lchown, symlink, PermissionsExt};
    let dev = upper.join("dev");
    fs::create_dir(&dev)?;
    fs::set_permissions(&dev, fs::Permissions::from_mode(0o755))?;
    xattr_set(&dev, "trusted.overlay.opaque", b"y")?;
    for (_, _, name) in crate::cgroup::ALLOWED_DEVICES {
        let p = dev.join(name);
        fs::File::create(&p)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(0o666))?;
        chown(&p, Some(owner), Some(owner))?;
    }
    for (name, target) in DEV_LINKS {
        let p = dev.join(name);
        symlink(target, &p)?;
        lchown(&p, Some(owner), Some(owner))?;
    }
    let shm = dev.join("shm");
    fs::create_dir(&shm)?;
    fs::set_permissions(&shm, fs::Permissions::from_mode(0o1777))?;
    chown(&shm, Some(owner), Some(owner))?;
    chown(&dev, Some(owner), Some(owner))
}

fn xattr_set(path: &Path, name: &str, value: &[u8]) -> std::io::Result<()> {
    rustix::fs::setxattr(path, name, value, rustix::fs::XattrFlags::empty()).map_err(Into::into)
}

fn ensure_dir(path: &str, mode: u32) -> Result<(), SyscallError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(SyscallError::new("mkdir", path, nix::errno::Errno::ENOTDIR)),
        Err(_) => {
            fs::create_dir(path).map_err(|e| SyscallError::io("mkdir", path, e))?;
            fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .map_err(|e| SyscallError::io("chmod", path, e))
        }
    }
}
