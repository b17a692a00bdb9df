//! The mount tree of a sandbox, built by its init in its fresh mount namespace.
//!
//! DESIGN.md invariant "Confinement": runc's masked and read-only paths, a private `/dev`,
//! no host device reachable. Starting from a copy of the host's mount tree (which, in a mount
//! namespace owned by the sandbox's user namespace, the kernel locks together: the sandbox can
//! never unmount a mask to reveal what is under it):
//! 1. make everything private, bind the overlay root onto itself (`pivot_root` needs a mount
//!    that is not locked) and enter it;
//! 2. mount a fresh `proc` (`nosuid,nodev,noexec`), then mask its host-revealing files with
//!    the host's `/dev/null` ([`MASKED_FILES`]), cover its host-revealing directories with
//!    empty read-only tmpfs ([`MASKED_DIRS`]), and make the host-settings trees read-only
//!    ([`READ_ONLY`]);
//! 3. mount a private `/dev` tmpfs (`nosuid,noexec`) holding only bind mounts of the host's
//!    harmless character devices ([`crate::cgroup::ALLOWED_DEVICES`]; a user namespace cannot
//!    `mknod`), the usual `/dev/fd`, `/dev/std*` links and `/dev/shm`;
//! 4. `pivot_root` and detach the old root, so no host path remains reachable.
//!
//! CRIU dumps this tree as it is (the device and `/dev/null` binds as external mounts of the
//! host's devtmpfs) and rebuilds it at restore.

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

/// Directories of `/proc` covered with an empty read-only tmpfs (runc's defaults).
pub const MASKED_DIRS: &[&str] = &["proc/acpi", "proc/asound", "proc/scsi"];

/// Trees of `/proc` made read-only (runc's defaults): host-wide kernel settings.
pub const READ_ONLY: &[&str] = &["proc/bus", "proc/fs", "proc/irq", "proc/sys"];

const NONE: Option<&str> = None;

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
            mount(Some("/dev/null"), *file, NONE, MsFlags::MS_BIND, NONE)
                .map_err(|e| SyscallError::new("mount", format!("/dev/null on /{file}"), e))?;
        }
    }
    for dir in MASKED_DIRS {
        if fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir()) {
            mount(
                Some("tmpfs"),
                *dir,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
                Some("size=0,mode=555"),
            )
            .map_err(|e| SyscallError::new("mount", format!("tmpfs on /{dir}"), e))?;
        }
    }
    for dir in READ_ONLY {
        if fs::symlink_metadata(dir).is_err() {
            continue;
        }
        mount(
            Some(*dir),
            *dir,
            NONE,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            NONE,
        )
        .map_err(|e| SyscallError::new("mount", format!("/{dir} bind"), e))?;
        mount(
            NONE,
            *dir,
            NONE,
            MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC,
            NONE,
        )
        .map_err(|e| SyscallError::new("mount", format!("/{dir} read-only"), e))?;
    }
    Ok(())
}

/// The private `/dev`: a tmpfs with bind mounts of the allowed host devices.
fn build_dev() -> Result<(), SyscallError> {
    ensure_dir("dev", 0o755)?;
    mount(
        Some("tmpfs"),
        "dev",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )
    .map_err(|e| SyscallError::new("mount", "/dev tmpfs", e))?;
    for (_, _, name) in crate::cgroup::ALLOWED_DEVICES {
        let node = format!("dev/{name}");
        fs::File::create(&node).map_err(|e| SyscallError::io("create", node.clone(), e))?;
        fs::set_permissions(&node, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .map_err(|e| SyscallError::io("chmod", node.clone(), e))?;
        let host = format!("/dev/{name}");
        mount(
            Some(host.as_str()),
            node.as_str(),
            NONE,
            MsFlags::MS_BIND,
            NONE,
        )
        .map_err(|e| SyscallError::new("mount", format!("{host} bind"), e))?;
    }
    for (link, target) in [
        ("dev/fd", "/proc/self/fd"),
        ("dev/stdin", "/proc/self/fd/0"),
        ("dev/stdout", "/proc/self/fd/1"),
        ("dev/stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, link)
            .map_err(|e| SyscallError::io("symlink", link, e))?;
    }
    fs::create_dir("dev/shm").map_err(|e| SyscallError::io("mkdir", "/dev/shm", e))?;
    fs::set_permissions(
        "dev/shm",
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .map_err(|e| SyscallError::io("chmod", "/dev/shm", e))?;
    Ok(())
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
