//! The last steps of a helper process before it becomes a sandbox process: confinement
//! (capabilities, `no_new_privs`, seccomp) and the `execve` of the sandbox's own shell,
//! opened beneath the sandbox root.
//!
//! The shell is opened with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to
//! the sandbox root and executed through that fd (`execveat(AT_EMPTY_PATH)`): a `/bin/sh`
//! that the sandbox turned into a link to `/proc/self/exe` (or any other magic link) is
//! refused, and absolute symlinks resolve inside the sandbox. What is executed is exactly the
//! file that was checked, whatever a sandbox process renames meanwhile.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::{Mode, OFlags, ResolveFlags};

use crate::sys::SyscallError;

/// Opens `path` (absolute, inside the sandbox) beneath the caller's root, which must already
/// be the sandbox root (after `pivot_root` or `setns` into its mount namespace). Only a
/// regular file is accepted.
pub(crate) fn open_executable(path: &str) -> Result<OwnedFd, SyscallError> {
    let root = rustix::fs::open(
        "/",
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SyscallError::io("open", "/", e.into()))?;
    let fd = rustix::fs::openat2(
        &root,
        path.trim_start_matches('/'),
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .map_err(|e| SyscallError::io("openat2(RESOLVE_IN_ROOT)", path, e.into()))?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| SyscallError::io("fstat", path, e.into()))?;
    if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(SyscallError::new(
            "execveat",
            format!("{path} (not a regular file)"),
            nix::errno::Errno::EACCES,
        ));
    }
    Ok(fd)
}

/// Executes the file open as `fd` (`execveat(fd, "", argv, envp, AT_EMPTY_PATH)`). Returns
/// only on failure.
pub(crate) fn exec_fd(fd: &OwnedFd, what: &str, argv: &[CString], env: &[CString]) -> SyscallError {
    let mut argv_ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    argv_ptrs.push(std::ptr::null());
    let mut env_ptrs: Vec<*const libc::c_char> = env.iter().map(|e| e.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());
    // SAFETY: both arrays are NUL-terminated arrays of pointers to C strings that outlive
    // the call (`argv`, `env` are borrowed); the path is an empty C string with
    // AT_EMPTY_PATH, so the kernel executes `fd` itself.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            fd.as_raw_fd(),
            c"".as_ptr(),
            argv_ptrs.as_ptr(),
            env_ptrs.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    SyscallError::io("execveat", what, std::io::Error::last_os_error())
}

/// Confines the calling process for good: the container capability set
/// ([`super::SANDBOX_CAPABILITIES`], bounding set included; less
/// [`super::PRIVATE_USERNS_DROPPED`] in a private user namespace), then `no_new_privs` and the
/// sandbox seccomp filter (built before the fork, [`super::seccomp`]). Call right before
/// [`exec_fd`]: nothing the filter refuses may follow.
///
/// With `user = Some((uid, gid))` the process then becomes that user of its user namespace
/// (no supplementary groups, real, effective and saved ids), after the bounding set was
/// dropped: the kernel clears its permitted and effective capabilities, as for a non-root
/// user of a container.
pub(crate) fn confine(
    filter: &super::seccomp::SandboxFilter,
    private_userns: bool,
    user: Option<(u32, u32)>,
) -> Result<(), SyscallError> {
    super::drop_capabilities(private_userns).map_err(|e| {
        SyscallError::io(
            "capset",
            "sandbox capabilities",
            std::io::Error::other(e.to_string()),
        )
    })?;
    if let Some((uid, gid)) = user {
        become_user(uid, gid)?;
    }
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1) takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(SyscallError::new(
            "prctl",
            "PR_SET_NO_NEW_PRIVS",
            nix::errno::Errno::last(),
        ));
    }
    filter.install().map_err(|e| {
        let errno = e
            .raw_os_error()
            .map_or(nix::errno::Errno::EINVAL, nix::errno::Errno::from_raw);
        SyscallError::new("seccomp", "sandbox filter", errno)
    })
}

/// `setgroups([])`, `setresgid(gid)`, `setresuid(uid)`.
fn become_user(uid: u32, gid: u32) -> Result<(), SyscallError> {
    // SAFETY: setgroups/setresgid/setresuid take integers and an empty list.
    let (call, rc) = unsafe {
        if libc::setgroups(0, std::ptr::null()) != 0 {
            ("setgroups", -1)
        } else if libc::setresgid(gid, gid, gid) != 0 {
            ("setresgid", -1)
        } else if libc::setresuid(uid, uid, uid) != 0 {
            ("setresuid", -1)
        } else {
            ("", 0)
        }
    };
    if rc != 0 {
        return Err(SyscallError::new(
            call,
            "action user",
            nix::errno::Errno::last(),
        ));
    }
    Ok(())
}

/// Closes every fd from 3 up except those in `keep`.
pub(crate) fn close_all_but(keep: &[u32]) -> Result<(), SyscallError> {
    for (first, last) in ranges_to_close(keep) {
        crate::sys::close_range(first, last)?;
    }
    Ok(())
}

/// The inclusive fd ranges from 3 to `u32::MAX` that exclude every fd in `keep`.
fn ranges_to_close(keep: &[u32]) -> Vec<(u32, u32)> {
    let mut keep = keep.to_vec();
    keep.sort_unstable();
    let mut out = Vec::new();
    let mut first = 3u32;
    for k in keep {
        if k > first {
            out.push((first, k - 1));
        }
        first = first.max(k.saturating_add(1));
    }
    out.push((first, u32::MAX));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn close_ranges_skip_the_kept_fds() {
        assert_eq!(ranges_to_close(&[]), vec![(3, u32::MAX)]);
        assert_eq!(ranges_to_close(&[5, 3]), vec![(4, 4), (6, u32::MAX)]);
        assert_eq!(ranges_to_close(&[9]), vec![(3, 8), (10, u32::MAX)]);
    }
}
