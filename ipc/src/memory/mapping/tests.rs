//! Unit tests of `mapping`.

use super::*;
use crate::memory::host::HostRegion;
use crate::memory::layout::{Layout, Role};
use crate::memory::message::LeaseMode;
use crate::memory::placeholder::Placeholder;

fn attach_info(layout: &Layout, mode: LeaseMode) -> AttachInfo {
    let placement = layout.place(host::page_size()).unwrap();
    AttachInfo {
        attachment: 1,
        role: Role::Weights,
        backend: Backend::Host,
        layout_hash: layout.hash(),
        version: 0,
        granularity: placement.granularity,
        total: placement.total,
        mode,
        regions: placement.regions,
    }
}

fn layout() -> Layout {
    Layout::from_toml(
        "[[region]]\nname = \"a\"\nsize = 100\n[[region]]\nname = \"b\"\nsize = 10000\n",
    )
    .unwrap()
}

fn backing(info: &AttachInfo) -> Vec<HostRegion> {
    info.regions
        .iter()
        .map(|r| HostRegion::create(&r.name, r.mapped_size).unwrap())
        .collect()
}

fn dup(regions: &[HostRegion]) -> Vec<OwnedFd> {
    regions
        .iter()
        .map(|r| r.fd().try_clone_to_owned().unwrap())
        .collect()
}

#[test]
fn a_host_mapping_reads_writes_unmaps_and_remaps_in_place() {
    let info = attach_info(&layout(), LeaseMode::Write);
    let regions = backing(&info);
    let mut mapping = Mapping::map(info.clone(), dup(&regions)).unwrap();
    let b = mapping.region("b").unwrap();
    assert_eq!(b.addr, mapping.base() + info.regions[1].offset);
    mapping.write("b", 9990, b"0123456789").unwrap();
    assert!(matches!(
        mapping.write("b", 9991, b"0123456789"),
        Err(MapError::OutOfBounds { .. })
    ));
    assert!(matches!(
        mapping.read("c", 0, &mut [0; 1]),
        Err(MapError::UnknownRegion { .. })
    ));
    assert_eq!(mapping.unmap("b").unwrap(), b.addr);
    assert!(!mapping.region("b").unwrap().mapped);
    assert!(matches!(
        mapping.read("b", 0, &mut [0; 1]),
        Err(MapError::NotMapped { .. })
    ));
    assert!(matches!(
        mapping.unmap("b"),
        Err(MapError::NotMapped { .. })
    ));
    assert_eq!(mapping.remap("b").unwrap(), b.addr);
    assert!(matches!(
        mapping.remap("b"),
        Err(MapError::AlreadyMapped { .. })
    ));
    let mut buf = [0u8; 10];
    mapping.read("b", 9990, &mut buf).unwrap();
    assert_eq!(&buf, b"0123456789");
    mapping.zero("b").unwrap();
    mapping.read("b", 9990, &mut buf).unwrap();
    assert_eq!(buf, [0; 10]);
    assert_eq!(mapping.regions().len(), 2);
}

#[test]
fn a_read_lease_maps_read_only() {
    let info = attach_info(&layout(), LeaseMode::Read);
    let regions = backing(&info);
    let fds = regions.iter().map(|r| r.read_only_fd().unwrap()).collect();
    let mut mapping = Mapping::map(info, fds).unwrap();
    assert!(matches!(
        mapping.write("a", 0, b"x"),
        Err(MapError::ReadOnly { .. })
    ));
    assert!(matches!(mapping.zero("a"), Err(MapError::ReadOnly { .. })));
    let mut buf = [1u8; 4];
    mapping.read("a", 0, &mut buf).unwrap();
    assert_eq!(buf, [0; 4]);
}

#[test]
fn bad_answers_are_refused_before_mapping() {
    let info = attach_info(&layout(), LeaseMode::Write);
    let regions = backing(&info);
    let mut fds = dup(&regions);
    fds.pop();
    assert!(matches!(
        Mapping::map(info.clone(), fds),
        Err(MapError::FdCount {
            expected: 2,
            got: 1
        })
    ));
    let mut bad = info.clone();
    bad.regions[1].offset = bad.total;
    assert!(matches!(
        Mapping::map(bad, dup(&regions)),
        Err(MapError::BadRegion { .. })
    ));
    // A backing smaller than the region would SIGBUS on access: refused.
    let small: Vec<OwnedFd> = info
        .regions
        .iter()
        .map(|r| {
            HostRegion::create(&r.name, host::page_size())
                .unwrap()
                .fd()
                .try_clone_to_owned()
                .unwrap()
        })
        .collect();
    assert!(matches!(
        Mapping::map(info, small),
        Err(MapError::ShortBacking { .. })
    ));
}

#[test]
fn a_host_placeholder_gives_memory_back_and_keeps_its_address() {
    let mut placeholder = Placeholder::new(Backend::Host, 3 * host::page_size() + 1).unwrap();
    assert_eq!(placeholder.len(), 4 * host::page_size());
    assert!(placeholder.is_mapped() && !placeholder.is_empty());
    let addr = placeholder.addr();
    // SAFETY: the placeholder is mapped read-write over its whole length.
    unsafe { host::copy_in(addr, b"graph") };
    assert_eq!(placeholder.unmap().unwrap(), addr);
    assert!(matches!(
        placeholder.unmap(),
        Err(MapError::NotMapped { .. })
    ));
    assert_eq!(placeholder.remap().unwrap(), addr);
    let mut buf = [1u8; 5];
    // SAFETY: remapped read-write just above.
    unsafe { host::copy_out(addr, &mut buf) };
    assert_eq!(buf, [0; 5], "a remapped placeholder holds fresh memory");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_placeholders_need_the_cuda_feature() {
    assert!(matches!(
        Placeholder::new(Backend::Cuda { device: 0 }, 1 << 20),
        Err(MapError::OpenDevice {
            device: 0,
            source: CudaError::NotBuilt
        })
    ));
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_placeholders_need_a_driver() {
    if crate::memory::cuda::driver_present() {
        eprintln!("skipping: a CUDA driver is present; scripts/gpu-check.sh covers it");
        return;
    }
    assert!(matches!(
        Placeholder::new(Backend::Cuda { device: 0 }, 1 << 20),
        Err(MapError::OpenDevice {
            device: 0,
            source: CudaError::NoDriver
        })
    ));
}
