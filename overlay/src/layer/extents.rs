//! Data extents of a regular file, found with `lseek(SEEK_DATA / SEEK_HOLE)`, so sparse files
//! are captured as sparse: a 10 GiB file with 4 KiB of data costs 4 KiB.

use std::os::fd::BorrowedFd;

use rustix::fs::SeekFrom;
use rustix::io::Errno;

use super::manifest::Extent;
use crate::sys::{Call, SyscallError};

/// Most extents recorded per file (16 bytes each in the manifest, at most 1 MiB per file). A
/// file with more data runs than this (a hostile pattern: one byte every other block) gets
/// its extents merged over ever larger aligned windows, holes in between captured as data,
/// so the manifest stays bounded; the capture refuses a file whose merge would store more
/// than [`MAX_HOLE_AMPLIFICATION`] times its data.
pub const MAX_EXTENTS_PER_FILE: usize = 1 << 16;

/// Largest factor by which merging extents may grow the bytes captured for one file (beyond
/// a 64 MiB allowance).
pub const MAX_HOLE_AMPLIFICATION: u64 = 8;

/// The data extents of the open file `fd` of apparent size `size` and `blocks` 512-byte
/// blocks allocated, and the bytes of data the kernel reported before any merge. A file
/// with at least as many allocated bytes as its size is taken as dense (one extent) without
/// asking the kernel. The extents are sorted, disjoint, within `size`, at most
/// [`MAX_EXTENTS_PER_FILE`].
pub(crate) fn data_extents(
    fd: BorrowedFd<'_>,
    size: u64,
    blocks: u64,
) -> Result<(Vec<Extent>, u64), SyscallError> {
    let dense = || {
        (
            vec![Extent {
                offset: 0,
                len: size,
            }],
            size,
        )
    };
    if size == 0 {
        return Ok((Vec::new(), 0));
    }
    if blocks.saturating_mul(512) >= size {
        return Ok(dense());
    }
    let mut real = 0u64;
    let mut extents = Vec::new();
    let mut offset = 0u64;
    while offset < size {
        let data = match rustix::fs::seek(fd, SeekFrom::Data(offset)) {
            Ok(d) => d,
            Err(Errno::NXIO) => break,
            // A filesystem without SEEK_DATA support: all data.
            Err(Errno::INVAL) if extents.is_empty() => return Ok(dense()),
            Err(e) => return Err(SyscallError::new("lseek(SEEK_DATA)", e)),
        };
        if data >= size {
            break;
        }
        let hole = rustix::fs::seek(fd, SeekFrom::Hole(data))
            .call("lseek(SEEK_HOLE)")?
            .min(size);
        if hole > data {
            real += hole - data;
            extents.push(Extent {
                offset: data,
                len: hole - data,
            });
        }
        offset = hole.max(data + 1);
        if extents.len() > 4 * MAX_EXTENTS_PER_FILE {
            extents = coalesce(&extents, size, MAX_EXTENTS_PER_FILE);
        }
    }
    if extents.len() > MAX_EXTENTS_PER_FILE {
        extents = coalesce(&extents, size, MAX_EXTENTS_PER_FILE);
    }
    Ok((extents, real))
}

/// Merges `extents` over aligned windows of growing size (starting at 64 KiB) until at most
/// `max` remain; the result covers every byte the input covered.
pub(crate) fn coalesce(extents: &[Extent], size: u64, max: usize) -> Vec<Extent> {
    let mut window = 64u64 << 10;
    loop {
        let mut out: Vec<Extent> = Vec::new();
        for e in extents {
            let start = e.offset / window * window;
            let end = (e.offset + e.len)
                .div_ceil(window)
                .saturating_mul(window)
                .min(size);
            match out.last_mut() {
                Some(last) if last.offset + last.len >= start => {
                    last.len = end.max(last.offset + last.len) - last.offset;
                }
                _ => out.push(Extent {
                    offset: start,
                    len: end - start,
                }),
            }
        }
        if out.len() <= max {
            return out;
        }
        window = window.saturating_mul(2);
    }
}

/// Checks that `extents` are sorted, disjoint, non-empty and within `size`.
pub(crate) fn extents_valid(extents: &[Extent], size: u64) -> Result<(), &'static str> {
    if extents.len() > MAX_EXTENTS_PER_FILE {
        return Err("too many extents");
    }
    let mut end = 0u64;
    for (i, e) in extents.iter().enumerate() {
        if e.len == 0 {
            return Err("empty extent");
        }
        if i > 0 && e.offset < end {
            return Err("extents overlap or are not sorted");
        }
        end = e.offset.checked_add(e.len).ok_or("extent end overflows")?;
        if end > size {
            return Err("extent beyond the file size");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::{Seek, SeekFrom as StdSeek, Write};
    use std::os::fd::AsFd;

    use super::*;

    #[test]
    fn finds_holes_and_bounds_the_extent_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse");
        let mut f = File::create(&path).unwrap();
        f.set_len(10 << 30).unwrap();
        f.seek(StdSeek::Start(1 << 30)).unwrap();
        f.write_all(&[7u8; 4096]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        let meta = rustix::fs::fstat(&f).unwrap();
        let (extents, real) = data_extents(f.as_fd(), 10 << 30, meta.st_blocks as u64).unwrap();
        assert_eq!(real, 4096);
        assert_eq!(
            extents,
            [Extent {
                offset: 1 << 30,
                len: 4096
            }]
        );
        let empty = File::create(dir.path().join("empty")).unwrap();
        assert!(data_extents(empty.as_fd(), 0, 0).unwrap().0.is_empty());
    }

    #[test]
    fn coalescing_covers_everything() {
        let extents: Vec<Extent> = (0..10_000u64)
            .map(|i| Extent {
                offset: i * 8192,
                len: 1,
            })
            .collect();
        let size = 10_000 * 8192;
        let merged = coalesce(&extents, size, 100);
        assert!(merged.len() <= 100);
        extents_valid(&merged, size).unwrap();
        for e in &extents {
            assert!(merged
                .iter()
                .any(|m| m.offset <= e.offset && e.offset + e.len <= m.offset + m.len));
        }
        assert_eq!(
            extents_valid(&[Extent { offset: 5, len: 0 }], 10),
            Err("empty extent")
        );
        assert!(extents_valid(&[Extent { offset: 5, len: 6 }], 10).is_err());
        assert!(extents_valid(
            &[Extent { offset: 4, len: 2 }, Extent { offset: 5, len: 1 }],
            10
        )
        .is_err());
    }
}
