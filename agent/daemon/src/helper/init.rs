//! The `init` helper: creates a sandbox's namespaces and starts its long-lived init.
//!
//! Steps (what CRIU needs to dump and restore the tree is in DESIGN.md; what confinement
//! needs is in [`super::mount`]):
//! 1. join the sandbox cgroup in every hierarchy, so everything below inherits it;
//! 2. enter the sandbox's user namespace (`setns` to the fd the daemon passes as
//!    [`USERNS_FD`], made with the sandbox's id map) and become its root, unless the sandbox
//!    was created with `--userns=host`;
//! 3. `unshare(CLONE_NEWNET)`: the network namespace belongs to the sandbox's user namespace
//!    (so CRIU's restore, which recreates both, can repair TCP sockets in it), or to the
//!    host's with `--userns=host`; bring `lo` up and let every uid bind low ports and ping
//!    ([`crate::sys::prepare_netns`]). No sandbox process holds `CAP_NET_ADMIN` or
//!    `CAP_NET_RAW` (bounding set, [`super::CONTAINER_CAPS`]) nor may create namespaces
//!    (seccomp), so owning the namespace gives the sandbox's root nothing to use;
//! 4. `unshare` mount, uts, ipc, cgroup and pid namespaces (owned by that user namespace) and
//!    fork: the child is pid 1 of the new pid namespace, its cgroup namespace is rooted at the
//!    sandbox cgroup;
//! 5. in the child: build the root ([`super::mount::build_root`]: `/proc` with runc's masked
//!    and read-only paths, a private `/dev` with bind-mounted allowed devices, `pivot_root`),
//!    set the hostname, point stdio at the sandbox's own `/dev/null`, close every other fd,
//!    `setsid` (the init must lead its session inside the pid namespace), drop to the
//!    container capability set with `no_new_privs`, and exec the image's `/bin/sh` (opened
//!    beneath the new root) running an endless `sleep` loop, which also reaps orphans;
//! 6. the parent learns success when the close-on-exec status pipe closes, prints the child's
//!    host pid on stdout and exits; the child is re-parented to the agent (a child subreaper).

use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::stat::{umask, Mode};
use nix::unistd::{fork, sethostname, setsid, ForkResult};

use super::Args;
use crate::sys::{self, SyscallError};

/// Script run by the sandbox init: sleeps forever; `sh` reaps any child that exits meanwhile.
pub const INIT_SCRIPT: &str = "while :; do sleep 3600; done";

/// PATH given to processes in a sandbox.
pub const SANDBOX_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Fd number of the sandbox's user namespace in the init helper.
pub const USERNS_FD: i32 = 3;
/// Fd number the daemon gives the sealed seccomp filter in the helper.
pub const SECCOMP_FD: i32 = 4;

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
    /// The seccomp filter could not be built.
    #[error(transparent)]
    Seccomp(#[from] super::seccomp::SeccompError),
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
            eprintln!("belayer init helper: {}", error_chain(&e));
            1
        }
    }
}

fn run(args: &Args<'_>) -> Result<i32, InitError> {
    let root = args
        .one("--root")
        .ok_or(InitError::MissingArgument("--root"))?;
    let hostname = args.one("--hostname").unwrap_or("sandbox");
    let private_userns = args.one("--userns").unwrap_or("private") != "host";
    let env: Vec<CString> = std::iter::once(format!("PATH={SANDBOX_PATH}"))
        .chain(std::iter::once("HOME=/root".to_string()))
        .chain(args.all("--env").into_iter().map(str::to_string))
        .map(|s| CString::new(s).unwrap_or_default())
        .collect();
    super::join_cgroup(&args.all("--procs"))?;
    // Enter the root while still host root: the state dir above it is root-only, and the
    // sandbox's root cannot traverse it. The mount namespace copy keeps the cwd.
    nix::unistd::chdir(root).map_err(|e| SyscallError::new("chdir", root, e))?;
    if private_userns {
        // SAFETY: the daemon dup2'ed the namespace fd to USERNS_FD before exec; nothing
        // else in this process owns it.
        let userns = unsafe { OwnedFd::from_raw_fd(USERNS_FD) };
        enter_userns(std::os::fd::AsFd::as_fd(&userns))?;
    }
    // Made by the sandbox's root, so owned by its user namespace (by the host's with
    // `--userns=host`).
    unshare(CloneFlags::CLONE_NEWNET).map_err(|e| SyscallError::new("unshare", "net", e))?;
    sys::prepare_netns(private_userns)?;
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| SyscallError::io("pipe2", "status", e.into()))?;
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWCGROUP
            | CloneFlags::CLONE_NEWPID,
    )
    .map_err(|e| SyscallError::new("unshare", "mnt|uts|ipc|cgroup|pid", e))?;
    // Compiled by the daemon once, sealed in a memfd: read it, don't compile it again.
    let filter = super::seccomp::sealed::from_helper_arg(args.one("--seccomp-fd"))?;
    // SAFETY: this helper process is single-threaded (a fresh exec of the helper binary that
    // has started no threads), so the child may allocate and run arbitrary code after fork.
    match unsafe { fork() }.map_err(|e| SyscallError::new("fork", "sandbox init", e))? {
        ForkResult::Child => {
            drop(rd);
            let err = child(
                Path::new(root),
                hostname,
                &env,
                std::os::fd::AsRawFd::as_raw_fd(&wr) as u32,
                &filter,
                private_userns,
            );
            let mut wr = fs::File::from(wr);
            let _ = write!(wr, "{}", error_chain(&err));
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

pub(crate) use crate::sys::error_chain;

/// Joins the user namespace `userns` and becomes its root (uid and gid 0, no supplementary
/// groups). Afterwards the process has every capability inside that namespace and none
/// outside.
pub(crate) fn enter_userns(userns: BorrowedFd<'_>) -> Result<(), SyscallError> {
    setns(userns, CloneFlags::CLONE_NEWUSER).map_err(|e| SyscallError::new("setns", "user", e))?;
    // SAFETY: setgroups/setresgid/setresuid take integers and an empty list.
    let rc = unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            -1
        } else if libc::setresgid(0, 0, 0) != 0 {
            -2
        } else if libc::setresuid(0, 0, 0) != 0 {
            -3
        } else {
            0
        }
    };
    if rc != 0 {
        let call = match rc {
            -1 => "setgroups",
            -2 => "setresgid",
            _ => "setresuid",
        };
        return Err(SyscallError::new(
            call,
            "sandbox root",
            nix::errno::Errno::last(),
        ));
    }
    Ok(())
}

/// Runs in pid 1 of the new namespaces; returns only on error.
fn child(
    root: &Path,
    hostname: &str,
    env: &[CString],
    status_fd: u32,
    filter: &super::seccomp::SandboxFilter,
    private_userns: bool,
) -> InitError {
    match setup(root, hostname, status_fd, filter, private_userns) {
        Err(e) => e,
        Ok(shell) => {
            let argv = [
                CString::from(c"sh"),
                CString::from(c"-c"),
                CString::new(INIT_SCRIPT).unwrap_or_default(),
            ];
            super::finish::exec_fd(&shell, "/bin/sh", &argv, env).into()
        }
    }
}

fn setup(
    root: &Path,
    hostname: &str,
    status_fd: u32,
    filter: &super::seccomp::SandboxFilter,
    private_userns: bool,
) -> Result<OwnedFd, InitError> {
    super::mount::build_root(root, private_userns)?;
    sethostname(hostname).map_err(|e| SyscallError::new("sethostname", hostname, e))?;
    umask(Mode::from_bits_truncate(0o022));
    let null = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| SyscallError::io("open", "/dev/null", e))?;
    redirect_stdio(&null)?;
    drop(null);
    let shell = super::finish::open_executable("/bin/sh")?;
    // Keep only stdio, the shell and the close-on-exec status pipe.
    let keep = [status_fd, std::os::fd::AsRawFd::as_raw_fd(&shell) as u32];
    super::finish::close_all_but(&keep)?;
    setsid().map_err(|e| SyscallError::new("setsid", "sandbox init", e))?;
    super::finish::confine(filter, private_userns, None)?;
    Ok(shell)
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
