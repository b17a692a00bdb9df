//! The `init` helper: creates a sandbox's namespaces and starts its long-lived init.
//!
//! Steps (learned from what CRIU needs to dump and restore the tree, see DESIGN.md):
//! 1. join the sandbox cgroup (every hierarchy), so everything below inherits it;
//! 2. `unshare` mount, uts, ipc, net and pid namespaces and fork: the child is pid 1 of the new
//!    pid namespace;
//! 3. in the child: make `/` recursively private, set the hostname, `pivot_root` into the overlay
//!    merged directory (CRIU refuses a `chroot`ed root), mount `/proc` and a private `/dev`
//!    (tmpfs with the usual character devices), bring `lo` up, point stdio at the sandbox's own
//!    `/dev/null`, close every other fd, `setsid` (the init must lead its session inside the pid
//!    namespace) and exec the image's `/bin/sh` running an endless `sleep` loop, which also reaps
//!    orphans re-parented to it;
//! 4. the parent learns success when the close-on-exec status pipe closes, prints the child's
//!    host pid on stdout and exits; the child is re-parented to the agent (a child subreaper).

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknod, umask, Mode, SFlag};
use nix::unistd::{chdir, execve, fork, pivot_root, sethostname, setsid, ForkResult};

use super::Args;
use crate::sys::{self, SyscallError};

/// Script run by the sandbox init: sleeps forever; `sh` reaps any child that exits meanwhile.
pub const INIT_SCRIPT: &str = "while :; do sleep 3600; done";

/// PATH given to processes in a sandbox.
pub const SANDBOX_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Errors of the init helper.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A required argument is missing.
    #[error("missing argument {0}")]
    MissingArgument(&'static str),
    /// Joining the sandbox cgroup failed.
    #[error(transparent)]
    JoinCgroup(#[from] super::JoinCgroupError),
    /// A syscall failed in the helper.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    /// Dropping capabilities failed.
    #[error(transparent)]
    Capabilities(#[from] super::CapabilityError),
    /// The sandbox init failed while setting up its namespaces.
    #[error("sandbox init setup failed: {0}")]
    ChildSetup(String),
}

/// Entry point; prints the host pid of the new init on success. Returns the exit code.
pub fn main(args: &[String]) -> i32 {
    match run(&Args::new(args)) {
        Ok(pid) => {
            println!("{pid}");
            0
        }
        Err(e) => {
            eprintln!("belayer init helper: {e}");
            1
        }
    }
}

fn run(args: &Args<'_>) -> Result<i32, InitError> {
    let root = args
        .one("--root")
        .ok_or(InitError::MissingArgument("--root"))?;
    let hostname = args.one("--hostname").unwrap_or("sandbox");
    let env: Vec<CString> = std::iter::once(format!("PATH={SANDBOX_PATH}"))
        .chain(std::iter::once("HOME=/root".to_string()))
        .chain(args.all("--env").into_iter().map(str::to_string))
        .map(|s| CString::new(s).unwrap_or_default())
        .collect();
    super::join_cgroup(&args.all("--procs"))?;
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| SyscallError::io("pipe2", "status", e.into()))?;
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWPID,
    )
    .map_err(|e| SyscallError::new("unshare", "mnt|uts|ipc|net|pid", e))?;
    // SAFETY: this helper process is single-threaded (a fresh exec of the agent binary that has
    // started no threads), so the child may allocate and run arbitrary code after fork.
    match unsafe { fork() }.map_err(|e| SyscallError::new("fork", "sandbox init", e))? {
        ForkResult::Child => {
            drop(rd);
            let err = child(
                Path::new(root),
                hostname,
                &env,
                std::os::fd::AsRawFd::as_raw_fd(&wr) as u32,
            );
            let mut wr = fs::File::from(wr);
            let _ = write!(wr, "{}", err);
            // SAFETY: _exit is always safe; it ends the child without running destructors.
            unsafe { libc::_exit(1) }
        }
        ForkResult::Parent { child } => {
            drop(wr);
            let mut msg = String::new();
            let _ = fs::File::from(rd).read_to_string(&mut msg);
            if msg.is_empty() {
                Ok(child.as_raw())
            } else {
                let _ = nix::sys::wait::waitpid(child, None);
                Err(InitError::ChildSetup(msg))
            }
        }
    }
}

/// Runs in pid 1 of the new namespaces; returns only on error.
fn child(root: &Path, hostname: &str, env: &[CString], status_fd: u32) -> InitError {
    match setup(root, hostname, status_fd) {
        Err(e) => e,
        Ok(()) => {
            let sh = CString::from(c"/bin/sh");
            let argv = [
                CString::from(c"sh"),
                CString::from(c"-c"),
                CString::new(INIT_SCRIPT).unwrap_or_default(),
            ];
            match execve(&sh, &argv, env) {
                Err(e) => SyscallError::new("execve", "/bin/sh", e).into(),
                Ok(never) => match never {},
            }
        }
    }
}

fn setup(root: &Path, hostname: &str, status_fd: u32) -> Result<(), InitError> {
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none)
        .map_err(|e| SyscallError::new("mount", "/ rprivate", e))?;
    sethostname(hostname).map_err(|e| SyscallError::new("sethostname", hostname, e))?;
    chdir(root).map_err(|e| SyscallError::new("chdir", root.display().to_string(), e))?;
    pivot_root(".", ".")
        .map_err(|e| SyscallError::new("pivot_root", root.display().to_string(), e))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| SyscallError::new("umount2", "old root", e))?;
    chdir("/").map_err(|e| SyscallError::new("chdir", "/", e))?;
    umask(Mode::empty());
    ensure_dir("/proc", 0o555)?;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        none,
    )
    .map_err(|e| SyscallError::new("mount", "/proc", e))?;
    // Root in the sandbox must not reach host-wide kernel settings through /proc: /proc/sys is
    // read-only. (/proc/sysrq-trigger, where the kernel has it, is masked once /dev exists.)
    mount(
        Some("/proc/sys"),
        "/proc/sys",
        none,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        none,
    )
    .map_err(|e| SyscallError::new("mount", "/proc/sys", e))?;
    mount(
        none,
        "/proc/sys",
        none,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
        none,
    )
    .map_err(|e| SyscallError::new("mount", "/proc/sys read-only", e))?;
    ensure_dir("/dev", 0o755)?;
    mount(
        Some("tmpfs"),
        "/dev",
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )
    .map_err(|e| SyscallError::new("mount", "/dev tmpfs", e))?;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ] {
        let path = format!("/dev/{name}");
        mknod(
            path.as_str(),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            makedev(major, minor),
        )
        .map_err(|e| SyscallError::new("mknod", path.clone(), e))?;
    }
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, link)
            .map_err(|e| SyscallError::io("symlink", link, e))?;
    }
    fs::create_dir("/dev/shm").map_err(|e| SyscallError::io("mkdir", "/dev/shm", e))?;
    if Path::new("/proc/sysrq-trigger").exists() {
        mount(
            Some("/dev/null"),
            "/proc/sysrq-trigger",
            none,
            MsFlags::MS_BIND,
            none,
        )
        .map_err(|e| SyscallError::new("mount", "/dev/null on /proc/sysrq-trigger", e))?;
    }
    fs::set_permissions(
        "/dev/shm",
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .map_err(|e| SyscallError::io("chmod", "/dev/shm", e))?;
    sys::loopback_up()?;
    umask(Mode::from_bits_truncate(0o022));
    let null = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| SyscallError::io("open", "/dev/null", e))?;
    redirect_stdio(&null)?;
    drop(null);
    // Keep only stdio and the close-on-exec status pipe.
    if status_fd > 3 {
        sys::close_range(3, status_fd - 1)?;
    }
    sys::close_range(status_fd + 1, u32::MAX)?;
    setsid().map_err(|e| SyscallError::new("setsid", "sandbox init", e))?;
    super::drop_capabilities()?;
    Ok(())
}

fn ensure_dir(path: &str, mode: u32) -> Result<(), InitError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(SyscallError::new("mkdir", path, nix::errno::Errno::ENOTDIR).into()),
        Err(_) => {
            fs::create_dir(path).map_err(|e| SyscallError::io("mkdir", path, e))?;
            fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .map_err(|e| SyscallError::io("chmod", path, e).into())
        }
    }
}

/// Points fds 0, 1 and 2 at `file`.
pub(crate) fn redirect_stdio(file: &fs::File) -> Result<(), SyscallError> {
    use std::os::fd::AsRawFd;
    for target in 0..3 {
        // SAFETY: dup2 onto the stdio numbers; `file` is open for the duration of the call.
        if unsafe { libc::dup2(file.as_raw_fd(), target) } < 0 {
            return Err(SyscallError::new(
                "dup2",
                target.to_string(),
                nix::errno::Errno::last(),
            ));
        }
    }
    Ok(())
}
