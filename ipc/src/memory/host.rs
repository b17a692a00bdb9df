//! Host backend: sealed memfd regions (server side) and mappings at fixed addresses inside an
//! address-space reservation (worker side).
//!
//! A region is a memfd of its mapped size, sealed with `F_SEAL_SHRINK | F_SEAL_GROW |
//! F_SEAL_SEAL` so that no holder of a descriptor can change its size under the others (a
//! shrink would turn other mappings' accesses into `SIGBUS`). Its inode mode is 0600, so a
//! reader of another uid cannot reopen its read-only descriptor for writing through
//! `/proc/<pid>/fd` (root, or a reader of the server's own uid, could).
//!
//! A worker reserves the whole layout range with a `PROT_NONE`, `MAP_NORESERVE` anonymous
//! mapping, then places each region with `MAP_SHARED | MAP_FIXED` at its offset. Unmapping a
//! region puts a fresh `PROT_NONE` mapping over it (`MAP_FIXED` again), which drops the pages
//! from this process but keeps the range reserved, so a later remap lands at the same address.

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use nix::errno::Errno;
use nix::fcntl::{fallocate, fcntl, FallocateFlags, FcntlArg, OFlag, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use nix::sys::mman::{mmap, mmap_anonymous, munmap, MapFlags, ProtFlags};
use nix::sys::stat::{fchmod, fstat, Mode};

/// A failed system call of the host backend.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed")]
pub struct HostError {
    /// The system call (e.g. `"memfd_create"`, `"mmap(MAP_FIXED)"`).
    pub call: &'static str,
    /// The errno.
    #[source]
    pub source: Errno,
}

fn host_err(call: &'static str) -> impl FnOnce(Errno) -> HostError {
    move |source| HostError { call, source }
}

/// The page size of this machine, bytes (the host backend's granularity).
pub fn page_size() -> u64 {
    // sysconf(_SC_PAGESIZE) cannot fail on Linux; 4 KiB is the fallback of every other case.
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .map_or(4096, |size| size as u64)
}

/// One host region: a sealed memfd of a fixed size. Dropping it closes the server's
/// descriptor; the memory lives on while any worker holds a descriptor or a mapping.
#[derive(Debug)]
pub struct HostRegion {
    fd: OwnedFd,
    size: u64,
}

impl HostRegion {
    /// Creates a zero-filled memfd named `belayer:<name>` of `size` bytes, sealed against
    /// resizing, inode mode 0600. No page is touched, so a large region costs nothing until it
    /// is written.
    ///
    /// Errors: [`HostError`] naming `memfd_create`, `ftruncate`, `fchmod` or
    /// `fcntl(F_ADD_SEALS)`.
    pub fn create(name: &str, size: u64) -> Result<HostRegion, HostError> {
        let fd = memfd_create(
            format!("belayer:{name}").as_str(),
            MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
        )
        .map_err(host_err("memfd_create"))?;
        let len = i64::try_from(size).map_err(|_| HostError {
            call: "ftruncate",
            source: Errno::EFBIG,
        })?;
        nix::unistd::ftruncate(&fd, len).map_err(host_err("ftruncate"))?;
        fchmod(&fd, Mode::S_IRUSR | Mode::S_IWUSR).map_err(host_err("fchmod"))?;
        fcntl(
            &fd,
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(host_err("fcntl(F_ADD_SEALS)"))?;
        Ok(HostRegion { fd, size })
    }

    /// The read-write descriptor (what writers receive).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Size, bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// A new read-only open file description of the same memory (reopened through
    /// `/proc/self/fd`, `O_RDONLY | O_CLOEXEC`): mapping it writable fails with `EACCES`.
    ///
    /// Errors: [`HostError`] naming `open(/proc/self/fd, O_RDONLY)`.
    pub fn read_only_fd(&self) -> Result<OwnedFd, HostError> {
        nix::fcntl::open(
            format!("/proc/self/fd/{}", self.fd.as_raw_fd()).as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(host_err("open(/proc/self/fd, O_RDONLY)"))
    }

    /// Zeroes the region by punching out its pages (they are freed; every mapping reads zeros
    /// afterwards).
    ///
    /// Errors: those of [`zero_fd`].
    pub fn zero(&self) -> Result<(), HostError> {
        zero_fd(self.fd.as_fd(), self.size)
    }
}

/// Zeroes the first `len` bytes of the shared-memory file `fd` by punching a hole
/// (`fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`): the pages are freed and read as
/// zeros in every mapping. `fd` must be open for writing.
///
/// Errors: [`HostError`] naming `fallocate(PUNCH_HOLE)` (`EBADF` for a read-only descriptor).
pub fn zero_fd(fd: BorrowedFd<'_>, len: u64) -> Result<(), HostError> {
    let len = i64::try_from(len).map_err(|_| HostError {
        call: "fallocate(PUNCH_HOLE)",
        source: Errno::EFBIG,
    })?;
    fallocate(
        fd,
        FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        len,
    )
    .map_err(host_err("fallocate(PUNCH_HOLE)"))
}

/// Size of the file behind `fd`, bytes (`fstat`).
///
/// Errors: [`HostError`] naming `fstat`.
pub fn fd_size(fd: BorrowedFd<'_>) -> Result<u64, HostError> {
    let stat = fstat(fd).map_err(host_err("fstat"))?;
    Ok(stat.st_size.max(0) as u64)
}

/// A reserved range of this process's address space (`PROT_NONE`, `MAP_NORESERVE`), into
/// which shared or anonymous memory is placed at fixed offsets. Dropping it unmaps the whole
/// range, whatever is placed in it.
///
/// The type hands out addresses, never references: reading or writing the memory is the
/// caller's business (see [`Mapping`](super::mapping::Mapping) for checked copies).
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
}

impl Reservation {
    /// Reserves `len` bytes (rounded up to the page size) anywhere in the address space.
    ///
    /// Errors: [`HostError`] naming `mmap(PROT_NONE)` (`EINVAL` for a zero length, `ENOMEM`
    /// when the address space is exhausted).
    pub fn new(len: u64) -> Result<Reservation, HostError> {
        let len = usize::try_from(len.next_multiple_of(page_size()))
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or(HostError {
                call: "mmap(PROT_NONE)",
                source: Errno::EINVAL,
            })?;
        // SAFETY: a new anonymous mapping at an address of the kernel's choice (no MAP_FIXED)
        // cannot replace any existing mapping; the range is owned by the Reservation from here
        // on and unmapped by its Drop.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                len,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }
        .map_err(host_err("mmap(PROT_NONE)"))?;
        Ok(Reservation {
            base: ptr.as_ptr() as usize,
            len: len.get(),
        })
    }

    /// Start address of the range.
    pub fn base(&self) -> u64 {
        self.base as u64
    }

    /// Length of the range, bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether the range is empty (never: a reservation holds at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address and non-zero length of `[offset, offset + len)`, checked to lie inside the
    /// range and to be page aligned.
    fn span(
        &self,
        offset: u64,
        len: u64,
        call: &'static str,
    ) -> Result<(usize, NonZeroUsize), HostError> {
        let page = page_size();
        let inside = offset
            .checked_add(len)
            .is_some_and(|end| end <= self.len as u64);
        let aligned = offset.is_multiple_of(page) && len.is_multiple_of(page);
        match (inside && aligned, NonZeroUsize::new(len as usize)) {
            (true, Some(len)) => Ok((self.base + offset as usize, len)),
            _ => Err(HostError {
                call,
                source: Errno::EINVAL,
            }),
        }
    }

    /// Maps the first `len` bytes of the shared-memory file `fd` at `base + offset`
    /// (`MAP_SHARED | MAP_FIXED`), readable, and writable when `writable`. Whatever was there
    /// (the reservation, or an earlier mapping) is replaced atomically.
    ///
    /// Errors: [`HostError`] naming `mmap(MAP_SHARED|MAP_FIXED)`: `EINVAL` for a span outside
    /// the range or not page aligned, `EACCES` for a writable mapping of a read-only
    /// descriptor.
    pub fn map_shared(
        &mut self,
        offset: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        writable: bool,
    ) -> Result<u64, HostError> {
        const CALL: &str = "mmap(MAP_SHARED|MAP_FIXED)";
        let (addr, len) = self.span(offset, len, CALL)?;
        let prot = if writable {
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE
        } else {
            ProtFlags::PROT_READ
        };
        // SAFETY: MAP_FIXED replaces only [addr, addr + len), which `span` checked lies inside
        // this reservation, a range this process reserved for exactly this purpose and that
        // holds no Rust object (the type hands out addresses, not references).
        let placed = unsafe {
            mmap(
                NonZeroUsize::new(addr),
                len,
                prot,
                MapFlags::MAP_SHARED | MapFlags::MAP_FIXED,
                fd,
                0,
            )
        }
        .map_err(host_err(CALL))?;
        debug_assert_eq!(placed.as_ptr() as usize, addr);
        Ok(addr as u64)
    }

    /// Places fresh private zero-filled memory at `base + offset` (`MAP_PRIVATE |
    /// MAP_ANONYMOUS | MAP_FIXED`, read-write), replacing what was there.
    ///
    /// Errors: [`HostError`] naming `mmap(MAP_ANONYMOUS|MAP_FIXED)`.
    pub fn map_anonymous(&mut self, offset: u64, len: u64) -> Result<u64, HostError> {
        const CALL: &str = "mmap(MAP_ANONYMOUS|MAP_FIXED)";
        let (addr, len) = self.span(offset, len, CALL)?;
        // SAFETY: as in `map_shared`: the replaced span lies inside this reservation and holds
        // no Rust object.
        unsafe {
            mmap_anonymous(
                NonZeroUsize::new(addr),
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
            )
        }
        .map_err(host_err(CALL))?;
        Ok(addr as u64)
    }

    /// Puts the span back to reserved-only (`PROT_NONE | MAP_NORESERVE`, `MAP_FIXED`): the
    /// pages mapped there are dropped from this process, the addresses stay reserved.
    ///
    /// Errors: [`HostError`] naming `mmap(PROT_NONE|MAP_FIXED)`.
    pub fn release(&mut self, offset: u64, len: u64) -> Result<u64, HostError> {
        const CALL: &str = "mmap(PROT_NONE|MAP_FIXED)";
        let (addr, len) = self.span(offset, len, CALL)?;
        // SAFETY: as in `map_shared`: the replaced span lies inside this reservation and holds
        // no Rust object.
        unsafe {
            mmap_anonymous(
                NonZeroUsize::new(addr),
                len,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE | MapFlags::MAP_FIXED,
            )
        }
        .map_err(host_err(CALL))?;
        Ok(addr as u64)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let Some(ptr) = NonNull::new(self.base as *mut c_void) else {
            return;
        };
        // SAFETY: [base, base + len) is the range this Reservation mapped in `new` and has
        // owned since; nothing else refers to it once the Reservation is dropped.
        if let Err(err) = unsafe { munmap(ptr, self.len) } {
            tracing::warn!(base = self.base, len = self.len, error = %err, "munmap of a reservation failed");
        }
    }
}

/// Copies `buf.len()` bytes from address `src` into `buf`.
///
/// # Safety
/// `[src, src + buf.len())` must be mapped readable for the whole call.
pub(crate) unsafe fn copy_out(src: u64, buf: &mut [u8]) {
    // SAFETY: the caller guarantees the source span is mapped readable; `buf` is a distinct
    // Rust buffer, so the spans cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, buf.as_mut_ptr(), buf.len()) }
}

/// Copies `data` to address `dst`.
///
/// # Safety
/// `[dst, dst + data.len())` must be mapped writable for the whole call.
pub(crate) unsafe fn copy_in(dst: u64, data: &[u8]) {
    // SAFETY: the caller guarantees the destination span is mapped writable; `data` is a
    // distinct Rust buffer, so the spans cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn maps_line(addr: u64) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .find(|line| {
                let range = line.split_whitespace().next().unwrap();
                let (start, end) = range.split_once('-').unwrap();
                let start = u64::from_str_radix(start, 16).unwrap();
                let end = u64::from_str_radix(end, 16).unwrap();
                (start..end).contains(&addr)
            })
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn a_sealed_memfd_maps_at_a_fixed_offset_and_unmaps_to_a_reservation() {
        let page = page_size();
        let region = HostRegion::create("test", 2 * page).unwrap();
        assert_eq!(fd_size(region.fd()).unwrap(), 2 * page);
        // Sealed: the size cannot change.
        assert_eq!(
            nix::unistd::ftruncate(region.fd(), 1).unwrap_err(),
            Errno::EPERM
        );
        let mut space = Reservation::new(4 * page).unwrap();
        let addr = space.map_shared(page, 2 * page, region.fd(), true).unwrap();
        assert_eq!(addr, space.base() + page);
        // SAFETY: [addr, addr + 2 pages) was just mapped read-write.
        unsafe { copy_in(addr + 10, b"hello") };
        let ro = region.read_only_fd().unwrap();
        let mut other = Reservation::new(2 * page).unwrap();
        let seen = other.map_shared(0, 2 * page, ro.as_fd(), false).unwrap();
        let mut buf = [0u8; 5];
        // SAFETY: mapped readable just above.
        unsafe { copy_out(seen + 10, &mut buf) };
        assert_eq!(&buf, b"hello");
        // A read-only descriptor cannot be mapped writable.
        assert_eq!(
            other
                .map_shared(0, 2 * page, ro.as_fd(), true)
                .unwrap_err()
                .source,
            Errno::EACCES
        );
        // Unmapping keeps the address reserved (PROT_NONE), remapping lands at the same place.
        assert_eq!(space.release(page, 2 * page).unwrap(), addr);
        assert!(maps_line(addr).contains("---p"), "{}", maps_line(addr));
        assert_eq!(
            space.map_shared(page, 2 * page, region.fd(), true).unwrap(),
            addr
        );
        // SAFETY: remapped readable just above.
        unsafe { copy_out(addr + 10, &mut buf) };
        assert_eq!(&buf, b"hello");
        // Punching the pages zeroes them everywhere.
        region.zero().unwrap();
        // SAFETY: still mapped.
        unsafe { copy_out(seen + 10, &mut buf) };
        assert_eq!(buf, [0; 5]);
        // A read-only descriptor cannot punch.
        assert_eq!(zero_fd(ro.as_fd(), page).unwrap_err().source, Errno::EBADF);
    }

    #[test]
    fn spans_outside_the_range_or_unaligned_are_refused() {
        let page = page_size();
        let mut space = Reservation::new(2 * page).unwrap();
        assert_eq!(space.len(), 2 * page);
        assert!(!space.is_empty());
        for (offset, len) in [(0, 3 * page), (page, 2 * page), (1, page), (0, 0), (0, 100)] {
            assert_eq!(
                space.map_anonymous(offset, len).unwrap_err().source,
                Errno::EINVAL,
                "{offset} {len}"
            );
        }
        let addr = space.map_anonymous(page, page).unwrap();
        // SAFETY: mapped read-write just above.
        unsafe { copy_in(addr, &[7; 16]) };
        assert!(Reservation::new(0).is_err());
    }
}
