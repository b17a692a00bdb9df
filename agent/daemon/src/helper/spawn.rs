//! Starting a helper from the sealed memfd with `posix_spawn(3)`, its descriptors placed at
//! fixed numbers.
//!
//! `belayerd` is multi-threaded: a `fork` of it copies its page tables and makes every page it
//! touches afterwards copy-on-write, for a child that only calls `execve`. glibc's
//! `posix_spawn` runs the child on the parent's memory (`clone(CLONE_VM | CLONE_VFORK)`) until
//! its `execve`, with the descriptor moves as file actions (`dup2`, which clears
//! close-on-exec on the copy only), so the helper starts at the same cost whatever the size of
//! the daemon. The parent's descriptors stay close-on-exec throughout: no other thread's child
//! can inherit one (a status pipe held by a stray process would never report end of file).
//!
//! Like `std::process::Command` the child gets the daemon's environment, an empty signal mask
//! and `SIGPIPE` back at its default disposition (the Rust runtime ignores it in the daemon,
//! and an ignored disposition survives `execve`: every sandbox process would inherit it).

use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;

use nix::errno::Errno;
use nix::spawn::{posix_spawn, PosixSpawnAttr, PosixSpawnFileActions, PosixSpawnFlags};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

use crate::sys::SyscallError;

/// Lowest number the descriptors are copied to before the file actions move them to their
/// places: above every target, so no move overwrites the source of a later one.
const STAGING_MIN_FD: RawFd = 64;

/// A helper started by [`spawn`]. Wait for it with [`Helper::wait`]: it is not reaped when
/// dropped (the daemon's reaper leaves host-namespace children to whoever started them).
#[derive(Debug)]
pub struct Helper {
    pid: Pid,
}

impl Helper {
    /// Its pid.
    pub fn id(&self) -> i32 {
        self.pid.as_raw()
    }

    /// Waits for it to exit; its status.
    ///
    /// Errors: `waitpid` failed (not a child of this process any more).
    pub fn wait(self) -> Result<ExitStatus, SyscallError> {
        loop {
            match waitpid(self.pid, None) {
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(SyscallError::new("waitpid", self.pid.to_string(), e)),
                Ok(WaitStatus::Exited(_, code)) => return Ok(ExitStatus::from_raw(code << 8)),
                Ok(WaitStatus::Signaled(_, sig, core)) => {
                    return Ok(ExitStatus::from_raw(
                        sig as i32 | if core { 0x80 } else { 0 },
                    ))
                }
                // Stopped or continued (only reported when asked for): keep waiting.
                Ok(_) => continue,
            }
        }
    }
}

/// Starts `image` (the helper's `/proc/self/fd/<n>` path) with `args` (the first one is its
/// `argv[0]`), each descriptor of `fds` placed at its target number (`(fd, target)`; every
/// other descriptor of the daemon is close-on-exec and stays behind).
///
/// Errors: an argument with a NUL byte, a failed `fcntl(F_DUPFD_CLOEXEC)`, or `posix_spawn`
/// itself (the `execve` of the helper included: glibc reports its errno).
pub fn spawn(
    image: &Path,
    args: &[OsString],
    fds: &[(BorrowedFd<'_>, RawFd)],
) -> Result<Helper, SyscallError> {
    let cstring = |s: OsString| {
        CString::new(s.into_vec())
            .map_err(|_| SyscallError::new("posix_spawn", "argument with NUL", Errno::EINVAL))
    };
    let argv: Vec<CString> = args
        .iter()
        .cloned()
        .map(cstring)
        .collect::<Result<_, _>>()?;
    let env: Vec<CString> = std::env::vars_os()
        .map(|(k, v)| {
            let mut kv = k;
            kv.push("=");
            kv.push(v);
            cstring(kv)
        })
        .collect::<Result<_, _>>()?;
    // Copies above every target, held (close-on-exec) until the spawn returns.
    let staged: Vec<(OwnedFd, RawFd)> = fds
        .iter()
        .map(|(fd, target)| {
            rustix::io::fcntl_dupfd_cloexec(fd, STAGING_MIN_FD)
                .map(|copy| (copy, *target))
                .map_err(|e| SyscallError::io("fcntl(F_DUPFD_CLOEXEC)", "helper fd", e.into()))
        })
        .collect::<Result<_, _>>()?;
    let spawn_err = |what: &'static str| move |e| SyscallError::new("posix_spawn", what, e);
    let mut actions = PosixSpawnFileActions::init().map_err(spawn_err("file actions"))?;
    for (copy, target) in &staged {
        actions
            .add_dup2(copy.as_raw_fd(), *target)
            .map_err(spawn_err("dup2 action"))?;
    }
    let mut attr = PosixSpawnAttr::init().map_err(spawn_err("attributes"))?;
    let mut sigpipe = SigSet::empty();
    sigpipe.add(Signal::SIGPIPE);
    attr.set_sigmask(&SigSet::empty())
        .and_then(|()| attr.set_sigdefault(&sigpipe))
        .and_then(|()| {
            attr.set_flags(
                PosixSpawnFlags::POSIX_SPAWN_SETSIGMASK | PosixSpawnFlags::POSIX_SPAWN_SETSIGDEF,
            )
        })
        .map_err(spawn_err("attributes"))?;
    let pid = posix_spawn(image, &actions, &attr, &argv, &env)
        .map_err(|e| SyscallError::new("posix_spawn", image.display().to_string(), e))?;
    drop(staged);
    Ok(Helper { pid })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[test]
    fn descriptors_land_at_their_targets_and_nothing_else_leaks() {
        let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let (leak_rd, _leak_wr) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        let script = format!(
            "ls /proc/self/fd >&3; echo ignored=$(grep SigIgn /proc/self/status) >&3; \
             if test -e /proc/self/fd/{}; then echo leaked >&3; fi",
            leak_rd.as_raw_fd()
        );
        let args: Vec<OsString> = ["sh", "-c", &script].iter().map(OsString::from).collect();
        let child = spawn(Path::new("/bin/sh"), &args, &[(wr.as_fd(), 3)]).unwrap();
        drop(wr);
        let mut out = String::new();
        std::fs::File::from(rd).read_to_string(&mut out).unwrap();
        assert!(child.wait().unwrap().success());
        let fds: Vec<&str> = out
            .lines()
            .take_while(|l| !l.starts_with("ignored"))
            .collect();
        assert!(fds.contains(&"3"), "{out}");
        // Beyond 0-3 and what this test process itself leaves inheritable, only the fd `ls`
        // opens for the listing: the staged copies stay behind like every other daemon fd.
        let inheritable: Vec<String> = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| {
                n.parse::<RawFd>().is_ok_and(|fd| {
                    // SAFETY: F_GETFD on a number only reads its flags (-1 if closed meanwhile).
                    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
                    flags >= 0 && flags & libc::FD_CLOEXEC == 0
                })
            })
            .collect();
        let extra: Vec<&&str> = fds
            .iter()
            .filter(|fd| {
                !["0", "1", "2", "3"].contains(fd) && !inheritable.iter().any(|i| i == *fd)
            })
            .collect();
        assert!(extra.len() <= 1, "{out}");
        let ignored = out
            .lines()
            .find_map(|l| l.strip_prefix("ignored=SigIgn:"))
            .map(str::trim)
            .and_then(|m| u64::from_str_radix(m, 16).ok())
            .unwrap();
        assert_eq!(
            ignored & (1 << (libc::SIGPIPE - 1)),
            0,
            "SIGPIPE stays ignored"
        );
    }

    #[test]
    fn exit_statuses_are_kept() {
        let args: Vec<OsString> = ["sh", "-c", "exit 7"].iter().map(OsString::from).collect();
        let status = spawn(Path::new("/bin/sh"), &args, &[])
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(status.code(), Some(7));
        let args: Vec<OsString> = ["sh", "-c", "kill -9 $$"]
            .iter()
            .map(OsString::from)
            .collect();
        let status = spawn(Path::new("/bin/sh"), &args, &[])
            .unwrap()
            .wait()
            .unwrap();
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        let missing = spawn(Path::new("/nonexistent/helper"), &args, &[]);
        assert!(missing.is_err());
    }
}
