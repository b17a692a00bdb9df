//! The few syscalls this crate makes, behind safe functions.
//!
//! Two kinds live here: ordinary wrappers used by the calling process (statfs, mounts), each error
//! naming its syscall, and `child_*` helpers meant to run between `fork` and `exec` (inside a
//! `pre_exec` hook). The latter only make async-signal-safe syscalls on data prepared before the
//! fork, never allocate, and report plain [`io::Error`]s built from the raw errno.

use std::ffi::CStr;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::statfs::{statfs, TMPFS_MAGIC};

/// A syscall that failed, with the errno it returned.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed")]
pub struct SyscallError {
    /// The syscall's name, e.g. `"mount"`.
    pub call: &'static str,
    /// The errno it returned.
    #[source]
    pub source: io::Error,
}

impl SyscallError {
    pub(crate) fn new(call: &'static str, errno: Errno) -> Self {
        Self {
            call,
            source: io::Error::from(errno),
        }
    }

    /// The raw errno, for callers that react to one (`ENOENT`, `EINVAL`).
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// Whether `path` lives on a tmpfs (`statfs(2)` `f_type == TMPFS_MAGIC`).
pub(crate) fn is_tmpfs(path: &Path) -> Result<bool, SyscallError> {
    let fs = statfs(path).map_err(|e| SyscallError::new("statfs", e))?;
    Ok(fs.filesystem_type() == TMPFS_MAGIC)
}

/// Mounts a fresh tmpfs of at most `size_bytes` bytes, mode 0700, `nosuid,nodev,noexec`, at `target`.
pub(crate) fn mount_tmpfs(target: &Path, size_bytes: u64) -> Result<(), SyscallError> {
    let data = format!("size={size_bytes},mode=0700");
    nix::mount::mount(
        Some("belayer-criu-kdat"),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(data.as_str()),
    )
    .map_err(|e| SyscallError::new("mount", e))
}

/// Bind-mounts `source` (a file or a directory) onto `target`, which must exist and be of the same kind.
pub(crate) fn bind_mount(source: &Path, target: &Path) -> Result<(), SyscallError> {
    nix::mount::mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| SyscallError::new("mount", e))
}

/// Lazily unmounts whatever is mounted on `target` (`umount2(MNT_DETACH)`); `EINVAL` means that
/// nothing was mounted there.
pub(crate) fn unmount_detach(target: &Path) -> Result<(), SyscallError> {
    nix::mount::umount2(target, MntFlags::MNT_DETACH).map_err(|e| SyscallError::new("umount2", e))
}

/// In a forked child: marks every fd from 3 up close-on-exec (`close_range(3, ~0,
/// CLOSE_RANGE_CLOEXEC)`), so that nothing the caller holds (sockets, sandbox pipes) leaks into
/// CRIU. Kernels without `close_range` (before 5.11) answer `ENOSYS`/`EINVAL`: then std's own
/// close-on-exec flags are all there is, which is not an error.
pub(crate) fn child_mark_fds_cloexec() -> io::Result<()> {
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on open descriptors of this
    // (forked, single-threaded) process; it closes nothing and touches no memory.
    let ret = unsafe { libc::close_range(3, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC as i32) };
    if ret == 0 {
        return Ok(());
    }
    match Errno::last() {
        Errno::ENOSYS | Errno::EINVAL => Ok(()),
        e => Err(io::Error::from_raw_os_error(e as i32)),
    }
}

/// In a forked child: enters the network namespace open as `fd`.
pub(crate) fn child_enter_netns(fd: BorrowedFd<'_>) -> io::Result<()> {
    nix::sched::setns(fd, CloneFlags::CLONE_NEWNET)
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// In a forked child: enters the cgroup namespace open as `fd`.
pub(crate) fn child_enter_cgroupns(fd: BorrowedFd<'_>) -> io::Result<()> {
    nix::sched::setns(fd, CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// In a forked child: unshares a cgroup namespace rooted at the current cgroup.
pub(crate) fn child_new_cgroupns() -> io::Result<()> {
    nix::sched::unshare(CloneFlags::CLONE_NEWCGROUP)
        .map_err(|e| io::Error::from_raw_os_error(e as i32))
}

/// In a forked child: moves this process into the cgroup whose `cgroup.procs` is open as `procs`
/// (writing `"0"` names the writer).
pub(crate) fn child_join_cgroup(procs: BorrowedFd<'_>) -> io::Result<()> {
    nix::unistd::write(procs, b"0").map_err(|e| io::Error::from_raw_os_error(e as i32))?;
    Ok(())
}

/// In a forked child: writes the action script `text` to `path` (a new file, mode 0700, the
/// old one unlinked first), closing it before the exec. CRIU execs its script while this
/// process is the only one that ever held it open for writing: a script the caller wrote
/// could still be open for writing in a child another of the caller's threads forked meanwhile
/// (until that child's exec), and exec of a file open for writing fails with `ETXTBSY`.
/// Async-signal-safe: `unlink`, `open`, `fchmod`, `write` and `close` on a C string and a
/// buffer made before the fork.
pub(crate) fn child_write_script(path: &CStr, text: &[u8]) -> io::Result<()> {
    let err = |e: Errno| io::Error::from_raw_os_error(e as i32);
    match nix::unistd::unlink(path) {
        Ok(()) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(err(e)),
    }
    let fd = nix::fcntl::open(
        path,
        nix::fcntl::OFlag::O_WRONLY
            | nix::fcntl::OFlag::O_CREAT
            | nix::fcntl::OFlag::O_EXCL
            | nix::fcntl::OFlag::O_CLOEXEC
            | nix::fcntl::OFlag::O_NOFOLLOW,
        nix::sys::stat::Mode::from_bits_truncate(0o700),
    )
    .map_err(err)?;
    // The mode whatever the umask (one without `u+x` would make the script unexecutable).
    nix::sys::stat::fchmod(&fd, nix::sys::stat::Mode::from_bits_truncate(0o700)).map_err(err)?;
    let mut left = text;
    while !left.is_empty() {
        match nix::unistd::write(&fd, left) {
            Ok(0) => return Err(err(Errno::EIO)),
            Ok(n) => left = &left[n..],
            Err(Errno::EINTR) => {}
            Err(e) => return Err(err(e)),
        }
    }
    drop(fd);
    Ok(())
}

/// In a forked child: enters a new mount namespace, makes every mount in it private (so nothing
/// propagates back to the caller's namespace) and bind-mounts `source` over `target` there.
pub(crate) fn child_private_bind(source: &CStr, target: &CStr) -> io::Result<()> {
    let err = |e: Errno| io::Error::from_raw_os_error(e as i32);
    nix::sched::unshare(CloneFlags::CLONE_NEWNS).map_err(err)?;
    nix::mount::mount(
        None::<&CStr>,
        c"/",
        None::<&CStr>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&CStr>,
    )
    .map_err(err)?;
    nix::mount::mount(
        Some(source),
        target,
        None::<&CStr>,
        MsFlags::MS_BIND,
        None::<&CStr>,
    )
    .map_err(err)
}

/// `SIGKILL` to every process of process group `pgid` (a CRIU run's, see `run::run`).
pub(crate) fn kill_process_group(pgid: u32) -> Result<(), SyscallError> {
    let pgid = i32::try_from(pgid).map_err(|_| SyscallError::new("killpg", Errno::EINVAL))?;
    nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), nix::sys::signal::SIGKILL)
        .map_err(|e| SyscallError::new("killpg", e))
}

/// `capget`/`capset` header (`struct __user_cap_header_struct`).
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// One 32-bit word of each set (`struct __user_cap_data_struct`).
#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two [`CapData`] words.
const CAP_VERSION_3: u32 = 0x2008_0522;

/// In a forked child: sets the inheritable set to the permitted set (allowed: the new
/// inheritable set is within old inheritable ∪ permitted when `CAP_SETPCAP` is effective, as it
/// is for root, and within the bounding set, which root's permitted set is).
pub(crate) fn child_inheritable_from_permitted() -> io::Result<()> {
    let mut hdr = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capget writes one header and two data words, which `hdr` and `data` are (version
    // 3 layout); both live on this stack frame for the whole call.
    if unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut hdr as *mut CapHeader,
            data.as_mut_ptr(),
        )
    } != 0
    {
        return Err(io::Error::last_os_error());
    }
    for word in &mut data {
        word.inheritable = word.permitted;
    }
    // SAFETY: capset reads the same header and two data words, valid for the call.
    if unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut CapHeader, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until the process behind `pidfd` exits or `deadline` passes; returns whether it
/// exited. Polls the descriptor (no busy wait; restarts after signals).
pub(crate) fn pidfd_wait_until(pidfd: BorrowedFd<'_>, deadline: std::time::Instant) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        let mut fds = [PollFd::new(pidfd, PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(n) if n > 0 => return true,
            Ok(_) if left.is_zero() => return false,
            Ok(_) | Err(Errno::EINTR) => continue,
            // A descriptor poll refuses: treat as exited (the caller then reaps it).
            Err(_) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_is_not_tmpfs_and_dev_shm_is() {
        assert!(!is_tmpfs(Path::new("/proc")).unwrap());
        if Path::new("/dev/shm").is_dir() {
            assert!(is_tmpfs(Path::new("/dev/shm")).unwrap());
        }
    }

    #[test]
    fn statfs_error_names_the_syscall() {
        let err = is_tmpfs(Path::new("/nonexistent/belayer")).unwrap_err();
        assert_eq!(err.call, "statfs");
        assert_eq!(err.errno(), Some(libc::ENOENT));
    }
}
