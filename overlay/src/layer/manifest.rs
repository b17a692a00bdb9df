//! The layer manifest: every entry of an upper layer with its metadata, its data extents and
//! the blob holding its data, plus the stat key that lets the next capture skip it.

use serde::{Deserialize, Serialize};

use crate::format::hex;

/// Magic bytes opening an encoded [`LayerManifest`].
pub const MANIFEST_MAGIC: &[u8; 8] = b"BLYRLAYR";
/// Version of the encoding written by [`LayerManifest::encode`]; decoding refuses others.
pub const LAYER_FORMAT_VERSION: u32 = 1;
/// Largest encoded manifest [`LayerManifest::decode`] accepts, in bytes.
pub const MAX_MANIFEST_BYTES: usize = 1 << 30;

/// The blake3 digest naming a blob: 32 bytes, written as 64 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlobId(pub [u8; 32]);

impl BlobId {
    /// The id of `data` (blake3).
    pub fn of(data: &[u8]) -> BlobId {
        BlobId(*blake3::hash(data).as_bytes())
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Option<BlobId> {
        let bytes = crate::format::unhex(text.as_bytes()).ok()?;
        Some(BlobId(bytes.try_into().ok()?))
    }
}

impl std::fmt::Display for BlobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A run of data in a regular file: `len` bytes at byte `offset`. Everything outside the
/// extents of a file is a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Start, in bytes from the beginning of the file.
    pub offset: u64,
    /// Length in bytes (never 0).
    pub len: u64,
}

/// What identifies an inode's state between two captures of the same upper directory:
/// `statx` inode number, size, mtime and ctime (seconds, nanoseconds). The ctime changes on
/// every write and metadata change and cannot be set by the sandbox, so an equal key means
/// unchanged content and metadata (given the racy-window rule of
/// [`capture_layer`](super::capture_layer)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatKey {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Modification time (seconds, nanoseconds).
    pub mtime: (i64, u32),
    /// Status-change time (seconds, nanoseconds).
    pub ctime: (i64, u32),
}

/// The type of an entry and what only that type has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum EntryKind {
    /// A directory (opaque ones carry `trusted.overlay.opaque`, renamed lower directories
    /// `trusted.overlay.redirect`).
    Directory,
    /// A regular file of apparent `size` bytes whose data are `extents`, stored
    /// concatenated in blob `blob` (`None` when the file has no data).
    Regular {
        /// Apparent size in bytes, holes included.
        size: u64,
        /// Data extents, sorted, disjoint, within `size`.
        extents: Vec<Extent>,
        /// The blob with the extents' bytes.
        blob: Option<BlobId>,
    },
    /// A symbolic link and its target, verbatim (never followed).
    Symlink {
        /// The target bytes.
        target: Vec<u8>,
    },
    /// A further name of the inode of an earlier entry (`target`, a path in this layer).
    Hardlink {
        /// The earlier entry's path.
        target: Vec<u8>,
    },
    /// An overlay whiteout: a character device, which must be 0:0.
    Whiteout {
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// A named pipe.
    Fifo,
}

impl EntryKind {
    /// Short name of the type, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            EntryKind::Directory => "directory",
            EntryKind::Regular { .. } => "file",
            EntryKind::Symlink { .. } => "symlink",
            EntryKind::Hardlink { .. } => "hardlink",
            EntryKind::Whiteout { .. } => "whiteout",
            EntryKind::Fifo => "fifo",
        }
    }
}

/// One entry of an upper layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerEntry {
    /// Path relative to the upper directory, components joined by `/`; empty for the root.
    pub path: Vec<u8>,
    /// Type and type-specific data.
    pub kind: EntryKind,
    /// Permission bits with setuid, setgid and sticky (`0o7777` at most).
    pub mode: u32,
    /// Owner uid.
    pub uid: u32,
    /// Owner gid.
    pub gid: u32,
    /// Modification time (seconds, nanoseconds).
    pub mtime: (i64, u32),
    /// Extended attributes (`user.`, `security.`, `trusted.` including `trusted.overlay.*`,
    /// POSIX ACLs), sorted by name; the root's `trusted.overlay.uuid` is left out.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// The inode's state when captured, compared by the next capture.
    pub key: StatKey,
}

/// An upper layer F_k: its entries in sorted pre-order (root first), and what changed since
/// the manifest it was captured against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerManifest {
    /// Wall-clock time the capture started (seconds, nanoseconds since the epoch): entries
    /// changed within the racy window before it are read again by the next capture.
    pub captured_at: (i64, u32),
    /// Every entry, root first, in sorted pre-order (parents before children).
    pub entries: Vec<LayerEntry>,
    /// Paths of the base manifest that no longer exist (deletions since then).
    pub removed: Vec<Vec<u8>>,
    /// [`LayerManifest::content_digest`] of the manifest this one was captured against.
    pub base: Option<BlobId>,
}

/// Why an encoded manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// It does not start with [`MANIFEST_MAGIC`].
    #[error("not a layer manifest (bad magic)")]
    BadMagic,
    /// It has another format version.
    #[error("layer manifest format version {found} (supported: {supported})")]
    UnsupportedVersion {
        /// Version in the file.
        found: u32,
        /// [`LAYER_FORMAT_VERSION`].
        supported: u32,
    },
    /// It is larger than [`MAX_MANIFEST_BYTES`].
    #[error("layer manifest of {size} bytes is larger than {max}")]
    TooLarge {
        /// Encoded size in bytes.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The body does not decode.
    #[error("malformed layer manifest")]
    Decode(#[source] bincode::error::DecodeError),
    /// Bytes follow the body.
    #[error("layer manifest has {0} trailing bytes")]
    TrailingBytes(usize),
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_MANIFEST_BYTES>()
}

impl LayerManifest {
    /// Encodes: [`MANIFEST_MAGIC`], [`LAYER_FORMAT_VERSION`] (u32 little endian), then the
    /// manifest in bincode 2's standard configuration (varint integers).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MANIFEST_MAGIC.to_vec();
        out.extend_from_slice(&LAYER_FORMAT_VERSION.to_le_bytes());
        let body = bincode::serde::encode_to_vec(self, config())
            .expect("encoding plain data into a Vec cannot fail");
        out.extend_from_slice(&body);
        out
    }

    /// Decodes what [`encode`](Self::encode) wrote. Only the encoding is checked here;
    /// [`materialize_layer`](super::materialize_layer) checks every entry (names, types,
    /// devices, extents, attributes) before creating it.
    ///
    /// Errors: [`ManifestError`].
    pub fn decode(bytes: &[u8]) -> Result<LayerManifest, ManifestError> {
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(ManifestError::TooLarge {
                size: bytes.len(),
                max: MAX_MANIFEST_BYTES,
            });
        }
        let body = bytes
            .strip_prefix(MANIFEST_MAGIC.as_slice())
            .ok_or(ManifestError::BadMagic)?;
        let (version, body) = body
            .split_first_chunk::<4>()
            .ok_or(ManifestError::BadMagic)?;
        let version = u32::from_le_bytes(*version);
        if version != LAYER_FORMAT_VERSION {
            return Err(ManifestError::UnsupportedVersion {
                found: version,
                supported: LAYER_FORMAT_VERSION,
            });
        }
        let (manifest, used): (LayerManifest, usize) =
            bincode::serde::decode_from_slice(body, config()).map_err(ManifestError::Decode)?;
        if used != body.len() {
            return Err(ManifestError::TrailingBytes(body.len() - used));
        }
        Ok(manifest)
    }

    /// blake3 of the layer's content: every entry's path, type, data, metadata and
    /// attributes, without the stat keys, the capture time or the change list. Two
    /// captures of equal trees (say a layer and its restore) have equal content digests.
    pub fn content_digest(&self) -> BlobId {
        #[derive(Serialize)]
        struct Content<'a> {
            path: &'a [u8],
            kind: &'a EntryKind,
            mode: u32,
            uid: u32,
            gid: u32,
            mtime: (i64, u32),
            xattrs: &'a [(Vec<u8>, Vec<u8>)],
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(MANIFEST_MAGIC);
        for e in &self.entries {
            let content = Content {
                path: &e.path,
                kind: &e.kind,
                mode: e.mode,
                uid: e.uid,
                gid: e.gid,
                mtime: e.mtime,
                xattrs: &e.xattrs,
            };
            let bytes = bincode::serde::encode_to_vec(&content, config())
                .expect("encoding plain data into a Vec cannot fail");
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(&bytes);
        }
        BlobId(*hasher.finalize().as_bytes())
    }

    /// The distinct blobs the layer references, sorted.
    pub fn blobs(&self) -> Vec<BlobId> {
        let mut ids: Vec<BlobId> = self
            .entries
            .iter()
            .filter_map(|e| match &e.kind {
                EntryKind::Regular { blob, .. } => *blob,
                _ => None,
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Bytes of file data the layer holds (holes excluded, each hardlinked inode once).
    pub fn data_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| match &e.kind {
                EntryKind::Regular { extents, .. } => extents.iter().map(|x| x.len).sum(),
                _ => 0,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LayerManifest {
        LayerManifest {
            captured_at: (1_700_000_000, 5),
            entries: vec![
                LayerEntry {
                    path: Vec::new(),
                    kind: EntryKind::Directory,
                    mode: 0o755,
                    uid: 0,
                    gid: 0,
                    mtime: (1, 2),
                    xattrs: vec![(b"trusted.overlay.opaque".to_vec(), b"y".to_vec())],
                    key: StatKey::default(),
                },
                LayerEntry {
                    path: b"f".to_vec(),
                    kind: EntryKind::Regular {
                        size: 10,
                        extents: vec![Extent { offset: 0, len: 10 }],
                        blob: Some(BlobId::of(b"0123456789")),
                    },
                    mode: 0o4755,
                    uid: 1000,
                    gid: 1000,
                    mtime: (-2, 750_000_000),
                    xattrs: Vec::new(),
                    key: StatKey {
                        ino: 7,
                        size: 10,
                        mtime: (3, 4),
                        ctime: (5, 6),
                    },
                },
            ],
            removed: vec![b"gone".to_vec()],
            base: Some(BlobId([9; 32])),
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let m = sample();
        let bytes = m.encode();
        assert_eq!(LayerManifest::decode(&bytes).unwrap(), m);
        assert!(matches!(
            LayerManifest::decode(b"nope"),
            Err(ManifestError::BadMagic)
        ));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(matches!(
            LayerManifest::decode(&v2),
            Err(ManifestError::UnsupportedVersion { found: 2, .. })
        ));
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(
            LayerManifest::decode(&long),
            Err(ManifestError::TrailingBytes(1))
        ));
        for cut in 12..bytes.len() {
            assert!(
                LayerManifest::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        // A length prefix claiming 2^60 entries fails without allocating them.
        let mut huge = bytes[..12].to_vec();
        huge.extend_from_slice(&[0, 0, 0xff, 0, 0, 0, 0, 0, 0, 0x10]);
        assert!(LayerManifest::decode(&huge).is_err());
    }

    #[test]
    fn content_digest_ignores_keys_and_times_of_capture() {
        let a = sample();
        let mut b = a.clone();
        b.entries[1].key.ino = 99;
        b.captured_at = (0, 0);
        b.removed.clear();
        b.base = None;
        assert_eq!(a.content_digest(), b.content_digest());
        b.entries[1].mode = 0o755;
        assert_ne!(a.content_digest(), b.content_digest());
        assert_eq!(a.blobs().len(), 1);
        assert_eq!(a.data_bytes(), 10);
        let id = BlobId::of(b"x");
        assert_eq!(BlobId::from_hex(&id.to_hex()), Some(id));
    }
}
