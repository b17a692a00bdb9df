//! The in-memory index of a context log and the file operations behind it: the streaming scan
//! that builds it (with torn-tail recovery), appends, and reading one record back.
//!
//! The index never holds a context: per record it keeps where the frame lies (offset, length)
//! and what a lookup answers without reading (a boundary's blake3, a token prefix's length),
//! about 100 bytes whatever the record's size. A lookup reads its record back with one `pread`
//! of the frame and checks the frame's crc32 and that it is the record the index names.
//!
//! Every operation takes the log's [`File`] as an argument, so an owner may keep the index of
//! a log whose file it has closed and reopen the file later (the daemon bounds its open logs
//! that way, see `daemon::contexts`).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::encode::{hex, EncodedRecord, Meta};
use super::frame::{self, FrameHead, FrameRead, HeaderCheck};
use super::record::{decode_view, Record, RecordId, RecordView};
use super::{
    ContextLogError, Damage, Durability, Recovery, FORMAT_VERSION, FRAME_HEADER_BYTES, HEADER_BYTES,
};

/// Read buffer of the scan on open, bytes (payloads at least this long bypass it).
const SCAN_BUFFER_BYTES: usize = 64 << 10;

/// Where a boundary record lies and the digest of its context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundaryRef {
    id: RecordId,
    frame_len: u32,
    digest: [u8; 32],
}

impl BoundaryRef {
    /// The record's id (its frame's offset).
    pub fn id(&self) -> RecordId {
        self.id
    }

    /// blake3 of the context, lowercase hex (64 characters).
    pub fn digest(&self) -> String {
        hex(&self.digest)
    }
}

#[derive(Debug, Clone, Copy)]
struct TokensRef {
    id: RecordId,
    frame_len: u32,
    count: u32,
}

#[derive(Debug, Default)]
struct TrajectoryIndex {
    /// Prefix k → the latest boundary record of k.
    boundaries: BTreeMap<u64, BoundaryRef>,
    /// Prefix of the most recently appended boundary record (its entry in `boundaries`).
    latest: Option<u64>,
    /// Request → its longest token-prefix record (the latest among equally long ones).
    token_prefixes: HashMap<String, TokensRef>,
}

/// The index of one context log file: where every record lies and, per trajectory, the latest
/// boundary of each prefix, the latest boundary overall and the longest token prefix of each
/// request.
#[derive(Debug)]
pub struct LogIndex {
    path: PathBuf,
    /// Byte length of the valid file (where the next frame goes).
    end: u64,
    /// Offset and length of every frame, in append (and offset) order.
    frames: Vec<(u64, u32)>,
    trajectories: HashMap<String, TrajectoryIndex>,
}

/// A positional reader over a file (the scan never moves the descriptor's offset).
struct PosReader<'a> {
    file: &'a File,
    pos: u64,
}

impl Read for PosReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Reads until `buf` is full or the end of the file; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match r.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl LogIndex {
    /// Makes `file` (at `path`) an empty log: cuts it to zero, writes the header, fsyncs the
    /// file and its directory.
    ///
    /// Errors: [`ContextLogError::WriteHeader`], [`ContextLogError::Sync`].
    pub fn create(file: &File, path: &Path) -> Result<LogIndex, ContextLogError> {
        let header_err = |source| ContextLogError::WriteHeader {
            path: path.to_path_buf(),
            source,
        };
        file.set_len(0).map_err(header_err)?;
        file.write_all_at(&frame::header(), 0).map_err(header_err)?;
        file.sync_all().map_err(|source| ContextLogError::Sync {
            path: path.to_path_buf(),
            source,
        })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| ContextLogError::Sync { path: dir, source })?;
        Ok(LogIndex {
            path: path.to_path_buf(),
            end: HEADER_BYTES,
            frames: Vec::new(),
            trajectories: HashMap::new(),
        })
    }

    /// Scans the log in `file` (at `path`) frame by frame and builds its index.
    ///
    /// An empty file or one cut inside its header gets a fresh header ([`Recovery::created`]).
    /// The scan stops at the first torn, short, bad-length or CRC-bad frame and the file is
    /// truncated there (and fsynced), keeping every complete record before it. Memory use is
    /// one payload at a time (at most [`MAX_RECORD_BYTES`](super::MAX_RECORD_BYTES)), whatever
    /// the file's size.
    ///
    /// Errors: [`ContextLogError::Read`], [`BadHeader`](ContextLogError::BadHeader),
    /// [`UnsupportedVersion`](ContextLogError::UnsupportedVersion),
    /// [`Decode`](ContextLogError::Decode) for a CRC-valid frame that is not a [`Record`] (the
    /// file is left untouched), and the errors of truncating, syncing and writing a header.
    pub fn scan(file: &File, path: &Path) -> Result<(LogIndex, Recovery), ContextLogError> {
        let read_err = |source| ContextLogError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file_len = file.metadata().map_err(read_err)?.len();
        let mut reader = BufReader::with_capacity(SCAN_BUFFER_BYTES, PosReader { file, pos: 0 });
        let mut head = [0u8; HEADER_BYTES as usize];
        let got = read_full(&mut reader, &mut head).map_err(read_err)?;
        let mut recovery = Recovery::default();
        match frame::check_header(&head[..got]) {
            HeaderCheck::Valid => {}
            HeaderCheck::Torn => {
                if file_len > 0 {
                    recovery.truncated_bytes = file_len;
                    recovery.damage = Some(Damage::Short { offset: 0 });
                }
                recovery.created = true;
                return Ok((LogIndex::create(file, path)?, recovery));
            }
            HeaderCheck::BadMagic => {
                return Err(ContextLogError::BadHeader {
                    path: path.to_path_buf(),
                })
            }
            HeaderCheck::Version(found) => {
                return Err(ContextLogError::UnsupportedVersion {
                    path: path.to_path_buf(),
                    found,
                    supported: FORMAT_VERSION,
                })
            }
        }

        let mut index = LogIndex {
            path: path.to_path_buf(),
            end: HEADER_BYTES,
            frames: Vec::new(),
            trajectories: HashMap::new(),
        };
        let mut payload = Vec::new();
        let mut offset = HEADER_BYTES;
        loop {
            let mut fh = [0u8; FRAME_HEADER_BYTES as usize];
            let got = read_full(&mut reader, &mut fh).map_err(read_err)?;
            if got == 0 {
                break;
            }
            if got < fh.len() {
                recovery.damage = Some(Damage::Short { offset });
                break;
            }
            let (len, stored) = match frame::parse_head(&fh) {
                FrameHead::Valid { len, crc } => (len, crc),
                FrameHead::BadLength { len } => {
                    recovery.damage = Some(Damage::BadLength { offset, len });
                    break;
                }
            };
            // A length past the end of the file is a torn frame: known without reading (or
            // allocating) the payload.
            if offset + FRAME_HEADER_BYTES + u64::from(len) > file_len {
                recovery.damage = Some(Damage::Short { offset });
                break;
            }
            payload.resize(len as usize, 0);
            if read_full(&mut reader, &mut payload).map_err(read_err)? < payload.len() {
                recovery.damage = Some(Damage::Short { offset });
                break;
            }
            let computed = crc32fast::hash(&payload);
            if computed != stored {
                recovery.damage = Some(Damage::CrcMismatch {
                    offset,
                    stored,
                    computed,
                });
                break;
            }
            let view = decode_view(&payload).map_err(|source| ContextLogError::Decode {
                path: path.to_path_buf(),
                offset,
                source,
            })?;
            let meta = Meta::of_view(&view);
            let frame_len = FRAME_HEADER_BYTES as u32 + len;
            index.insert(offset, frame_len, view.trajectory(), view.prefix(), meta);
            offset += u64::from(frame_len);
        }
        index.end = offset;
        recovery.records = index.frames.len() as u64;
        recovery.truncated_bytes = file_len.saturating_sub(index.end);
        if recovery.truncated_bytes > 0 {
            tracing::warn!(
                path = %path.display(),
                kept_records = recovery.records,
                truncated_bytes = recovery.truncated_bytes,
                damage = ?recovery.damage,
                "context log had a damaged tail, truncated"
            );
            index.truncate_file(file, index.end)?;
            file.sync_data().map_err(|source| ContextLogError::Sync {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok((index, recovery))
    }

    /// Appends `record` to `file` (the file this index describes) and indexes it; returns its
    /// id (the frame's byte offset).
    ///
    /// With [`Durability::EveryRecord`] the record is fdatasynced before this returns. On a
    /// write or sync error the file is cut back to its previous end and the record is not
    /// indexed.
    ///
    /// Errors: [`Append`](ContextLogError::Append), [`Sync`](ContextLogError::Sync).
    pub fn append(
        &mut self,
        file: &File,
        record: EncodedRecord,
        durability: Durability,
    ) -> Result<RecordId, ContextLogError> {
        let offset = self.end;
        if let Err(source) = file.write_all_at(record.frame(), offset) {
            self.cut_back(file, offset);
            return Err(ContextLogError::Append {
                path: self.path.clone(),
                offset,
                source,
            });
        }
        if durability == Durability::EveryRecord {
            if let Err(source) = file.sync_data() {
                self.cut_back(file, offset);
                return Err(ContextLogError::Sync {
                    path: self.path.clone(),
                    source,
                });
            }
        }
        let frame_len = record.frame().len() as u32;
        self.end = offset + u64::from(frame_len);
        tracing::trace!(
            path = %self.path.display(),
            trajectory = record.trajectory(),
            prefix = record.prefix(),
            id = offset,
            bytes = frame_len,
            "context record appended"
        );
        let (trajectory, prefix, meta) = record.into_meta();
        self.insert(offset, frame_len, &trajectory, prefix, meta);
        Ok(RecordId(offset))
    }

    /// The latest boundary record of prefix `k` of `trajectory` (from the index; nothing read).
    pub fn boundary(&self, trajectory: &str, k: u64) -> Option<BoundaryRef> {
        self.trajectories
            .get(trajectory)?
            .boundaries
            .get(&k)
            .copied()
    }

    /// The most recently appended boundary record of `trajectory` and its prefix k.
    pub fn latest_boundary(&self, trajectory: &str) -> Option<(u64, BoundaryRef)> {
        let t = self.trajectories.get(trajectory)?;
        let k = t.latest?;
        Some((k, *t.boundaries.get(&k)?))
    }

    /// Reads the context of boundary `b` of `trajectory` at prefix `k` from `file`: one `pread`
    /// of the frame, its crc32 checked and the record checked to be that boundary.
    ///
    /// Errors: [`ReadRecord`](ContextLogError::ReadRecord),
    /// [`RecordChanged`](ContextLogError::RecordChanged), [`Decode`](ContextLogError::Decode).
    pub fn read_context(
        &self,
        file: &File,
        trajectory: &str,
        k: u64,
        b: &BoundaryRef,
    ) -> Result<Vec<u8>, ContextLogError> {
        let mut buf = self.read_frame(file, b.id.0, b.frame_len)?;
        let range = {
            let payload = &buf[FRAME_HEADER_BYTES as usize..];
            match self.decode_at(b.id.0, payload)? {
                RecordView::Boundary {
                    trajectory: t,
                    prefix,
                    context,
                } if t == trajectory && prefix == k => {
                    // Where in the frame's buffer the decoder found the context.
                    let start = (context.as_ptr() as usize).checked_sub(buf.as_ptr() as usize);
                    match start {
                        Some(s) if s + context.len() <= buf.len() => s..s + context.len(),
                        _ => return Ok(context.to_vec()),
                    }
                }
                _ => return Err(self.changed(b.id.0)),
            }
        };
        // Keep the context in the frame's buffer rather than copying it out.
        buf.truncate(range.end);
        buf.drain(..range.start);
        Ok(buf)
    }

    /// The tokens of the longest token prefix recorded for response `request` of
    /// `trajectory`, read from `file`.
    ///
    /// Errors: as [`read_context`](Self::read_context).
    pub fn longest_token_prefix(
        &self,
        file: &File,
        trajectory: &str,
        request: &str,
    ) -> Result<Option<Vec<u32>>, ContextLogError> {
        let Some(t) = self
            .trajectories
            .get(trajectory)
            .and_then(|t| t.token_prefixes.get(request))
        else {
            return Ok(None);
        };
        let buf = self.read_frame(file, t.id.0, t.frame_len)?;
        match self.decode_at(t.id.0, &buf[FRAME_HEADER_BYTES as usize..])? {
            RecordView::TokenPrefix {
                trajectory: tr,
                request: r,
                tokens,
                ..
            } if tr == trajectory && r == request => Ok(Some(tokens)),
            _ => Err(self.changed(t.id.0)),
        }
    }

    /// The record with id `id` read from `file`, if `id` is one of this log's records.
    ///
    /// Errors: as [`read_context`](Self::read_context).
    pub fn get(&self, file: &File, id: RecordId) -> Result<Option<Record>, ContextLogError> {
        let Ok(i) = self.frames.binary_search_by_key(&id.0, |(o, _)| *o) else {
            return Ok(None);
        };
        let (offset, frame_len) = self.frames[i];
        let buf = self.read_frame(file, offset, frame_len)?;
        let view = self.decode_at(offset, &buf[FRAME_HEADER_BYTES as usize..])?;
        Ok(Some(view.to_record()))
    }

    /// The ids of every record, in append order.
    pub fn ids(&self) -> impl Iterator<Item = RecordId> + '_ {
        self.frames.iter().map(|(o, _)| RecordId(*o))
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.frames.len()
    }

    /// Whether the log holds no record.
    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Size of the valid file (header and complete frames), bytes.
    pub fn size_bytes(&self) -> u64 {
        self.end
    }

    /// The log file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn read_frame(
        &self,
        file: &File,
        offset: u64,
        frame_len: u32,
    ) -> Result<Vec<u8>, ContextLogError> {
        let mut buf = vec![0u8; frame_len as usize];
        match file.read_exact_at(&mut buf, offset) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(self.changed(offset)),
            Err(source) => {
                return Err(ContextLogError::ReadRecord {
                    path: self.path.clone(),
                    offset,
                    source,
                })
            }
        }
        match frame::read_frame(&buf) {
            FrameRead::Frame { frame_len: n, .. } if n == buf.len() => Ok(buf),
            _ => Err(self.changed(offset)),
        }
    }

    fn decode_at<'a>(
        &self,
        offset: u64,
        payload: &'a [u8],
    ) -> Result<RecordView<'a>, ContextLogError> {
        decode_view(payload).map_err(|source| ContextLogError::Decode {
            path: self.path.clone(),
            offset,
            source,
        })
    }

    fn changed(&self, offset: u64) -> ContextLogError {
        ContextLogError::RecordChanged {
            path: self.path.clone(),
            offset,
        }
    }

    fn insert(&mut self, offset: u64, frame_len: u32, trajectory: &str, prefix: u64, meta: Meta) {
        self.frames.push((offset, frame_len));
        let entry = match self.trajectories.get_mut(trajectory) {
            Some(e) => e,
            None => self.trajectories.entry(trajectory.to_owned()).or_default(),
        };
        let id = RecordId(offset);
        match meta {
            Meta::Boundary { digest } => {
                entry.boundaries.insert(
                    prefix,
                    BoundaryRef {
                        id,
                        frame_len,
                        digest,
                    },
                );
                entry.latest = Some(prefix);
            }
            Meta::Tokens { request, count } => {
                let longer = entry
                    .token_prefixes
                    .get(&request)
                    .is_none_or(|old| count >= old.count);
                if longer {
                    entry.token_prefixes.insert(
                        request,
                        TokensRef {
                            id,
                            frame_len,
                            count,
                        },
                    );
                }
            }
        }
    }

    fn truncate_file(&self, file: &File, len: u64) -> Result<(), ContextLogError> {
        file.set_len(len)
            .map_err(|source| ContextLogError::Truncate {
                path: self.path.clone(),
                len,
                source,
            })
    }

    /// Best effort after a failed append: the error being returned is the one that matters.
    fn cut_back(&self, file: &File, len: u64) {
        if let Err(e) = self.truncate_file(file, len) {
            tracing::warn!(
                path = %self.path.display(),
                len,
                error = %e,
                "cannot cut back context log after a failed append"
            );
        }
    }
}
