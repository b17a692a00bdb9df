//! The CUDA backend proper (cargo feature `cuda`): the driver's VMM calls through
//! `cudarc::driver::sys` (raw `CUresult` calls, `libcuda` loaded at run time). The parent
//! module describes the types; this file holds every `unsafe` driver call.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::CudaError;

fn check(call: &'static str, code: sys::CUresult) -> Result<(), CudaError> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Call { call, code })
    }
}

/// Whether a CUDA driver library can be loaded (probed once, then cached).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: is_culib_present only tries to dlopen the candidate library names and drops
        // what it opened; it calls no driver function.
        unsafe { sys::is_culib_present() }
    })
}

/// `cuInit(0)` once per process, after checking that the library is there.
fn init() -> Result<(), CudaError> {
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    static INIT: OnceLock<sys::CUresult> = OnceLock::new();
    // SAFETY: the driver library is present (checked above), so the lazy symbol load
    // succeeds; cuInit takes flags 0 and may be called from any thread.
    let code = *INIT.get_or_init(|| unsafe { sys::cuInit(0) });
    check("cuInit", code)
}

/// A CUDA device and its retained primary context. Shared through `Arc` by the allocations and
/// ranges made on it; the primary context is released when the last user is gone.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: sys::CUdevice,
    context: sys::CUcontext,
}

// SAFETY: a CUcontext is a driver handle, not thread-bound memory: the driver API allows any
// thread to make it current (cuCtxSetCurrent, done before every call here), and retain/release
// of a primary context are thread safe.
unsafe impl Send for CudaDevice {}
// SAFETY: as for Send; the struct holds only immutable handle values.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens device `ordinal`: `cuInit`, `cuDeviceGetCount`, `cuDeviceGet`,
    /// `cuDevicePrimaryCtxRetain`.
    ///
    /// Errors: [`CudaError::NoDriver`] without a driver library, [`CudaError::NoSuchDevice`],
    /// [`CudaError::Call`].
    pub fn open(ordinal: i32) -> Result<Arc<CudaDevice>, CudaError> {
        init()?;
        let mut count: c_int = 0;
        // SAFETY: the driver is initialised; `count` is a valid out-pointer for the call.
        check("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let mut device: sys::CUdevice = 0;
        // SAFETY: the ordinal was checked against the device count; `device` is a valid
        // out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `device` is a valid device handle; `context` is a valid out-pointer. The
        // retain is balanced by cuDevicePrimaryCtxRelease_v2 in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, device)
        })?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            device,
            context,
        }))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// Makes the primary context current on the calling thread.
    fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: `context` is the primary context retained in `open` and not yet released
        // (self is alive).
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.context)
        })
    }

    /// Allocation properties: pinned device memory on this device, POSIX-fd shareable.
    fn properties(&self, exportable: bool) -> sys::CUmemAllocationProp {
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: if exportable {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
            },
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    fn access(&self) -> sys::CUmemAccessDesc {
        sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    /// The minimum allocation granularity of exportable allocations on this device, bytes
    /// (`cuMemGetAllocationGranularity`, typically 2 MiB). Sizes and offsets of mappings are
    /// multiples of it.
    ///
    /// Errors: [`CudaError::Call`].
    pub fn granularity(&self) -> Result<u64, CudaError> {
        self.bind()?;
        let prop = self.properties(true);
        let mut granularity: usize = 0;
        // SAFETY: `prop` is a fully initialised property struct for this device and
        // `granularity` a valid out-pointer; the context is current.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity as u64)
    }

    /// Allocates `size` bytes of device memory (`cuMemCreate`); `size` must be a multiple of
    /// [`granularity`](CudaDevice::granularity). With `exportable`, the allocation can be
    /// exported as a file descriptor.
    ///
    /// Errors: [`CudaError::Call`] (`CUDA_ERROR_OUT_OF_MEMORY`, `CUDA_ERROR_INVALID_VALUE` for
    /// an unaligned size, ...).
    pub fn allocate(
        self: &Arc<Self>,
        size: u64,
        exportable: bool,
    ) -> Result<PhysicalAlloc, CudaError> {
        self.bind()?;
        let prop = self.properties(exportable);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `prop` is fully initialised, `handle` a valid out-pointer, flags must be 0;
        // the context is current. The handle is released by PhysicalAlloc's Drop.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size as usize, &prop, 0)
        })?;
        Ok(PhysicalAlloc {
            device: Arc::clone(self),
            handle,
            size,
        })
    }

    /// Imports an allocation exported by another process (`cuMemImportFromShareableHandle`).
    /// `fd` stays owned by the caller; `size` is the allocation's size as described by the
    /// exporter.
    ///
    /// Errors: [`CudaError::Call`].
    pub fn import(
        self: &Arc<Self>,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> Result<PhysicalAlloc, CudaError> {
        self.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver takes the descriptor
        // number cast to a pointer; `fd` is open for the whole call. `handle` is a valid
        // out-pointer, released by PhysicalAlloc's Drop.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(PhysicalAlloc {
            device: Arc::clone(self),
            handle,
            size,
        })
    }

    /// Reserves `size` bytes of device virtual addresses aligned to `alignment`
    /// (`cuMemAddressReserve`).
    ///
    /// Errors: [`CudaError::Call`].
    pub fn reserve(self: &Arc<Self>, size: u64, alignment: u64) -> Result<VaRange, CudaError> {
        self.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `base` is a valid out-pointer; a zero fixed address lets the driver choose;
        // flags must be 0. The range is freed by VaRange's Drop.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size as usize, alignment as usize, 0, 0)
        })?;
        Ok(VaRange {
            device: Arc::clone(self),
            base,
            size,
            granularity: alignment.max(1),
            mapped: Vec::new(),
        })
    }

    /// Waits for all work on the device's primary context (`cuCtxSynchronize`).
    ///
    /// Errors: [`CudaError::Call`] (also reports earlier asynchronous faults).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: the context is current; the call takes no arguments.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: balances the cuDevicePrimaryCtxRetain of `open`; no allocation or range made
        // on this device outlives it (they hold an Arc to it).
        let code = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(err) = check("cuDevicePrimaryCtxRelease", code) {
            tracing::warn!(device = self.ordinal, error = %err, "releasing the primary context failed");
        }
    }
}

/// A generic allocation handle (`cuMemCreate` or imported). Dropping it releases the handle;
/// the memory stays alive while it is mapped anywhere or another handle to it exists.
#[derive(Debug)]
pub struct PhysicalAlloc {
    device: Arc<CudaDevice>,
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
}

impl PhysicalAlloc {
    /// Size of the allocation, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Exports the allocation as a new POSIX file descriptor (`cuMemExportToShareableHandle`)
    /// that another process imports after receiving it by `SCM_RIGHTS`.
    ///
    /// Errors: [`CudaError::Call`] (`CUDA_ERROR_INVALID_VALUE` when the allocation was not
    /// created exportable).
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        self.device.bind()?;
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR the driver writes an int
        // descriptor through the pointer, which points at `fd`; the handle is alive; flags 0.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: on success the driver created descriptor `fd` for the caller, who owns it;
        // nothing else refers to it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for PhysicalAlloc {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: `handle` came from cuMemCreate or cuMemImportFromShareableHandle and is
        // released exactly once, here; existing mappings keep the memory alive on their own.
        let code = unsafe { sys::cuMemRelease(self.handle) };
        if let Err(err) = check("cuMemRelease", code) {
            tracing::warn!(device = self.device.ordinal, error = %err, "releasing an allocation handle failed");
        }
    }
}

/// A reserved device virtual-address range. Mappings placed in it are unmapped, and the range
/// freed, on drop.
#[derive(Debug)]
pub struct VaRange {
    device: Arc<CudaDevice>,
    base: sys::CUdeviceptr,
    size: u64,
    granularity: u64,
    /// `(offset, len)` of the spans mapped now.
    mapped: Vec<(u64, u64)>,
}

impl VaRange {
    /// Start address of the range (a device pointer).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Size of the range, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device the range belongs to.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    fn span(&self, offset: u64, len: u64) -> Result<sys::CUdeviceptr, CudaError> {
        let inside = offset.checked_add(len).is_some_and(|end| end <= self.size);
        let aligned =
            offset.is_multiple_of(self.granularity) && len.is_multiple_of(self.granularity);
        if inside && aligned && len > 0 {
            Ok(self.base + offset)
        } else {
            Err(CudaError::BadSpan {
                offset,
                len,
                size: self.size,
                granularity: self.granularity,
            })
        }
    }

    /// Maps the first `len` bytes of `alloc` at `base + offset` and makes them readable and
    /// writable from this device (`cuMemMap`, `cuMemSetAccess`). The handle may be dropped
    /// afterwards: the mapping keeps the memory alive. Returns the device address.
    ///
    /// Errors: [`CudaError::BadSpan`], [`CudaError::Call`] (also when the span is mapped
    /// already).
    pub fn map(&mut self, offset: u64, len: u64, alloc: &PhysicalAlloc) -> Result<u64, CudaError> {
        let ptr = self.span(offset, len)?;
        self.device.bind()?;
        // SAFETY: the span lies inside this reserved range (checked); the handle is alive for
        // the call; offset into the allocation 0 and flags 0 as the API requires.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, len as usize, 0, alloc.handle, 0)
        })?;
        let desc = self.device.access();
        // SAFETY: the span was just mapped; `desc` points at one initialised access
        // descriptor, matching the count 1.
        let access = check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, len as usize, &desc, 1)
        });
        if let Err(err) = access {
            // SAFETY: undoes the cuMemMap just above on the same span.
            let _ = unsafe { sys::cuMemUnmap(ptr, len as usize) };
            return Err(err);
        }
        self.mapped.push((offset, len));
        Ok(ptr)
    }

    /// Unmaps `[base + offset, base + offset + len)` (`cuMemUnmap`), keeping the addresses
    /// reserved. The memory is freed when no other mapping or handle refers to it. Returns
    /// the device address.
    ///
    /// Errors: [`CudaError::BadSpan`], [`CudaError::Call`].
    pub fn unmap(&mut self, offset: u64, len: u64) -> Result<u64, CudaError> {
        let ptr = self.span(offset, len)?;
        self.device.bind()?;
        // Pending work may still use the memory: wait for it first.
        self.device.synchronize()?;
        // SAFETY: the span lies inside this range; cuMemUnmap refuses spans that are not
        // exactly mapped ones, so no foreign mapping can be removed.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, len as usize) })?;
        self.mapped.retain(|span| *span != (offset, len));
        Ok(ptr)
    }

    /// Sets `len` bytes at `base + offset` to zero (`cuMemsetD8`) and waits for it.
    ///
    /// Errors: [`CudaError::Call`] (e.g. the span is not mapped).
    pub fn zero(&self, offset: u64, len: u64) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: a device-side memset of device addresses; the driver validates that they
        // are mapped and reports an error code otherwise. No host memory is touched.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(self.base + offset, 0, len as usize)
        })?;
        self.device.synchronize()
    }

    /// Copies `data` to device address `base + offset` (`cuMemcpyHtoD`).
    ///
    /// Errors: [`CudaError::Call`].
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: `data` is a valid host buffer of `data.len()` bytes for the whole
        // (synchronous) copy; the driver validates the device span.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.base + offset, data.as_ptr().cast(), data.len())
        })
    }

    /// Copies `buf.len()` bytes from device address `base + offset` into `buf`
    /// (`cuMemcpyDtoH`).
    ///
    /// Errors: [`CudaError::Call`].
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), CudaError> {
        self.device.bind()?;
        // SAFETY: `buf` is a valid, writable host buffer of `buf.len()` bytes for the whole
        // (synchronous) copy; the driver validates the device span.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(buf.as_mut_ptr().cast(), self.base + offset, buf.len())
        })
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        let _ = self.device.bind();
        for (offset, len) in std::mem::take(&mut self.mapped) {
            // SAFETY: the span was mapped by `map` in this range and not unmapped since.
            let code = unsafe { sys::cuMemUnmap(self.base + offset, len as usize) };
            if let Err(err) = check("cuMemUnmap", code) {
                tracing::warn!(offset, len, error = %err, "unmapping on drop failed");
            }
        }
        // SAFETY: the range came from cuMemAddressReserve with this size and is freed once.
        let code = unsafe { sys::cuMemAddressFree(self.base, self.size as usize) };
        if let Err(err) = check("cuMemAddressFree", code) {
            tracing::warn!(base = self.base, size = self.size, error = %err, "freeing a reserved range failed");
        }
    }
}

/// Lightweight GPU health check (paper: handover step 2): on device `ordinal`, allocates 4 KiB
/// (`cuMemAlloc`), fills it with a pattern (`cuMemsetD8`), synchronizes, reads one byte back
/// and frees it. Returns how long it took.
///
/// Errors: [`CudaError::NoDriver`], [`CudaError::NoSuchDevice`], [`CudaError::Call`] (a
/// faulted or lost device fails here), [`CudaError::HealthMismatch`].
pub fn health_check(ordinal: i32) -> Result<Duration, CudaError> {
    const PATTERN: u8 = 0xA5;
    const LEN: usize = 4096;
    let started = Instant::now();
    let device = CudaDevice::open(ordinal)?;
    device.bind()?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: the context is current; `ptr` is a valid out-pointer; freed below.
    check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, LEN) })?;
    let result = (|| {
        // SAFETY: [ptr, ptr + LEN) was just allocated on this context.
        check("cuMemsetD8", unsafe {
            sys::cuMemsetD8_v2(ptr, PATTERN, LEN)
        })?;
        device.synchronize()?;
        let mut byte = [0u8; 1];
        // SAFETY: copies one byte from the allocation above into a one-byte host buffer.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(byte.as_mut_ptr().cast(), ptr + LEN as u64 - 1, 1)
        })?;
        if byte[0] == PATTERN {
            Ok(())
        } else {
            Err(CudaError::HealthMismatch {
                expected: PATTERN,
                got: byte[0],
            })
        }
    })();
    // SAFETY: frees the allocation made above, exactly once.
    let freed = check("cuMemFree", unsafe { sys::cuMemFree_v2(ptr) });
    result?;
    freed?;
    Ok(started.elapsed())
}
