//! Actions: `belayer_exec` (a command and a timeout) and `belayer_exec_with` (every option of
//! the protocol's `ExecRequest`: cwd, env, timeout, output limit, merged output, stdin).

use std::ffi::{c_char, c_int};

use belayer_ipc::{ExecRequest, ExecResult, InfraFaultKind, Request, Response};

use crate::convert::*;
use crate::status::{guard, text, writable, Failure, BELAYER_E_INVALID_ARGUMENT};
use crate::types::*;

/// `BelayerExecVerdict.infra_fault`: no infrastructure fault.
pub const BELAYER_INFRA_FAULT_NONE: c_int = 0;
/// `BelayerExecVerdict.infra_fault`: a fatal signal sent from outside the sandbox reached one
/// of its processes.
pub const BELAYER_INFRA_FAULT_EXTERNAL_KILL: c_int = 1;
/// `BelayerExecVerdict.infra_fault`: the OOM killer killed a process of the sandbox.
pub const BELAYER_INFRA_FAULT_OOM: c_int = 2;
/// `BelayerExecVerdict.infra_fault`: the sandbox init died; the whole sandbox is gone.
pub const BELAYER_INFRA_FAULT_SANDBOX_LOST: c_int = 3;

/// `BelayerExecVerdict.dirty`: the daemon cannot tell whether the action changed the sandbox.
pub const BELAYER_DIRTY_UNKNOWN: c_int = -1;
/// `BelayerExecVerdict.dirty`: the action left the sandbox unchanged.
pub const BELAYER_DIRTY_CLEAN: c_int = 0;
/// `BelayerExecVerdict.dirty`: the action changed the sandbox (files, processes).
pub const BELAYER_DIRTY_CHANGED: c_int = 1;

/// The `BELAYER_INFRA_FAULT_*` code of `kind`.
fn fault_code(kind: InfraFaultKind) -> c_int {
    match kind {
        InfraFaultKind::ExternalKill => BELAYER_INFRA_FAULT_EXTERNAL_KILL,
        InfraFaultKind::Oom => BELAYER_INFRA_FAULT_OOM,
        InfraFaultKind::SandboxLost => BELAYER_INFRA_FAULT_SANDBOX_LOST,
    }
}

impl BelayerExecVerdict {
    /// Nothing known: no fault, dirtiness unknown.
    const UNKNOWN: BelayerExecVerdict = BelayerExecVerdict {
        infra_fault: BELAYER_INFRA_FAULT_NONE,
        infra_fault_pid: -1,
        infra_fault_signal: 0,
        dirty: BELAYER_DIRTY_UNKNOWN,
    };

    /// The C form of `r`'s fault and dirtiness.
    fn of(r: &ExecResult) -> BelayerExecVerdict {
        let fault = r.infra_fault.as_ref();
        BelayerExecVerdict {
            infra_fault: fault.map_or(BELAYER_INFRA_FAULT_NONE, |f| fault_code(f.kind)),
            infra_fault_pid: fault.and_then(|f| f.pid).unwrap_or(-1),
            infra_fault_signal: fault.and_then(|f| f.signal).unwrap_or(0),
            dirty: match r.dirty {
                None => BELAYER_DIRTY_UNKNOWN,
                Some(false) => BELAYER_DIRTY_CLEAN,
                Some(true) => BELAYER_DIRTY_CHANGED,
            },
        }
    }
}

impl BelayerExecResult {
    /// The C form of `r` (takes its buffers).
    fn from_result(r: ExecResult) -> BelayerExecResult {
        BelayerExecResult {
            exit_code: r.exit_code,
            signal: r.signal.unwrap_or(0),
            timed_out: r.timed_out,
            truncated: r.truncated,
            duration_ms: r.duration_ms,
            stdout_buf: buf(r.stdout),
            stderr_buf: buf(r.stderr),
        }
    }
}

/// Sends `req` and stores its result in `out` (already set to empty) and, when given, its
/// verdict in `verdict`.
fn run(
    client: BelayerClient,
    req: ExecRequest,
    out: &mut BelayerExecResult,
    verdict: Option<&mut BelayerExecVerdict>,
) -> Result<(), Failure> {
    match call(client, Request::Exec(req))? {
        Response::Exec(r) => {
            if let Some(v) = verdict {
                *v = BelayerExecVerdict::of(&r);
            }
            *out = BelayerExecResult::from_result(r);
            Ok(())
        }
        other => Err(unexpected("exec", &other)),
    }
}

/// Runs one action, `command` with `/bin/sh -c`, in sandbox `id`, killed after `timeout_ms`
/// milliseconds (0: no timeout); stores the outcome in `*out` (free with
/// [`belayer_exec_result_free`]). A non-zero exit of the action is not a failure of the call.
/// The same as [`belayer_exec_with`] with only a timeout.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `command` are NUL-terminated strings; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_exec(
    client: BelayerClient,
    id: *const c_char,
    command: *const c_char,
    timeout_ms: u64,
    out: *mut BelayerExecResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, command, out) = unsafe {
            (
                text(id, "id")?,
                text(command, "command")?,
                writable(out, "out")?,
            )
        };
        // SAFETY: `out` is valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerExecResult::EMPTY) };
        let req = ExecRequest {
            id: id.to_owned(),
            argv: vec![command.to_owned()],
            timeout_ms: (timeout_ms > 0).then_some(timeout_ms),
            ..Default::default()
        };
        run(client, req, out, None)
    })
}

/// Runs one action, `command` with `/bin/sh -c`, in sandbox `id` with the options `*opts`
/// (NULL: all defaults, as [`belayer_exec`] without a timeout); stores the outcome in `*out`
/// (free with [`belayer_exec_result_free`]) and, when `verdict` is not NULL, the
/// infrastructure fault and dirtiness in `*verdict` (`BELAYER_INFRA_FAULT_NONE`,
/// `BELAYER_DIRTY_UNKNOWN` when the call fails). A non-zero exit of the action is not a
/// failure of the call.
///
/// Errors: `BELAYER_E_INVALID_ARGUMENT` for a null `id`, `command` or `out`, an env entry that
/// is NULL, not UTF-8 or not `KEY=VALUE` with a non-empty KEY, a NULL `env` or `stdin_data`
/// with a non-zero count; daemon codes (`BELAYER_E_BAD_REQUEST` for a relative cwd or stdin
/// over the daemon's bound, `BELAYER_E_INVALID_STATE` for a sandbox that is not running, ...).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `command` are NUL-terminated strings; `opts` is NULL or a valid pointer whose
/// `cwd` is NULL or a NUL-terminated string, whose `env` points at `env_len` NUL-terminated
/// strings (or is NULL with `env_len` 0) and whose `stdin_data` points at `stdin_len`
/// readable bytes (or is NULL with `stdin_len` 0); `out` is a valid pointer to write to;
/// `verdict` is NULL or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_exec_with(
    client: BelayerClient,
    id: *const c_char,
    command: *const c_char,
    opts: *const BelayerExecOptions,
    out: *mut BelayerExecResult,
    verdict: *mut BelayerExecVerdict,
) -> c_int {
    guard(|| {
        // SAFETY: `verdict` is null or valid for writes (this function's contract); plain
        // values, so the old content needs no drop.
        let mut verdict = unsafe { verdict.as_mut() };
        if let Some(v) = verdict.as_deref_mut() {
            *v = BelayerExecVerdict::UNKNOWN;
        }
        // SAFETY: forwarded from this function's contract.
        let (id, command, out) = unsafe {
            (
                text(id, "id")?,
                text(command, "command")?,
                writable(out, "out")?,
            )
        };
        // SAFETY: `out` is valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerExecResult::EMPTY) };
        let mut req = ExecRequest {
            id: id.to_owned(),
            argv: vec![command.to_owned()],
            ..Default::default()
        };
        // SAFETY: `opts` is null or valid for reads (this function's contract).
        if let Some(o) = unsafe { opts.as_ref() } {
            // SAFETY: the pointers inside `*o` follow this function's contract.
            unsafe { apply_options(o, &mut req)? };
        }
        run(client, req, out, verdict)
    })
}

/// Copies the options `o` into `req`, validating them.
///
/// # Safety
/// The pointers of `o` follow the contract of [`belayer_exec_with`].
unsafe fn apply_options(o: &BelayerExecOptions, req: &mut ExecRequest) -> Result<(), Failure> {
    if !o.cwd.is_null() {
        // SAFETY: non-null, a NUL-terminated string by contract.
        req.cwd = Some(unsafe { text(o.cwd, "opts.cwd")? }.to_owned());
    }
    req.timeout_ms = (o.timeout_ms > 0).then_some(o.timeout_ms);
    req.output_limit = (o.output_limit > 0).then_some(o.output_limit);
    req.merge_stderr = o.merge_stderr != 0;
    // SAFETY: `env` and `env_len` follow the contract of `belayer_exec_with`.
    req.env = unsafe { env_pairs(o.env, o.env_len, "opts.env")? };
    if o.stdin_len > 0 {
        if o.stdin_data.is_null() {
            return Err(Failure::invalid(
                "opts.stdin_data is NULL with a non-zero stdin_len",
            ));
        }
        if o.stdin_len as u64 > u64::from(belayer_ipc::DEFAULT_MAX_FRAME) {
            return Err(Failure::invalid(&format!(
                "opts.stdin_len {} is over the frame limit of {} bytes",
                o.stdin_len,
                belayer_ipc::DEFAULT_MAX_FRAME
            )));
        }
        // SAFETY: non-null and `stdin_len` readable bytes by contract.
        req.stdin = unsafe { std::slice::from_raw_parts(o.stdin_data, o.stdin_len) }.to_vec();
    }
    Ok(())
}

/// Splits the env entry `entry` (index `i` of the array `what`) at its first `=`: KEY must be
/// non-empty.
pub(crate) fn env_pair(entry: &str, what: &str, i: usize) -> Result<(String, String), Failure> {
    match entry.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(Failure::new(
            BELAYER_E_INVALID_ARGUMENT,
            format!(
                "invalid argument: {what}[{i}] {entry:?} is not KEY=VALUE with a non-empty KEY"
            ),
        )),
    }
}

/// The `count` strings of the C array `entries` (the field `what`) as `(KEY, VALUE)` pairs.
///
/// # Safety
/// `entries` is NULL (then `count` must be 0) or points at `count` pointers, each NULL or a
/// NUL-terminated string, valid for the call.
pub(crate) unsafe fn env_pairs(
    entries: *const *const c_char,
    count: usize,
    what: &str,
) -> Result<Vec<(String, String)>, Failure> {
    if count == 0 {
        return Ok(Vec::new());
    }
    if entries.is_null() {
        return Err(Failure::invalid(&format!(
            "{what} is NULL with a non-zero count"
        )));
    }
    // SAFETY: non-null and `count` entries long by contract.
    let entries = unsafe { std::slice::from_raw_parts(entries, count) };
    entries
        .iter()
        .enumerate()
        .map(|(i, &entry)| {
            // SAFETY: each entry is null or a NUL-terminated string by contract.
            let entry = unsafe { text(entry, &format!("{what}[{i}]"))? };
            env_pair(entry, what, i)
        })
        .collect()
}

/// Frees the buffers of `*result` and zeroes it. NULL is ignored.
///
/// # Safety
/// `result` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_exec_result_free(result: *mut BelayerExecResult) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(r) = unsafe { result.as_mut() } {
        r.stdout_buf.release();
        r.stderr_buf.release();
        *r = BelayerExecResult::EMPTY;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_entries_need_a_key() {
        assert_eq!(
            env_pair("A=b=c", "opts.env", 0).unwrap(),
            ("A".into(), "b=c".into())
        );
        assert_eq!(
            env_pair("A=", "opts.env", 0).unwrap(),
            ("A".into(), String::new())
        );
        for bad in ["=x", "NOEQUALS", ""] {
            let e = env_pair(bad, "opts.env", 3).unwrap_err();
            assert_eq!(e.code, BELAYER_E_INVALID_ARGUMENT);
            assert!(e.message.contains("opts.env[3]"), "{}", e.message);
        }
    }

    #[test]
    fn verdicts_carry_fault_and_dirtiness() {
        let r = BelayerExecVerdict::of(&ExecResult {
            infra_fault: Some(belayer_ipc::InfraFault {
                kind: InfraFaultKind::Oom,
                pid: Some(7),
                signal: Some(9),
            }),
            dirty: Some(true),
            ..Default::default()
        });
        assert_eq!(
            (
                r.infra_fault,
                r.infra_fault_pid,
                r.infra_fault_signal,
                r.dirty
            ),
            (BELAYER_INFRA_FAULT_OOM, 7, 9, BELAYER_DIRTY_CHANGED)
        );
        let r = BelayerExecVerdict::of(&ExecResult::default());
        assert_eq!(r, BelayerExecVerdict::UNKNOWN);
        assert_eq!(
            (
                r.infra_fault,
                r.infra_fault_pid,
                r.infra_fault_signal,
                r.dirty
            ),
            (BELAYER_INFRA_FAULT_NONE, -1, 0, BELAYER_DIRTY_UNKNOWN)
        );
    }
}
