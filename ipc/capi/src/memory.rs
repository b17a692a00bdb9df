//! The worker-side C ABI of the memory servers (part of `libbelayer`).
//!
//! Handles are opaque pointers: `belayer_mem_client` (a [`MemClient`]), `belayer_mem_mapping`
//! (a [`Mapping`]) and `belayer_placeholder` (a [`Placeholder`]), each freed by its own
//! `*_free` function. Every function returns a status code ([`BELAYER_OK`] = 0, negative on
//! failure); on failure a description is kept per thread and returned by
//! [`belayer_last_error`]. No Rust panic crosses the boundary: a panic becomes
//! [`BELAYER_E_PANIC`].
//!
//! ```c
//! belayer_mem_client *c; belayer_mem_mapping *m; uint64_t addr, size;
//! if (belayer_mem_connect("/run/belayer/weights.sock", &c) != 0) puts(belayer_last_error());
//! belayer_mem_attach(c, "worker-0", hash, BELAYER_LEASE_READ, &m);
//! belayer_mem_region(m, "layers", &addr, &size);
//! ...
//! belayer_mem_detach(c, m);      /* releases the leases and frees m */
//! belayer_mem_client_free(c);
//! ```
//!
//! Strings are NUL-terminated UTF-8. Addresses are host virtual addresses (host backend) or
//! CUDA device pointers (CUDA backend). A C header generated from this module is part of the
//! `libbelayer` build.

use std::ffi::{c_char, c_int, CString};

use crate::status::{guard, text, writable, Failure};
use crate::status::{
    BELAYER_E_CONNECT, BELAYER_E_CUDA, BELAYER_E_INVALID_ARGUMENT, BELAYER_E_LAYOUT, BELAYER_E_MAP,
    BELAYER_E_OWNER_GONE, BELAYER_E_REFUSED,
};
use belayer_ipc::error_chain;
use belayer_ipc::memory::client::{MemClient, MemClientError};
use belayer_ipc::memory::layout::Layout;
use belayer_ipc::memory::mapping::{MapError, Mapping};
use belayer_ipc::memory::message::{AttachRequest, Backend, LeaseMode};
use belayer_ipc::memory::placeholder::Placeholder;

/// Lease mode [`LeaseMode::Read`].
pub const BELAYER_LEASE_READ: c_int = 0;
/// Lease mode [`LeaseMode::Write`].
pub const BELAYER_LEASE_WRITE: c_int = 1;
/// Lease mode [`LeaseMode::Exclusive`].
pub const BELAYER_LEASE_EXCLUSIVE: c_int = 2;

/// Opaque client handle.
#[derive(Debug)]
pub struct BelayerMemClient(MemClient);
/// Opaque mapping handle.
#[derive(Debug)]
pub struct BelayerMemMapping(Mapping);
/// Opaque placeholder handle.
#[derive(Debug)]
pub struct BelayerPlaceholder(Placeholder);

impl From<MemClientError> for Failure {
    fn from(err: MemClientError) -> Failure {
        let code = match &err {
            MemClientError::Refused { .. } => BELAYER_E_REFUSED,
            MemClientError::Map { source, .. } => map_code(source),
            _ => BELAYER_E_CONNECT,
        };
        Failure::new(code, error_chain(&err))
    }
}

impl From<MapError> for Failure {
    fn from(err: MapError) -> Failure {
        Failure::new(map_code(&err), error_chain(&err))
    }
}

fn map_code(err: &MapError) -> c_int {
    use belayer_ipc::memory::mapping::BackendError;
    match err {
        MapError::OpenDevice { .. } => BELAYER_E_CUDA,
        MapError::Reserve { source, .. }
        | MapError::MapRegion { source, .. }
        | MapError::UnmapRegion { source, .. }
        | MapError::ZeroRegion { source, .. }
        | MapError::Copy { source, .. }
            if matches!(source, BackendError::Cuda(_)) =>
        {
            BELAYER_E_CUDA
        }
        _ => BELAYER_E_MAP,
    }
}

/// Connects to the memory server socket `socket_path`; stores the client in `*out`.
///
/// # Safety
/// `socket_path` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_connect(
    socket_path: *const c_char,
    out: *mut *mut BelayerMemClient,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (path, out) = unsafe { (text(socket_path, "socket_path")?, writable(out, "out")?) };
        let client = MemClient::connect(path)?;
        *out = Box::into_raw(Box::new(BelayerMemClient(client)));
        Ok(())
    })
}

/// Frees a client (closing the connection releases all its leases; mappings stay usable).
/// Null is ignored.
///
/// # Safety
/// `client` is null or a pointer from [`belayer_mem_connect`] not freed yet.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_client_free(client: *mut BelayerMemClient) {
    if !client.is_null() {
        // SAFETY: the pointer came from Box::into_raw in belayer_mem_connect and is freed once.
        drop(unsafe { Box::from_raw(client) });
    }
}

/// Computes the layout hash (64 hex digits and a NUL) of the layout file `layout_path` into
/// `out_hash`, a buffer of at least 65 bytes.
///
/// # Safety
/// `layout_path` is a NUL-terminated string; `out_hash` points at 65 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_layout_hash(
    layout_path: *const c_char,
    out_hash: *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let path = unsafe { text(layout_path, "layout_path")? };
        if out_hash.is_null() {
            return Err(Failure::invalid("out_hash"));
        }
        let layout = Layout::load(std::path::Path::new(path))
            .map_err(|err| Failure::new(BELAYER_E_LAYOUT, error_chain(&err)))?;
        let hash = CString::new(layout.hash()).map_err(|_| Failure::invalid("hash"))?;
        let bytes = hash.as_bytes_with_nul();
        // SAFETY: `out_hash` points at 65 writable bytes (contract); the hash is 64 bytes plus
        // NUL, and the source is a distinct Rust allocation.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().cast(), out_hash, bytes.len()) };
        Ok(())
    })
}

/// Attaches every region as worker `worker`, presenting layout hash `layout_hash`, with lease
/// `mode` (`BELAYER_LEASE_*`); maps them and stores the mapping in `*out`.
///
/// # Safety
/// `client` is a live client; `worker` and `layout_hash` are NUL-terminated strings; `out` is a
/// valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_attach(
    client: *mut BelayerMemClient,
    worker: *const c_char,
    layout_hash: *const c_char,
    mode: c_int,
    out: *mut *mut BelayerMemMapping,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (client, worker, hash, out) = unsafe {
            (
                writable(client, "client")?,
                text(worker, "worker")?,
                text(layout_hash, "layout_hash")?,
                writable(out, "out")?,
            )
        };
        let mode = match mode {
            BELAYER_LEASE_READ => LeaseMode::Read,
            BELAYER_LEASE_WRITE => LeaseMode::Write,
            BELAYER_LEASE_EXCLUSIVE => LeaseMode::Exclusive,
            _ => return Err(Failure::invalid("mode")),
        };
        let mapping = client.0.attach(AttachRequest {
            worker: worker.to_owned(),
            layout_hash: hash.to_owned(),
            mode,
            regions: Vec::new(),
        })?;
        *out = Box::into_raw(Box::new(BelayerMemMapping(mapping)));
        Ok(())
    })
}

/// Releases the leases of `mapping` on the server, unmaps it and frees it (also on failure).
///
/// # Safety
/// `client` is a live client; `mapping` is a pointer from [`belayer_mem_attach`] not freed
/// yet (it is freed here).
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_detach(
    client: *mut BelayerMemClient,
    mapping: *mut BelayerMemMapping,
) -> c_int {
    guard(|| {
        if mapping.is_null() {
            return Err(Failure::invalid("mapping"));
        }
        // SAFETY: the pointer came from Box::into_raw in belayer_mem_attach and is freed once.
        let mapping = unsafe { Box::from_raw(mapping) }.0;
        // SAFETY: forwarded from this function's contract.
        let client = unsafe { writable(client, "client")? };
        client.0.detach(mapping)?;
        Ok(())
    })
}

/// Unmaps and frees a mapping without telling the server (its leases end with the
/// connection). Null is ignored.
///
/// # Safety
/// `mapping` is null or a pointer from [`belayer_mem_attach`] not freed yet.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_mapping_free(mapping: *mut BelayerMemMapping) {
    if !mapping.is_null() {
        // SAFETY: the pointer came from Box::into_raw in belayer_mem_attach and is freed once.
        drop(unsafe { Box::from_raw(mapping) });
    }
}

/// Stores the address and size (bytes, as in the layout) of region `name` in `*addr` and
/// `*size`.
///
/// # Safety
/// `mapping` is a live mapping; `name` is a NUL-terminated string; `addr` and `size` are valid
/// pointers to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_region(
    mapping: *const BelayerMemMapping,
    name: *const c_char,
    addr: *mut u64,
    size: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (mapping, name, addr, size) = unsafe {
            (
                mapping
                    .as_ref()
                    .ok_or_else(|| Failure::invalid("mapping"))?,
                text(name, "name")?,
                writable(addr, "addr")?,
                writable(size, "size")?,
            )
        };
        let view = mapping.0.region(name).ok_or_else(|| {
            Failure::new(
                BELAYER_E_INVALID_ARGUMENT,
                format!("no attached region named {name:?}"),
            )
        })?;
        *addr = view.addr;
        *size = view.size;
        Ok(())
    })
}

/// Unmaps region `name`, keeping its address reserved; stores the address in `*addr`.
///
/// # Safety
/// `mapping` is a live mapping; `name` is a NUL-terminated string; `addr` is a valid pointer
/// to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_unmap(
    mapping: *mut BelayerMemMapping,
    name: *const c_char,
    addr: *mut u64,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { region_op(mapping, name, addr, |m, n| m.unmap(n)) }
}

/// Maps region `name` again at its address; stores the address in `*addr`.
///
/// # Safety
/// As for [`belayer_mem_unmap`].
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_remap(
    mapping: *mut BelayerMemMapping,
    name: *const c_char,
    addr: *mut u64,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    unsafe { region_op(mapping, name, addr, |m, n| m.remap(n)) }
}

/// Runs `op` on region `name` of `mapping` and stores the address it returns in `*addr`.
///
/// # Safety
/// As for [`belayer_mem_unmap`].
unsafe fn region_op(
    mapping: *mut BelayerMemMapping,
    name: *const c_char,
    addr: *mut u64,
    op: impl FnOnce(&mut Mapping, &str) -> Result<u64, MapError>,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let (mapping, name, addr) = unsafe {
            (
                writable(mapping, "mapping")?,
                text(name, "name")?,
                writable(addr, "addr")?,
            )
        };
        *addr = op(&mut mapping.0, name)?;
        Ok(())
    })
}

/// Asks the server to zero KV-arena region `region`; stores the bytes zeroed in `*bytes`.
///
/// # Safety
/// `client` is a live client; `region` is a NUL-terminated string; `bytes` is a valid pointer
/// to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_flush(
    client: *mut BelayerMemClient,
    region: *const c_char,
    bytes: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (client, region, bytes) = unsafe {
            (
                writable(client, "client")?,
                text(region, "region")?,
                writable(bytes, "bytes")?,
            )
        };
        *bytes = client.0.flush(region)?;
        Ok(())
    })
}

/// Stores the server's weights version counter in `*version`.
///
/// # Safety
/// `client` is a live client; `version` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_version(
    client: *mut BelayerMemClient,
    version: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (client, version) =
            unsafe { (writable(client, "client")?, writable(version, "version")?) };
        *version = client.0.version()?;
        Ok(())
    })
}

/// Owner-alive check: [`BELAYER_OK`] while the server process, this connection and the
/// socket are there, [`BELAYER_E_OWNER_GONE`] otherwise.
///
/// # Safety
/// `client` is a live client.
#[no_mangle]
pub unsafe extern "C" fn belayer_mem_owner_alive(client: *const BelayerMemClient) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let client = unsafe { client.as_ref() }.ok_or_else(|| Failure::invalid("client"))?;
        client
            .0
            .owner_alive()
            .map_err(|err| Failure::new(BELAYER_E_OWNER_GONE, error_chain(&err)))
    })
}

/// Lightweight GPU health check of CUDA device `device`; stores its duration in
/// microseconds in `*micros` (may be null).
///
/// # Safety
/// `micros` is null or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_gpu_health_check(device: c_int, micros: *mut u64) -> c_int {
    guard(|| {
        let took = belayer_ipc::memory::cuda::health_check(device)
            .map_err(|err| Failure::new(BELAYER_E_CUDA, error_chain(&err)))?;
        // SAFETY: forwarded from this function's contract (null allowed).
        if let Some(micros) = unsafe { micros.as_mut() } {
            *micros = took.as_micros() as u64;
        }
        Ok(())
    })
}

/// Creates a placeholder buffer of `size` bytes on CUDA device `device`, or in host memory
/// when `device` is negative; stores it in `*out`.
///
/// # Safety
/// `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_placeholder_new(
    device: c_int,
    size: u64,
    out: *mut *mut BelayerPlaceholder,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let out = unsafe { writable(out, "out")? };
        let backend = if device < 0 {
            Backend::Host
        } else {
            Backend::Cuda { device }
        };
        let placeholder = Placeholder::new(backend, size)?;
        *out = Box::into_raw(Box::new(BelayerPlaceholder(placeholder)));
        Ok(())
    })
}

/// Stores the placeholder's address and size (bytes, rounded to the granularity).
///
/// # Safety
/// `placeholder` is a live placeholder; `addr` and `size` are valid pointers to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_placeholder_info(
    placeholder: *const BelayerPlaceholder,
    addr: *mut u64,
    size: *mut u64,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (placeholder, addr, size) = unsafe {
            (
                placeholder
                    .as_ref()
                    .ok_or_else(|| Failure::invalid("placeholder"))?,
                writable(addr, "addr")?,
                writable(size, "size")?,
            )
        };
        *addr = placeholder.0.addr();
        *size = placeholder.0.len();
        Ok(())
    })
}

/// Gives the placeholder's memory back, keeping its address reserved.
///
/// # Safety
/// `placeholder` is a live placeholder.
#[no_mangle]
pub unsafe extern "C" fn belayer_placeholder_unmap(placeholder: *mut BelayerPlaceholder) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let placeholder = unsafe { writable(placeholder, "placeholder")? };
        placeholder.0.unmap()?;
        Ok(())
    })
}

/// Maps fresh memory at the placeholder's address.
///
/// # Safety
/// `placeholder` is a live placeholder.
#[no_mangle]
pub unsafe extern "C" fn belayer_placeholder_remap(placeholder: *mut BelayerPlaceholder) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let placeholder = unsafe { writable(placeholder, "placeholder")? };
        placeholder.0.remap()?;
        Ok(())
    })
}

/// Frees a placeholder (its memory and its address range). Null is ignored.
///
/// # Safety
/// `placeholder` is null or a pointer from [`belayer_placeholder_new`] not freed yet.
#[no_mangle]
pub unsafe extern "C" fn belayer_placeholder_free(placeholder: *mut BelayerPlaceholder) {
    if !placeholder.is_null() {
        // SAFETY: the pointer came from Box::into_raw in belayer_placeholder_new, freed once.
        drop(unsafe { Box::from_raw(placeholder) });
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;
    use std::ptr;

    use super::*;
    use crate::status::{belayer_last_error, BELAYER_OK};

    fn last_error() -> String {
        // SAFETY: belayer_last_error never returns null and the string lives until the next
        // failing call on this thread.
        unsafe { CStr::from_ptr(belayer_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn null_and_bad_arguments_give_status_codes_and_messages() {
        let mut client = ptr::null_mut();
        // SAFETY: a null path is part of what is being tested; `client` is writable.
        let rc = unsafe { belayer_mem_connect(ptr::null(), &mut client) };
        assert_eq!(rc, BELAYER_E_INVALID_ARGUMENT);
        assert!(last_error().contains("socket_path"));
        let path = c"/nonexistent/belayer-mem.sock";
        // SAFETY: valid string and out-pointer.
        let rc = unsafe { belayer_mem_connect(path.as_ptr(), &mut client) };
        assert_eq!(rc, BELAYER_E_CONNECT);
        assert!(last_error().contains("/nonexistent/belayer-mem.sock"));
        assert!(client.is_null());
        // SAFETY: null handles are accepted by the free functions.
        unsafe {
            belayer_mem_client_free(ptr::null_mut());
            belayer_mem_mapping_free(ptr::null_mut());
            belayer_placeholder_free(ptr::null_mut());
        }
        let mut hash = [0 as c_char; 65];
        // SAFETY: valid string and a 65-byte buffer.
        let rc =
            unsafe { belayer_mem_layout_hash(c"/nonexistent.toml".as_ptr(), hash.as_mut_ptr()) };
        assert_eq!(rc, BELAYER_E_LAYOUT);
    }

    #[test]
    fn layout_hash_and_host_placeholders_work_through_the_abi() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("layout.toml");
        std::fs::write(&file, "[[region]]\nname = \"w\"\nsize = 4096\n").unwrap();
        let path = CString::new(file.to_str().unwrap()).unwrap();
        let mut hash = [0 as c_char; 65];
        // SAFETY: valid string and a 65-byte buffer.
        let rc = unsafe { belayer_mem_layout_hash(path.as_ptr(), hash.as_mut_ptr()) };
        assert_eq!(rc, BELAYER_OK);
        // SAFETY: the call wrote a NUL-terminated string into `hash`.
        let text = unsafe { CStr::from_ptr(hash.as_ptr()) }.to_str().unwrap();
        assert_eq!(text, Layout::load(&file).unwrap().hash());

        let mut placeholder = ptr::null_mut();
        let (mut addr, mut size, mut again) = (0u64, 0u64, 0u64);
        // SAFETY: valid out-pointers; the handle is used while live and freed once.
        unsafe {
            assert_eq!(
                belayer_placeholder_new(-1, 10_000, &mut placeholder),
                BELAYER_OK
            );
            assert_eq!(
                belayer_placeholder_info(placeholder, &mut addr, &mut size),
                BELAYER_OK
            );
            assert_eq!(belayer_placeholder_unmap(placeholder), BELAYER_OK);
            assert_eq!(belayer_placeholder_unmap(placeholder), BELAYER_E_MAP);
            assert!(last_error().contains("not mapped"));
            assert_eq!(belayer_placeholder_remap(placeholder), BELAYER_OK);
            assert_eq!(
                belayer_placeholder_info(placeholder, &mut again, &mut size),
                BELAYER_OK
            );
            belayer_placeholder_free(placeholder);
        }
        assert_eq!(addr, again);
        assert!(size >= 10_000);
    }

    #[test]
    fn cuda_calls_without_a_driver_report_cuda_errors() {
        if belayer_ipc::memory::cuda::driver_present() {
            eprintln!("skipping: a CUDA driver is present");
            return;
        }
        let mut micros = 0u64;
        // SAFETY: valid out-pointer.
        let rc = unsafe { belayer_gpu_health_check(0, &mut micros) };
        assert_eq!(rc, BELAYER_E_CUDA);
        assert!(last_error().contains("libcuda"));
        let mut placeholder = ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { belayer_placeholder_new(0, 1 << 20, &mut placeholder) };
        assert_eq!(rc, BELAYER_E_CUDA);
    }
}
