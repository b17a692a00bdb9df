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

/// `bpf(2)` commands and constants of the cgroup attachment API (include/uapi/linux/bpf.h).
pub(crate) const BPF_PROG_ATTACH: libc::c_long = 8;
/// `BPF_PROG_DETACH`.
pub(crate) const BPF_PROG_DETACH: libc::c_long = 9;
/// `BPF_PROG_QUERY`.
pub(crate) const BPF_PROG_QUERY: libc::c_long = 16;
/// `enum bpf_attach_type`: `BPF_CGROUP_DEVICE`.
pub(crate) const BPF_CGROUP_DEVICE: u32 = 6;
/// Attach flag: programs of descendant cgroups run as well (none replaces this one).
pub(crate) const BPF_F_ALLOW_MULTI: u32 = 1 << 1;

/// The `BPF_PROG_ATTACH` / `BPF_PROG_DETACH` member of `union bpf_attr` (Linux 6.6 layout;
/// older kernels read the prefix they know and the rest is zero).
#[repr(C)]
#[derive(Default)]
struct AttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
    relative_fd: u32,
    expected_revision: u64,
}

/// The `BPF_PROG_QUERY` member of `union bpf_attr`, up to `revision`, which the kernel writes
/// back (Linux ≥ 6.6) whatever size the caller passes: the struct must reach that far.
#[repr(C)]
#[derive(Default)]
struct QueryAttr {
    target_fd: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    _pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// `bpf(cmd, attr, size_of::<T>())`.
///
/// # Safety
/// `attr` must be the `union bpf_attr` member of `cmd`, with every pointer field it holds
/// pointing to memory valid for what the kernel reads or writes through it.
unsafe fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<()> {
    // SAFETY: the caller guarantees `attr` is the member of `cmd` with valid pointers; the
    // size passed is that of `*attr`, which is exclusively borrowed for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Legacy `BPF_PROG_ATTACH` of program `prog` to the cgroup `cgroup` (a directory fd) as
/// `attach_type` with `flags`. Unlike a bpf_link, the attachment belongs to the cgroup: it
/// stays when every descriptor of the program is closed, and goes with the cgroup.
pub(crate) fn prog_attach(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    attach_type: u32,
    flags: u32,
) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type,
        attach_flags: flags,
        ..AttachAttr::default()
    };
    // SAFETY: `attr` is the BPF_PROG_ATTACH member and holds no pointers; both fds are
    // borrowed (open) for the call.
    unsafe { sys_bpf(BPF_PROG_ATTACH, &mut attr) }
}

/// `BPF_PROG_DETACH` of program `prog` from the cgroup `cgroup` (`attach_type`).
pub(crate) fn prog_detach(
    prog: BorrowedFd<'_>,
    cgroup: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    let mut attr = AttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type,
        ..AttachAttr::default()
    };
    // SAFETY: `attr` is the BPF_PROG_DETACH member and holds no pointers; both fds are
    // borrowed (open) for the call.
    unsafe { sys_bpf(BPF_PROG_DETACH, &mut attr) }
}

/// `BPF_PROG_QUERY`: the ids of the programs attached to the cgroup `cgroup` itself as
/// `attach_type` (not those inherited from its ancestors), at most 64.
pub(crate) fn prog_query(cgroup: BorrowedFd<'_>, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut attr = QueryAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_type,
        prog_ids: ids.as_mut_ptr() as u64,
        prog_cnt: ids.len() as u32,
        ..QueryAttr::default()
    };
    // SAFETY: `attr` is the BPF_PROG_QUERY member; `prog_ids` points to `ids`, which holds
    // `prog_cnt` u32 slots and outlives the call; the other pointer fields are null.
    unsafe { sys_bpf(BPF_PROG_QUERY, &mut attr) }?;
    let n = (attr.prog_cnt as usize).min(ids.len());
    Ok(ids[..n].to_vec())
}
