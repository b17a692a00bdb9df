//! Blobs written piece by piece and read back by range: the page packs that hold a
//! checkpoint's memory pages (R_k's `pages-*.img`, content-addressed per page by the
//! daemon's checkpoint store). A pack is an ordinary blob of the [`BlobStore`] (named by the
//! blake3 of its bytes, immutable, collected by reference count through
//! [`GcRoots::add_blob`](super::GcRoots::add_blob)) but is always stored uncompressed, so
//! that pages are copied out of it by range with `copy_file_range` (extents shared on btrfs)
//! and a pack that is one whole pages file can be hard-linked into a restore's images dir.

use std::fs::{self, File};
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;

use super::blobs::{BlobBatch, BlobError, BlobStore};
use super::manifest::BlobId;
use crate::sys;

/// Permission bits of a new pack: readable by all, so that a pack hard-linked into a
/// restore's images dir as a whole pages file can be read by CRIU's tasks as the restored
/// user namespace's root (host uid 100000 and up, not the file's owner). Nobody else reaches
/// it: the blob store's dir is root's, mode 0700, and the images dir lies under the state
/// dir (mode 0700), which CRIU's tasks never walk (they read through the images dir's fd).
pub const PACK_MODE: u32 = 0o444;

/// A pack being written into the store's staging dir; removed on drop unless
/// [`finish`](Self::finish)ed.
#[derive(Debug)]
pub struct PackWriter<'s> {
    store: &'s BlobStore,
    file: Option<(File, PathBuf)>,
    hasher: blake3::Hasher,
    len: u64,
}

impl Drop for PackWriter<'_> {
    fn drop(&mut self) {
        if let Some((_, path)) = self.file.take() {
            let _ = fs::remove_file(path);
        }
    }
}

impl PackWriter<'_> {
    /// Appends `data`; returns the byte offset it starts at in the pack.
    ///
    /// Errors: [`BlobError::Io`] (a full disk among them).
    pub fn append(&mut self, data: &[u8]) -> Result<u64, BlobError> {
        let at = self.len;
        if let Some((file, path)) = self.file.as_mut() {
            file.write_all(data).map_err(|source| BlobError::Io {
                op: "write",
                path: path.clone(),
                source,
            })?;
        }
        self.hasher.update(data);
        self.len += data.len() as u64;
        Ok(at)
    }

    /// Bytes appended so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was appended.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Ends the pack: adds it, uncompressed, to `batch` (nothing is visible before
    /// [`BlobStore::commit`]). Returns its id and the bytes the store grows by (0 when the
    /// store already holds an intact blob of these bytes).
    ///
    /// Errors: [`BlobError::Io`].
    pub fn finish(mut self, batch: &mut BlobBatch) -> Result<(BlobId, u64), BlobError> {
        let id = BlobId(*self.hasher.finalize().as_bytes());
        let Some((file, path)) = self.file.take() else {
            return Ok((id, 0));
        };
        drop(file);
        let grown = self
            .store
            .insert_staged_as(&path, &id, batch, None, PACK_MODE)?;
        Ok((id, grown))
    }
}

/// One run of bytes to copy out of a pack: `len` bytes at `src` in the pack to `dst` in the
/// destination file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackRange {
    /// Offset in the pack, bytes.
    pub src: u64,
    /// Offset in the destination, bytes.
    pub dst: u64,
    /// Length, bytes.
    pub len: u64,
}

impl BlobStore {
    /// A new, empty pack in the staging dir.
    ///
    /// Errors: [`BlobError::Io`].
    pub fn pack_writer(&self) -> Result<PackWriter<'_>, BlobError> {
        let file = self.staging_file()?;
        Ok(PackWriter {
            store: self,
            file: Some(file),
            hasher: blake3::Hasher::new(),
            len: 0,
        })
    }

    /// Path and length of the uncompressed blob `id` (a pack).
    ///
    /// Errors: [`BlobError::Missing`]; [`BlobError::Corrupt`] when it is stored compressed
    /// (packs never are); [`BlobError::Io`].
    pub fn pack_file(&self, id: &BlobId) -> Result<(PathBuf, u64), BlobError> {
        let (file, compressed) = self.open_blob(id)?;
        if compressed {
            return Err(BlobError::Corrupt {
                blob: *id,
                reason: "a page pack stored compressed".into(),
            });
        }
        let path = self.blob_path(id);
        let len = file.metadata().map_err(|source| BlobError::Io {
            op: "stat",
            path: path.clone(),
            source,
        })?;
        Ok((path, len.len()))
    }

    /// Copies `ranges` of pack `id` into `dst`: runs of 64 KiB or more with the kernel
    /// (`copy_file_range`: shared extents on btrfs, where the two files allow it), shorter
    /// ones read and written through one buffer. Returns the bytes copied. The bytes are not hashed: verify the pack
    /// ([`BlobStore::verify`]) before trusting them.
    ///
    /// Errors: [`BlobError::Corrupt`] when a range lies beyond the pack's end or the pack is
    /// compressed; [`BlobError::Missing`]; [`BlobError::Copy`].
    pub fn copy_out(
        &self,
        id: &BlobId,
        ranges: &[PackRange],
        dst: BorrowedFd<'_>,
    ) -> Result<u64, BlobError> {
        let (path, len) = self.pack_file(id)?;
        let file = File::open(&path).map_err(|source| BlobError::Io {
            op: "open",
            path: path.clone(),
            source,
        })?;
        // Runs shorter than this are read and written (sharing an extent of a page or two
        // costs more than copying it).
        const KERNEL_MIN: u64 = 64 << 10;
        let mut copier = sys::RangeCopier::new(KERNEL_MIN);
        let mut total = 0;
        for r in ranges {
            if r.src.checked_add(r.len).is_none_or(|end| end > len) {
                return Err(BlobError::Corrupt {
                    blob: *id,
                    reason: format!("{len} bytes, a page lies at {}+{}", r.src, r.len),
                });
            }
            let n = copier
                .copy(file.as_fd(), r.src, dst, r.dst, r.len)
                .map_err(|source| BlobError::Copy { blob: *id, source })?;
            if n < r.len {
                return Err(BlobError::Corrupt {
                    blob: *id,
                    reason: format!("short read at {}: {n} of {} bytes", r.src, r.len),
                });
            }
            total += n;
        }
        Ok(total)
    }
}
