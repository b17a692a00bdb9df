//! Small safe wrappers over the syscalls the tracer needs.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `pidfd_open(pid, 0)`.
pub(crate) fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes plain integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Exit status of an exited child without reaping it: `(exit code, signal)`; `None` when the
/// process is not our child (or not exited).
pub(crate) fn waitid_nowait(pidfd: BorrowedFd<'_>) -> Option<(Option<i32>, Option<i32>)> {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid siginfo_t we own; the pidfd is borrowed for the call.
    let r = unsafe {
        libc::waitid(
            libc::P_PIDFD,
            pidfd.as_raw_fd() as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT | libc::WNOHANG,
        )
    };
    // SAFETY: waitid filled `info` (or left it zeroed); reading si_pid/si_status is defined for
    // SIGCHLD infos.
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if r < 0 || pid == 0 {
        return None;
    }
    match info.si_code {
        libc::CLD_EXITED => Some((Some(status), None)),
        libc::CLD_KILLED | libc::CLD_DUMPED => Some((None, Some(status))),
        _ => None,
    }
}

/// `poll` on `fds` for at most `timeout_ms`; returns the number of ready entries.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd for the whole call.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(r as usize)
}
