//! The pid counter of a sandbox's pid namespace (`/proc/sys/kernel/ns_last_pid`): read while
//! the sandbox is frozen at checkpoint, written back after `criu restore`, so that the first
//! process forked after a restore gets the pid it would have got had the sandbox never failed
//! (DESIGN.md "recovery alignment": observations such as `echo $$` agree with the failure-free
//! run).
//!
//! `ns_last_pid` is served for the *caller's* active pid namespace, which `setns` does not
//! change (it only sets the namespace of the caller's future children). So a short-lived
//! thread `setns`es into the sandbox's pid namespace (opened through `/proc/<pid>/ns/pid` of a
//! process the daemon knows: the frozen init, or CRIU's restored root, its own unreaped child)
//! and starts a child there (`CLONE_VM | CLONE_VFORK`: no copy of the daemon's memory); the
//! child opens the host's procfs file (the daemon's mount namespace: no path inside the
//! sandbox is used), writes it, leaves its verdict in the thread's memory and exits; the
//! thread reaps it.
//!
//! **The caller keeps the namespace's processes frozen** for the call: the child shares the
//! daemon's memory and sits in the sandbox's pid namespace, where a running sandbox process
//! could signal it or, in a sandbox in the host user namespace, try to `ptrace` it (it cannot
//! be made non-dumpable: `PR_SET_DUMPABLE` is a property of the shared memory, so it would
//! change the daemon's own). Frozen, no sandbox process runs while it exists. The child costs the namespace a pid of its own, which is accounted for:
//! at checkpoint it writes back its own pid minus one (the next fork gets the child's pid
//! again, as it would have without the read), at restore it writes the recorded value.
//!
//! Writing needs `CAP_SYS_ADMIN` over the namespace's user namespace (the daemon is host root).
//! About 0.2 ms (a thread, a `setns`, a vfork-like clone).

use std::fs::File;
use std::os::fd::OwnedFd;

/// Why the pid counter could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PidCounterError {
    /// `/proc/<pid>/ns/pid` could not be opened.
    #[error("cannot open the pid namespace of pid {pid}")]
    OpenNs {
        /// The process whose namespace was wanted.
        pid: i32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The pipe to the child, `setns` or `fork` failed.
    #[error("cannot enter the pid namespace of pid {pid} ({what})")]
    Enter {
        /// The process whose namespace was entered.
        pid: i32,
        /// The failed call.
        what: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The child in the namespace could not read or write `ns_last_pid`.
    #[error("cannot {} ns_last_pid in the pid namespace of pid {pid} (errno {errno})", if *write { "write" } else { "read" })]
    Access {
        /// The process whose namespace was used.
        pid: i32,
        /// A write (else a read).
        write: bool,
        /// The errno the child saw.
        errno: i32,
    },
    /// The thread that did the work panicked.
    #[error("the pid-counter thread for pid {pid} panicked")]
    Panicked {
        /// The process whose namespace was used.
        pid: i32,
    },
}

/// Reads the pid counter of the pid namespace of `pid` and leaves it as it was: returns the
/// value to record (the counter the next fork in that namespace starts from). Every process
/// of the namespace must be frozen (see the module docs).
pub fn read(pid: i32) -> Result<i32, PidCounterError> {
    exchange(pid, None)
}

/// Sets the pid counter of the pid namespace of `pid` to `last`: the next fork there gets
/// the first free pid above `last`. Every process of the namespace must be frozen.
pub fn write(pid: i32, last: i32) -> Result<(), PidCounterError> {
    exchange(pid, Some(last)).map(|_| ())
}

/// Stack of the child (it runs a few raw syscalls).
const CHILD_STACK: usize = 64 << 10;

fn exchange(pid: i32, value: Option<i32>) -> Result<i32, PidCounterError> {
    let ns: OwnedFd = File::open(format!("/proc/{pid}/ns/pid"))
        .map_err(|source| PidCounterError::OpenNs { pid, source })?
        .into();
    std::thread::spawn(move || in_thread(pid, &ns, value))
        .join()
        .unwrap_or(Err(PidCounterError::Panicked { pid }))
}

/// Runs on a thread of its own: the `setns` changes only this thread's namespace for children.
fn in_thread(pid: i32, ns: &OwnedFd, value: Option<i32>) -> Result<i32, PidCounterError> {
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWPID).map_err(|e| {
        PidCounterError::Enter {
            pid,
            what: "setns",
            source: e.into(),
        }
    })?;
    let path = c"/proc/sys/kernel/ns_last_pid";
    // (ok, value or errno), written by the child into this thread's memory (CLONE_VM).
    let mut outcome: (bool, i32) = (false, libc::EIO);
    let out: *mut (bool, i32) = &mut outcome;
    let mut stack = vec![0u8; CHILD_STACK];
    let cb = Box::new(move || {
        // SAFETY: runs in the child, which shares this thread's memory and is the only one
        // running until it exits (CLONE_VFORK); `out` points at `outcome`, alive until then.
        unsafe {
            *out = child_main(path.as_ptr(), value);
        }
        0
    });
    // SAFETY: CLONE_VM | CLONE_VFORK: the child runs `cb` on its own stack, making only
    // raw syscalls (getpid, open, write, close) and writing `outcome`, while this
    // thread waits for it to exit; nothing is allocated or locked in the child, and no copy of
    // the daemon's memory is made (a fork of the daemon took milliseconds).
    let child = unsafe {
        nix::sched::clone(
            cb,
            &mut stack,
            nix::sched::CloneFlags::CLONE_VM | nix::sched::CloneFlags::CLONE_VFORK,
            Some(libc::SIGCHLD),
        )
    }
    .map_err(|e| PidCounterError::Enter {
        pid,
        what: "clone",
        source: e.into(),
    })?;
    let _ = nix::sys::wait::waitpid(child, Some(nix::sys::wait::WaitPidFlag::__WALL));
    match outcome {
        (true, n) => Ok(n),
        (false, errno) => Err(PidCounterError::Access {
            pid,
            write: value.is_some(),
            errno,
        }),
    }
}

/// The child, inside the pid namespace: writes `ns_last_pid` (`value`, or its own pid minus
/// one) and returns `(true, value written)` or `(false, errno)`.
///
/// # Safety
/// Only in the child of a `CLONE_VM | CLONE_VFORK` clone; `path` must be NUL-terminated.
unsafe fn child_main(path: *const libc::c_char, value: Option<i32>) -> (bool, i32) {
    // The child's own pid came from the counter: one below it is where the counter stood
    // for the next fork (skipping pids in use changes nothing: the next fork skips them too).
    // SAFETY: getpid has no arguments (a raw syscall: glibc may cache the parent's pid).
    let target = value.unwrap_or_else(|| unsafe { libc::syscall(libc::SYS_getpid) } as i32 - 1);
    // SAFETY: `path` is a NUL-terminated string.
    let fd = unsafe { libc::open(path, libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return (false, errno());
    }
    let mut buf = [0u8; 12];
    let len = format_i32(target, &mut buf);
    // SAFETY: writes `len` bytes of a stack array to an fd this process owns, then closes it.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), len) };
    let err = errno();
    // SAFETY: closes the fd opened above.
    unsafe { libc::close(fd) };
    if n != len as isize {
        return (false, if n < 0 { err } else { libc::EIO });
    }
    (true, target)
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Writes `n` (non-negative values; negatives become 0) in decimal into `buf` without
/// allocating; returns the length.
fn format_i32(n: i32, buf: &mut [u8; 12]) -> usize {
    let mut v = n.max(0) as u32;
    let mut digits = [0u8; 10];
    let mut k = 0;
    loop {
        digits[k] = b'0' + (v % 10) as u8;
        k += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..k {
        buf[i] = digits[k - 1 - i];
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_decimal() {
        let mut buf = [0u8; 12];
        for n in [0, 7, 12, 4_194_304, i32::MAX] {
            let len = format_i32(n, &mut buf);
            assert_eq!(&buf[..len], n.to_string().as_bytes());
        }
    }
}
