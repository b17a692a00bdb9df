//! Unit tests of `cuda`.

use super::*;

#[cfg(not(feature = "cuda"))]
#[test]
fn without_the_cuda_feature_every_entry_point_answers_not_built() {
    assert!(!driver_present());
    assert!(matches!(CudaDevice::open(0), Err(CudaError::NotBuilt)));
    assert!(matches!(health_check(0), Err(CudaError::NotBuilt)));
    let message = CudaError::NotBuilt.to_string();
    assert!(message.contains("feature `cuda`") && message.contains("--device host"));
}

#[cfg(feature = "cuda")]
#[test]
fn without_a_driver_every_entry_point_answers_no_driver() {
    if driver_present() {
        eprintln!("skipping: a CUDA driver is present here; the GPU tests cover it");
        return;
    }
    assert!(matches!(CudaDevice::open(0), Err(CudaError::NoDriver)));
    assert!(matches!(health_check(0), Err(CudaError::NoDriver)));
    let message = CudaError::NoDriver.to_string();
    assert!(message.contains("libcuda") && message.contains("--device host"));
}

#[cfg(feature = "cuda")]
#[test]
fn export_import_map_and_unmap_on_a_real_device() {
    if !driver_present() {
        eprintln!("skipping: no CUDA driver library on this machine");
        return;
    }
    let device = match CudaDevice::open(0) {
        Ok(device) => device,
        Err(err) => {
            eprintln!("skipping: CUDA device 0 unavailable: {err}");
            return;
        }
    };
    health_check(0).unwrap();
    let granularity = device.granularity().unwrap();
    let alloc = device.allocate(granularity, true).unwrap();
    let fd = alloc.export_fd().unwrap();
    let imported = device
        .import(std::os::fd::AsFd::as_fd(&fd), granularity)
        .unwrap();
    let mut range = device.reserve(2 * granularity, granularity).unwrap();
    let a = range.map(0, granularity, &alloc).unwrap();
    let b = range.map(granularity, granularity, &imported).unwrap();
    drop(imported);
    range.write(0, b"shared bytes").unwrap();
    let mut buf = [0u8; 12];
    range.read(granularity, &mut buf).unwrap();
    assert_eq!(&buf, b"shared bytes");
    assert_eq!(range.unmap(granularity, granularity).unwrap(), b);
    assert_eq!(range.map(granularity, granularity, &alloc).unwrap(), b);
    range.zero(granularity, granularity).unwrap();
    range.read(0, &mut buf).unwrap();
    assert_eq!(buf, [0; 12]);
    assert_eq!(a, range.base());
}
