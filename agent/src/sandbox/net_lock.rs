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
//! lock); once CRIU has exited, the table goes. What the kernel sent meanwhile is dropped and
//! sent again by TCP's retransmission timer. Through libnftables (the library CRIU itself is
//! built with, `scripts/setup.sh`), loaded at run time, so a node without it still restores
//! trees without connections: [`NetLock::lock`] then fails and the caller goes on unlocked.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::BorrowedFd;
use std::sync::OnceLock;

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

const UNLOCK: &CStr = c"delete table inet belayer_restore_lock\n";

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
        /// `create` or `delete`.
        what: &'static str,
        /// nftables' error output.
        message: String,
    },
    /// The thread that did the work panicked.
    #[error("the network-lock thread panicked")]
    Panicked,
}

/// A taken lock: an nftables context whose netlink socket lives in the locked namespace, so
/// [`NetLock::unlock`] needs no `setns` (which can wait for an RCU grace period).
#[derive(Debug)]
pub struct NetLock {
    ctx: std::ptr::NonNull<c_void>,
    api: Api,
}

// SAFETY: the context is used by one thread at a time (`NetLock` is owned, its methods take
// `self` or `&mut self`); libnftables keeps no thread-local state in it.
unsafe impl Send for NetLock {}

impl NetLock {
    /// Blocks all traffic in the network namespace `netns` (an nsfs fd).
    pub fn lock(netns: BorrowedFd<'_>) -> Result<NetLock, NetLockError> {
        let api = api()?;
        let fd = netns.try_clone_to_owned().map_err(NetLockError::Enter)?;
        std::thread::spawn(move || {
            nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| NetLockError::Enter(e.into()))?;
            // SAFETY: nft_ctx_new takes flags only (0: NFT_CTX_DEFAULT); its netlink socket
            // is opened here, inside `netns`.
            let ctx = unsafe { (api.ctx_new)(0) };
            let ctx = std::ptr::NonNull::new(ctx)
                .ok_or_else(|| NetLockError::Load("nft_ctx_new failed".into()))?;
            let mut lock = NetLock { ctx, api };
            lock.run(LOCK, "create")?;
            Ok(lock)
        })
        .join()
        .unwrap_or(Err(NetLockError::Panicked))
    }

    /// Lifts the block.
    pub fn unlock(mut self) -> Result<(), NetLockError> {
        self.run(UNLOCK, "delete")
    }

    fn run(&mut self, cmd: &'static CStr, what: &'static str) -> Result<(), NetLockError> {
        let (api, ctx) = (self.api, self.ctx.as_ptr());
        // SAFETY: `ctx` is a live context owned by `self`; the commands are NUL-terminated;
        // the error buffer is copied before the context is used again.
        unsafe {
            (api.buffer_output)(ctx);
            (api.buffer_error)(ctx);
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
}

impl Drop for NetLock {
    fn drop(&mut self) {
        // SAFETY: frees the context this lock owns, once.
        unsafe { (self.api.ctx_free)(self.ctx.as_ptr()) }
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
