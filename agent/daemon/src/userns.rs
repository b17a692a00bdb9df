//! User namespaces of sandboxes: root in a sandbox is an unprivileged host uid.
//!
//! DESIGN.md invariant "Confinement": root in a sandbox is not root on the host. Every sandbox
//! (unless created with `--userns=host`) runs in its own user namespace whose map sends
//! sandbox ids `0..size` to a **host range of its own**, `base + slot * size ..`, allocated
//! from a pool (`userns_host_base`, `userns_size`, `userns_count` in the daemon config; by
//! default 4096 slots of 65 536 ids from host uid 2^30). One range per sandbox rather than one
//! shared by all, because host ids are what the kernel compares across namespaces: with
//! distinct ranges, a process of one sandbox that somehow reached another's files, processes
//! or IPC objects would meet foreign, unprivileged owners (no signal, no ptrace, no write),
//! per-uid kernel accounting (`RLIMIT_NPROC`, user keyrings, inotify instances) is per
//! sandbox, and the files of each upper layer are owned by that sandbox's range only. A
//! restore of a sandbox reuses its range (its upper layer and CRIU images carry host ids).
//!
//! The image (lower layer) belongs to host root; sandboxes see it through an idmapped mount
//! made with a namespace of the same map ([`UserNamespace::new`], see
//! `belayer_overlay::idmap`), so it appears owned by the sandbox's root without being copied.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use serde::{Deserialize, Serialize};

use crate::sys::SyscallError;

/// The host id range of a sandbox's user namespace: sandbox ids `0..size` are host ids
/// `host_base..host_base + size`, for uids and gids alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IdRange {
    /// First host id (sandbox id 0).
    pub host_base: u32,
    /// Number of ids mapped.
    pub size: u32,
}

impl IdRange {
    /// The `uid_map`/`gid_map` line: `"0 <host_base> <size>\n"`.
    pub fn map_line(&self) -> String {
        format!("0 {} {}\n", self.host_base, self.size)
    }

    /// Whether `host_id` belongs to the range.
    pub fn contains(&self, host_id: u32) -> bool {
        host_id >= self.host_base && host_id - self.host_base < self.size
    }
}

/// The pool of host ranges sandboxes get theirs from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdPool {
    /// First host id of slot 0.
    pub host_base: u32,
    /// Ids per sandbox (≥ 65 536, so `nobody` (65534) exists inside).
    pub size: u32,
    /// Number of slots.
    pub count: u32,
}

/// Errors of the user-namespace module.
#[derive(Debug, thiserror::Error)]
pub enum UsernsError {
    /// Every slot of the pool is taken by a sandbox.
    #[error("no free user-namespace id range: all {count} ranges are in use")]
    PoolExhausted {
        /// Slots in the pool.
        count: u32,
    },
    /// Making the namespace failed.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
    /// The helper process that holds the new namespace failed.
    #[error("the user-namespace holder process failed: {0}")]
    Holder(String),
}

impl IdPool {
    /// The range of slot `i`.
    pub fn slot(&self, i: u32) -> IdRange {
        IdRange {
            host_base: self.host_base + i * self.size,
            size: self.size,
        }
    }

    /// The first range of the pool that none of `used` overlaps.
    ///
    /// Errors: [`UsernsError::PoolExhausted`].
    pub fn allocate<'a>(
        &self,
        used: impl IntoIterator<Item = &'a IdRange>,
    ) -> Result<IdRange, UsernsError> {
        let used: Vec<&IdRange> = used.into_iter().collect();
        (0..self.count)
            .map(|i| self.slot(i))
            .find(|r| {
                used.iter().all(|u| {
                    let (a0, a1) = (
                        u64::from(r.host_base),
                        u64::from(r.host_base) + u64::from(r.size),
                    );
                    let (b0, b1) = (
                        u64::from(u.host_base),
                        u64::from(u.host_base) + u64::from(u.size),
                    );
                    a1 <= b0 || b1 <= a0
                })
            })
            .ok_or(UsernsError::PoolExhausted { count: self.count })
    }
}

/// The ranges of a pool handed out to sandboxes of this daemon (reserved at creation, kept
/// across restores, released at removal, re-learned from the records at adoption).
///
/// It also keeps one [`UserNamespace`] per range handed out ([`Self::namespace`]): every
/// mount of that sandbox's image is idmapped with it, so a restore makes no namespace.
#[derive(Debug)]
pub struct RangeAllocator {
    pool: IdPool,
    used: std::sync::Mutex<Vec<IdRange>>,
    namespaces: std::sync::Mutex<std::collections::HashMap<IdRange, std::sync::Arc<UserNamespace>>>,
}

impl RangeAllocator {
    /// An allocator over `pool` with nothing handed out.
    pub fn new(pool: IdPool) -> RangeAllocator {
        RangeAllocator {
            pool,
            used: std::sync::Mutex::new(Vec::new()),
            namespaces: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    fn used(&self) -> std::sync::MutexGuard<'_, Vec<IdRange>> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves the first free range. Errors: [`UsernsError::PoolExhausted`].
    pub fn reserve(&self) -> Result<IdRange, UsernsError> {
        let mut used = self.used();
        let range = self.pool.allocate(used.iter())?;
        used.push(range);
        Ok(range)
    }

    /// Records a range an adopted sandbox holds (whatever pool it came from).
    pub fn adopt(&self, range: IdRange) {
        let mut used = self.used();
        if !used.contains(&range) {
            used.push(range);
        }
    }

    /// Hands a range back (its sandbox was removed, or never came up).
    pub fn release(&self, range: IdRange) {
        self.used().retain(|r| *r != range);
        self.namespaces
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&range);
    }

    /// A user namespace with the map of `range`, made once and kept until the range is
    /// released. Errors: those of [`UserNamespace::new`].
    pub fn namespace(&self, range: IdRange) -> Result<std::sync::Arc<UserNamespace>, UsernsError> {
        let mut namespaces = self.namespaces.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ns) = namespaces.get(&range) {
            return Ok(ns.clone());
        }
        let ns = std::sync::Arc::new(UserNamespace::new(range)?);
        namespaces.insert(range, ns.clone());
        Ok(ns)
    }
}

/// An open user namespace with a sandbox's map (an nsfs fd). It lives as long as this fd or
/// any process in it.
#[derive(Debug)]
pub struct UserNamespace {
    fd: OwnedFd,
}

impl UserNamespace {
    /// Makes a user namespace mapping sandbox ids `0..size` to `range` (uids and gids;
    /// `setgroups` stays allowed, as the map is written by host root).
    ///
    /// A short-lived child process (forked, single-threaded, only raw syscalls) unshares the
    /// namespace and waits; this process writes its maps, opens `/proc/<child>/ns/user` and
    /// lets it exit. About a millisecond.
    ///
    /// Errors: [`UsernsError::Syscall`] naming the call (`pipe2`, `fork`, writing a map,
    /// opening the namespace), [`UsernsError::Holder`] when the child could not unshare.
    pub fn new(range: IdRange) -> Result<UserNamespace, UsernsError> {
        let (ready_rd, ready_wr) = pipe()?;
        let (go_rd, go_wr) = pipe()?;
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the child runs only async-signal-safe raw syscalls (close, prctl, getppid,
        // unshare, write, read, _exit) on fds created before the fork, so forking a
        // multi-threaded process is sound.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(SyscallError::io(
                "fork",
                "user-namespace holder",
                std::io::Error::last_os_error(),
            )
            .into());
        }
        if pid == 0 {
            use std::os::fd::AsRawFd;
            holder(
                ready_wr,
                go_rd,
                [ready_rd.as_raw_fd(), go_wr.as_raw_fd()],
                parent,
            );
        }
        drop(ready_wr);
        drop(go_rd);
        let result = (|| {
            let mut status = [0u8; 1];
            let n = fs::File::from(ready_rd).read(&mut status).unwrap_or(0);
            if n != 1 || status[0] != b'+' {
                return Err(UsernsError::Holder(
                    "could not unshare CLONE_NEWUSER".into(),
                ));
            }
            for file in ["uid_map", "gid_map"] {
                let path = format!("/proc/{pid}/{file}");
                fs::write(&path, range.map_line())
                    .map_err(|e| SyscallError::io("write", path.clone(), e))?;
            }
            let path = format!("/proc/{pid}/ns/user");
            let fd =
                fs::File::open(&path).map_err(|e| SyscallError::io("open", path.clone(), e))?;
            Ok(UserNamespace { fd: fd.into() })
        })();
        let _ = fs::File::from(go_wr).write_all(b"x");
        let mut wstatus = 0;
        // SAFETY: waits for our own child; `wstatus` is a valid out-pointer.
        unsafe { libc::waitpid(pid, &mut wstatus, 0) };
        result
    }

    /// Adopts an nsfs fd of an existing user namespace.
    pub fn from_fd(fd: OwnedFd) -> UserNamespace {
        UserNamespace { fd }
    }
}

impl AsFd for UserNamespace {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Runs in the forked child: unshare, report, wait for the parent, exit. Never returns.
///
/// The parent's ends of both pipes (`parent_ends`) are closed first and the child dies with
/// the thread that forked it: a daemon killed meanwhile leaves no holder blocked forever
/// (holding every descriptor the daemon had, client connections included).
fn holder(ready: OwnedFd, go: OwnedFd, parent_ends: [i32; 2], parent: i32) -> ! {
    use std::os::fd::AsRawFd;
    // SAFETY: raw syscalls on fds this child owns, with a valid 1-byte buffer each; no
    // allocation, no locks (we are the only thread of a forked child).
    unsafe {
        for fd in parent_ends {
            libc::close(fd);
        }
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        let ok = libc::unshare(libc::CLONE_NEWUSER) == 0;
        let byte: u8 = if ok { b'+' } else { b'-' };
        libc::write(ready.as_raw_fd(), (&byte as *const u8).cast(), 1);
        let mut buf = 0u8;
        libc::read(go.as_raw_fd(), (&mut buf as *mut u8).cast(), 1);
        libc::_exit(0)
    }
}

fn pipe() -> Result<(OwnedFd, OwnedFd), SyscallError> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills the two-element array with fresh descriptors on success.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(SyscallError::io(
            "pipe2",
            "user-namespace holder",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Lines of a `uid_map` or `gid_map`: `(inside, outside, count)`.
pub type IdMap = Vec<[u32; 3]>;

/// The id maps of process `pid` (`/proc/<pid>/uid_map`, `gid_map`) as `(inside, outside,
/// count)` triples; `None` when the process is gone.
pub fn maps_of(pid: i32) -> Option<(IdMap, IdMap)> {
    let read = |file: &str| -> Option<IdMap> {
        let text = fs::read_to_string(format!("/proc/{pid}/{file}")).ok()?;
        text.lines()
            .map(|l| {
                let v: Vec<u32> = l
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                (v.len() == 3).then(|| [v[0], v[1], v[2]])
            })
            .collect()
    };
    Some((read("uid_map")?, read("gid_map")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_skips_used_ranges() {
        let pool = IdPool {
            host_base: 1 << 30,
            size: 65536,
            count: 3,
        };
        let a = pool.allocate([]).unwrap();
        assert_eq!(a, pool.slot(0));
        let b = pool.allocate([&a]).unwrap();
        assert_eq!(b, pool.slot(1));
        let c = pool.allocate([&b]).unwrap();
        assert_eq!(c, pool.slot(0));
        let all = [pool.slot(0), pool.slot(1), pool.slot(2)];
        assert!(matches!(
            pool.allocate(all.iter()),
            Err(UsernsError::PoolExhausted { count: 3 })
        ));
        assert!(a.contains(1 << 30) && !a.contains((1 << 30) + 65536));
    }

    #[test]
    fn namespace_has_the_map() {
        let range = IdRange {
            host_base: 1 << 30,
            size: 65536,
        };
        let ns = UserNamespace::new(range).unwrap();
        // Joining a user namespace needs a single-threaded process: check the map from a
        // forked child, which compares `/proc/self/uid_map` inside with the expected line.
        let fd = std::os::fd::AsRawFd::as_raw_fd(&ns.as_fd());
        let expected = format!("{:>10} {:>10} {:>10}\n", 0, range.host_base, range.size);
        // SAFETY: the child only calls setns/open/read/_exit on memory and fds prepared
        // before the fork; no allocation.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: raw syscalls in the forked child on a stack buffer.
            unsafe {
                if libc::setns(fd, libc::CLONE_NEWUSER) != 0 {
                    libc::_exit(1);
                }
                let map = libc::open(c"/proc/self/uid_map".as_ptr(), libc::O_RDONLY);
                let mut buf = [0u8; 128];
                let n = libc::read(map, buf.as_mut_ptr().cast(), buf.len());
                let same =
                    n == expected.len() as isize && buf[..n as usize] == *expected.as_bytes();
                libc::_exit(if same { 0 } else { 2 });
            }
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "setns failed (1) or wrong map (2)"
        );
    }
}
