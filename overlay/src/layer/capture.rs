//! Incremental capture of an upper layer into a [`LayerManifest`] plus blobs.
//!
//! [`capture_layer`] runs inside the frozen window and does only what must see the frozen
//! tree: one sorted no-follow walk with a `statx` per entry; entries whose [`StatKey`]
//! equals the base manifest's are taken over from it without opening them; changed files
//! are read (small ones into memory and hashed; large ones copied by the kernel into a
//! staging file, extents only). [`PendingLayer::seal`] runs after the thaw: it hashes the
//! staged files, moves new blobs into the store (fsync'd) and lists what was removed.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Statx, StatxFlags};

use super::blobs::BlobStore;
use super::extents::{data_extents, MAX_HOLE_AMPLIFICATION};
use super::manifest::{BlobId, EntryKind, Extent, LayerEntry, LayerManifest, StatKey};
use crate::capture::{check_path_len, rel_path, CaptureError};
use crate::install::InstallLimits;
use crate::sys::{self, Call};
use crate::walk::{file_type, walk, WalkEntry};

/// Files up to this many data bytes are read into memory and hashed in the frozen window;
/// larger ones are copied into a staging file and hashed after the thaw.
pub const INLINE_MAX_BYTES: u64 = 256 << 10;
/// Most bytes of small-file data held in memory by one capture; beyond it small files are
/// staged like large ones.
const INLINE_BUDGET_BYTES: u64 = 64 << 20;

/// Options of [`capture_layer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCaptureOptions {
    /// Bounds on entries and data; the capture fails with a typed error rather than produce
    /// a manifest that [`materialize_layer`](super::materialize_layer) with the same limits
    /// would refuse.
    pub limits: InstallLimits,
    /// Entries whose ctime falls within this window before the base manifest's capture time
    /// are read again even when their key is equal (a change in the same clock tick as the
    /// capture could leave the ctime unchanged; the idea of git's "racy clean" entries).
    pub racy_window: Duration,
}

impl Default for LayerCaptureOptions {
    /// Default limits; racy window of two ticks of the coarse clock the kernel stamps file
    /// times with (`clock_getres(CLOCK_REALTIME_COARSE)`: 8 ms at 250 Hz), at least 2 ms.
    /// A change after the capture gets a ctime at most one tick behind the real time, so
    /// an entry whose ctime is more than a tick older than the capture cannot be changed
    /// without its ctime moving.
    fn default() -> Self {
        let res = rustix::time::clock_getres(rustix::time::ClockId::RealtimeCoarse);
        let tick = Duration::new(
            res.tv_sec.max(0) as u64,
            res.tv_nsec.clamp(0, 999_999_999) as u32,
        );
        LayerCaptureOptions {
            limits: InstallLimits::default(),
            racy_window: (tick * 2).max(Duration::from_millis(2)),
        }
    }
}

/// What a capture did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries in the manifest.
    pub entries: u64,
    /// Entries taken over from the base manifest without being opened.
    pub reused: u64,
    /// Regular files whose data was read.
    pub files_read: u64,
    /// Data bytes read (or copied to staging) by this capture: the delta.
    pub bytes_read: u64,
    /// Data bytes of the whole layer (holes excluded).
    pub data_bytes: u64,
    /// Blobs added to the store.
    pub new_blobs: u64,
    /// Bytes the store grew by.
    pub new_blob_bytes: u64,
    /// Paths of the base manifest that are gone.
    pub removed: u64,
    /// Unix-domain socket files skipped (a process that binds again after restore
    /// recreates its socket file).
    pub skipped_sockets: u64,
    /// Time of the walk and reads ([`capture_layer`]), microseconds.
    pub capture_us: u64,
    /// Time of [`PendingLayer::seal`], microseconds.
    pub seal_us: u64,
}

/// A capture whose walk is done (the frozen part) but whose new blobs are not yet in the
/// store. Dropping it removes its staging files.
#[derive(Debug)]
pub struct PendingLayer<'s> {
    store: &'s BlobStore,
    manifest: LayerManifest,
    base_paths: Vec<Vec<u8>>,
    inline: Vec<(usize, Vec<u8>)>,
    staged: Vec<(usize, PathBuf)>,
    reused_blobs: HashSet<BlobId>,
    stats: LayerStats,
}

/// Where file data goes during the walk.
enum Sink<'s> {
    Store(&'s BlobStore),
    HashOnly,
}

struct Walker<'a, 's> {
    sink: Sink<'s>,
    opts: &'a LayerCaptureOptions,
    base: HashMap<u64, &'a LayerEntry>,
    reread: &'a HashSet<u64>,
    racy_cutoff: (i64, u32),
    links: HashMap<(u32, u32, u64), Vec<u8>>,
    entries: Vec<LayerEntry>,
    inline: Vec<(usize, Vec<u8>)>,
    inline_bytes: u64,
    staged: Vec<(usize, PathBuf)>,
    reused_blobs: HashSet<BlobId>,
    stats: LayerStats,
}

impl Drop for Walker<'_, '_> {
    fn drop(&mut self) {
        remove_staged(&mut self.staged);
    }
}

impl Drop for PendingLayer<'_> {
    fn drop(&mut self) {
        remove_staged(&mut self.staged);
    }
}

fn remove_staged(staged: &mut Vec<(usize, PathBuf)>) {
    for (_, path) in staged.drain(..) {
        let _ = fs::remove_file(&path);
    }
}

fn time_of(ts: rustix::fs::StatxTimestamp) -> (i64, u32) {
    (ts.tv_sec, ts.tv_nsec)
}

pub(crate) fn key_of(stat: &Statx) -> StatKey {
    StatKey {
        ino: stat.stx_ino,
        size: stat.stx_size,
        mtime: time_of(stat.stx_mtime),
        ctime: time_of(stat.stx_ctime),
    }
}

fn now() -> (i64, u32) {
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos())
}

fn minus((sec, nsec): (i64, u32), d: Duration) -> (i64, u32) {
    let total = i128::from(sec) * 1_000_000_000 + i128::from(nsec) - d.as_nanos() as i128;
    (
        total.div_euclid(1_000_000_000) as i64,
        total.rem_euclid(1_000_000_000) as u32,
    )
}

/// Captures the upper directory `upper` against `base` (the manifest of the previous ready
/// checkpoint of this same directory, or `None` for a full capture). Call it with the
/// sandbox frozen, then [`PendingLayer::seal`] after the thaw.
///
/// Never follows a symlink (the walk opens every directory with `O_NOFOLLOW` relative to
/// its parent and examines entries with `statx(AT_SYMLINK_NOFOLLOW)`). Sparse files are
/// captured as their data extents. Sockets are skipped and counted. Device nodes other
/// than 0:0 character devices (overlay whiteouts) are refused: they could never be
/// restored.
///
/// Errors: [`CaptureError`] (unreadable entries, limits, forbidden devices, staging I/O);
/// staging files of a failed capture are removed.
pub fn capture_layer<'s>(
    upper: &Path,
    base: Option<&LayerManifest>,
    store: &'s BlobStore,
    opts: &LayerCaptureOptions,
) -> Result<PendingLayer<'s>, CaptureError> {
    capture_layer_rereading(upper, base, store, opts, &HashSet::new())
}

/// [`capture_layer`], reading the files whose inode numbers are in `reread` even when their
/// key is unchanged: files mapped shared and writable by a process of the sandbox, whose
/// writes through the mapping change neither mtime nor ctime while the page stays dirty.
///
/// Errors: as [`capture_layer`].
pub fn capture_layer_rereading<'s>(
    upper: &Path,
    base: Option<&LayerManifest>,
    store: &'s BlobStore,
    opts: &LayerCaptureOptions,
    reread: &HashSet<u64>,
) -> Result<PendingLayer<'s>, CaptureError> {
    let (manifest, base_paths, mut walker) = run(upper, base, Sink::Store(store), opts, reread)?;
    Ok(PendingLayer {
        store,
        manifest,
        base_paths,
        inline: std::mem::take(&mut walker.inline),
        staged: std::mem::take(&mut walker.staged),
        reused_blobs: std::mem::take(&mut walker.reused_blobs),
        stats: walker.stats,
    })
}

/// The [`LayerManifest::content_digest`] of the tree at `upper`, computed by reading every
/// file (nothing is stored). Used to check that a restored upper layer equals its
/// checkpoint.
///
/// Errors: [`CaptureError`].
pub fn layer_digest(upper: &Path, limits: &InstallLimits) -> Result<BlobId, CaptureError> {
    let opts = LayerCaptureOptions {
        limits: *limits,
        ..LayerCaptureOptions::default()
    };
    let (manifest, _, _) = run(upper, None, Sink::HashOnly, &opts, &HashSet::new())?;
    Ok(manifest.content_digest())
}

fn run<'a, 's>(
    upper: &Path,
    base: Option<&'a LayerManifest>,
    sink: Sink<'s>,
    opts: &'a LayerCaptureOptions,
    reread: &'a HashSet<u64>,
) -> Result<(LayerManifest, Vec<Vec<u8>>, Walker<'a, 's>), CaptureError> {
    let started = Instant::now();
    let captured_at = now();
    let mut walker = Walker {
        sink,
        opts,
        base: HashMap::new(),
        reread,
        racy_cutoff: (i64::MIN, 0),
        links: HashMap::new(),
        entries: Vec::new(),
        inline: Vec::new(),
        inline_bytes: 0,
        staged: Vec::new(),
        reused_blobs: HashSet::new(),
        stats: LayerStats::default(),
    };
    let mut base_paths = Vec::new();
    if let Some(base) = base {
        walker.racy_cutoff = minus(base.captured_at, opts.racy_window);
        for e in &base.entries {
            base_paths.push(e.path.clone());
            if !matches!(e.kind, EntryKind::Hardlink { .. }) {
                walker.base.insert(e.key.ino, e);
            }
        }
    }
    walk(upper, &[], opts.limits.max_entries, |entry| {
        walker.add(entry)
    })?;
    walker.stats.entries = walker.entries.len() as u64;
    walker.stats.capture_us = started.elapsed().as_micros() as u64;
    let manifest = LayerManifest {
        captured_at,
        entries: std::mem::take(&mut walker.entries),
        removed: Vec::new(),
        base: base.map(LayerManifest::content_digest),
    };
    tracing::debug!(
        upper = %upper.display(),
        entries = walker.stats.entries,
        reused = walker.stats.reused,
        bytes_read = walker.stats.bytes_read,
        elapsed_us = walker.stats.capture_us,
        "captured upper layer (frozen part)"
    );
    Ok((manifest, base_paths, walker))
}

impl Walker<'_, '_> {
    fn add(&mut self, entry: &WalkEntry<'_>) -> Result<(), CaptureError> {
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

fn hash_file(path: &Path) -> std::io::Result<BlobId> {
    let mut file = fs::File::open(path)?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(BlobId(*hasher.finalize().as_bytes()))
}

impl PendingLayer<'_> {
    /// What the frozen part did (new-blob counts are filled in by [`seal`](Self::seal)).
    pub fn stats(&self) -> &LayerStats {
        &self.stats
    }

    /// Completes the capture after the thaw: hashes staged files, moves new blobs into the
    /// store (each fsync'd before its rename, and its directory after), checks that every
    /// blob taken over from the base manifest is still in the store, and lists the base's
    /// paths that are gone. Hold the store's [`lease`](BlobStore::lease) from before
    /// [`capture_layer`] until the manifest is published.
    ///
    /// Errors: [`CaptureError::Blob`] (store I/O, a base blob collected meanwhile: capture
    /// again without a base).
    pub fn seal(mut self) -> Result<(LayerManifest, LayerStats), CaptureError> {
        let started = Instant::now();
        let mut batch = super::blobs::BlobBatch::default();
        for (index, data) in std::mem::take(&mut self.inline) {
            let EntryKind::Regular { blob: Some(id), .. } = &self.manifest.entries[index].kind
            else {
                unreachable!("inline data belongs to a regular file with a blob id");
            };
            let grew = self
                .store
                .insert_bytes(id, &data, &mut batch)
                .map_err(CaptureError::Blob)?;
            self.count_new(grew);
        }
        for (index, path) in std::mem::take(&mut self.staged) {
            let id = match hash_file(&path) {
                Ok(id) => id,
                Err(source) => {
                    let _ = fs::remove_file(&path);
                    return Err(CaptureError::Blob(super::BlobError::Io {
                        op: "hash",
                        path,
                        source,
                    }));
                }
            };
            let grew = self
                .store
                .insert_staged(&path, &id, &mut batch)
                .map_err(CaptureError::Blob)?;
            self.count_new(grew);
            if let EntryKind::Regular { blob, .. } = &mut self.manifest.entries[index].kind {
                *blob = Some(id);
            }
        }
        self.store.commit(batch).map_err(CaptureError::Blob)?;
        for id in &self.reused_blobs {
            if !self.store.contains(id) {
                return Err(CaptureError::Blob(super::BlobError::Missing { blob: *id }));
            }
        }
        let now: HashSet<&[u8]> = self
            .manifest
            .entries
            .iter()
            .map(|e| e.path.as_slice())
            .collect();
        let removed: Vec<Vec<u8>> = self
            .base_paths
            .iter()
            .filter(|p| !now.contains(p.as_slice()))
            .cloned()
            .collect();
        self.stats.removed = removed.len() as u64;
        self.manifest.removed = removed;
        self.stats.seal_us = started.elapsed().as_micros() as u64;
        Ok((std::mem::take(&mut self.manifest), self.stats))
    }

    fn count_new(&mut self, grew: u64) {
        if grew > 0 {
            self.stats.new_blobs += 1;
            self.stats.new_blob_bytes += grew;
        }
    }
}
