//! The blob store: content-addressed, immutable files named by the blake3 of their bytes,
//! shared by every checkpoint of every sandbox on the node (paper: "Environment-state
//! recovery", F_k). Layout under the store directory (mode 0700):
//!
//! - `ab/<64 hex>`: a blob (`ab` = its first two hex digits), or `ab/<64 hex>.zst` when it
//!   was stored zstd-compressed; mode 0400, never modified after its rename into place;
//! - `.staging/`: files being copied or written before they are hashed and renamed;
//! - `.lock`: `flock`ed shared by every capture until its manifest is published
//!   ([`BlobStore::lease`]) and exclusively by [`BlobStore::gc`], so a collection never
//!   removes a blob that an unpublished capture refers to.
//!
//! Blobs are written to a staging file, fsync'd, then renamed into place, so a crash leaves
//! either no blob or a whole one. Restores copy out of blobs (`copy_file_range`, or a
//! verifying read + hash + write) and never hardlink them: an upper-layer file is writable by
//! the sandbox, a hardlink would let it rewrite the blob.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use super::manifest::{BlobId, EntryKind, Extent, LayerManifest};
use crate::sys::{self, SyscallError};

/// Why a blob-store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// A file-system operation on the store failed.
    #[error("blob store: {op} {path} failed")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A syscall on a blob or on the file being filled failed.
    #[error("blob store: copying blob {blob} failed")]
    Copy {
        /// The blob.
        blob: BlobId,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// A referenced blob is not in the store.
    #[error("blob {blob} is missing from the store")]
    Missing {
        /// The blob.
        blob: BlobId,
    },
    /// A blob's bytes do not hash to its name, or it is shorter than its extents.
    #[error("blob {blob} is corrupt: {reason}")]
    Corrupt {
        /// The blob.
        blob: BlobId,
        /// What differs.
        reason: String,
    },
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(io::Error) -> BlobError {
    let path = path.to_path_buf();
    move |source| BlobError::Io { op, path, source }
}

/// What [`BlobStore::gc`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcStats {
    /// Blobs referenced by at least one live manifest (kept).
    pub live_blobs: u64,
    /// References from live manifests, all blobs together (their reference counts summed).
    pub references: u64,
    /// Blobs with no reference left, removed.
    pub removed_blobs: u64,
    /// Bytes freed (on-disk sizes of the removed blobs and staging leftovers).
    pub removed_bytes: u64,
}

/// New blobs of one capture, prepared in staging and made visible together by
/// [`BlobStore::commit`]. Dropping an uncommitted batch removes its files.
#[derive(Debug, Default)]
pub struct BlobBatch {
    ids: std::collections::HashSet<BlobId>,
    files: Vec<(PathBuf, PathBuf)>,
}

impl Drop for BlobBatch {
    fn drop(&mut self) {
        for (src, _) in self.files.drain(..) {
            let _ = fs::remove_file(src);
        }
    }
}

/// A shared lock on the store held from the start of a capture until its manifest is
/// published; [`BlobStore::gc`] waits for every lease to end. Released on drop.
#[derive(Debug)]
pub struct StoreLease {
    _lock: File,
}

/// A per-node, content-addressed store of blobs (see the module docs for its layout).
#[derive(Debug)]
pub struct BlobStore {
    dir: PathBuf,
    compression: Option<i32>,
}

/// Read and copy buffer size, bytes.
const BUF_BYTES: usize = 1 << 20;

/// Smallest uncompressed blob [`BlobStore::verify`] hashes on every core, and the chunk it
/// reads at a time, bytes.
pub const PARALLEL_HASH_MIN: u64 = 4 << 20;

/// Permission bits of a stored blob: root's, read-only (the store's dir, mode 0700, keeps
/// everyone else out anyway).
pub(crate) const BLOB_MODE: u32 = 0o400;

impl BlobStore {
    /// Opens the store at `dir`, creating it (mode 0700) and its staging directory. Blobs are
    /// stored uncompressed unless [`with_compression`](Self::with_compression) says otherwise.
    ///
    /// Errors: [`BlobError::Io`].
    pub fn open(dir: &Path) -> Result<BlobStore, BlobError> {
        let staging = dir.join(".staging");
        fs::create_dir_all(&staging).map_err(io_err("mkdir", &staging))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .map_err(io_err("chmod", dir))?;
        Ok(BlobStore {
            dir: dir.to_path_buf(),
            compression: None,
        })
    }

    /// Stores new blobs zstd-compressed at `level` (1–19; `None`: uncompressed). Compression
    /// runs after the sandbox is thawed ([`PendingLayer::seal`](super::PendingLayer::seal));
    /// restoring a compressed blob decompresses it instead of letting the kernel copy it.
    pub fn with_compression(mut self, level: Option<i32>) -> BlobStore {
        self.compression = level;
        self
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn fanout(&self, id: &BlobId) -> PathBuf {
        self.dir.join(&id.to_hex()[..2])
    }

    /// Path of an uncompressed blob (whether or not it exists).
    pub fn blob_path(&self, id: &BlobId) -> PathBuf {
        self.fanout(id).join(id.to_hex())
    }

    fn zst_path(&self, id: &BlobId) -> PathBuf {
        self.fanout(id).join(format!("{}.zst", id.to_hex()))
    }

    /// Whether blob `id` is in the store (plain or compressed).
    pub fn contains(&self, id: &BlobId) -> bool {
        self.blob_path(id).is_file() || self.zst_path(id).is_file()
    }

    /// Whether blob `id` is in the store and hashes to its name. A blob that does not (damaged
    /// at rest) is removed, so the capture that has its bytes in hand stores them again
    /// instead of referring to the damaged copy. Runs after the thaw, only when a capture's
    /// content is already in the store.
    fn holds_intact(&self, id: &BlobId) -> bool {
        if !self.contains(id) {
            return false;
        }
        match self.verify(id) {
            Ok(_) => true,
            Err(e) => {
                tracing::warn!(blob = %id, error = %e, "replacing a damaged blob");
                let _ = fs::remove_file(self.blob_path(id));
                let _ = fs::remove_file(self.zst_path(id));
                false
            }
        }
    }

    /// Takes a [`StoreLease`] (blocks while a collection runs).
    ///
    /// Errors: [`BlobError::Io`].
    pub fn lease(&self) -> Result<StoreLease, BlobError> {
        Ok(StoreLease {
            _lock: self.lock(FlockOperation::LockShared)?,
        })
    }

    fn lock(&self, op: FlockOperation) -> Result<File, BlobError> {
        let path = self.dir.join(".lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err("open", &path))?;
        rustix::fs::flock(&file, op).map_err(|e| io_err("flock", &path)(e.into()))?;
        Ok(file)
    }

    /// A new, empty staging file (mode 0600) and its path.
    pub(crate) fn staging_file(&self) -> Result<(File, PathBuf), BlobError> {
        let path = self.dir.join(".staging").join(format!(
            "s-{}-{:016x}",
            std::process::id(),
            random_u64()
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io_err("create", &path))?;
        Ok((file, path))
    }

    /// Prepares a complete staging file holding exactly the bytes of `id` for the store
    /// (compressing it if configured) and adds it to `batch`; drops it if the blob is already
    /// there or in the batch. Nothing is visible in the store before [`commit`](Self::commit).
    /// Returns the bytes the store will grow by.
    pub(crate) fn insert_staged(
        &self,
        staged: &Path,
        id: &BlobId,
        batch: &mut BlobBatch,
    ) -> Result<u64, BlobError> {
        self.insert_staged_as(staged, id, batch, self.compression, BLOB_MODE)
    }

    /// [`insert_staged`](Self::insert_staged) compressed at `compression` whatever the
    /// store's setting; with `None` the blob is stored uncompressed even when a compressed
    /// copy is there already (a page pack must be, [`super::packs`]); the new file gets
    /// permission bits `mode` (an existing blob keeps its own).
    pub(crate) fn insert_staged_as(
        &self,
        staged: &Path,
        id: &BlobId,
        batch: &mut BlobBatch,
        compression: Option<i32>,
        mode: u32,
    ) -> Result<u64, BlobError> {
        let there = match compression {
            None => self.blob_path(id).is_file() && self.holds_intact(id),
            Some(_) => self.holds_intact(id),
        };
        if batch.ids.contains(id) || there {
            fs::remove_file(staged).map_err(io_err("unlink", staged))?;
            return Ok(0);
        }
        let (src, dest) = match compression {
            None => (staged.to_path_buf(), self.blob_path(id)),
            Some(level) => {
                let (out, zst) = self.staging_file()?;
                let input = File::open(staged).map_err(io_err("open", staged))?;
                let result = zstd::stream::copy_encode(input, &out, level)
                    .map_err(io_err("compress", staged));
                fs::remove_file(staged).map_err(io_err("unlink", staged))?;
                if let Err(e) = result {
                    let _ = fs::remove_file(&zst);
                    return Err(e);
                }
                (zst, self.zst_path(id))
            }
        };
        fs::set_permissions(&src, fs::Permissions::from_mode(mode))
            .map_err(io_err("chmod", &src))?;
        let bytes = fs::metadata(&src).map_err(io_err("stat", &src))?.len();
        batch.ids.insert(*id);
        batch.files.push((src, dest));
        Ok(bytes)
    }

    /// Stores `data` as blob `id` (= [`BlobId::of`]`(data)`) in `batch`; returns the bytes the
    /// store will grow by.
    pub(crate) fn insert_bytes(
        &self,
        id: &BlobId,
        data: &[u8],
        batch: &mut BlobBatch,
    ) -> Result<u64, BlobError> {
        if batch.ids.contains(id) || self.holds_intact(id) {
            return Ok(0);
        }
        let (mut file, path) = self.staging_file()?;
        if let Err(e) = file.write_all(data) {
            let _ = fs::remove_file(&path);
            return Err(io_err("write", &path)(e));
        }
        drop(file);
        self.insert_staged(&path, id, batch)
    }

    /// Makes the blobs of `batch` durable and visible: their data is synced (one `fsync` per
    /// file for a few, one `syncfs` of the store's filesystem for many), then each is renamed
    /// into place, then each fan-out directory touched is synced once.
    ///
    /// Errors: [`BlobError::Io`]; blobs not yet renamed stay in staging (collected later).
    pub fn commit(&self, mut batch: BlobBatch) -> Result<(), BlobError> {
        const FSYNC_EACH_UP_TO: usize = 16;
        let files = std::mem::take(&mut batch.files);
        if files.is_empty() {
            return Ok(());
        }
        if files.len() <= FSYNC_EACH_UP_TO {
            for (src, _) in &files {
                File::open(src)
                    .and_then(|f| f.sync_all())
                    .map_err(io_err("fsync", src))?;
            }
        } else {
            let dir = File::open(&self.dir).map_err(io_err("open", &self.dir))?;
            rustix::fs::syncfs(&dir).map_err(|e| io_err("syncfs", &self.dir)(e.into()))?;
        }
        let mut fanouts = std::collections::BTreeSet::new();
        for (src, dest) in files {
            let fanout = dest.parent().unwrap_or(&self.dir).to_path_buf();
            fs::create_dir_all(&fanout).map_err(io_err("mkdir", &fanout))?;
            fs::rename(&src, &dest).map_err(io_err("rename", &dest))?;
            fanouts.insert(fanout);
        }
        for fanout in fanouts {
            sys::fsync_dir(&fanout).map_err(|e| io_err("fsync", &fanout)(e.source))?;
        }
        Ok(())
    }

    pub(crate) fn open_blob(&self, id: &BlobId) -> Result<(File, bool), BlobError> {
        for (path, compressed) in [(self.blob_path(id), false), (self.zst_path(id), true)] {
            match File::open(&path) {
                Ok(f) => return Ok((f, compressed)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("open", &path)(e)),
            }
        }
        Err(BlobError::Missing { blob: *id })
    }

    /// Writes the bytes of blob `id` into `dst` at `extents` (the blob holds the extents'
    /// bytes back to back). With `verify` the blob is read, hashed and written in one pass
    /// and a blob that does not hash to `id` is an error ([`BlobError::Corrupt`]);
    /// otherwise an uncompressed blob is copied by the kernel (`copy_file_range`, which
    /// shares the blob's extents on btrfs). Returns the bytes written and, of those, the
    /// bytes placed by `copy_file_range` (possibly shared, so not charged to `dst`'s volume
    /// by a quota that charges whoever allocated an extent).
    pub(crate) fn write_extents(
        &self,
        id: &BlobId,
        extents: &[Extent],
        dst: BorrowedFd<'_>,
        verify: bool,
    ) -> Result<(u64, u64), BlobError> {
        let (file, compressed) = self.open_blob(id)?;
        let want: u64 = extents.iter().map(|e| e.len).sum();
        let short = |got: u64| BlobError::Corrupt {
            blob: *id,
            reason: format!("{got} bytes, extents need {want}"),
        };
        if !verify && !compressed {
            let mut src_off = 0u64;
            for e in extents {
                let n = sys::copy_range(file.as_fd(), src_off, dst, e.offset, e.len)
                    .map_err(|source| BlobError::Copy { blob: *id, source })?;
                if n < e.len {
                    return Err(short(src_off + n));
                }
                src_off += n;
            }
            return Ok((want, want));
        }
        let mut reader = self.reader(id, file, compressed)?;
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; BUF_BYTES];
        let mut total = 0u64;
        for e in extents {
            let mut done = 0u64;
            while done < e.len {
                let take = (e.len - done).min(BUF_BYTES as u64) as usize;
                let n = read_full(&mut reader, &mut buf[..take]).map_err(|source| {
                    BlobError::Corrupt {
                        blob: *id,
                        reason: format!("unreadable: {source}"),
                    }
                })?;
                if n == 0 {
                    return Err(short(total));
                }
                hasher.update(&buf[..n]);
                sys::write_all_at(dst, &buf[..n], e.offset + done)
                    .map_err(|source| BlobError::Copy { blob: *id, source })?;
                done += n as u64;
                total += n as u64;
            }
        }
        if verify {
            // Reading on to the end also makes a compressed blob's frame end (and garbage
            // after it) be checked, as `verify` does.
            let mut extra = [0u8; 1];
            match read_full(&mut reader, &mut extra) {
                Ok(0) => {}
                Ok(_) => {
                    return Err(BlobError::Corrupt {
                        blob: *id,
                        reason: format!("longer than the {want} bytes of its extents"),
                    })
                }
                Err(e) => {
                    return Err(BlobError::Corrupt {
                        blob: *id,
                        reason: format!("unreadable: {e}"),
                    })
                }
            }
            if BlobId(*hasher.finalize().as_bytes()) != *id {
                return Err(BlobError::Corrupt {
                    blob: *id,
                    reason: "content does not hash to its name".into(),
                });
            }
        }
        Ok((total, 0))
    }

    /// The bytes of blob `id` open as `file`, decompressed when stored compressed.
    fn reader(
        &self,
        id: &BlobId,
        file: File,
        compressed: bool,
    ) -> Result<Box<dyn Read>, BlobError> {
        if !compressed {
            return Ok(Box::new(file));
        }
        let decoder = zstd::stream::read::Decoder::new(file)
            .map_err(io_err("decompress", &self.zst_path(id)))?;
        Ok(Box::new(decoder))
    }

    /// Re-hashes blob `id`; [`BlobError::Corrupt`] when it does not hash to its name (or
    /// cannot be read). An uncompressed blob of [`PARALLEL_HASH_MIN`] bytes or more (a page
    /// pack, a large file) is hashed on every core (blake3's tree hashing over rayon's pool),
    /// [`PARALLEL_HASH_MIN`] bytes at a time.
    pub fn verify(&self, id: &BlobId) -> Result<u64, BlobError> {
        let (file, compressed) = self.open_blob(id)?;
        let unreadable = |e: io::Error| BlobError::Corrupt {
            blob: *id,
            reason: format!("unreadable: {e}"),
        };
        let mut hasher = blake3::Hasher::new();
        let len = file.metadata().map_or(0, |m| m.len());
        let n = if !compressed && len >= PARALLEL_HASH_MIN {
            // Read (not mapped: a bad sector or a btrfs checksum failure must come back as
            // an error, where a mapping would raise SIGBUS) in large chunks, each hashed on
            // every core.
            let mut file = file;
            let mut buf = vec![0u8; PARALLEL_HASH_MIN as usize];
            loop {
                let got = read_full(&mut file, &mut buf).map_err(unreadable)?;
                if got == 0 {
                    break;
                }
                hasher.update_rayon(&buf[..got]);
            }
            hasher.count()
        } else {
            let mut reader = self.reader(id, file, compressed)?;
            io::copy(&mut reader, &mut hasher).map_err(unreadable)?
        };
        if BlobId(*hasher.finalize().as_bytes()) != *id {
            return Err(BlobError::Corrupt {
                blob: *id,
                reason: "content does not hash to its name".into(),
            });
        }
        Ok(n)
    }

    /// Number of blobs and their bytes on disk.
    ///
    /// Errors: [`BlobError::Io`].
    pub fn usage(&self) -> Result<(u64, u64), BlobError> {
        let mut count = 0;
        let mut bytes = 0;
        self.for_each_blob(|_, _, len| {
            count += 1;
            bytes += len;
        })?;
        Ok((count, bytes))
    }

    fn for_each_blob(&self, mut f: impl FnMut(&Path, BlobId, u64)) -> Result<(), BlobError> {
        for fan in fs::read_dir(&self.dir).map_err(io_err("readdir", &self.dir))? {
            let fan = fan.map_err(io_err("readdir", &self.dir))?;
            let name = fan.file_name();
            let name = name.to_string_lossy();
            if name.len() != 2 || !fan.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let fan_path = fan.path();
            for blob in fs::read_dir(&fan_path).map_err(io_err("readdir", &fan_path))? {
                let blob = blob.map_err(io_err("readdir", &fan_path))?;
                let file_name = blob.file_name();
                let file_name = file_name.to_string_lossy();
                let hex = file_name.strip_suffix(".zst").unwrap_or(&file_name);
                if let Some(id) = BlobId::from_hex(hex) {
                    let len = blob.metadata().map(|m| m.len()).unwrap_or(0);
                    f(&blob.path(), id, len);
                }
            }
        }
        Ok(())
    }

    /// Reference-counted collection over the `live` manifests: see
    /// [`gc_with`](Self::gc_with). The manifests must be read while the collection holds the
    /// lock to be safe against captures publishing meanwhile; this form is for callers that
    /// know no capture runs.
    ///
    /// Errors: [`BlobError::Io`].
    pub fn gc<'a>(
        &self,
        live: impl IntoIterator<Item = &'a LayerManifest>,
    ) -> Result<GcStats, BlobError> {
        self.gc_with(|roots: &mut GcRoots| {
            for manifest in live {
                roots.add(manifest);
            }
            Ok::<(), BlobError>(())
        })
    }

    /// Reference-counted collection: takes the store's lock exclusively (waiting for
    /// captures in flight, their [`StoreLease`]s, and keeping new ones from starting), lets
    /// `roots` add every live manifest, counts for every blob the entries that refer to it,
    /// and removes every blob whose count is zero and every staging leftover. If `roots`
    /// fails nothing is removed.
    ///
    /// Errors: `roots`' error, or [`BlobError::Io`] converted into it.
    pub fn gc_with<E: From<BlobError>>(
        &self,
        roots: impl FnOnce(&mut GcRoots) -> Result<(), E>,
    ) -> Result<GcStats, E> {
        let _lock = self.lock(FlockOperation::LockExclusive)?;
        let mut live = GcRoots::default();
        roots(&mut live)?;
        let refs = live.refs;
        let mut stats = GcStats {
            references: refs.values().sum(),
            ..GcStats::default()
        };
        let mut dead = Vec::new();
        self.for_each_blob(|path, id, len| {
            if refs.contains_key(&id) {
                stats.live_blobs += 1;
            } else {
                dead.push((path.to_path_buf(), len));
            }
        })?;
        let staging = self.dir.join(".staging");
        for leftover in fs::read_dir(&staging).map_err(io_err("readdir", &staging))? {
            let leftover = leftover.map_err(io_err("readdir", &staging))?;
            let len = leftover.metadata().map(|m| m.len()).unwrap_or(0);
            dead.push((leftover.path(), len));
        }
        for (path, len) in dead {
            match fs::remove_file(&path) {
                Ok(()) => {
                    stats.removed_bytes += len;
                    if path.parent() != Some(staging.as_path()) {
                        stats.removed_blobs += 1;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err("unlink", &path)(e).into()),
            }
        }
        tracing::debug!(
            store = %self.dir.display(),
            live = stats.live_blobs,
            removed = stats.removed_blobs,
            removed_bytes = stats.removed_bytes,
            "blob store collected"
        );
        Ok(stats)
    }
}

/// The reference counts a collection keeps: one per file entry of every live manifest.
#[derive(Debug, Default)]
pub struct GcRoots {
    refs: HashMap<BlobId, u64>,
}

impl GcRoots {
    /// Counts one reference to blob `id` held by something else than a layer manifest (a
    /// page pack of a checkpoint's memory images, see [`BlobStore::insert_pack`]).
    pub fn add_blob(&mut self, id: BlobId) {
        *self.refs.entry(id).or_default() += 1;
    }

    /// Counts the references of a live manifest.
    pub fn add(&mut self, manifest: &LayerManifest) {
        for entry in &manifest.entries {
            if let EntryKind::Regular {
                blob: Some(blob), ..
            } = &entry.kind
            {
                *self.refs.entry(*blob).or_default() += 1;
            }
        }
    }
}

fn read_full(reader: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match reader.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // getrandom never fails for 8 bytes once the pool is initialised; fall back to time.
    if rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty()).is_err() {
        return std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    }
    u64::from_le_bytes(bytes)
}
