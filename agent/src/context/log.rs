//! The context log file: open with recovery, append, lookups.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

use super::frame::{self, FrameRead, HeaderCheck};
use super::record::{Record, RecordId};
use super::{ContextLogError, FORMAT_VERSION, HEADER_BYTES, MAX_RECORD_BYTES};

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
    /// A frame announces a payload length of 0 or above [`MAX_RECORD_BYTES`].
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

/// What [`ContextLog::open`] found.
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

#[derive(Debug, Default)]
struct TrajectoryIndex {
    /// Prefix k → index (into `records`) of the latest boundary record of k.
    boundaries: BTreeMap<u64, usize>,
    /// The most recently appended boundary record.
    latest_boundary: Option<usize>,
    /// Request → index of its longest token-prefix record.
    token_prefixes: HashMap<String, usize>,
}

/// An open context log: the file (exclusively `flock`ed while open) and an in-memory index of all
/// its records, built on open and kept current by [`append`](Self::append).
///
/// All records stay in memory, so lookups borrow from the log. The lock is released on drop.
pub struct ContextLog {
    path: PathBuf,
    file: File,
    durability: Durability,
    /// Byte length of the valid file (where the next frame goes).
    end: u64,
    records: Vec<(RecordId, Record)>,
    index: HashMap<String, TrajectoryIndex>,
}

impl fmt::Debug for ContextLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextLog")
            .field("path", &self.path)
            .field("durability", &self.durability)
            .field("size_bytes", &self.end)
            .field("records", &self.records.len())
            .field("trajectories", &self.index.len())
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
    /// existing file is scanned frame by frame; the scan stops at the first torn, short,
    /// bad-length or CRC-bad frame, and the file is truncated there (and fsynced), keeping every
    /// complete record before it. [`Recovery`] says what was kept and cut.
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
        let mut file = OpenOptions::new()
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
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(|source| ContextLogError::Read {
                path: path.clone(),
                source,
            })?;

        let mut log = ContextLog {
            path,
            file,
            durability,
            end: HEADER_BYTES,
            records: Vec::new(),
            index: HashMap::new(),
        };
        let mut recovery = Recovery::default();
        match frame::check_header(&bytes) {
            HeaderCheck::Valid => {}
            HeaderCheck::Torn => {
                if !bytes.is_empty() {
                    recovery.truncated_bytes = bytes.len() as u64;
                    recovery.damage = Some(Damage::Short { offset: 0 });
                }
                recovery.created = true;
                log.write_header()?;
                return Ok((log, recovery));
            }
            HeaderCheck::BadMagic => return Err(ContextLogError::BadHeader { path: log.path }),
            HeaderCheck::Version(found) => {
                return Err(ContextLogError::UnsupportedVersion {
                    path: log.path,
                    found,
                    supported: FORMAT_VERSION,
                })
            }
        }

        let mut offset = HEADER_BYTES as usize;
        loop {
            let damage_at = offset as u64;
            match frame::read_frame(&bytes[offset..]) {
                FrameRead::End => break,
                FrameRead::Frame { payload, frame_len } => {
                    let record = decode(payload).map_err(|source| ContextLogError::Decode {
                        path: log.path.clone(),
                        offset: damage_at,
                        source,
                    })?;
                    log.insert(RecordId(damage_at), record);
                    offset += frame_len;
                }
                FrameRead::Short => {
                    recovery.damage = Some(Damage::Short { offset: damage_at });
                    break;
                }
                FrameRead::BadLength { len } => {
                    recovery.damage = Some(Damage::BadLength {
                        offset: damage_at,
                        len,
                    });
                    break;
                }
                FrameRead::Crc { stored, computed } => {
                    recovery.damage = Some(Damage::CrcMismatch {
                        offset: damage_at,
                        stored,
                        computed,
                    });
                    break;
                }
            }
        }
        log.end = offset as u64;
        recovery.records = log.records.len() as u64;
        recovery.truncated_bytes = bytes.len() as u64 - log.end;
        if recovery.truncated_bytes > 0 {
            tracing::warn!(
                path = %log.path.display(),
                kept_records = recovery.records,
                truncated_bytes = recovery.truncated_bytes,
                damage = ?recovery.damage,
                "context log had a damaged tail, truncated"
            );
            log.truncate_to(log.end)?;
            log.file
                .sync_data()
                .map_err(|source| ContextLogError::Sync {
                    path: log.path.clone(),
                    source,
                })?;
        }
        Ok((log, recovery))
    }

    /// Appends `record` and returns its id (the frame's byte offset).
    ///
    /// With [`Durability::EveryRecord`] the record is fdatasynced before this returns. On a write
    /// or sync error the file is cut back to its previous end and the record is not indexed.
    ///
    /// Errors: [`Encode`](ContextLogError::Encode),
    /// [`RecordTooLarge`](ContextLogError::RecordTooLarge) (payload above [`MAX_RECORD_BYTES`]),
    /// [`Append`](ContextLogError::Append), [`Sync`](ContextLogError::Sync).
    pub fn append(&mut self, record: &Record) -> Result<RecordId, ContextLogError> {
        let payload = bincode::serde::encode_to_vec(record, bincode::config::standard())
            .map_err(|source| ContextLogError::Encode { source })?;
        if payload.len() as u64 > u64::from(MAX_RECORD_BYTES) {
            return Err(ContextLogError::RecordTooLarge {
                bytes: payload.len() as u64,
                max: u64::from(MAX_RECORD_BYTES),
            });
        }
        let framed = frame::encode_frame(&payload);
        let offset = self.end;
        if let Err(source) = self.file.write_all_at(&framed, offset) {
            self.cut_back(offset);
            return Err(ContextLogError::Append {
                path: self.path.clone(),
                offset,
                source,
            });
        }
        if self.durability == Durability::EveryRecord {
            if let Err(source) = self.file.sync_data() {
                self.cut_back(offset);
                return Err(ContextLogError::Sync {
                    path: self.path.clone(),
                    source,
                });
            }
        }
        self.end = offset + framed.len() as u64;
        let id = RecordId(offset);
        self.insert(id, record.clone());
        tracing::trace!(
            path = %self.path.display(),
            trajectory = record.trajectory(),
            prefix = record.prefix(),
            id = offset,
            bytes = framed.len(),
            "context record appended"
        );
        Ok(id)
    }

    /// fdatasyncs every record appended so far (a no-op in effect under
    /// [`Durability::EveryRecord`]).
    ///
    /// Errors: [`Sync`](ContextLogError::Sync).
    pub fn sync(&mut self) -> Result<(), ContextLogError> {
        self.file
            .sync_data()
            .map_err(|source| ContextLogError::Sync {
                path: self.path.clone(),
                source,
            })
    }

    /// The context of the latest boundary record of prefix `k` of `trajectory`.
    pub fn boundary(&self, trajectory: &str, k: u64) -> Option<&[u8]> {
        let i = *self.index.get(trajectory)?.boundaries.get(&k)?;
        Some(self.boundary_at(i).1)
    }

    /// The id of the latest boundary record of prefix `k` of `trajectory` (for a checkpoint
    /// manifest, with [`record_digest`](super::record_digest) of [`boundary`](Self::boundary)).
    pub fn boundary_id(&self, trajectory: &str, k: u64) -> Option<RecordId> {
        let i = *self.index.get(trajectory)?.boundaries.get(&k)?;
        Some(self.records[i].0)
    }

    /// The most recently appended boundary record of `trajectory`: its prefix k and context.
    ///
    /// This is the trajectory's current position: after a rollback to k and regeneration, the
    /// new boundary records supersede the older ones of higher prefixes.
    pub fn latest_boundary(&self, trajectory: &str) -> Option<(u64, &[u8])> {
        let i = self.index.get(trajectory)?.latest_boundary?;
        Some(self.boundary_at(i))
    }

    /// The longest token prefix recorded for response `request` of `trajectory` (the latest
    /// among records of equal length).
    pub fn longest_token_prefix(&self, trajectory: &str, request: &str) -> Option<&[u32]> {
        let i = *self.index.get(trajectory)?.token_prefixes.get(request)?;
        match &self.records[i].1 {
            Record::TokenPrefix { tokens, .. } => Some(tokens),
            Record::Boundary { .. } => None,
        }
    }

    /// The record with id `id`, if it is one of this log's records.
    pub fn get(&self, id: RecordId) -> Option<&Record> {
        let i = self.records.binary_search_by_key(&id, |(r, _)| *r).ok()?;
        Some(&self.records[i].1)
    }

    /// Every record with its id, in append order.
    pub fn records(&self) -> impl Iterator<Item = (RecordId, &Record)> {
        self.records.iter().map(|(id, r)| (*id, r))
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the log holds no record.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Size of the valid file (header and complete frames), bytes.
    pub fn size_bytes(&self) -> u64 {
        self.end
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        &self.path
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

    fn boundary_at(&self, i: usize) -> (u64, &[u8]) {
        match &self.records[i].1 {
            Record::Boundary {
                prefix, context, ..
            } => (*prefix, context),
            Record::TokenPrefix { .. } => unreachable!("boundary index points at a boundary"),
        }
    }

    fn insert(&mut self, id: RecordId, record: Record) {
        let i = self.records.len();
        let entry = self
            .index
            .entry(record.trajectory().to_owned())
            .or_default();
        match &record {
            Record::Boundary { prefix, .. } => {
                entry.boundaries.insert(*prefix, i);
                entry.latest_boundary = Some(i);
            }
            Record::TokenPrefix {
                request, tokens, ..
            } => {
                let longer = match entry.token_prefixes.get(request) {
                    Some(&j) => match &self.records[j].1 {
                        Record::TokenPrefix { tokens: old, .. } => tokens.len() >= old.len(),
                        Record::Boundary { .. } => true,
                    },
                    None => true,
                };
                if longer {
                    entry.token_prefixes.insert(request.clone(), i);
                }
            }
        }
        self.records.push((id, record));
    }

    fn write_header(&mut self) -> Result<(), ContextLogError> {
        let header_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ContextLogError::WriteHeader { path, source }
        };
        self.file.set_len(0).map_err(header_err(&self.path))?;
        self.file
            .write_all_at(&frame::header(), 0)
            .map_err(header_err(&self.path))?;
        self.file
            .sync_all()
            .map_err(|source| ContextLogError::Sync {
                path: self.path.clone(),
                source,
            })?;
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| ContextLogError::Sync { path: dir, source })?;
        self.end = HEADER_BYTES;
        Ok(())
    }

    fn truncate_to(&mut self, len: u64) -> Result<(), ContextLogError> {
        self.file
            .set_len(len)
            .map_err(|source| ContextLogError::Truncate {
                path: self.path.clone(),
                len,
                source,
            })
    }

    /// Best effort after a failed append: the error being returned is the one that matters.
    fn cut_back(&mut self, len: u64) {
        if let Err(e) = self.truncate_to(len) {
            tracing::warn!(path = %self.path.display(), len, error = %e, "cannot cut back context log after a failed append");
        }
    }
}

fn decode(payload: &[u8]) -> Result<Record, bincode::error::DecodeError> {
    let config = bincode::config::standard().with_limit::<{ MAX_RECORD_BYTES as usize }>();
    let (record, used) = bincode::serde::decode_from_slice(payload, config)?;
    if used != payload.len() {
        return Err(bincode::error::DecodeError::OtherString(format!(
            "{} trailing bytes after the record",
            payload.len() - used
        )));
    }
    Ok(record)
}

fn lock_exclusive(file: &File, path: &Path) -> Result<(), ContextLogError> {
    match rustix::fs::flock(file, FlockOperation::NonBlockingLockExclusive) {
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
mod tests {
    use super::*;
    use crate::context::{record_digest, FRAME_HEADER_BYTES};

    fn boundary(t: &str, k: u64, ctx: &[u8]) -> Record {
        Record::Boundary {
            trajectory: t.into(),
            prefix: k,
            context: ctx.to_vec(),
        }
    }

    fn tokens(t: &str, req: &str, k: u64, n: u32) -> Record {
        Record::TokenPrefix {
            trajectory: t.into(),
            request: req.into(),
            prefix: k,
            tokens: (0..n).collect(),
        }
    }

    /// Three boundaries of `a`, one of `b`, two token prefixes: returns the records and ids.
    fn fill(log: &mut ContextLog) -> Vec<(RecordId, Record)> {
        let recs = vec![
            boundary("a", 0, b"system prompt"),
            boundary("a", 1, b"system prompt|obs 1"),
            tokens("a", "a-r2", 1, 256),
            boundary("b", 0, &[0xff; 300]),
            tokens("a", "a-r2", 1, 512),
            boundary("a", 2, b"system prompt|obs 1|obs 2"),
        ];
        recs.into_iter()
            .map(|r| (log.append(&r).unwrap(), r))
            .collect()
    }

    fn assert_records(log: &ContextLog, expected: &[(RecordId, Record)]) {
        let got: Vec<_> = log.records().map(|(id, r)| (id, r.clone())).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn create_append_lookup_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        let (mut log, rec) = ContextLog::open(&path).unwrap();
        assert!(rec.created);
        assert_eq!(rec.records, 0);
        assert!(log.is_empty());
        assert_eq!(log.size_bytes(), HEADER_BYTES);
        let written = fill(&mut log);
        assert_eq!(written[0].0, RecordId(HEADER_BYTES));

        let check = |log: &ContextLog| {
            assert_eq!(log.len(), 6);
            assert_eq!(log.boundary("a", 1), Some(&b"system prompt|obs 1"[..]));
            assert_eq!(log.boundary("b", 0), Some(&[0xff; 300][..]));
            assert_eq!(log.boundary("a", 3), None);
            assert_eq!(log.boundary("c", 0), None);
            assert_eq!(
                log.latest_boundary("a"),
                Some((2, &b"system prompt|obs 1|obs 2"[..]))
            );
            assert_eq!(
                log.longest_token_prefix("a", "a-r2").map(<[u32]>::len),
                Some(512)
            );
            assert_eq!(log.longest_token_prefix("a", "nope"), None);
            assert_eq!(log.longest_token_prefix("b", "a-r2"), None);
            assert_eq!(log.boundary_id("a", 1), Some(written[1].0));
            assert_eq!(log.get(written[2].0), Some(&written[2].1));
            assert_eq!(log.get(RecordId(1)), None);
            assert_records(log, &written);
        };
        check(&log);
        let size = log.size_bytes();
        drop(log);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), size);

        let (log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(
            rec,
            Recovery {
                records: 6,
                truncated_bytes: 0,
                damage: None,
                created: false
            }
        );
        check(&log);
    }

    #[test]
    fn later_boundary_of_same_prefix_wins_and_shorter_token_prefix_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = ContextLog::open(dir.path().join("l")).unwrap();
        log.append(&boundary("a", 3, b"old")).unwrap();
        log.append(&boundary("a", 4, b"old4")).unwrap();
        // Rollback to 2 and regeneration: a new boundary 3 supersedes the old one.
        log.append(&boundary("a", 3, b"new")).unwrap();
        assert_eq!(log.boundary("a", 3), Some(&b"new"[..]));
        assert_eq!(log.latest_boundary("a"), Some((3, &b"new"[..])));
        log.append(&tokens("a", "r", 3, 512)).unwrap();
        log.append(&tokens("a", "r", 3, 256)).unwrap();
        assert_eq!(log.longest_token_prefix("a", "r").unwrap().len(), 512);
        log.append(&tokens("a", "r", 3, 512)).unwrap();
        assert_eq!(log.longest_token_prefix("a", "r").unwrap().len(), 512);
    }

    #[test]
    fn torn_tail_at_every_offset_of_last_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        let (mut log, _) = ContextLog::open(&path).unwrap();
        let written = fill(&mut log);
        let (last_id, _) = written.last().unwrap().clone();
        let full = log.size_bytes();
        drop(log);
        let pristine = std::fs::read(&path).unwrap();
        let kept = &written[..written.len() - 1];

        for cut in last_id.offset()..full {
            std::fs::write(&path, &pristine[..cut as usize]).unwrap();
            let (mut log, rec) = ContextLog::open(&path).unwrap();
            assert_eq!(rec.records, kept.len() as u64, "cut at {cut}");
            assert_eq!(rec.truncated_bytes, cut - last_id.offset(), "cut at {cut}");
            if cut == last_id.offset() {
                assert_eq!(rec.damage, None);
            } else {
                assert_eq!(
                    rec.damage,
                    Some(Damage::Short {
                        offset: last_id.offset()
                    }),
                    "cut at {cut}"
                );
            }
            assert_records(&log, kept);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), last_id.offset());
            assert_eq!(log.latest_boundary("a").unwrap().0, 1);
            // Appends work after recovery and land where the torn record was.
            let id = log.append(&boundary("a", 2, b"again")).unwrap();
            assert_eq!(id, last_id);
            drop(log);
            let (log, rec) = ContextLog::open(&path).unwrap();
            assert_eq!(rec.damage, None);
            assert_eq!(log.len(), kept.len() + 1);
            assert_eq!(log.boundary("a", 2), Some(&b"again"[..]));
        }
    }

    #[test]
    fn crc_mismatch_in_middle_record_drops_it_and_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        let (mut log, _) = ContextLog::open(&path).unwrap();
        let written = fill(&mut log);
        let full = log.size_bytes();
        drop(log);
        // Flip one payload byte of record 3 (the 300-byte boundary of "b").
        let victim = written[3].0.offset();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[(victim + FRAME_HEADER_BYTES + 20) as usize] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();

        let (log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(rec.records, 3);
        assert_eq!(rec.truncated_bytes, full - victim);
        assert!(
            matches!(rec.damage, Some(Damage::CrcMismatch { offset, stored, computed })
                if offset == victim && stored != computed),
            "{rec:?}"
        );
        assert_records(&log, &written[..3]);
        assert_eq!(log.boundary("b", 0), None);
        assert_eq!(log.longest_token_prefix("a", "a-r2").unwrap().len(), 256);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), victim);
    }

    #[test]
    fn zero_filled_tail_is_damage_not_a_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        let (mut log, _) = ContextLog::open(&path).unwrap();
        log.append(&boundary("a", 0, b"x")).unwrap();
        let end = log.size_bytes();
        drop(log);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&[0u8; 4096]);
        std::fs::write(&path, &bytes).unwrap();
        let (log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(rec.records, 1);
        assert_eq!(rec.truncated_bytes, 4096);
        assert_eq!(
            rec.damage,
            Some(Damage::BadLength {
                offset: end,
                len: 0
            })
        );
        assert_eq!(log.len(), 1);
    }

    #[test]
    fn header_errors_and_torn_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        std::fs::write(&path, b"definitely not a log").unwrap();
        assert!(matches!(
            ContextLog::open(&path),
            Err(ContextLogError::BadHeader { .. })
        ));
        let mut h = frame::header().to_vec();
        h[8] = 9;
        std::fs::write(&path, &h).unwrap();
        assert!(matches!(
            ContextLog::open(&path),
            Err(ContextLogError::UnsupportedVersion {
                found: 9,
                supported: FORMAT_VERSION,
                ..
            })
        ));
        // A creation cut short inside the header is redone.
        std::fs::write(&path, &frame::header()[..5]).unwrap();
        let (mut log, rec) = ContextLog::open(&path).unwrap();
        assert!(rec.created);
        assert_eq!(rec.truncated_bytes, 5);
        log.append(&boundary("a", 0, b"x")).unwrap();
        drop(log);
        assert_eq!(ContextLog::open(&path).unwrap().0.len(), 1);
    }

    #[test]
    fn crc_valid_garbage_is_a_decode_error_and_file_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        drop(ContextLog::open(&path).unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.extend_from_slice(&frame::encode_frame(&[0x7f; 3]));
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            ContextLog::open(&path),
            Err(ContextLogError::Decode {
                offset: HEADER_BYTES,
                ..
            })
        ));
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn second_writer_is_refused_and_buffered_mode_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctx.log");
        let (mut log, _) = ContextLog::open_with(&path, Durability::Buffered).unwrap();
        assert!(matches!(
            ContextLog::open(&path),
            Err(ContextLogError::Locked { .. })
        ));
        assert_eq!(log.durability(), Durability::Buffered);
        log.append(&boundary("a", 0, b"ctx")).unwrap();
        log.sync().unwrap();
        assert_eq!(log.path(), path);
        let debug = format!("{log:?}");
        assert!(
            debug.contains("records: 1") && !debug.contains("Boundary"),
            "{debug}"
        );
        drop(log);
        let (log, _) = ContextLog::open(&path).unwrap();
        assert_eq!(log.boundary("a", 0), Some(&b"ctx"[..]));
        assert_eq!(
            record_digest(log.boundary("a", 0).unwrap()),
            record_digest(b"ctx")
        );
    }

    #[test]
    fn oversized_record_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = ContextLog::open(dir.path().join("l")).unwrap();
        let big = boundary("a", 0, &vec![0u8; MAX_RECORD_BYTES as usize + 1]);
        assert!(matches!(
            log.append(&big),
            Err(ContextLogError::RecordTooLarge { max, .. }) if max == u64::from(MAX_RECORD_BYTES)
        ));
        assert!(log.is_empty());
        assert_eq!(log.size_bytes(), HEADER_BYTES);
    }
}
