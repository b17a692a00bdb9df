//! The CUDA backend of a build without the cargo feature `cuda`: the names of `driver.rs`,
//! none of which reaches a GPU. The entry points answer [`CudaError::NotBuilt`]; the device,
//! allocation and range types are empty enums, so no value of them exists and their methods
//! can never run (their bodies are `match *self {}`).

use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::CudaError;

/// Whether a CUDA driver library can be loaded: never in this build, which has no CUDA
/// backend.
pub fn driver_present() -> bool {
    false
}

/// A CUDA device. This build has no CUDA backend: [`CudaDevice::open`] always fails, and no
/// value of this type exists.
#[derive(Debug)]
pub enum CudaDevice {}

impl CudaDevice {
    /// Opening a device needs the CUDA backend.
    ///
    /// Errors: always [`CudaError::NotBuilt`].
    pub fn open(_ordinal: i32) -> Result<Arc<CudaDevice>, CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// The device ordinal (no device exists in this build).
    pub fn ordinal(&self) -> i32 {
        match *self {}
    }

    /// The allocation granularity, bytes (no device exists in this build).
    pub fn granularity(&self) -> Result<u64, CudaError> {
        match *self {}
    }

    /// Allocates `size` bytes of device memory (no device exists in this build).
    pub fn allocate(
        self: &Arc<Self>,
        _size: u64,
        _exportable: bool,
    ) -> Result<PhysicalAlloc, CudaError> {
        match **self {}
    }

    /// Imports an allocation exported by another process (no device exists in this build).
    pub fn import(
        self: &Arc<Self>,
        _fd: BorrowedFd<'_>,
        _size: u64,
    ) -> Result<PhysicalAlloc, CudaError> {
        match **self {}
    }

    /// Reserves `size` bytes of device virtual addresses (no device exists in this build).
    pub fn reserve(self: &Arc<Self>, _size: u64, _alignment: u64) -> Result<VaRange, CudaError> {
        match **self {}
    }

    /// Waits for all work on the device (no device exists in this build).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        match *self {}
    }
}

/// A device allocation handle. This build has no CUDA backend: no value of this type exists.
#[derive(Debug)]
pub enum PhysicalAlloc {}

impl PhysicalAlloc {
    /// Size of the allocation, bytes (no allocation exists in this build).
    pub fn size(&self) -> u64 {
        match *self {}
    }

    /// Exports the allocation as a file descriptor (no allocation exists in this build).
    pub fn export_fd(&self) -> Result<OwnedFd, CudaError> {
        match *self {}
    }
}

/// A reserved device virtual-address range. This build has no CUDA backend: no value of this
/// type exists.
#[derive(Debug)]
pub enum VaRange {}

impl VaRange {
    /// Start address of the range (no range exists in this build).
    pub fn base(&self) -> u64 {
        match *self {}
    }

    /// Size of the range, bytes (no range exists in this build).
    pub fn size(&self) -> u64 {
        match *self {}
    }

    /// The device the range belongs to (no range exists in this build).
    pub fn device(&self) -> &Arc<CudaDevice> {
        match *self {}
    }

    /// Maps `len` bytes of `alloc` at `base + offset` (no range exists in this build).
    pub fn map(
        &mut self,
        _offset: u64,
        _len: u64,
        _alloc: &PhysicalAlloc,
    ) -> Result<u64, CudaError> {
        match *self {}
    }

    /// Unmaps `[base + offset, base + offset + len)` (no range exists in this build).
    pub fn unmap(&mut self, _offset: u64, _len: u64) -> Result<u64, CudaError> {
        match *self {}
    }

    /// Sets `len` bytes at `base + offset` to zero (no range exists in this build).
    pub fn zero(&self, _offset: u64, _len: u64) -> Result<(), CudaError> {
        match *self {}
    }

    /// Copies `data` to `base + offset` (no range exists in this build).
    pub fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), CudaError> {
        match *self {}
    }

    /// Copies `buf.len()` bytes from `base + offset` into `buf` (no range exists in this
    /// build).
    pub fn read(&self, _offset: u64, _buf: &mut [u8]) -> Result<(), CudaError> {
        match *self {}
    }
}

/// The GPU health check of device `ordinal` needs the CUDA backend.
///
/// Errors: always [`CudaError::NotBuilt`].
pub fn health_check(_ordinal: i32) -> Result<Duration, CudaError> {
    Err(CudaError::NotBuilt)
}
