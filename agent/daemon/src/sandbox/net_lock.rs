//! A lock on the fresh network namespace of a restore: no packet enters or leaves it while
//! `criu restore` rebuilds the sandbox's TCP connections.
//!
//! CRIU runs inside the sandbox's network namespace and therefore neither dumps nor recreates
//! it, and it is told `--network-lock skip`: CRIU 4.2.1 locks only a namespace it manages
//! itself, or, for connections in its own namespace, expects the lock taken at dump time to
//! still stand (the same namespace on the same host). A restore has neither: it happens in a
//! namespace made for it. Without a lock, CRIU restoring the first end of a loopback
//! connection whose send queue holds data never sent (zdtm `socket-tcpbuf`) turns repair mode
//! off to queue that data, the kernel transmits it at once, and since the other end does not
//! exist yet, the namespace answers with a RST: the connection dies and the restore fails with
//! "Can't restore not-sent send queue data: Broken pipe".
//!
//! So before CRIU starts, an nftables table with `drop` policies on the input and output
//! hooks goes into the namespace (packets with CRIU's `SOCCR_MARK`, 0xC114, which libsoccr
//! uses for the FIN it forges while restoring closing connections, pass, as in CRIU's own
//! lock); once CRIU has exited, both chains are set to accept (one transaction: no hook is
//! unregistered, so no RCU grace period is waited for) and the table is deleted in the
//! background. What the kernel sent meanwhile is dropped and
//! sent again by TCP's retransmission timer. Through libnftables (the library CRIU itself is
//! built with, `scripts/setup.sh`), loaded at run time, so a node without it still restores
//! trees without connections: [`NetLock::lock`] then fails and the caller goes on unlocked.
//!
//! libnftables talks netlink through libmnl, which waits on its socket with `select(2)`: an fd
//! numbered 1024 or more makes glibc abort the whole process ("bit out of range 0 - FD_SETSIZE
//! on fd_set"), and `belayerd` holds well over 1024 fds with a few dozen busy sandboxes. So
//! every nftables command runs on a thread of its own that first takes a private copy of the
//! fd table (`unshare(CLONE_FILES)`), enters the namespace and closes every fd above 2 in that
//! copy: the library's sockets then get the lowest numbers, whatever the daemon holds. Each
//! command has its own nftables context, made and freed on that thread.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::BorrowedFd;
use std::sync::{mpsc, OnceLock};

/// Name of the table ([`NetLock::lock`] creates it, [`NetLock::unlock`] deletes it).
pub const TABLE: &str = "inet belayer_restore_lock";

const LOCK: &CStr = c"table inet belayer_restore_lock {
  chain input {
    type filter hook input priority -300; policy drop;
    meta mark 0xc114 accept
  }
  chain output {
    type filter hook output priority -300; policy drop;
    meta mark 0xc114 accept
  }
}
";

/// Opening the lock: both policies to `accept` in one transaction. The base chains stay
/// registered, so no RCU grace period is waited for (unregistering a netfilter hook waits for
/// one, several milliseconds here).
const UNLOCK: &CStr = c"chain inet belayer_restore_lock input { policy accept; }
chain inet belayer_restore_lock output { policy accept; }
";

/// Removing the opened lock, after [`NetLock::unlock`] answered.
const DELETE: &CStr = c"delete table inet belayer_restore_lock\n";

/// Why the lock could not be taken or released.
#[derive(Debug, thiserror::Error)]
pub enum NetLockError {
    /// libnftables (`libnftables.so.1`) or one of its functions could not be loaded.
    #[error("cannot load libnftables: {0}")]
    Load(String),
    /// Entering the network namespace failed.
    #[error("cannot enter the network namespace")]
    Enter(#[source] std::io::Error),
    /// nftables refused the commands.
    #[error("nftables refused to {what} {TABLE}: {message}")]
    Nft {
        /// `create`, `open` or `delete`.
        what: &'static str,
        /// nftables' error output.
        message: String,
    },
    /// The thread that did the work panicked.
    #[error("the network-lock thread panicked")]
    Panicked,
}

/// A locked network namespace: the table [`TABLE`] is in it until [`NetLock::unlock`]. The
/// lock is a thread of its own (private fd table, inside the namespace) holding the nftables
/// context that created the table, waiting for the unlock: deleting the table then costs one
/// netlink command, with no thread, `setns` (which can wait for an RCU grace period) or
/// context to make while the restored sandbox waits. Dropped without an unlock, the thread
/// frees its context and ends, the table left in the namespace.
#[derive(Debug)]
pub struct NetLock {
    unlock: Option<mpsc::SyncSender<()>>,
    done: mpsc::Receiver<Result<(), NetLockError>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

impl NetLock {
    /// Creates [`TABLE`] in the network namespace `netns` (an nsfs fd).
    ///
    /// Errors: [`NetLockError::Load`] without libnftables, [`NetLockError::Enter`],
    /// [`NetLockError::Nft`], [`NetLockError::Panicked`].
    pub fn lock(netns: BorrowedFd<'_>) -> Result<NetLock, NetLockError> {
        let api = api()?;
        // Open in the shared fd table until the thread answers: its private copy, taken
        // before it enters the namespace, has it under the same number.
        let netns = netns.try_clone_to_owned().map_err(NetLockError::Enter)?;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&netns);
        let (unlock_tx, unlock_rx) = mpsc::sync_channel::<()>(1);
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let worker = std::thread::Builder::new()
            .name("netns-lock".into())
            .spawn(move || hold(api, raw, unlock_rx, done_tx))
            .map_err(NetLockError::Enter)?;
        let mut lock = NetLock {
            unlock: Some(unlock_tx),
            done: done_rx,
            worker: Some(worker),
        };
        let answer = lock.done.recv();
        drop(netns);
        match answer {
            Ok(Ok(())) => Ok(lock),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                lock.join();
                Err(NetLockError::Panicked)
            }
        }
    }

    /// Sets both chains of [`TABLE`] to accept: packets flow again. The lock's thread then
    /// deletes the table by itself (not waited for; a sandbox that removed it first costs a
    /// debug line).
    ///
    /// Errors: [`NetLockError::Nft`], [`NetLockError::Panicked`].
    pub fn unlock(mut self) -> Result<(), NetLockError> {
        let sent = self.unlock.take().is_some_and(|tx| tx.send(()).is_ok());
        let result = if sent {
            self.done.recv().unwrap_or(Err(NetLockError::Panicked))
        } else {
            Err(NetLockError::Panicked)
        };
        // Detached: it ends after the delete.
        self.worker.take();
        result
    }

    /// [`NetLock::unlock`], then waits for the table's deletion: a test that locks the same
    /// namespace again must not race the previous lock's background delete (a restore's
    /// namespace is always a fresh one).
    #[cfg(test)]
    fn unlock_and_wait(mut self) -> Result<(), NetLockError> {
        let worker = self.worker.take();
        let result = self.unlock();
        if let Some(worker) = worker {
            let _ = worker.join();
        }
        result
    }

    fn join(&mut self) {
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

impl Drop for NetLock {
    fn drop(&mut self) {
        // Without an unlock: the closed channel ends the thread.
        self.unlock.take();
        self.join();
    }
}

/// The lock's thread: a private copy of the fd table holding only 0, 1, 2 (see the module
/// docs), inside `netns`; creates the table, answers on `done`, then waits for `unlock` and
/// deletes it (answering again), or for the channel to close.
fn hold(
    api: Api,
    netns: std::os::fd::RawFd,
    unlock: mpsc::Receiver<()>,
    done: mpsc::SyncSender<Result<(), NetLockError>>,
) {
    let entered = (|| {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_FILES)
            .map_err(|e| NetLockError::Enter(e.into()))?;
        // SAFETY: `netns` is open in this thread's copy of the fd table (copied from the
        // shared one while the caller holds it open) and is closed only below.
        let ns = unsafe { BorrowedFd::borrow_raw(netns) };
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| NetLockError::Enter(e.into()))?;
        // SAFETY: close_range on this thread's private fd table (unshared above); nothing of
        // this thread owns an fd above 2 any more. The namespace stays entered.
        if unsafe { libc::close_range(3, libc::c_uint::MAX, 0) } != 0 {
            return Err(NetLockError::Enter(std::io::Error::last_os_error()));
        }
        // SAFETY: `api` holds libnftables' functions (loaded by `api()`).
        let ctx = unsafe { (api.ctx_new)(0) };
        if ctx.is_null() {
            return Err(NetLockError::Load("nft_ctx_new failed".into()));
        }
        Ok(ctx)
    })();
    let ctx = match entered {
        Ok(ctx) => ctx,
        Err(e) => {
            let _ = done.send(Err(e));
            return;
        }
    };
    // SAFETY: `ctx` is a live context of this thread, used on it only and freed below.
    unsafe {
        (api.buffer_output)(ctx);
        (api.buffer_error)(ctx);
    }
    let locked = run(api, ctx, LOCK, "create");
    let go_on = locked.is_ok();
    if done.send(locked).is_ok() && go_on && unlock.recv().is_ok() {
        let opened = run(api, ctx, UNLOCK, "open");
        let go_on = opened.is_ok();
        let _ = done.send(opened);
        if go_on {
            if let Err(e) = run(api, ctx, DELETE, "delete") {
                tracing::debug!(error = %e, "opened restore lock not deleted");
            }
        }
    }
    // SAFETY: as above; not used after this.
    unsafe { (api.ctx_free)(ctx) };
}

/// Runs `cmd` on the context `ctx` (of the calling thread).
fn run(
    api: Api,
    ctx: *mut c_void,
    cmd: &'static CStr,
    what: &'static str,
) -> Result<(), NetLockError> {
    // SAFETY: `ctx` is a live context of the calling thread; `cmd` is NUL-terminated; the
    // error buffer is read before the next command on the context.
    unsafe {
        let rc = (api.run_cmd)(ctx, cmd.as_ptr());
        if rc == 0 {
            return Ok(());
        }
        let e = (api.error_buffer)(ctx);
        let message = if e.is_null() {
            format!("error {rc}")
        } else {
            CStr::from_ptr(e).to_string_lossy().trim().to_string()
        };
        Err(NetLockError::Nft { what, message })
    }
}

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxFree = unsafe extern "C" fn(*mut c_void);
type CtxBuffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxGetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunCmd = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

/// The libnftables functions used here.
#[derive(Debug, Clone, Copy)]
struct Api {
    ctx_new: CtxNew,
    ctx_free: CtxFree,
    buffer_output: CtxBuffer,
    buffer_error: CtxBuffer,
    error_buffer: CtxGetBuffer,
    run_cmd: RunCmd,
}

fn api() -> Result<Api, NetLockError> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).clone().map_err(NetLockError::Load)
}

fn load() -> Result<Api, String> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed, so the symbols
    // stay valid for the life of the process.
    let handle = unsafe { libc::dlopen(c"libnftables.so.1".as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return Err("libnftables.so.1 not found".into());
    }
    let sym = |name: &CStr| {
        // SAFETY: dlsym on a live handle with a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        if p.is_null() {
            Err(format!("{} missing", name.to_string_lossy()))
        } else {
            Ok(p)
        }
    };
    // SAFETY: each symbol is the libnftables function of that name, whose C signature
    // (libnftables.h, API 1) the target type spells out.
    unsafe {
        Ok(Api {
            ctx_new: std::mem::transmute::<*mut c_void, CtxNew>(sym(c"nft_ctx_new")?),
            ctx_free: std::mem::transmute::<*mut c_void, CtxFree>(sym(c"nft_ctx_free")?),
            buffer_output: std::mem::transmute::<*mut c_void, CtxBuffer>(sym(
                c"nft_ctx_buffer_output",
            )?),
            buffer_error: std::mem::transmute::<*mut c_void, CtxBuffer>(sym(
                c"nft_ctx_buffer_error",
            )?),
            error_buffer: std::mem::transmute::<*mut c_void, CtxGetBuffer>(sym(
                c"nft_ctx_get_error_buffer",
            )?),
            run_cmd: std::mem::transmute::<*mut c_void, RunCmd>(sym(c"nft_run_cmd_from_buffer")?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, OwnedFd};

    /// A fresh network namespace (an nsfs fd), made on a thread of its own.
    fn fresh_netns() -> OwnedFd {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare net");
            OwnedFd::from(std::fs::File::open("/proc/thread-self/ns/net").expect("open ns"))
        })
        .join()
        .unwrap()
    }

    /// State: a daemon holding more than FD_SETSIZE (1024) fds locks and unlocks a restore's
    /// network namespace (libmnl's `select` would abort the process on a high fd).
    #[test]
    fn locks_and_unlocks_with_more_than_fd_setsize_fds_open() {
        if api().is_err() || !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root and libnftables.so.1");
            return;
        }
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit/setrlimit with a valid rlimit struct.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
            let raised = libc::rlimit {
                rlim_cur: old.rlim_max.max(4096),
                rlim_max: old.rlim_max.max(4096),
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &raised), 0);
        }
        let null = std::fs::File::open("/dev/null").unwrap();
        let held: Vec<OwnedFd> = (0..1100)
            .map(|_| null.as_fd().try_clone_to_owned().unwrap())
            .collect();
        let netns = fresh_netns();
        // Other tests of this binary open and close a few fds concurrently, so counts move by
        // some either way: a leak of one fd per lock shows as at least ROUNDS more.
        const ROUNDS: usize = 50;
        let before = std::fs::read_dir("/proc/self/fd").unwrap().count();
        for _ in 0..ROUNDS {
            let lock = NetLock::lock(netns.as_fd()).expect("lock");
            lock.unlock_and_wait().expect("unlock");
        }
        let after = std::fs::read_dir("/proc/self/fd").unwrap().count();
        assert!(
            after < before + ROUNDS / 2,
            "fds leaked: {before} before {ROUNDS} lock/unlock rounds, {after} after"
        );
        drop(held);
        // SAFETY: as above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &old) };
    }
}
