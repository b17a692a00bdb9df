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
//! and forks a child there; the child opens the host's procfs file (the daemon's mount
//! namespace: no path inside the sandbox is used), reads or writes it, reports, and exits; the
//! thread reaps it. The child costs the namespace a pid of its own, which is accounted for:
//! at checkpoint it writes back its own pid minus one (the next fork gets the child's pid
//! again, as it would have without the read), at restore it writes the recorded value.
//!
//! Writing needs `CAP_SYS_ADMIN` over the namespace's user namespace (the daemon is host root).
//! About 1 ms, mostly the fork of the daemon.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};

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
/// value to record (the counter the next fork in that namespace starts from). The namespace
/// must not fork meanwhile (the sandbox is frozen).
pub fn read(pid: i32) -> Result<i32, PidCounterError> {
    exchange(pid, None)
}

/// Sets the pid counter of the pid namespace of `pid` to `last`: the next fork there gets
/// the first free pid above `last`.
pub fn write(pid: i32, last: i32) -> Result<(), PidCounterError> {
    exchange(pid, Some(last)).map(|_| ())
}

/// What the child reports through its pipe: 1 status byte (`+` done, `-` failed) and a
/// little-endian `i32` (the value written, or the errno).
const REPORT: usize = 5;

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
    let enter = |what| {
        move |e: nix::errno::Errno| PidCounterError::Enter {
            pid,
            what,
            source: std::io::Error::from(e),
        }
    };
    nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWPID).map_err(enter("setns"))?;
    let (rd, wr) = nix::unistd::pipe().map_err(enter("pipe"))?;
    let path = c"/proc/sys/kernel/ns_last_pid";
    // SAFETY: the child runs only async-signal-safe raw syscalls (prctl, getpid, open, read,
    // write, _exit) on a C string and fds made before the fork, and allocates nothing, so
    // forking this multi-threaded process is sound.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(PidCounterError::Enter {
            pid,
            what: "fork",
            source: std::io::Error::last_os_error(),
        });
    }
    if child == 0 {
        // SAFETY: see above; `path` is NUL-terminated and the buffers are stack arrays.
        unsafe { child_main(path.as_ptr(), wr.as_raw_fd(), value) }
    }
    drop(wr);
    let mut report = [0u8; REPORT];
    let got = File::from(rd).read_exact(&mut report);
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    unsafe { libc::waitpid(child, &mut status, libc::__WALL) };
    let n = i32::from_le_bytes([report[1], report[2], report[3], report[4]]);
    match (got, report[0]) {
        (Ok(()), b'+') => Ok(n),
        (Ok(()), _) => Err(PidCounterError::Access {
            pid,
            write: value.is_some(),
            errno: n,
        }),
        (Err(source), _) => Err(PidCounterError::Enter {
            pid,
            what: "child report",
            source,
        }),
    }
}

/// The forked child, inside the pid namespace: reads or writes `ns_last_pid`, reports, exits.
///
/// # Safety
/// Only in the child of a fork: `path` must be a NUL-terminated string and `report` the write
/// end of the report pipe.
unsafe fn child_main(path: *const libc::c_char, report: i32, value: Option<i32>) -> ! {
    // SAFETY: integer-only prctl; keeps sandbox processes from ptracing or inspecting this
    // copy of the daemon while it sits in their pid namespace.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    // The child's own pid came from the counter: one below it is where the counter stood
    // for the next fork (skipping pids in use changes nothing: the next fork skips them too).
    // SAFETY: getpid has no arguments.
    let target = value.unwrap_or_else(|| unsafe { libc::getpid() } - 1);
    // SAFETY: `path` is a NUL-terminated string.
    let fd = unsafe { libc::open(path, libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        child_report(report, false, errno());
    }
    let mut buf = [0u8; 12];
    let len = format_i32(target, &mut buf);
    // SAFETY: writes `len` bytes of a stack array to an fd this process owns.
    let n = unsafe { libc::write(fd, buf.as_ptr().cast(), len) };
    if n != len as isize {
        child_report(report, false, if n < 0 { errno() } else { libc::EIO });
    }
    child_report(report, true, target)
}

/// Sends the child's report and ends the child.
fn child_report(report: i32, ok: bool, n: i32) -> ! {
    let b = n.to_le_bytes();
    let msg = [if ok { b'+' } else { b'-' }, b[0], b[1], b[2], b[3]];
    // SAFETY: writes a stack array to an fd this process owns.
    unsafe { libc::write(report, msg.as_ptr().cast(), msg.len()) };
    // SAFETY: _exit ends the child without running the parent's destructors or atexit hooks.
    unsafe { libc::_exit(0) }
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
