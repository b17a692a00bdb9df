//! The frozen part of a layer capture: the [`Walker`] that turns each entry of the sorted,
//! no-follow walk into a [`LayerEntry`], takes unchanged entries over from the base manifest
//! by their [`StatKey`], and reads changed files' data extents (small ones into memory,
//! large ones copied by the kernel into a staging file of the store).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Statx, StatxFlags};

use super::options::{LayerCaptureOptions, LayerStats, INLINE_MAX_BYTES};
use crate::capture::{check_path_len, rel_path, CaptureError};
use crate::layer::blobs::BlobStore;
use crate::layer::extents::{data_extents, MAX_HOLE_AMPLIFICATION};
use crate::layer::manifest::{BlobId, EntryKind, Extent, LayerEntry, StatKey};
use crate::sys::{self, Call};
use crate::walk::{file_type, WalkEntry};

/// Most bytes of small-file data held in memory by one capture; beyond it small files are
/// staged like large ones.
const INLINE_BUDGET_BYTES: u64 = 64 << 20;

/// Where file data goes during the walk.
pub(super) enum Sink<'s> {
    Store(&'s BlobStore),
    HashOnly,
}

/// The frozen part of a capture: one sorted no-follow walk building the manifest entries,
/// reusing unchanged entries of the base, reading or staging changed files.
pub(super) struct Walker<'a, 's> {
    pub(super) sink: Sink<'s>,
    pub(super) opts: &'a LayerCaptureOptions,
    pub(super) base: HashMap<u64, &'a LayerEntry>,
    pub(super) reread: &'a HashSet<u64>,
    pub(super) racy_cutoff: (i64, u32),
    pub(super) links: HashMap<(u32, u32, u64), Vec<u8>>,
    pub(super) entries: Vec<LayerEntry>,
    pub(super) inline: Vec<(usize, Vec<u8>)>,
    pub(super) inline_bytes: u64,
    pub(super) staged: Vec<(usize, PathBuf)>,
    pub(super) reused_blobs: HashSet<BlobId>,
    pub(super) stats: LayerStats,
}

impl Drop for Walker<'_, '_> {
    fn drop(&mut self) {
        remove_staged(&mut self.staged);
    }
}

/// Removes the staging files of a capture that will not be sealed.
pub(super) fn remove_staged(staged: &mut Vec<(usize, PathBuf)>) {
    for (_, path) in staged.drain(..) {
        let _ = fs::remove_file(&path);
    }
}

fn time_of(ts: rustix::fs::StatxTimestamp) -> (i64, u32) {
    (ts.tv_sec, ts.tv_nsec)
}

/// The [`StatKey`] of an entry as `statx` describes it now.
pub(crate) fn key_of(stat: &Statx) -> StatKey {
    StatKey {
        ino: stat.stx_ino,
        size: stat.stx_size,
        mtime: time_of(stat.stx_mtime),
        ctime: time_of(stat.stx_ctime),
    }
}

impl Walker<'_, '_> {
    /// Adds one entry of the walk to the manifest (or skips a socket).
    pub(super) fn add(&mut self, entry: &WalkEntry<'_>) -> Result<(), CaptureError> {
        let rel = entry.rel;
        check_path_len(rel)?;
        let kind = file_type(entry.stat);
        if kind == FileType::Socket {
            tracing::warn!(path = %rel_path(rel).display(), "skipping unix socket in upper layer");
            self.stats.skipped_sockets += 1;
            return Ok(());
        }
        if self.entries.len() as u64 >= self.opts.limits.max_entries {
            return Err(CaptureError::TooManyEntries {
                path: rel_path(rel),
                max: self.opts.limits.max_entries,
            });
        }
        if kind != FileType::Directory && entry.stat.stx_nlink > 1 {
            let id = (
                entry.stat.stx_dev_major,
                entry.stat.stx_dev_minor,
                entry.stat.stx_ino,
            );
            if let Some(first) = self.links.get(&id) {
                let target = first.clone();
                self.push(entry.stat, rel, EntryKind::Hardlink { target }, Vec::new());
                return Ok(());
            }
            self.links.insert(id, rel.to_vec());
        }
        if self.try_reuse(entry.stat, rel, kind)? {
            return Ok(());
        }
        let read_err = |source| CaptureError::ReadUpper {
            path: rel_path(rel),
            source,
        };
        let proc_path = || sys::proc_fd_path(entry.parent, entry.name.to_bytes());
        match kind {
            FileType::Directory => {
                let dir = entry.dir.expect("the walk opens every directory");
                let mut xattrs = sys::xattrs_of_fd(dir).map_err(read_err)?;
                if rel.is_empty() {
                    // The uuid names the overlay instance, not content.
                    xattrs.retain(|(n, _)| n.as_slice() != b"trusted.overlay.uuid");
                }
                self.push(entry.stat, rel, EntryKind::Directory, xattrs);
            }
            FileType::RegularFile => self.add_file(entry)?,
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(entry.parent, entry.name, Vec::new())
                    .call("readlinkat")
                    .map_err(read_err)?;
                let xattrs = sys::xattrs_of_path(&proc_path()).map_err(read_err)?;
                let target = target.into_bytes();
                self.push(entry.stat, rel, EntryKind::Symlink { target }, xattrs);
            }
            FileType::CharacterDevice | FileType::BlockDevice => {
                let (major, minor) = (entry.stat.stx_rdev_major, entry.stat.stx_rdev_minor);
                if kind == FileType::BlockDevice || major != 0 || minor != 0 {
                    return Err(CaptureError::ForbiddenDevice {
                        path: rel_path(rel),
                        kind: if kind == FileType::BlockDevice {
                            "block"
                        } else {
                            "character"
                        },
                        major,
                        minor,
                    });
                }
                let xattrs = sys::xattrs_of_path(&proc_path()).map_err(read_err)?;
                self.push(
                    entry.stat,
                    rel,
                    EntryKind::Whiteout { major, minor },
                    xattrs,
                );
            }
            FileType::Fifo => {
                let xattrs = sys::xattrs_of_path(&proc_path()).map_err(read_err)?;
                self.push(entry.stat, rel, EntryKind::Fifo, xattrs);
            }
            _ => {
                return Err(CaptureError::UnsupportedFileType {
                    path: rel_path(rel),
                    mode: u32::from(entry.stat.stx_mode),
                })
            }
        }
        Ok(())
    }

    fn push(&mut self, stat: &Statx, rel: &[u8], kind: EntryKind, xattrs: Vec<(Vec<u8>, Vec<u8>)>) {
        self.entries.push(LayerEntry {
            path: rel.to_vec(),
            kind,
            mode: u32::from(stat.stx_mode) & 0o7777,
            uid: stat.stx_uid,
            gid: stat.stx_gid,
            mtime: time_of(stat.stx_mtime),
            xattrs,
            key: key_of(stat),
        });
    }

    /// Takes the entry over from the base manifest when its key is unchanged and outside
    /// the racy window.
    fn try_reuse(
        &mut self,
        stat: &Statx,
        rel: &[u8],
        kind: FileType,
    ) -> Result<bool, CaptureError> {
        let key = key_of(stat);
        if self.reread.contains(&key.ino) {
            return Ok(false);
        }
        let Some(old) = self.base.get(&key.ino) else {
            return Ok(false);
        };
        let same_type = matches!(
            (&old.kind, kind),
            (EntryKind::Directory, FileType::Directory)
                | (EntryKind::Regular { .. }, FileType::RegularFile)
                | (EntryKind::Symlink { .. }, FileType::Symlink)
                | (EntryKind::Whiteout { .. }, FileType::CharacterDevice)
                | (EntryKind::Fifo, FileType::Fifo)
        );
        if !same_type || old.key != key || old.key.ctime >= self.racy_cutoff {
            return Ok(false);
        }
        if rel.is_empty() != old.path.is_empty() {
            return Ok(false);
        }
        let mut entry = (*old).clone();
        entry.path = rel.to_vec();
        if let EntryKind::Regular { extents, blob, .. } = &entry.kind {
            self.account(rel, extents_len(extents))?;
            if let Some(blob) = blob {
                self.reused_blobs.insert(*blob);
            }
        }
        self.entries.push(entry);
        self.stats.reused += 1;
        Ok(true)
    }

    /// Counts `bytes` of file data against the limits.
    fn account(&mut self, rel: &[u8], bytes: u64) -> Result<(), CaptureError> {
        let limits = &self.opts.limits;
        if bytes > limits.max_file_bytes {
            return Err(CaptureError::FileTooLarge {
                path: rel_path(rel),
                size: bytes,
                max: limits.max_file_bytes,
            });
        }
        let total = self.stats.data_bytes.saturating_add(bytes);
        if total > limits.max_total_bytes {
            return Err(CaptureError::TotalBytesExceeded {
                path: rel_path(rel),
                total,
                max: limits.max_total_bytes,
            });
        }
        self.stats.data_bytes = total;
        Ok(())
    }

    fn add_file(&mut self, entry: &WalkEntry<'_>) -> Result<(), CaptureError> {
        let rel = entry.rel;
        let read_err = |source| CaptureError::ReadUpper {
            path: rel_path(rel),
            source,
        };
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = rustix::fs::openat(entry.parent, entry.name, flags, Mode::empty())
            .call("openat")
            .map_err(read_err)?;
        // Describe what was opened, not what was looked up.
        let stat = rustix::fs::statx(&fd, c"", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
            .call("statx")
            .map_err(read_err)?;
        let size = stat.stx_size;
        if size > self.opts.limits.max_apparent_bytes {
            return Err(CaptureError::ApparentSizeTooLarge {
                path: rel_path(rel),
                size,
                max: self.opts.limits.max_apparent_bytes,
            });
        }
        let xattrs = sys::xattrs_of_fd(fd.as_fd()).map_err(read_err)?;
        let (extents, real) = data_extents(fd.as_fd(), size, stat.stx_blocks).map_err(read_err)?;
        let bytes = extents_len(&extents);
        if bytes > real.saturating_mul(MAX_HOLE_AMPLIFICATION) + (64 << 20) {
            return Err(CaptureError::TooFragmented {
                path: rel_path(rel),
                data: real,
                captured: bytes,
            });
        }
        self.account(rel, bytes)?;
        let index = self.entries.len();
        let blob = if bytes == 0 {
            None
        } else {
            self.stats.files_read += 1;
            self.stats.bytes_read += bytes;
            match self.sink {
                Sink::HashOnly => Some(hash_extents(fd.as_fd(), &extents, rel)?),
                Sink::Store(store) => {
                    if bytes <= INLINE_MAX_BYTES && self.inline_bytes + bytes <= INLINE_BUDGET_BYTES
                    {
                        let data = read_extents(fd.as_fd(), &extents, rel)?;
                        let id = BlobId::of(&data);
                        self.inline_bytes += bytes;
                        self.inline.push((index, data));
                        Some(id)
                    } else {
                        self.stage(store, fd.as_fd(), &extents, rel, index)?;
                        None
                    }
                }
            }
        };
        let kind = EntryKind::Regular {
            size,
            extents,
            blob,
        };
        self.push(&stat, rel, kind, xattrs);
        Ok(())
    }

    /// Copies the extents of a large file back to back into a staging file.
    fn stage(
        &mut self,
        store: &BlobStore,
        src: BorrowedFd<'_>,
        extents: &[Extent],
        rel: &[u8],
        index: usize,
    ) -> Result<(), CaptureError> {
        let (file, path) = store.staging_file().map_err(CaptureError::Blob)?;
        self.staged.push((index, path));
        let mut out = 0u64;
        for e in extents {
            let n = sys::copy_range(src, e.offset, file.as_fd(), out, e.len).map_err(|source| {
                CaptureError::CopyContent {
                    path: rel_path(rel),
                    source,
                }
            })?;
            if n < e.len {
                return Err(CaptureError::FileShrank {
                    path: rel_path(rel),
                    expected: extents_len(extents),
                    copied: out + n,
                });
            }
            out += n;
        }
        Ok(())
    }
}

fn extents_len(extents: &[Extent]) -> u64 {
    extents.iter().map(|e| e.len).sum()
}

/// Reads the extents of `fd` in order, in chunks of at most 1 MiB, handing each to `chunk`.
fn read_extents_with(
    fd: BorrowedFd<'_>,
    extents: &[Extent],
    rel: &[u8],
    mut chunk: impl FnMut(&[u8]),
) -> Result<(), CaptureError> {
    let total = extents_len(extents);
    let mut buf = vec![0u8; total.min(1 << 20) as usize];
    let mut copied = 0u64;
    for e in extents {
        let mut done = 0u64;
        while done < e.len {
            let want = (e.len - done).min(buf.len() as u64) as usize;
            let n = sys::read_full_at(fd, &mut buf[..want], e.offset + done).map_err(|source| {
                CaptureError::CopyContent {
                    path: rel_path(rel),
                    source,
                }
            })?;
            if n < want {
                return Err(CaptureError::FileShrank {
                    path: rel_path(rel),
                    expected: total,
                    copied: copied + n as u64,
                });
            }
            chunk(&buf[..n]);
            done += n as u64;
            copied += n as u64;
        }
    }
    Ok(())
}

fn read_extents(
    fd: BorrowedFd<'_>,
    extents: &[Extent],
    rel: &[u8],
) -> Result<Vec<u8>, CaptureError> {
    let mut data = Vec::with_capacity(extents_len(extents) as usize);
    read_extents_with(fd, extents, rel, |c| data.extend_from_slice(c))?;
    Ok(data)
}

fn hash_extents(
    fd: BorrowedFd<'_>,
    extents: &[Extent],
    rel: &[u8],
) -> Result<BlobId, CaptureError> {
    let mut hasher = blake3::Hasher::new();
    read_extents_with(fd, extents, rel, |c| {
        hasher.update(c);
    })?;
    Ok(BlobId(*hasher.finalize().as_bytes()))
}
