//! Small safe wrappers over the syscalls the agent needs beyond what nix offers directly.
//!
//! Every failure is a [`SyscallError`] naming the call, so a log line says which syscall failed.

use std::fs;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;

/// A failed syscall: its name, the object it was applied to, and the errno.
#[derive(Debug, thiserror::Error)]
#[error("{call}({what}) failed")]
pub struct SyscallError {
    /// The syscall, e.g. `setns`.
    pub call: &'static str,
    /// What it was applied to (a path, a pid, an fd).
    pub what: String,
    /// The errno.
    #[source]
    pub source: std::io::Error,
}

impl SyscallError {
    /// Builds an error from an errno.
    pub fn new(call: &'static str, what: impl Into<String>, errno: Errno) -> Self {
        Self {
            call,
            what: what.into(),
            source: std::io::Error::from(errno),
        }
    }

    /// Builds an error from an `io::Error`.
    pub fn io(call: &'static str, what: impl Into<String>, source: std::io::Error) -> Self {
        Self {
            call,
            what: what.into(),
            source,
        }
    }
}

/// Result of this module.
pub type SysResult<T> = Result<T, SyscallError>;

/// `err` and its chain of sources, joined with `": "` (for error replies and reports).
pub use belayer_ipc::error_chain;

/// Closes every fd from `first` to `last` inclusive (`close_range(first, last, 0)`).
pub fn close_range(first: u32, last: u32) -> SysResult<()> {
    // SAFETY: close_range only closes descriptors; callers use it right before exec in a
    // single-threaded helper, where no Rust object still owns a descriptor in the range that is
    // used afterwards.
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first, last, 0u32) };
    if rc < 0 {
        return Err(SyscallError::new(
            "close_range",
            format!("{first}..={last}"),
            Errno::last(),
        ));
    }
    Ok(())
}

/// Creates a memfd (`MFD_CLOEXEC`) named `name`.
pub fn memfd(name: &str) -> SysResult<fs::File> {
    let fd = rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| SyscallError::io("memfd_create", name, e.into()))?;
    Ok(fs::File::from(fd))
}

/// A memfd to be filled once and then sealed against any change (`F_SEAL_SEAL |
/// F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE`), with a read-only twin descriptor (a fresh open
/// file description at offset 0, opened through this process's `/proc/self/fd` when created:
/// create it before entering another mount namespace). Whoever holds the twin, or reopens it
/// through `/proc/<pid>/fd`, reads exactly what was filled in and can neither write nor resize
/// it. The pages are charged to the memory cgroup of the process that fills it.
#[derive(Debug)]
pub struct SealableMemfd {
    name: String,
    writer: fs::File,
    reader: fs::File,
}

impl SealableMemfd {
    /// Creates the empty memfd `name` and its read-only twin.
    pub fn create(name: &str) -> SysResult<SealableMemfd> {
        use rustix::fs::MemfdFlags;
        use std::os::unix::fs::OpenOptionsExt;
        let flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        // Not executable, and sealed so (Linux >= 6.3; older kernels refuse the flag, and
        // hosts with vm.memfd_noexec = 2 refuse memfds without it).
        let fd = match rustix::fs::memfd_create(name, flags | MemfdFlags::NOEXEC_SEAL) {
            Err(rustix::io::Errno::INVAL) => rustix::fs::memfd_create(name, flags),
            other => other,
        }
        .map_err(|e| SyscallError::io("memfd_create", name, e.into()))?;
        let writer = fs::File::from(fd);
        let path = format!("/proc/self/fd/{}", writer.as_raw_fd());
        let reader = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| SyscallError::io("open", path, e))?;
        Ok(SealableMemfd {
            name: name.to_owned(),
            writer,
            reader,
        })
    }

    /// Copies everything `src` holds from offset 0 (a regular file or memfd: never blocks)
    /// into the memfd, gives it to `owner` (host uid and gid) when set, seals it and returns
    /// the read-only twin.
    pub fn fill_and_seal(
        &self,
        src: BorrowedFd<'_>,
        owner: Option<u32>,
    ) -> SysResult<BorrowedFd<'_>> {
        use std::io::Write;
        let mut chunk = vec![0u8; 64 << 10];
        let mut off = 0u64;
        loop {
            let n = match rustix::io::pread(src, &mut chunk, off) {
                Ok(0) => break,
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(SyscallError::io("pread", self.name.clone(), e.into())),
            };
            (&self.writer)
                .write_all(&chunk[..n])
                .map_err(|e| SyscallError::io("write", self.name.clone(), e))?;
            off += n as u64;
        }
        if let Some(id) = owner {
            std::os::unix::fs::fchown(&self.writer, Some(id), Some(id))
                .map_err(|e| SyscallError::io("fchown", self.name.clone(), e))?;
        }
        rustix::fs::fcntl_add_seals(
            &self.writer,
            rustix::fs::SealFlags::WRITE
                | rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL,
        )
        .map_err(|e| SyscallError::io("fcntl(F_ADD_SEALS)", self.name.clone(), e.into()))?;
        Ok(std::os::fd::AsFd::as_fd(&self.reader))
    }
}

/// Opens a pidfd for `pid` (Linux ≥ 5.3).
pub fn pidfd_open(pid: i32) -> SysResult<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if fd < 0 {
        return Err(SyscallError::new(
            "pidfd_open",
            pid.to_string(),
            Errno::last(),
        ));
    }
    // SAFETY: the syscall returned a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Waits until the process behind `pidfd` exits or `timeout_ms` passes (`None` = forever).
/// Returns `true` when it exited.
pub fn pidfd_wait(pidfd: BorrowedFd<'_>, timeout_ms: Option<u64>) -> SysResult<bool> {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline =
        timeout_ms.map(|ms| std::time::Instant::now() + std::time::Duration::from_millis(ms));
    loop {
        let wait = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Ok(false);
                }
                left.as_millis().min(i32::MAX as u128).max(1) as i32
            }
        };
        // SAFETY: `pfd` is a valid pollfd on our stack and we pass a count of 1.
        let rc = unsafe { libc::poll(&mut pfd, 1, wait) };
        if rc < 0 {
            let e = Errno::last();
            if e == Errno::EINTR {
                continue;
            }
            return Err(SyscallError::new("poll", "pidfd", e));
        }
        if rc > 0 {
            return Ok(true);
        }
    }
}

/// Sends `signal` to the process behind `pidfd` (immune to pid reuse).
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, signal: i32) -> SysResult<()> {
    // SAFETY: a valid pidfd, a signal number, a null siginfo and zero flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    if rc < 0 {
        return Err(SyscallError::new(
            "pidfd_send_signal",
            signal.to_string(),
            Errno::last(),
        ));
    }
    Ok(())
}

/// Start time of `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`); `None` when the
/// process does not exist. Together with the pid it identifies a process across pid reuse.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: parse after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Process state letter (field 3 of `/proc/<pid>/stat`), e.g. `R`, `S`, `Z`.
pub fn process_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].chars().next()
}

/// Whether `pid` is alive (not a zombie) and still the process that started at `start_time`.
pub fn process_matches(pid: i32, start_time: u64) -> bool {
    process_start_time(pid) == Some(start_time) && process_state(pid) != Some('Z')
}

/// Marks the calling process a child subreaper (`PR_SET_CHILD_SUBREAPER`): orphans of
/// processes it started (sandbox inits, restored trees) are re-parented to it.
pub fn set_child_subreaper() -> SysResult<()> {
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer flag and no pointers.
    let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if rc < 0 {
        return Err(SyscallError::new(
            "prctl",
            "PR_SET_CHILD_SUBREAPER",
            Errno::last(),
        ));
    }
    Ok(())
}

/// Reaps `pid` if it is an exited child of ours (non-blocking). Returns `true` when reaped.
pub fn try_reap(pid: i32) -> bool {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    matches!(
        waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)),
        Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..))
    )
}

/// fsyncs a file or directory by path.
pub fn fsync_path(path: &Path) -> SysResult<()> {
    let f = fs::File::open(path)
        .map_err(|e| SyscallError::io("open", path.display().to_string(), e))?;
    f.sync_all()
        .map_err(|e| SyscallError::io("fsync", path.display().to_string(), e))
}

/// Random hex string of `bytes` random bytes (from `getrandom`).
pub fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let mut filled = 0;
    while filled < bytes {
        match rustix::rand::getrandom(&mut buf[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => {
                // Fall back to time and pid: ids only need to be unique on this node.
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos();
                let seed = t ^ ((std::process::id() as u128) << 64);
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = (seed >> ((i % 16) * 8)) as u8;
                }
                break;
            }
        }
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// Milliseconds since the Unix epoch.
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Brings the loopback interface of the caller's network namespace up (`SIOCSIFFLAGS` on `lo`).
pub fn loopback_up() -> SysResult<()> {
    use std::os::fd::AsFd;
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
        None,
    )
    .map_err(|e| SyscallError::io("socket", "AF_INET", e.into()))?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    let fd = sock.as_fd().as_raw_fd();
    // SAFETY: `req` is a valid ifreq naming "lo"; SIOCGIFFLAGS fills its flags field.
    if unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(SyscallError::new("ioctl", "SIOCGIFFLAGS lo", Errno::last()));
    }
    // SAFETY: SIOCGIFFLAGS initialised the `ifru_flags` member of the union.
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    // SAFETY: `req` is a valid ifreq for "lo" with the flags to set.
    if unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(SyscallError::new("ioctl", "SIOCSIFFLAGS lo", Errno::last()));
    }
    Ok(())
}

/// Readies the caller's (fresh) network namespace for a sandbox: `lo` up and, for a sandbox
/// in its own user namespace (which holds no capability over this namespace, owned by the
/// host's), low ports bindable by every uid (`net.ipv4.ip_unprivileged_port_start = 0`) and
/// ICMP echo sockets for every gid (`net.ipv4.ping_group_range`), as root in a container
/// expects. These sysctls are per network namespace.
pub fn prepare_netns(unprivileged_root: bool) -> SysResult<()> {
    // Gids are read in the writer's user namespace, which must map them: every gid it maps
    // (all of them from the host's; the sandbox's range from inside its own).
    let ping = if unprivileged_root {
        let (_, last) = gid_map_span("/proc/thread-self/gid_map", false)?;
        Some((0, last.min(PING_GID_MAX)))
    } else {
        None
    };
    prepare_netns_with(ping)
}

/// Highest gid `ping_group_range` takes.
pub const PING_GID_MAX: u64 = 2_147_483_647;

/// `lo` up and, with `ping_gids` (first and last gid, in the caller's user namespace), low
/// ports for every uid and ICMP echo sockets for those gids.
fn prepare_netns_with(ping_gids: Option<(u64, u64)>) -> SysResult<()> {
    loopback_up()?;
    if let Some((first, last)) = ping_gids {
        let ping = format!("{first} {last}");
        for (file, value) in [
            ("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0"),
            ("/proc/sys/net/ipv4/ping_group_range", ping.as_str()),
        ] {
            fs::write(file, value).map_err(|e| SyscallError::io("write", file, e))?;
        }
    }
    Ok(())
}

/// Readies the network namespace `netns` (an nsfs fd) as [`prepare_netns`] does for a sandbox
/// with its own user namespace, ICMP echo for host gids `ping_gids` (first, last: the
/// sandbox's range, which the init helper sets from inside as `0 <last>`), from a short-lived
/// thread that joins it (the caller's own namespace never changes). Host root may do it
/// whoever owns the namespace.
pub fn prepare_netns_of(netns: BorrowedFd<'_>, ping_gids: (u64, u64)) -> SysResult<()> {
    let fd = netns
        .try_clone_to_owned()
        .map_err(|e| SyscallError::io("dup", "netns", e))?;
    std::thread::spawn(move || -> SysResult<()> {
        nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| SyscallError::new("setns", "CLONE_NEWNET", e))?;
        prepare_netns_with(Some(ping_gids))
    })
    .join()
    .unwrap_or_else(|_| {
        Err(SyscallError::new(
            "setns",
            "CLONE_NEWNET (thread panicked)",
            Errno::EINVAL,
        ))
    })
}

/// First and last gid a `gid_map` file maps: inside its namespace (`outside` false) or in
/// its parent's (`outside` true).
pub fn gid_map_span(file: &str, outside: bool) -> SysResult<(u64, u64)> {
    let text = fs::read_to_string(file).map_err(|e| SyscallError::io("read", file, e))?;
    let spans: Vec<(u64, u64)> = text
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace().map(|v| v.parse::<u64>().ok());
            let inside = f.next()??;
            let out = f.next()??;
            let count = f.next()??;
            let first = if outside { out } else { inside };
            Some((first, (first + count).checked_sub(1)?))
        })
        .collect();
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    first
        .zip(last)
        .ok_or_else(|| SyscallError::new("read", file, Errno::ENODATA))
}

/// A fresh network namespace readied by [`prepare_netns`], as an open nsfs fd (the namespace
/// lives as long as the fd or a process in it). Made on a short-lived thread, so the caller's
/// own namespace never changes.
pub fn new_netns(unprivileged_root: bool) -> SysResult<std::os::fd::OwnedFd> {
    let made = std::thread::spawn(move || -> SysResult<std::os::fd::OwnedFd> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| SyscallError::new("unshare", "CLONE_NEWNET", e))?;
        prepare_netns(unprivileged_root)?;
        std::fs::File::open("/proc/thread-self/ns/net")
            .map(Into::into)
            .map_err(|e| SyscallError::io("open", "/proc/thread-self/ns/net", e))
    })
    .join();
    made.unwrap_or_else(|_| {
        Err(SyscallError::new(
            "unshare",
            "CLONE_NEWNET (thread panicked)",
            Errno::EINVAL,
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_self_is_stable() {
        let pid = std::process::id() as i32;
        let a = process_start_time(pid).unwrap();
        assert_eq!(process_start_time(pid), Some(a));
        assert!(process_matches(pid, a));
        assert!(!process_matches(pid, a + 1));
    }

    #[test]
    fn pidfd_wait_sees_exit() {
        let mut child = std::process::Command::new("sleep")
            .arg("0.05")
            .spawn()
            .unwrap();
        let fd = pidfd_open(child.id() as i32).unwrap();
        use std::os::fd::AsFd;
        assert!(!pidfd_wait(fd.as_fd(), Some(1)).unwrap());
        assert!(pidfd_wait(fd.as_fd(), Some(5000)).unwrap());
        child.wait().unwrap();
    }

    #[test]
    fn random_hex_has_length() {
        assert_eq!(random_hex(6).len(), 12);
        assert_ne!(random_hex(8), random_hex(8));
    }
}
