//! Fork: N new sandboxes restored from one checkpoint C_K of a running sandbox
//! (`belayer_fork`), each with L_K and its own copy of C_K as its ready checkpoint.

use std::ffi::{c_char, c_int};

use belayer_ipc::{ForkRequest, Request, Response};

use crate::convert::*;
use crate::status::{guard, text, writable, Failure};
use crate::types::BelayerBuf;
use crate::BelayerClient;

/// One child of a fork.
#[repr(C)]
#[derive(Debug)]
pub struct BelayerForkChild {
    /// The child's sandbox id (owned by the library until freed).
    pub id: *mut c_char,
    /// Host pid of its init.
    pub init_pid: i32,
    /// Its restore, milliseconds.
    pub total_ms: f64,
    /// Whether its restored state was checked against the checkpoint.
    pub verified: bool,
    /// Its restored upper layer matches the checkpoint (valid when `verified`).
    pub fs_matches: bool,
    /// Its restored processes match the checkpoint (valid when `verified`).
    pub processes_match: bool,
}

/// Result of [`belayer_fork`]; free with [`belayer_fork_info_free`].
#[repr(C)]
#[derive(Debug)]
pub struct BelayerForkInfo {
    /// The fork's id, `fk-<12 hex>`.
    pub fork: *mut c_char,
    /// The checkpoint forked from, `c<seq>-k<K>`.
    pub checkpoint: *mut c_char,
    /// Its action boundary K.
    pub prefix: u64,
    /// L_K, the LLM context recorded with C_K.
    pub context: BelayerBuf,
    /// The children, `children_len` of them, in order.
    pub children: *mut BelayerForkChild,
    /// Number of children.
    pub children_len: usize,
    /// From the request until every child ran, milliseconds.
    pub total_ms: f64,
}

impl BelayerForkInfo {
    const EMPTY: BelayerForkInfo = BelayerForkInfo {
        fork: std::ptr::null_mut(),
        checkpoint: std::ptr::null_mut(),
        prefix: 0,
        context: BelayerBuf::EMPTY,
        children: std::ptr::null_mut(),
        children_len: 0,
        total_ms: 0.0,
    };

    fn release(&mut self) {
        free_string(&mut self.fork);
        free_string(&mut self.checkpoint);
        self.context.release();
        // SAFETY: `children` came from `array` in `belayer_fork` (or is NULL).
        for mut c in unsafe { take_array(&mut self.children, &mut self.children_len) } {
            free_string(&mut c.id);
        }
        *self = BelayerForkInfo::EMPTY;
    }
}

/// Forks `count` (1 to 256) new sandboxes from a checkpoint C_K of sandbox `id`, which keeps
/// running: the one named `checkpoint` (any branch) when not NULL, else that of action
/// boundary `prefix` on the ready checkpoint's line when `has_prefix`, else the ready one.
/// Each child is restored into an instance of its own (namespaces, cgroup, upper layer,
/// limits, user-namespace range), belongs to the caller, and has its own copy of C_K as its
/// ready checkpoint. All or nothing: on an error no child exists. Describes the fork in
/// `*out` (free with [`belayer_fork_info_free`]).
///
/// Errors: `BELAYER_E_BAD_REQUEST` (a count out of range), `BELAYER_E_NOT_FOUND` (no such
/// or no ready checkpoint), `BELAYER_E_PERMISSION_DENIED` (past the caller's sandbox cap),
/// daemon codes of a child's restore.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `checkpoint` is NULL or one; `out` is a valid pointer
/// to write to.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn belayer_fork(
    client: BelayerClient,
    id: *const c_char,
    checkpoint: *const c_char,
    has_prefix: bool,
    prefix: u64,
    count: u32,
    verify: bool,
    out: *mut BelayerForkInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerForkInfo::EMPTY) };
        let checkpoint = if checkpoint.is_null() {
            None
        } else {
            // SAFETY: a NUL-terminated string (contract).
            Some(unsafe { text(checkpoint, "checkpoint")? }.to_owned())
        };
        let req = ForkRequest {
            id: id.to_owned(),
            prefix: has_prefix.then_some(prefix),
            checkpoint,
            count,
            verify,
        };
        let f = match call(client, Request::Fork(req))? {
            Response::Forked(f) => f,
            other => return Err(unexpected("fork", &other)),
        };
        fill(out, f).inspect_err(|_| out.release())
    })
}

/// Fills `out` (empty) from `f`; on an error what was filled stays for the caller to free.
fn fill(out: &mut BelayerForkInfo, f: belayer_ipc::ForkInfo) -> Result<(), Failure> {
    out.fork = c_string(f.fork, "fork")?;
    out.checkpoint = c_string(f.checkpoint, "checkpoint")?;
    out.prefix = f.prefix;
    out.total_ms = f.total_ms;
    out.context = buf(f.context);
    let mut children = Vec::with_capacity(f.children.len());
    for c in f.children {
        let id = match c_string(c.sandbox, "child id") {
            Ok(id) => id,
            Err(e) => {
                (out.children, out.children_len) = array(children);
                return Err(e);
            }
        };
        children.push(BelayerForkChild {
            id,
            init_pid: c.init_pid,
            total_ms: c.timings_ms.total,
            verified: c.validity.is_some(),
            fs_matches: c.validity.as_ref().is_some_and(|v| v.fs_matches),
            processes_match: c.validity.as_ref().is_some_and(|v| v.processes_match),
        });
    }
    (out.children, out.children_len) = array(children);
    Ok(())
}

/// Frees what [`belayer_fork`] stored in `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_fork_info_free(info: *mut BelayerForkInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        info.release();
    }
}
