//! File transfer: `belayer_upload` / `belayer_download` (host paths) and
//! `belayer_upload_archive` / `belayer_download_archive` (tar streams on a descriptor), over
//! `belayer-transfer`'s hardened packing and extraction.

use std::ffi::{c_char, c_int};
use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::path::Path;

use belayer_ipc::TransferInfo;
use belayer_transfer::host::{self, HostError};
use belayer_transfer::ErrorClass;

use crate::convert::*;
use crate::handles::*;
use crate::status::{guard, text, Failure, BELAYER_E_INVALID_ARGUMENT};
use crate::types::*;
use crate::*;

impl BelayerTransferResult {
    const EMPTY: BelayerTransferResult = BelayerTransferResult {
        files: 0,
        bytes: 0,
        skipped: 0,
        changed: 0,
        duration_ms: 0.0,
    };

    fn of(info: &TransferInfo) -> BelayerTransferResult {
        BelayerTransferResult {
            files: info.files,
            bytes: info.bytes,
            skipped: info.skipped,
            changed: info.changed,
            duration_ms: info.duration_ms,
        }
    }
}

/// Runs `transfer` on `handle`'s connection and stores its outcome in `out` (when not null).
fn run(
    handle: BelayerClient,
    out: *mut BelayerTransferResult,
    transfer: impl FnOnce(&mut belayer_ipc::Client) -> Result<TransferInfo, HostError>,
) -> Result<(), Failure> {
    // SAFETY: `out` is null or valid for writes (the callers' contract); the struct holds
    // plain values, so overwriting garbage drops nothing.
    if let Some(out) = unsafe { out.as_mut() } {
        *out = BelayerTransferResult::EMPTY;
    }
    let client = client_of(handle)?;
    let mut client = lock(&client);
    let info = transfer(&mut client).map_err(|err| match err {
        HostError::Daemon(reply) => reply_failure(reply),
        HostError::Client(e) => connection_failure(&client, &e),
        HostError::Local(e) => Failure::new(
            match e.class() {
                ErrorClass::NotFound => BELAYER_E_NOT_FOUND,
                ErrorClass::NoSpace => BELAYER_E_NO_SPACE,
                _ => BELAYER_E_TRANSFER_FAILED,
            },
            format!("on the host: {}", belayer_ipc::error_chain(&e)),
        ),
        HostError::Unexpected(m) => Failure::new(BELAYER_E_PROTOCOL, m),
    })?;
    // SAFETY: as above.
    if let Some(out) = unsafe { out.as_mut() } {
        *out = BelayerTransferResult::of(&info);
    }
    Ok(())
}

fn timeout(ms: u64) -> Option<u64> {
    (ms > 0).then_some(ms)
}

/// Borrows the caller's descriptor `fd` as a file that is never closed here.
fn borrowed(fd: c_int, what: &str) -> Result<ManuallyDrop<File>, Failure> {
    if fd < 0 {
        return Err(Failure::new(
            BELAYER_E_INVALID_ARGUMENT,
            format!("invalid argument: {what} is not a descriptor"),
        ));
    }
    // SAFETY: the caller guarantees `fd` is an open descriptor for the call; ManuallyDrop
    // keeps it open afterwards (it stays the caller's).
    Ok(ManuallyDrop::new(unsafe { File::from_raw_fd(fd) }))
}

/// Uploads the host file, directory or symlink `host_src` (read with this process's rights)
/// to `sandbox_dst` in sandbox `id`: an existing directory takes it under its own name,
/// anything else becomes `sandbox_dst` (its parent must exist; a trailing `/` needs an
/// existing directory). Extraction runs inside the sandbox and never writes through a
/// symlink. `timeout_ms`: the transfer's timeout (0: the daemon's default). Stores the
/// outcome in `*out` when `out` is not NULL (nothing to free).
///
/// Errors: `BELAYER_E_INVALID_ARGUMENT`; `BELAYER_E_NOT_FOUND` (source, destination or its
/// parent missing), `BELAYER_E_NO_SPACE` (the sandbox's disk limit), `BELAYER_E_TRANSFER_FAILED`
/// (a source that cannot be read, a member refused), `BELAYER_E_TRANSFER_TIMED_OUT`, and the
/// daemon's other codes (`BELAYER_E_UNKNOWN_SANDBOX`, `BELAYER_E_INVALID_STATE`, ...).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id`, `host_src` and `sandbox_dst` are NUL-terminated strings; `out` is NULL or valid for
/// writes.
#[no_mangle]
pub unsafe extern "C" fn belayer_upload(
    client: BelayerClient,
    id: *const c_char,
    host_src: *const c_char,
    sandbox_dst: *const c_char,
    timeout_ms: u64,
    out: *mut BelayerTransferResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, src, dst) = unsafe {
            (
                text(id, "id")?,
                text(host_src, "host_src")?,
                text(sandbox_dst, "sandbox_dst")?,
            )
        };
        run(client, out, |c| {
            host::upload_path(c, id, Path::new(src), dst, timeout(timeout_ms))
        })
    })
}

/// Downloads `sandbox_src` of sandbox `id` (packed inside the sandbox; symlinks stay links,
/// special files are left out) to the host path `host_dst`: an existing directory takes it
/// under its own name, anything else becomes `host_dst` (its parent must exist). Nothing is
/// written outside `host_dst` or through a symlink beneath it. `timeout_ms` and `out` as for
/// [`belayer_upload`].
///
/// Errors: as [`belayer_upload`]; `BELAYER_E_TRANSFER_FAILED` also for a member refused on
/// the host (what was extracted before stays).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id`, `sandbox_src` and `host_dst` are NUL-terminated strings; `out` is NULL or valid for
/// writes.
#[no_mangle]
pub unsafe extern "C" fn belayer_download(
    client: BelayerClient,
    id: *const c_char,
    sandbox_src: *const c_char,
    host_dst: *const c_char,
    timeout_ms: u64,
    out: *mut BelayerTransferResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, src, dst) = unsafe {
            (
                text(id, "id")?,
                text(sandbox_src, "sandbox_src")?,
                text(host_dst, "host_dst")?,
            )
        };
        run(client, out, |c| {
            host::download_path(c, id, src, Path::new(dst), timeout(timeout_ms))
        })
    })
}

/// Uploads the tar archive read from descriptor `fd` (to its end; not closed) into the
/// existing directory `sandbox_dst` of sandbox `id`, every member under its own name (any
/// number of top-level members). `timeout_ms` and `out` as for [`belayer_upload`].
///
/// Errors: as [`belayer_upload`] (`BELAYER_E_NOT_FOUND` when `sandbox_dst` is no directory).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `sandbox_dst` are NUL-terminated strings; `fd` is an open descriptor; `out` is
/// NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn belayer_upload_archive(
    client: BelayerClient,
    id: *const c_char,
    fd: c_int,
    sandbox_dst: *const c_char,
    timeout_ms: u64,
    out: *mut BelayerTransferResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, dst) = unsafe { (text(id, "id")?, text(sandbox_dst, "sandbox_dst")?) };
        let file = borrowed(fd, "fd")?;
        run(client, out, |c| {
            host::upload_archive(c, id, &*file, dst, timeout(timeout_ms))
        })
    })
}

/// Writes the tar archive of `sandbox_src` of sandbox `id` (one tree named after its last
/// component) to descriptor `fd` (not closed). `timeout_ms` and `out` as for
/// [`belayer_upload`].
///
/// Errors: as [`belayer_download`]; `BELAYER_E_CONNECT` also when writing to `fd` fails.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` and `sandbox_src` are NUL-terminated strings; `fd` is an open descriptor; `out` is
/// NULL or valid for writes.
#[no_mangle]
pub unsafe extern "C" fn belayer_download_archive(
    client: BelayerClient,
    id: *const c_char,
    sandbox_src: *const c_char,
    fd: c_int,
    timeout_ms: u64,
    out: *mut BelayerTransferResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, src) = unsafe { (text(id, "id")?, text(sandbox_src, "sandbox_src")?) };
        let file = borrowed(fd, "fd")?;
        run(client, out, |c| {
            host::download_archive(c, id, src, &*file, timeout(timeout_ms))
        })
    })
}
