//! Worker side: an attached layout mapped into this process ([`Mapping`]), and worker-local
//! placeholder buffers that can give back their memory while keeping their addresses
//! ([`Placeholder`]).
//!
//! Both work on either backend. Addresses are `u64`: host virtual addresses on the host
//! backend, device pointers on CUDA. Nothing here hands out Rust references into the mapped
//! memory (other processes write it concurrently); [`Mapping::read`] and [`Mapping::write`]
//! copy with bounds and state checks, and engines use the raw addresses.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use super::cuda::{CudaDevice, CudaError, VaRange};
use super::host::{self, HostError, Reservation};
use super::message::{AttachInfo, Backend, RegionDesc};

/// A backend failure under a [`MapError`].
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// A host system call failed.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A CUDA driver call failed.
    #[error(transparent)]
    Cuda(#[from] CudaError),
}

/// Why mapping, unmapping, remapping, copying or zeroing failed.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The server sent another number of descriptors than regions.
    #[error("received {got} descriptors for {expected} regions")]
    FdCount {
        /// Regions described.
        expected: usize,
        /// Descriptors received.
        got: usize,
    },
    /// A region descriptor does not fit the layout range, or is not aligned.
    #[error("region {region:?} at offset {offset} of {len} bytes does not fit the {total}-byte layout range")]
    BadRegion {
        /// Region name.
        region: String,
        /// Offset, bytes.
        offset: u64,
        /// Mapped size, bytes.
        len: u64,
        /// Layout range, bytes.
        total: u64,
    },
    /// The memory behind a host descriptor is smaller than the region.
    #[error("region {region:?} is backed by {backing} bytes, less than its {len} bytes")]
    ShortBacking {
        /// Region name.
        region: String,
        /// Size of the file behind the descriptor, bytes.
        backing: u64,
        /// Mapped size, bytes.
        len: u64,
    },
    /// Opening the CUDA device failed.
    #[error("opening CUDA device {device} failed")]
    OpenDevice {
        /// Ordinal.
        device: i32,
        /// The driver error.
        #[source]
        source: CudaError,
    },
    /// Reserving the address range failed.
    #[error("reserving {len} bytes of address space failed")]
    Reserve {
        /// Bytes.
        len: u64,
        /// The backend error.
        #[source]
        source: BackendError,
    },
    /// Mapping (or importing) a region failed.
    #[error("mapping region {region:?} failed")]
    MapRegion {
        /// Region name.
        region: String,
        /// The backend error.
        #[source]
        source: BackendError,
    },
    /// Unmapping a region failed.
    #[error("unmapping region {region:?} failed")]
    UnmapRegion {
        /// Region name.
        region: String,
        /// The backend error.
        #[source]
        source: BackendError,
    },
    /// Zeroing a region failed.
    #[error("zeroing region {region:?} failed")]
    ZeroRegion {
        /// Region name.
        region: String,
        /// The backend error.
        #[source]
        source: BackendError,
    },
    /// Copying to or from a region failed.
    #[error("copying {len} bytes at offset {offset} of region {region:?} failed")]
    Copy {
        /// Region name.
        region: String,
        /// Offset in the region, bytes.
        offset: u64,
        /// Bytes.
        len: u64,
        /// The backend error.
        #[source]
        source: BackendError,
    },
    /// No region of that name is attached.
    #[error("no attached region named {region:?}")]
    UnknownRegion {
        /// Name asked for.
        region: String,
    },
    /// The region is unmapped (see [`Mapping::remap`]).
    #[error("region {region:?} is not mapped")]
    NotMapped {
        /// Region name.
        region: String,
    },
    /// The region is mapped already.
    #[error("region {region:?} is mapped already")]
    AlreadyMapped {
        /// Region name.
        region: String,
    },
    /// The attachment holds a read lease; writing is refused.
    #[error("region {region:?} is attached read-only")]
    ReadOnly {
        /// Region name.
        region: String,
    },
    /// The span lies outside the region.
    #[error("{len} bytes at offset {offset} exceed region {region:?} of {size} bytes")]
    OutOfBounds {
        /// Region name.
        region: String,
        /// Offset, bytes.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Region size, bytes.
        size: u64,
    },
}

/// Where a mapping's regions live in this process.
#[derive(Debug)]
pub(super) enum Space {
    Host(Reservation),
    Cuda(VaRange),
}

#[derive(Debug)]
struct Slot {
    desc: RegionDesc,
    /// The descriptor received from the server, kept for remapping (and, on the host backend,
    /// for zeroing).
    fd: OwnedFd,
    mapped: bool,
}

/// What [`Mapping::region`] reports about one region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionView {
    /// Region name.
    pub name: String,
    /// Address of the region's first byte (kept while unmapped).
    pub addr: u64,
    /// Size asked for by the layout, bytes.
    pub size: u64,
    /// Size mapped (rounded to the granularity), bytes.
    pub mapped_size: u64,
    /// Whether the memory is mapped now.
    pub mapped: bool,
}

/// An attached layout, mapped into one reservation of [`AttachInfo::total`] bytes with every
/// region at `base + offset`. Dropping it unmaps everything and frees the reservation (the
/// server's allocations are not affected); the leases end only with
/// [`MemClient::detach`](super::client::MemClient::detach) or the connection.
#[derive(Debug)]
pub struct Mapping {
    info: AttachInfo,
    space: Space,
    slots: Vec<Slot>,
}

impl Mapping {
    /// Maps the regions of an attach answer: reserves the layout range, then maps every region
    /// at its offset (host: `mmap(MAP_SHARED | MAP_FIXED)`, writable unless the lease is
    /// `Read`; CUDA: `cuMemImportFromShareableHandle`, `cuMemMap`, `cuMemSetAccess`, then the
    /// imported handle is released as the mapping keeps the memory alive).
    ///
    /// Errors: [`MapError::FdCount`], [`MapError::BadRegion`], [`MapError::ShortBacking`],
    /// [`MapError::OpenDevice`], [`MapError::Reserve`], [`MapError::MapRegion`].
    pub fn map(info: AttachInfo, fds: Vec<OwnedFd>) -> Result<Mapping, MapError> {
        if fds.len() != info.regions.len() {
            return Err(MapError::FdCount {
                expected: info.regions.len(),
                got: fds.len(),
            });
        }
        for desc in &info.regions {
            let fits = desc
                .offset
                .checked_add(desc.mapped_size)
                .is_some_and(|end| end <= info.total);
            let aligned = info.granularity > 0
                && desc.offset.is_multiple_of(info.granularity)
                && desc.mapped_size.is_multiple_of(info.granularity)
                && desc.mapped_size >= desc.size;
            if !fits || !aligned || desc.mapped_size == 0 {
                return Err(MapError::BadRegion {
                    region: desc.name.clone(),
                    offset: desc.offset,
                    len: desc.mapped_size,
                    total: info.total,
                });
            }
        }
        let space = match info.backend {
            Backend::Host => {
                Space::Host(Reservation::new(info.total).map_err(|e| MapError::Reserve {
                    len: info.total,
                    source: e.into(),
                })?)
            }
            Backend::Cuda { device } => {
                let device = CudaDevice::open(device)
                    .map_err(|source| MapError::OpenDevice { device, source })?;
                Space::Cuda(device.reserve(info.total, info.granularity).map_err(|e| {
                    MapError::Reserve {
                        len: info.total,
                        source: e.into(),
                    }
                })?)
            }
        };
        let slots = info
            .regions
            .iter()
            .cloned()
            .zip(fds)
            .map(|(desc, fd)| Slot {
                desc,
                fd,
                mapped: false,
            })
            .collect();
        let mut mapping = Mapping { info, space, slots };
        for index in 0..mapping.slots.len() {
            mapping.map_slot(index)?;
        }
        Ok(mapping)
    }

    fn map_slot(&mut self, index: usize) -> Result<u64, MapError> {
        let writable = self.info.mode.writes();
        let slot = &mut self.slots[index];
        let (offset, len) = (slot.desc.offset, slot.desc.mapped_size);
        let region = || slot.desc.name.clone();
        let addr = match &mut self.space {
            Space::Host(reservation) => {
                let backing = host::fd_size(slot.fd.as_fd()).map_err(|e| MapError::MapRegion {
                    region: region(),
                    source: e.into(),
                })?;
                if backing < len {
                    return Err(MapError::ShortBacking {
                        region: region(),
                        backing,
                        len,
                    });
                }
                reservation
                    .map_shared(offset, len, slot.fd.as_fd(), writable)
                    .map_err(|e| MapError::MapRegion {
                        region: region(),
                        source: e.into(),
                    })?
            }
            Space::Cuda(range) => {
                let device = Arc::clone(range.device());
                let alloc =
                    device
                        .import(slot.fd.as_fd(), len)
                        .map_err(|e| MapError::MapRegion {
                            region: region(),
                            source: e.into(),
                        })?;
                // The imported handle is released when `alloc` drops: the mapping keeps the
                // memory alive, and the descriptor is kept for a later remap.
                range
                    .map(offset, len, &alloc)
                    .map_err(|e| MapError::MapRegion {
                        region: region(),
                        source: e.into(),
                    })?
            }
        };
        slot.mapped = true;
        Ok(addr)
    }

    /// The attach answer this mapping was made from (attachment id, version, lease, regions).
    pub fn info(&self) -> &AttachInfo {
        &self.info
    }

    /// Start of the layout range: region `r` lies at `base() + r.offset`.
    pub fn base(&self) -> u64 {
        match &self.space {
            Space::Host(reservation) => reservation.base(),
            Space::Cuda(range) => range.base(),
        }
    }

    fn slot(&self, name: &str) -> Result<usize, MapError> {
        self.slots
            .iter()
            .position(|slot| slot.desc.name == name)
            .ok_or_else(|| MapError::UnknownRegion {
                region: name.to_owned(),
            })
    }

    fn view(&self, slot: &Slot) -> RegionView {
        RegionView {
            name: slot.desc.name.clone(),
            addr: self.base() + slot.desc.offset,
            size: slot.desc.size,
            mapped_size: slot.desc.mapped_size,
            mapped: slot.mapped,
        }
    }

    /// The attached region `name`, or `None`.
    pub fn region(&self, name: &str) -> Option<RegionView> {
        let index = self.slot(name).ok()?;
        Some(self.view(&self.slots[index]))
    }

    /// Every attached region, in layout order.
    pub fn regions(&self) -> Vec<RegionView> {
        self.slots.iter().map(|slot| self.view(slot)).collect()
    }

    /// Address of region `name`.
    ///
    /// Errors: [`MapError::UnknownRegion`].
    pub fn addr(&self, name: &str) -> Result<u64, MapError> {
        let index = self.slot(name)?;
        Ok(self.base() + self.slots[index].desc.offset)
    }

    /// Checks that `[offset, offset + len)` lies in the (mapped) region; returns the slot.
    fn checked(&self, name: &str, offset: u64, len: u64) -> Result<&Slot, MapError> {
        let slot = &self.slots[self.slot(name)?];
        if !slot.mapped {
            return Err(MapError::NotMapped {
                region: name.to_owned(),
            });
        }
        if offset
            .checked_add(len)
            .is_none_or(|end| end > slot.desc.size)
        {
            return Err(MapError::OutOfBounds {
                region: name.to_owned(),
                offset,
                len,
                size: slot.desc.size,
            });
        }
        Ok(slot)
    }

    /// Copies `buf.len()` bytes from offset `offset` of region `name` into `buf` (host:
    /// memory copy; CUDA: `cuMemcpyDtoH`).
    ///
    /// Errors: [`MapError::UnknownRegion`], [`MapError::NotMapped`],
    /// [`MapError::OutOfBounds`], [`MapError::Copy`].
    pub fn read(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<(), MapError> {
        let slot = self.checked(name, offset, buf.len() as u64)?;
        let at = slot.desc.offset + offset;
        match &self.space {
            Space::Host(reservation) => {
                // SAFETY: the span lies inside the region (checked), which is mapped readable
                // (every lease mode maps readable) and stays mapped while `self` is borrowed:
                // unmap/remap need `&mut self`.
                unsafe { host::copy_out(reservation.base() + at, buf) };
                Ok(())
            }
            Space::Cuda(range) => range.read(at, buf).map_err(|e| MapError::Copy {
                region: name.to_owned(),
                offset,
                len: buf.len() as u64,
                source: e.into(),
            }),
        }
    }

    fn check_writable(&self, name: &str) -> Result<(), MapError> {
        if self.info.mode.writes() {
            Ok(())
        } else {
            Err(MapError::ReadOnly {
                region: name.to_owned(),
            })
        }
    }

    /// Copies `data` to offset `offset` of region `name` (host: memory copy; CUDA:
    /// `cuMemcpyHtoD`). Needs a write lease.
    ///
    /// Errors: [`MapError::ReadOnly`], and those of [`read`](Mapping::read).
    pub fn write(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<(), MapError> {
        self.check_writable(name)?;
        let slot = self.checked(name, offset, data.len() as u64)?;
        let at = slot.desc.offset + offset;
        match &self.space {
            Space::Host(reservation) => {
                // SAFETY: the span lies inside the region (checked), which is mapped writable
                // (write lease, checked) and stays mapped while `self` is borrowed.
                unsafe { host::copy_in(reservation.base() + at, data) };
                Ok(())
            }
            Space::Cuda(range) => range.write(at, data).map_err(|e| MapError::Copy {
                region: name.to_owned(),
                offset,
                len: data.len() as u64,
                source: e.into(),
            }),
        }
    }

    /// Zeroes region `name` from this worker (KV flush on the worker side; host: punches the
    /// memfd's pages, so every process sees zeros and the memory is freed; CUDA:
    /// `cuMemsetD8` + synchronize). Needs a write lease.
    ///
    /// Errors: [`MapError::ReadOnly`], [`MapError::UnknownRegion`], [`MapError::NotMapped`],
    /// [`MapError::ZeroRegion`].
    pub fn zero(&mut self, name: &str) -> Result<(), MapError> {
        self.check_writable(name)?;
        let slot = self.checked(name, 0, 0)?;
        let result = match &self.space {
            Space::Host(_) => {
                host::zero_fd(slot.fd.as_fd(), slot.desc.mapped_size).map_err(BackendError::from)
            }
            Space::Cuda(range) => range
                .zero(slot.desc.offset, slot.desc.mapped_size)
                .map_err(BackendError::from),
        };
        result.map_err(|source| MapError::ZeroRegion {
            region: name.to_owned(),
            source,
        })
    }

    /// Unmaps region `name` but keeps its addresses reserved (host: a `PROT_NONE` mapping
    /// over it; CUDA: `cuMemUnmap`). Returns the address, which [`remap`](Mapping::remap)
    /// maps again. The server's memory and contents are untouched.
    ///
    /// Errors: [`MapError::UnknownRegion`], [`MapError::NotMapped`], [`MapError::UnmapRegion`].
    pub fn unmap(&mut self, name: &str) -> Result<u64, MapError> {
        let index = self.slot(name)?;
        let slot = &mut self.slots[index];
        if !slot.mapped {
            return Err(MapError::NotMapped {
                region: name.to_owned(),
            });
        }
        let (offset, len) = (slot.desc.offset, slot.desc.mapped_size);
        let addr = match &mut self.space {
            Space::Host(reservation) => {
                reservation.release(offset, len).map_err(BackendError::from)
            }
            Space::Cuda(range) => range.unmap(offset, len).map_err(BackendError::from),
        }
        .map_err(|source| MapError::UnmapRegion {
            region: name.to_owned(),
            source,
        })?;
        slot.mapped = false;
        Ok(addr)
    }

    /// Maps region `name` again at the address it had, with the same contents (the server's
    /// memory). Returns the address.
    ///
    /// Errors: [`MapError::UnknownRegion`], [`MapError::AlreadyMapped`],
    /// [`MapError::MapRegion`].
    pub fn remap(&mut self, name: &str) -> Result<u64, MapError> {
        let index = self.slot(name)?;
        if self.slots[index].mapped {
            return Err(MapError::AlreadyMapped {
                region: name.to_owned(),
            });
        }
        self.map_slot(index)
    }
}

#[cfg(test)]
mod tests;
