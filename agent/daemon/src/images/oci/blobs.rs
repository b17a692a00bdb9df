//! Blobs a client opened and passed with its request ([`FdBlobs`]): the layers of an
//! `oci:DIR` layout (one file each) or of a `docker-archive:FILE` (byte ranges of one file).
//! They are read with `pread`, so the client's file offsets never move, and only as the
//! client could read them: the client opened them.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use belayer_ipc::BlobRange;
use rustix::fs::FileType;

use super::super::stream::RangeReader;
use super::super::ImageError;
use super::{BlobSource, LayerBlob};

/// The layer blobs of an `ImportOci` request.
#[derive(Debug)]
pub struct FdBlobs {
    fds: Vec<Arc<OwnedFd>>,
    ranges: Vec<BlobRange>,
}

impl FdBlobs {
    /// Checks that every range names one of `fds`, every fd is used and is a regular file
    /// outside procfs and sysfs (some of their files check the reader at read time).
    ///
    /// Errors: [`ImageError::BadBlobs`].
    pub fn new(
        image: &str,
        fds: Vec<OwnedFd>,
        ranges: Vec<BlobRange>,
    ) -> Result<FdBlobs, ImageError> {
        let bad = |reason: String| ImageError::BadBlobs {
            image: image.to_string(),
            reason,
        };
        if let Some(r) = ranges.iter().find(|r| r.fd as usize >= fds.len()) {
            return Err(bad(format!(
                "a layer names descriptor {} of {} passed",
                r.fd,
                fds.len()
            )));
        }
        if (0..fds.len()).any(|i| !ranges.iter().any(|r| r.fd as usize == i)) {
            return Err(bad("a descriptor passed is no layer's".into()));
        }
        for (i, fd) in fds.iter().enumerate() {
            let st =
                rustix::fs::fstat(fd).map_err(|e| bad(format!("descriptor {i}: fstat: {e}")))?;
            if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
                return Err(bad(format!("descriptor {i} is not a regular file")));
            }
            let fs_type = rustix::fs::fstatfs(fd)
                .map_err(|e| bad(format!("descriptor {i}: fstatfs: {e}")))?
                .f_type;
            // PROC_SUPER_MAGIC, SYSFS_MAGIC.
            if matches!(fs_type as u64, 0x9fa0 | 0x6265_6572) {
                return Err(bad(format!("descriptor {i} is a file of procfs or sysfs")));
            }
        }
        Ok(FdBlobs {
            fds: fds.into_iter().map(Arc::new).collect(),
            ranges,
        })
    }

    /// Number of layer blobs.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

impl BlobSource for FdBlobs {
    fn open_layer(
        &mut self,
        index: usize,
        _blob: Option<&LayerBlob>,
    ) -> std::io::Result<Box<dyn Read + Send + '_>> {
        let r = self.ranges.get(index).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("no blob was passed for layer {index}"),
            )
        })?;
        let fd = Arc::clone(&self.fds[r.fd as usize]);
        Ok(Box::new(RangeReader::range(fd, r.offset, r.len)))
    }
}
