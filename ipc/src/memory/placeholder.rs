//! Worker-local placeholder buffers ([`Placeholder`]) that give back their memory while
//! keeping their addresses (paper: "Shadow-worker preparation"), on either backend.

use std::sync::Arc;

use super::cuda::CudaDevice;
use super::host::{self, Reservation};
use super::mapping::{BackendError, MapError, Space};
use super::message::Backend;

/// A worker-local buffer whose memory can be given back while its address range stays
/// reserved (paper: "Shadow-worker preparation": a standby shadow worker unmaps its CUDA-graph
/// placeholder buffers and remaps them, at the same addresses, when it takes over). Contents
/// are not kept across unmap/remap: a remapped buffer holds fresh memory (zeros on the host).
#[derive(Debug)]
pub struct Placeholder {
    space: Space,
    len: u64,
    mapped: bool,
}

impl Placeholder {
    /// A placeholder of `size` bytes (rounded up to the backend granularity) on `backend`,
    /// mapped (host: private anonymous memory; CUDA: a `cuMemCreate` allocation whose handle
    /// is released once mapped).
    ///
    /// Errors: [`MapError::OpenDevice`], [`MapError::Reserve`], [`MapError::MapRegion`]
    /// (region name `"placeholder"`).
    pub fn new(backend: Backend, size: u64) -> Result<Placeholder, MapError> {
        let reserve_err = |len: u64| move |source: BackendError| MapError::Reserve { len, source };
        let (space, len) = match backend {
            Backend::Host => {
                let len = size.max(1).next_multiple_of(host::page_size());
                let reservation = Reservation::new(len).map_err(|e| reserve_err(len)(e.into()))?;
                (Space::Host(reservation), len)
            }
            Backend::Cuda { device } => {
                let dev = CudaDevice::open(device)
                    .map_err(|source| MapError::OpenDevice { device, source })?;
                let granularity = dev.granularity().map_err(|e| reserve_err(size)(e.into()))?;
                let len = size.max(1).next_multiple_of(granularity);
                let range = dev
                    .reserve(len, granularity)
                    .map_err(|e| reserve_err(len)(e.into()))?;
                (Space::Cuda(range), len)
            }
        };
        let mut placeholder = Placeholder {
            space,
            len,
            mapped: false,
        };
        placeholder.remap()?;
        Ok(placeholder)
    }

    /// Address of the buffer (stable for its whole life).
    pub fn addr(&self) -> u64 {
        match &self.space {
            Space::Host(reservation) => reservation.base(),
            Space::Cuda(range) => range.base(),
        }
    }

    /// Size of the buffer, bytes (rounded up to the granularity).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer is empty (never: it holds at least one page or granule).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether memory is mapped at the address now.
    pub fn is_mapped(&self) -> bool {
        self.mapped
    }

    /// Gives the memory back, keeping the address reserved. Returns the address.
    ///
    /// Errors: [`MapError::NotMapped`], [`MapError::UnmapRegion`].
    pub fn unmap(&mut self) -> Result<u64, MapError> {
        if !self.mapped {
            return Err(MapError::NotMapped {
                region: "placeholder".to_owned(),
            });
        }
        let addr = match &mut self.space {
            Space::Host(reservation) => {
                reservation.release(0, self.len).map_err(BackendError::from)
            }
            Space::Cuda(range) => range.unmap(0, self.len).map_err(BackendError::from),
        }
        .map_err(|source| MapError::UnmapRegion {
            region: "placeholder".to_owned(),
            source,
        })?;
        self.mapped = false;
        Ok(addr)
    }

    /// Maps fresh memory at the same address. Returns the address.
    ///
    /// Errors: [`MapError::AlreadyMapped`], [`MapError::MapRegion`].
    pub fn remap(&mut self) -> Result<u64, MapError> {
        if self.mapped {
            return Err(MapError::AlreadyMapped {
                region: "placeholder".to_owned(),
            });
        }
        let len = self.len;
        let addr = match &mut self.space {
            Space::Host(reservation) => reservation
                .map_anonymous(0, len)
                .map_err(BackendError::from),
            Space::Cuda(range) => {
                let device = Arc::clone(range.device());
                device
                    .allocate(len, false)
                    .and_then(|alloc| range.map(0, len, &alloc))
                    .map_err(BackendError::from)
            }
        }
        .map_err(|source| MapError::MapRegion {
            region: "placeholder".to_owned(),
            source,
        })?;
        self.mapped = true;
        Ok(addr)
    }
}
