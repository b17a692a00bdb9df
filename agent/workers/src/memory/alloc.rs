//! The allocations a memory server owns: one per region of its layout, alive for the server's
//! whole life (paper: "State isolation").
//!
//! - Host: one sealed memfd per region ([`HostRegion`]), plus a read-only descriptor for
//!   readers. Untouched pages cost nothing, so a 64 GiB layout starts instantly.
//! - CUDA: one exportable `cuMemCreate` allocation per region, exported once as a POSIX file
//!   descriptor, and mapped into the server's own address range so that the server can zero it
//!   (at start and on flush). Read leases get the same descriptor as write leases: CUDA
//!   mappings are made read-write, so on this backend leases are advisory.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use belayer_ipc::memory::cuda::{CudaDevice, CudaError, PhysicalAlloc, VaRange};
use belayer_ipc::memory::host::{self, HostError, HostRegion};
use belayer_ipc::memory::{Backend, Layout, LayoutError, LeaseMode, Placement};

/// Why allocating or zeroing failed.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// The layout could not be placed.
    #[error("placing the layout failed")]
    Place {
        /// The layout error.
        #[source]
        source: LayoutError,
    },
    /// Opening the CUDA device (or reading its granularity) failed; without a driver this is
    /// [`CudaError::NoDriver`].
    #[error("opening CUDA device {device} failed")]
    OpenDevice {
        /// Ordinal.
        device: i32,
        /// The driver error.
        #[source]
        source: CudaError,
    },
    /// Creating a host region failed.
    #[error("creating host region {region:?} of {size} bytes failed")]
    CreateHost {
        /// Region name.
        region: String,
        /// Bytes.
        size: u64,
        /// The system call error.
        #[source]
        source: HostError,
    },
    /// Allocating, exporting or mapping a CUDA region failed.
    #[error("allocating CUDA region {region:?} of {size} bytes failed")]
    CreateCuda {
        /// Region name (or `"<layout>"` for the server's address range).
        region: String,
        /// Bytes.
        size: u64,
        /// The driver error.
        #[source]
        source: CudaError,
    },
    /// Zeroing a region failed.
    #[error("zeroing region {region:?} failed")]
    Zero {
        /// Region name.
        region: String,
        /// What failed underneath.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

#[derive(Debug)]
enum Regions {
    Host {
        regions: Vec<HostRegion>,
        read_only: Vec<OwnedFd>,
    },
    Cuda {
        /// Server-side mapping of every region, for zeroing. Dropped before `allocs`.
        range: VaRange,
        /// Exported descriptors, one per region.
        fds: Vec<OwnedFd>,
        /// The allocation handles, kept for the server's lifetime.
        _allocs: Vec<PhysicalAlloc>,
    },
}

/// Every region of a layout, allocated on one backend.
#[derive(Debug)]
pub struct Allocation {
    backend: Backend,
    placement: Placement,
    regions: Regions,
}

impl Allocation {
    /// Allocates every region of `layout` on `backend`, zero-filled, at the backend's
    /// granularity (host: the page size; CUDA: `cuMemGetAllocationGranularity`).
    ///
    /// Errors: [`AllocError::OpenDevice`] (no driver, no such device),
    /// [`AllocError::Place`], [`AllocError::CreateHost`], [`AllocError::CreateCuda`].
    pub fn new(backend: Backend, layout: &Layout) -> Result<Allocation, AllocError> {
        match backend {
            Backend::Host => {
                let placement = layout
                    .place(host::page_size())
                    .map_err(|source| AllocError::Place { source })?;
                let mut regions = Vec::with_capacity(placement.regions.len());
                let mut read_only = Vec::with_capacity(placement.regions.len());
                for region in &placement.regions {
                    let create_err = |source| AllocError::CreateHost {
                        region: region.name.clone(),
                        size: region.mapped_size,
                        source,
                    };
                    let memfd =
                        HostRegion::create(&region.name, region.mapped_size).map_err(create_err)?;
                    read_only.push(memfd.read_only_fd().map_err(create_err)?);
                    regions.push(memfd);
                }
                Ok(Allocation {
                    backend,
                    placement,
                    regions: Regions::Host { regions, read_only },
                })
            }
            Backend::Cuda { device } => {
                let open_err = |source| AllocError::OpenDevice { device, source };
                let dev = CudaDevice::open(device).map_err(open_err)?;
                let granularity = dev.granularity().map_err(open_err)?;
                let placement = layout
                    .place(granularity)
                    .map_err(|source| AllocError::Place { source })?;
                let mut range = dev
                    .reserve(placement.total, granularity)
                    .map_err(|source| AllocError::CreateCuda {
                        region: "<layout>".to_owned(),
                        size: placement.total,
                        source,
                    })?;
                let mut fds = Vec::with_capacity(placement.regions.len());
                let mut allocs = Vec::with_capacity(placement.regions.len());
                for region in &placement.regions {
                    let (offset, size) = (region.offset, region.mapped_size);
                    let made = dev.allocate(size, true).and_then(|alloc| {
                        let fd = alloc.export_fd()?;
                        range.map(offset, size, &alloc)?;
                        range.zero(offset, size)?;
                        Ok((alloc, fd))
                    });
                    let (alloc, fd) = made.map_err(|source| AllocError::CreateCuda {
                        region: region.name.clone(),
                        size,
                        source,
                    })?;
                    allocs.push(alloc);
                    fds.push(fd);
                }
                Ok(Allocation {
                    backend,
                    placement,
                    regions: Regions::Cuda {
                        range,
                        fds,
                        _allocs: allocs,
                    },
                })
            }
        }
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Where every region lies in the layout range.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Bytes allocated (sum of the mapped sizes).
    pub fn bytes(&self) -> u64 {
        self.placement.regions.iter().map(|r| r.mapped_size).sum()
    }

    /// The descriptor a holder of a `mode` lease receives for region `index` (host: read-only
    /// for [`LeaseMode::Read`]). `None` for an index outside the layout.
    pub fn fd(&self, index: usize, mode: LeaseMode) -> Option<BorrowedFd<'_>> {
        match &self.regions {
            Regions::Host { regions, read_only } => match mode {
                LeaseMode::Read => read_only.get(index).map(|fd| fd.as_fd()),
                LeaseMode::Write | LeaseMode::Exclusive => regions.get(index).map(|r| r.fd()),
            },
            Regions::Cuda { fds, .. } => fds.get(index).map(|fd| fd.as_fd()),
        }
    }

    /// Zeroes region `index` (host: punches out its pages; CUDA: `cuMemsetD8` and
    /// synchronize). Returns the bytes zeroed; 0 for an index outside the layout.
    ///
    /// Errors: [`AllocError::Zero`].
    pub fn zero(&self, index: usize) -> Result<u64, AllocError> {
        let Some(region) = self.placement.regions.get(index) else {
            return Ok(0);
        };
        let zero_err = |source: Box<dyn std::error::Error + Send + Sync>| AllocError::Zero {
            region: region.name.clone(),
            source,
        };
        match &self.regions {
            Regions::Host { regions, .. } => {
                regions[index].zero().map_err(|e| zero_err(e.into()))?
            }
            Regions::Cuda { range, .. } => range
                .zero(region.offset, region.mapped_size)
                .map_err(|e| zero_err(e.into()))?,
        }
        Ok(region.mapped_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_allocations_are_sealed_memfds_with_read_only_twins() {
        let layout = Layout::from_toml(
            "[[region]]\nname = \"a\"\nsize = 10\n[[region]]\nname = \"b\"\nsize = 70000\n",
        )
        .unwrap();
        let alloc = Allocation::new(Backend::Host, &layout).unwrap();
        let page = host::page_size();
        assert_eq!(alloc.bytes(), page + 70000u64.next_multiple_of(page));
        assert_eq!(alloc.backend(), Backend::Host);
        let rw = alloc.fd(1, LeaseMode::Write).unwrap();
        let ro = alloc.fd(1, LeaseMode::Read).unwrap();
        assert_eq!(
            host::fd_size(rw).unwrap(),
            alloc.placement().regions[1].mapped_size
        );
        let mode =
            |fd| nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFL).unwrap() & libc::O_ACCMODE;
        assert_eq!(mode(rw), libc::O_RDWR);
        assert_eq!(mode(ro), libc::O_RDONLY);
        assert!(alloc.fd(2, LeaseMode::Read).is_none());
        assert_eq!(
            alloc.zero(1).unwrap(),
            alloc.placement().regions[1].mapped_size
        );
        assert_eq!(alloc.zero(9).unwrap(), 0);
    }

    #[test]
    fn cuda_without_a_driver_is_a_typed_error() {
        if belayer_ipc::memory::cuda::driver_present() {
            eprintln!("skipping: a CUDA driver is present; scripts/gpu-check.sh covers it");
            return;
        }
        let layout = Layout::from_toml("[[region]]\nname = \"w\"\nsize = 1\n").unwrap();
        match Allocation::new(Backend::Cuda { device: 0 }, &layout) {
            Err(AllocError::OpenDevice {
                device: 0,
                source: CudaError::NoDriver,
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
