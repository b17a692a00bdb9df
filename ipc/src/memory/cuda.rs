//! CUDA backend: a thin safe layer over the driver's virtual memory management (VMM) API,
//! through `cudarc::driver::sys` (raw `CUresult` calls, library loaded at run time).
//!
//! - [`driver_present`] tells whether `libcuda` can be loaded at all. cudarc's loader panics
//!   when it cannot, so every entry point here ([`CudaDevice::open`], [`health_check`]) checks
//!   it first and answers [`CudaError::NoDriver`]; every other call needs a [`CudaDevice`].
//! - [`CudaDevice`]: an ordinal with its retained primary context, made current on the calling
//!   thread before each call (`cuCtxSetCurrent`).
//! - [`PhysicalAlloc`]: a `cuMemCreate` allocation (pinned device memory, requested handle type
//!   `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`), exportable as a file descriptor
//!   (`cuMemExportToShareableHandle`) and importable from one in another process
//!   (`cuMemImportFromShareableHandle`). Dropping it releases the handle (`cuMemRelease`); the
//!   memory itself lives while any handle or mapping of it remains, in any process.
//! - [`VaRange`]: a reserved device virtual-address range (`cuMemAddressReserve`) into which
//!   allocations are mapped (`cuMemMap` + `cuMemSetAccess`) and unmapped (`cuMemUnmap`)
//!   without giving up the addresses (paper: "Shadow-worker preparation": CUDA-graph
//!   placeholder buffers are unmapped on standby and remapped at the same address).
//! - [`health_check`]: a tiny allocation, a memset, a synchronize and a read-back (paper:
//!   handover step 2).
//!
//! Requires a driver with VMM and POSIX-fd handles (CUDA 10.2 or newer, Linux). Device
//! ordinals are those the calling process sees: the server and its workers must agree on
//! `CUDA_VISIBLE_DEVICES`.
//!
//! # The `cuda` feature
//!
//! The driver calls (`driver.rs`, the only user of `cudarc`) are built with the cargo feature
//! `cuda`, which the memory servers, the workers' C ABI and the benchmarks turn on; the
//! command-line client does not, so it does not link `cudarc`. Without the feature the same
//! names exist (`unbuilt.rs`) and nothing touches a GPU: [`driver_present`] is false,
//! [`CudaDevice::open`] and [`health_check`] answer [`CudaError::NotBuilt`], and
//! [`CudaDevice`], [`PhysicalAlloc`] and [`VaRange`] have no values at all. The protocol is
//! the same in both builds ([`Backend::Cuda`](super::Backend::Cuda) still travels).

#[cfg(feature = "cuda")]
mod driver;
#[cfg(not(feature = "cuda"))]
mod unbuilt;

#[cfg(feature = "cuda")]
pub use driver::{driver_present, health_check, CudaDevice, PhysicalAlloc, VaRange};
#[cfg(not(feature = "cuda"))]
pub use unbuilt::{driver_present, health_check, CudaDevice, PhysicalAlloc, VaRange};

/// The result code of a failed driver call: cudarc's `CUresult` (its `Debug` form is the
/// driver's name for it, e.g. `CUDA_ERROR_OUT_OF_MEMORY`).
#[cfg(feature = "cuda")]
pub type DriverCode = cudarc::driver::sys::CUresult;

/// The result code of a failed driver call. This build has no CUDA backend (cargo feature
/// `cuda`), makes no driver call, and so has no such codes: the type has no values.
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverCode {}

/// Why a CUDA operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// This build has no CUDA backend: belayer-ipc was compiled without its cargo feature
    /// `cuda`.
    #[error(
        "this build of belayer-ipc has no CUDA backend (cargo feature `cuda`); use the host \
         backend (--device host) or a build with the feature"
    )]
    NotBuilt,
    /// No CUDA driver library could be loaded (`is_culib_present()` is false).
    #[error(
        "no CUDA driver library (libcuda.so) is present on this machine; use the host backend \
         (--device host) where there is no NVIDIA GPU"
    )]
    NoDriver,
    /// A driver call returned an error.
    #[error("{call} failed with {code:?}")]
    Call {
        /// The driver function.
        call: &'static str,
        /// Its result code.
        code: DriverCode,
    },
    /// The ordinal is not one of the visible devices.
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoSuchDevice {
        /// Ordinal asked for.
        ordinal: i32,
        /// Devices visible to this process.
        count: i32,
    },
    /// An offset or length lies outside a [`VaRange`] or is not granularity aligned.
    #[error("span at offset {offset} of {len} bytes does not fit range of {size} bytes aligned to {granularity}")]
    BadSpan {
        /// Offset in the range, bytes.
        offset: u64,
        /// Length, bytes.
        len: u64,
        /// Range size, bytes.
        size: u64,
        /// Required alignment, bytes.
        granularity: u64,
    },
    /// The health check read back other bytes than it wrote.
    #[error("health check read back {got:#04x} instead of {expected:#04x}")]
    HealthMismatch {
        /// Byte written.
        expected: u8,
        /// Byte read back.
        got: u8,
    },
}

#[cfg(test)]
mod tests;
