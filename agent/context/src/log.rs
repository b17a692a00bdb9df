//! The context log file of one writer: open with recovery, append, lookups.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::path::Path;

use rustix::fs::FlockOperation;

use super::encode::EncodedRecord;
use super::index::LogIndex;
use super::record::{Record, RecordId};
use super::ContextLogError;

/// When appended records reach stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `fdatasync` after every record: an appended record survives a machine crash.
    #[default]
    EveryRecord,
    /// Each record is handed to the kernel by one `pwrite` (it survives a crash of this process)
    /// but reaches the disk only on [`ContextLog::sync`] or when the kernel writes it back.
    Buffered,
}

/// The damage that ended the scan of a reopened log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// The file ends inside a frame (or inside the file header), at byte `offset`.
    Short {
        /// Byte offset of the incomplete frame (0 for a torn header).
        offset: u64,
    },
    /// A frame announces a payload length of 0 or above
    /// [`MAX_RECORD_BYTES`](super::MAX_RECORD_BYTES).
    BadLength {
        /// Byte offset of the frame.
        offset: u64,
        /// Announced payload length, bytes.
        len: u32,
    },
    /// The payload's crc32 does not match the stored one.
    CrcMismatch {
        /// Byte offset of the frame.
        offset: u64,
        /// crc32 stored in the frame.
        stored: u32,
        /// crc32 of the payload as read.
        computed: u32,
    },
}

/// What [`ContextLog::open`] (or [`LogIndex::scan`]) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Complete records kept (all records of a clean file).
    pub records: u64,
    /// Bytes cut from the end of the file: the first damaged frame and everything after it.
    pub truncated_bytes: u64,
    /// The damage that ended the scan, `None` for a clean file.
    pub damage: Option<Damage>,
    /// Whether the file was created (or its torn header rewritten) by this open.
    pub created: bool,
}

/// An open context log: the file (exclusively `flock`ed while open) and its [`LogIndex`],
/// built on open and kept current by [`append`](Self::append).
///
/// Contexts stay on disk: a lookup reads its record back with one `pread` (and returns an
/// owned copy), so memory grows with the number of records (about 100 bytes each), not with
/// their size. The lock is released on drop.
pub struct ContextLog {
    file: File,
    durability: Durability,
    index: LogIndex,
}

impl fmt::Debug for ContextLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextLog")
            .field("path", &self.index.path())
            .field("durability", &self.durability)
            .field("size_bytes", &self.index.size_bytes())
            .field("records", &self.index.len())
            .finish_non_exhaustive()
    }
}

impl ContextLog {
    /// Opens the log at `path` with [`Durability::EveryRecord`], creating it if missing.
    ///
    /// See [`open_with`](Self::open_with).
    pub fn open(path: impl AsRef<Path>) -> Result<(ContextLog, Recovery), ContextLogError> {
        Self::open_with(path, Durability::default())
    }

    /// Opens or creates the log at `path`.
    ///
    /// A new (empty) file gets the header, then the file and its directory are fsynced. An
    /// existing file is scanned frame by frame ([`LogIndex::scan`]); the scan stops at the
    /// first torn, short, bad-length or CRC-bad frame, and the file is truncated there (and
    /// fsynced), keeping every complete record before it. [`Recovery`] says what was kept and
    /// cut.
    ///
    /// Errors: [`ContextLogError::Open`], [`Locked`](ContextLogError::Locked) when another open
    /// log holds the file, [`BadHeader`](ContextLogError::BadHeader),
    /// [`UnsupportedVersion`](ContextLogError::UnsupportedVersion),
    /// [`Decode`](ContextLogError::Decode) for a CRC-valid frame that is not a [`Record`] (the
    /// file is left untouched), and I/O errors of reading, truncating and syncing.
    pub fn open_with(
        path: impl AsRef<Path>,
        durability: Durability,
    ) -> Result<(ContextLog, Recovery), ContextLogError> {
        let path = path.as_ref().to_path_buf();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|source| ContextLogError::Open {
                path: path.clone(),
                source,
            })?;
        lock_exclusive(&file, &path)?;
        let (index, recovery) = LogIndex::scan(&file, &path)?;
        Ok((
            ContextLog {
                file,
                durability,
                index,
            },
            recovery,
        ))
    }

    /// Appends `record` and returns its id (the frame's byte offset).
    ///
    /// With [`Durability::EveryRecord`] the record is fdatasynced before this returns. On a write
    /// or sync error the file is cut back to its previous end and the record is not indexed.
    ///
    /// Errors: [`Encode`](ContextLogError::Encode),
    /// [`RecordTooLarge`](ContextLogError::RecordTooLarge) (payload above
    /// [`MAX_RECORD_BYTES`](super::MAX_RECORD_BYTES)), [`Append`](ContextLogError::Append),
    /// [`Sync`](ContextLogError::Sync).
    pub fn append(&mut self, record: &Record) -> Result<RecordId, ContextLogError> {
        let encoded = EncodedRecord::new(record)?;
        self.index.append(&self.file, encoded, self.durability)
    }

    /// fdatasyncs every record appended so far (a no-op in effect under
    /// [`Durability::EveryRecord`]).
    ///
    /// Errors: [`Sync`](ContextLogError::Sync).
    pub fn sync(&mut self) -> Result<(), ContextLogError> {
        self.file
            .sync_data()
            .map_err(|source| ContextLogError::Sync {
                path: self.index.path().to_path_buf(),
                source,
            })
    }

    /// The context of the latest boundary record of prefix `k` of `trajectory`, read from the
    /// file.
    ///
    /// Errors: [`ReadRecord`](ContextLogError::ReadRecord),
    /// [`RecordChanged`](ContextLogError::RecordChanged) (the file changed behind the log),
    /// [`Decode`](ContextLogError::Decode).
    pub fn boundary(&self, trajectory: &str, k: u64) -> Result<Option<Vec<u8>>, ContextLogError> {
        match self.index.boundary(trajectory, k) {
            Some(b) => self
                .index
                .read_context(&self.file, trajectory, k, &b)
                .map(Some),
            None => Ok(None),
        }
    }

    /// The id of the latest boundary record of prefix `k` of `trajectory` (for a checkpoint
    /// manifest, with [`boundary_digest`](Self::boundary_digest)); nothing is read.
    pub fn boundary_id(&self, trajectory: &str, k: u64) -> Option<RecordId> {
        self.index.boundary(trajectory, k).map(|b| b.id())
    }

    /// [`record_digest`](super::record_digest) of the context of the latest boundary record of
    /// prefix `k` of `trajectory`, from the index (nothing is read).
    pub fn boundary_digest(&self, trajectory: &str, k: u64) -> Option<String> {
        self.index.boundary(trajectory, k).map(|b| b.digest())
    }

    /// The most recently appended boundary record of `trajectory`: its prefix k and context.
    ///
    /// This is the trajectory's current position: after a rollback to k and regeneration, the
    /// new boundary records supersede the older ones of higher prefixes.
    ///
    /// Errors: as [`boundary`](Self::boundary).
    pub fn latest_boundary(
        &self,
        trajectory: &str,
    ) -> Result<Option<(u64, Vec<u8>)>, ContextLogError> {
        match self.index.latest_boundary(trajectory) {
            Some((k, b)) => Ok(Some((
                k,
                self.index.read_context(&self.file, trajectory, k, &b)?,
            ))),
            None => Ok(None),
        }
    }

    /// The longest token prefix recorded for response `request` of `trajectory` (the latest
    /// among records of equal length).
    ///
    /// Errors: as [`boundary`](Self::boundary).
    pub fn longest_token_prefix(
        &self,
        trajectory: &str,
        request: &str,
    ) -> Result<Option<Vec<u32>>, ContextLogError> {
        self.index
            .longest_token_prefix(&self.file, trajectory, request)
    }

    /// The record with id `id`, if it is one of this log's records, read from the file.
    ///
    /// Errors: as [`boundary`](Self::boundary).
    pub fn get(&self, id: RecordId) -> Result<Option<Record>, ContextLogError> {
        self.index.get(&self.file, id)
    }

    /// The ids of every record, in append order.
    pub fn ids(&self) -> impl Iterator<Item = RecordId> + '_ {
        self.index.ids()
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether the log holds no record.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Size of the valid file (header and complete frames), bytes.
    pub fn size_bytes(&self) -> u64 {
        self.index.size_bytes()
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        self.index.path()
    }

    /// The durability policy in effect.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Changes the durability policy for later appends (call [`sync`](Self::sync) to flush
    /// records appended under [`Durability::Buffered`]).
    pub fn set_durability(&mut self, durability: Durability) {
        self.durability = durability;
    }
}

/// How long [`flock_exclusive`] keeps trying a lock that is held.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(250);

/// `flock(LOCK_EX | LOCK_NB)`, tried again for up to 250 ms while it answers `EWOULDBLOCK`:
/// a lock this process released can stay held for a moment by a copy of its fd table (a child
/// forked to run CRIU or a helper, before its exec closes the copy; a thread that unshared its
/// fd table). Another writer keeps it longer and is still refused.
pub fn flock_exclusive(fd: impl rustix::fd::AsFd) -> rustix::io::Result<()> {
    let deadline = std::time::Instant::now() + LOCK_PATIENCE;
    loop {
        match rustix::fs::flock(&fd, FlockOperation::NonBlockingLockExclusive) {
            Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

fn lock_exclusive(file: &File, path: &Path) -> Result<(), ContextLogError> {
    match flock_exclusive(file) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(ContextLogError::Locked {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(ContextLogError::Lock {
            path: path.to_path_buf(),
            source: e.into(),
        }),
    }
}

#[cfg(test)]
mod tests;
