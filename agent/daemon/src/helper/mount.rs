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
//! 4. mount a private `devpts` instance on `/dev/pts` ([`devpts_options`]): the sandbox's
//!    own ptys, numbered from 0, invisible to the host's and other sandboxes' instances;
//!    `/dev/ptmx` is a link to its `pts/ptmx`;
//! 5. `pivot_root` and detach the old root, so no host path remains reachable.
//!
//! CRIU dumps this tree as it is and rebuilds it at restore. Every mount is a bind of a host
//! file or of the empty directory [`EMPTY_DIR`] (external mounts: nothing to copy), or the
//! `proc` and `devpts` instances (CRIU mounts fresh ones and re-creates the open ptys in
//! theirs by index); no tmpfs, whose content CRIU would archive with `tar` in every frozen
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
    ("ptmx", "pts/ptmx"),
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
pub(crate) fn build_root(root: &Path, private_userns: bool) -> Result<(), SyscallError> {
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
    build_dev(private_userns)?;
    mount_devpts()?;
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
    bind_remounted(
        source,
        target,
        MsFlags::MS_REC,
        MsFlags::MS_RDONLY,
        MsFlags::MS_NODEV,
    )
}

/// Binds `source` on `target` (with `bind_flags`, e.g. `MS_REC`), then remounts the bind
/// `nosuid`, `noexec`, `read_only` (`MS_RDONLY` or nothing) and `extra` (e.g. `MS_NODEV`).
fn bind_remounted(
    source: &str,
    target: &str,
    bind_flags: MsFlags,
    read_only: MsFlags,
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
        | read_only
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NOEXEC
        | extra;
    mount(NONE, target, NONE, remount, NONE)
        .map_err(|e| SyscallError::new("mount", format!("/{target} remount"), e))
}

/// Binds the allowed host devices over their placeholders in the sandbox's `/dev` (made by
/// [`dev_skeleton`]; each must be a plain file there, never a symlink), read-only, except
/// `/dev/tty` in a sandbox with a private user namespace.
///
/// Why that one: CRIU's restore of a descriptor of `/dev/tty` (a process holding its
/// controlling terminal open that way, as `less`, `ssh`, `sudo`, zdtm `pty00` do) `fchown`s
/// it (to uid and gid -1, which changes nothing), and `fchown` on a read-only mount fails
/// with `EROFS`, failing the whole restore. Writable, the bind lets the sandbox do no more to
/// the host's node than before: its root has no capability over the node's owner (host root
/// is not mapped in its user namespace), so `chmod`, `chown`, explicit times, ACLs and
/// `security.` attributes fail with `EPERM`; what is left is setting the times to now, which
/// every write to a tty does to that node anyway. With `--userns=host` the sandbox's root
/// would have `CAP_FOWNER` over it, so there it stays read-only (and such a restore fails).
fn build_dev(private_userns: bool) -> Result<(), SyscallError> {
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
        if *name == "tty" && private_userns {
            bind_remounted(
                "/dev/tty",
                &node,
                MsFlags::empty(),
                MsFlags::empty(),
                MsFlags::empty(),
            )?;
        } else {
            bind_device(&format!("/dev/{name}"), &node)?;
        }
    }
    Ok(())
}

/// Most ptys one sandbox may hold open at once (devpts `max`): every slave then has major
/// [`PTY_SLAVE_MAJOR`], the only one the device allow-list admits, and one sandbox cannot take
/// the node's whole share of ptys (`kernel.pty.max` minus `kernel.pty.reserve`).
pub const PTY_MAX: u32 = 256;

/// Major number of the pty slaves `/dev/pts/0` .. `/dev/pts/255` (`UNIX98_PTY_SLAVE_MAJOR`).
pub use crate::cgroup::PTY_SLAVE_MAJOR;

/// The group pty slaves belong to when the image's `/etc/group` names no `tty` group (5, as on
/// Debian, Alpine, Fedora).
pub const DEFAULT_TTY_GID: u32 = 5;

/// The devpts options of a sandbox: a new instance (never the host's), `/dev/pts/ptmx` usable by
/// everyone, slaves `rw--w----` and of group `gid`, at most [`PTY_MAX`] ptys.
pub fn devpts_options(gid: u32) -> String {
    format!("newinstance,ptmxmode=0666,mode=0620,gid={gid},max={PTY_MAX}")
}

/// Mounts the sandbox's own `devpts` on `dev/pts` (relative to the new root, the cwd),
/// `nosuid,noexec`, with [`devpts_options`] and the image's tty group ([`tty_gid`]; one the
/// sandbox's user namespace does not map, which the kernel refuses with `EINVAL`, falls back
/// to [`DEFAULT_TTY_GID`]). Runs in the sandbox's user namespace (devpts may be mounted there,
/// Linux ≥ 4.7); the gid is one of that namespace.
fn mount_devpts() -> Result<(), SyscallError> {
    ensure_dir("dev/pts", 0o755)?;
    let attempt = |gid: u32| {
        let options = devpts_options(gid);
        mount(
            Some("devpts"),
            "dev/pts",
            Some("devpts"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some(options.as_str()),
        )
        .map_err(|e| (e, options))
    };
    let gid = tty_gid();
    let mounted = match attempt(gid) {
        Err((nix::errno::Errno::EINVAL, _)) if gid != DEFAULT_TTY_GID => attempt(DEFAULT_TTY_GID),
        r => r,
    };
    mounted.map_err(|(e, options)| {
        SyscallError::new("mount", format!("devpts on /dev/pts ({options})"), e)
    })
}

/// Bytes of the image's `/etc/group` read at most when looking for the tty group.
const GROUP_FILE_MAX: usize = 64 << 10;

/// The gid of group `tty` in the image's `etc/group` (resolved beneath the new root, the cwd:
/// an absolute link in the image never reaches the host's), or [`DEFAULT_TTY_GID`] when the
/// file is missing, not a regular file, too long, or names no such group.
fn tty_gid() -> u32 {
    use rustix::fs::{Mode as RMode, OFlags, ResolveFlags};
    use std::io::Read;
    let opened = rustix::fs::openat2(
        rustix::fs::CWD,
        "etc/group",
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        RMode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
    );
    let Ok(fd) = opened else {
        return DEFAULT_TTY_GID;
    };
    let file = fs::File::from(fd);
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return DEFAULT_TTY_GID;
    }
    let mut text = Vec::new();
    let read = file.take(GROUP_FILE_MAX as u64 + 1).read_to_end(&mut text);
    if read.is_err() || text.len() > GROUP_FILE_MAX {
        return DEFAULT_TTY_GID;
    }
    group_gid(&String::from_utf8_lossy(&text), "tty").unwrap_or(DEFAULT_TTY_GID)
}

/// The gid of group `name` in the text of a `/etc/group` file (`name:password:gid:members`).
pub(crate) fn group_gid(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name)
            .then(|| fields.nth(1)?.trim().parse().ok())
            .flatten()
    })
}

/// Binds the host device node `source` onto `target`, read-only, `nosuid`, `noexec`: the node
/// is the host's inode, so its times, mode and owner are not the sandbox's to change (reads
/// and writes of the device itself are unaffected).
fn bind_device(source: &str, target: &str) -> Result<(), SyscallError> {
    bind_remounted(
        source,
        target,
        MsFlags::empty(),
        MsFlags::MS_RDONLY,
        MsFlags::empty(),
    )
}

/// Makes `/dev` of a fresh upper layer (host side, before the overlay is mounted): an opaque
/// directory (the image's `/dev` never shows through) owned by `owner` (the sandbox's root)
/// with a placeholder file per allowed device, the `/dev/ptmx`, `/dev/fd` and `/dev/std*`
/// links ([`DEV_LINKS`]), the `/dev/pts` mount point and a world-writable, sticky `/dev/shm`.
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
    let pts = dev.join("pts");
    fs::create_dir(&pts)?;
    fs::set_permissions(&pts, fs::Permissions::from_mode(0o755))?;
    chown(&pts, Some(owner), Some(owner))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tty_group_is_read_from_group_lines() {
        let text = "root:x:0:\ndaemon:x:1:\ntty:x:7:alice\nusers:x:100:\n";
        assert_eq!(group_gid(text, "tty"), Some(7));
        assert_eq!(group_gid(text, "users"), Some(100));
        assert_eq!(group_gid(text, "wheel"), None);
        assert_eq!(group_gid("tty:x:nan:\n", "tty"), None);
        assert_eq!(group_gid("ttyx:x:9:\ntty", "tty"), None);
        assert_eq!(group_gid("", "tty"), None);
    }

    #[test]
    fn devpts_is_a_bounded_private_instance() {
        let o = devpts_options(5);
        for part in [
            "newinstance",
            "ptmxmode=0666",
            "mode=0620",
            "gid=5",
            "max=256",
        ] {
            assert!(o.split(',').any(|p| p == part), "{part} missing in {o}");
        }
        // Every slave index below the limit has the one allowed major.
        assert_eq!((PTY_MAX - 1) / 256, 0);
    }
}
