//! The records of the context log and their ids.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::MAX_RECORD_BYTES;

/// One record of the context log (bincode 2 serde payload of a frame).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// The LLM context L_k of `trajectory` after action boundary `prefix` = k.
    Boundary {
        /// Trajectory id.
        trajectory: String,
        /// Action boundary k (number of completed actions).
        prefix: u64,
        /// The context, opaque to the log: serialized messages or token ids.
        #[serde(with = "serde_bytes")]
        context: Vec<u8>,
    },
    /// The tokens a streaming response `request` has produced so far, written every
    /// [`DEFAULT_TOKEN_INTERVAL`](super::DEFAULT_TOKEN_INTERVAL) tokens. Each record holds the whole
    /// prefix from the start of the response, not a delta.
    TokenPrefix {
        /// Trajectory id.
        trajectory: String,
        /// Request id of the response (unique within the trajectory).
        request: String,
        /// The action boundary k whose context the response follows.
        prefix: u64,
        /// Generated token ids so far.
        tokens: Vec<u32>,
    },
}

impl Record {
    /// The trajectory the record belongs to.
    pub fn trajectory(&self) -> &str {
        match self {
            Record::Boundary { trajectory, .. } | Record::TokenPrefix { trajectory, .. } => {
                trajectory
            }
        }
    }

    /// The action boundary k the record belongs to.
    pub fn prefix(&self) -> u64 {
        match self {
            Record::Boundary { prefix, .. } | Record::TokenPrefix { prefix, .. } => *prefix,
        }
    }
}

/// The wire twin of [`Record`] borrowing its strings and context from a frame being read or
/// written, so that neither the scan on open nor an append copies a context. Its encoding is
/// byte for byte that of [`Record`] (same variants and fields, in the same order; a test checks
/// it).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RecordView<'a> {
    /// See [`Record::Boundary`].
    Boundary {
        #[serde(borrow)]
        trajectory: &'a str,
        prefix: u64,
        #[serde(borrow, with = "serde_bytes")]
        context: &'a [u8],
    },
    /// See [`Record::TokenPrefix`].
    TokenPrefix {
        #[serde(borrow)]
        trajectory: &'a str,
        #[serde(borrow)]
        request: &'a str,
        prefix: u64,
        tokens: Vec<u32>,
    },
}

impl RecordView<'_> {
    pub(super) fn trajectory(&self) -> &str {
        match self {
            RecordView::Boundary { trajectory, .. }
            | RecordView::TokenPrefix { trajectory, .. } => trajectory,
        }
    }

    pub(super) fn prefix(&self) -> u64 {
        match self {
            RecordView::Boundary { prefix, .. } | RecordView::TokenPrefix { prefix, .. } => *prefix,
        }
    }

    pub(super) fn to_record(&self) -> Record {
        match self {
            RecordView::Boundary {
                trajectory,
                prefix,
                context,
            } => Record::Boundary {
                trajectory: (*trajectory).to_owned(),
                prefix: *prefix,
                context: context.to_vec(),
            },
            RecordView::TokenPrefix {
                trajectory,
                request,
                prefix,
                tokens,
            } => Record::TokenPrefix {
                trajectory: (*trajectory).to_owned(),
                request: (*request).to_owned(),
                prefix: *prefix,
                tokens: tokens.clone(),
            },
        }
    }
}

/// Decodes one frame payload (all of it) as a record view borrowing from `payload`.
pub(super) fn decode_view(payload: &[u8]) -> Result<RecordView<'_>, bincode::error::DecodeError> {
    let config = bincode::config::standard().with_limit::<{ MAX_RECORD_BYTES as usize }>();
    let (record, used) = bincode::serde::borrow_decode_from_slice(payload, config)?;
    if used != payload.len() {
        return Err(bincode::error::DecodeError::OtherString(format!(
            "{} trailing bytes after the record",
            payload.len() - used
        )));
    }
    Ok(record)
}

/// Id of a record: the byte offset of its frame in the log file.
///
/// Stable for the life of the file (the log is append-only and a reopen only drops damaged frames
/// after the last complete one), so a checkpoint manifest can name the record by it. Ids grow in
/// append order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RecordId(pub u64);

impl RecordId {
    /// Byte offset of the frame in the file.
    pub fn offset(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.0)
    }
}

/// blake3 of `bytes` (e.g. a boundary's context), lowercase hex (64 characters): the digest a
/// checkpoint manifest stores next to the [`RecordId`] so recovery can check that L_k matches.
pub fn record_digest(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_blake3_hex() {
        let d = record_digest(b"abc");
        assert_eq!(d.len(), 64);
        assert_eq!(d, blake3::hash(b"abc").to_hex().as_str());
        assert_ne!(d, record_digest(b"abd"));
    }

    #[test]
    fn the_view_encodes_and_decodes_like_the_record() {
        let config = bincode::config::standard();
        let records = [
            Record::Boundary {
                trajectory: "traj-1".into(),
                prefix: 300,
                context: vec![0, 1, 0xff, 7],
            },
            Record::TokenPrefix {
                trajectory: "t".into(),
                request: "req".into(),
                prefix: 2,
                tokens: vec![1, 70_000, u32::MAX],
            },
        ];
        for r in records {
            let bytes = bincode::serde::encode_to_vec(&r, config).unwrap();
            let view = decode_view(&bytes).unwrap();
            assert_eq!(view.to_record(), r);
            assert_eq!(view.trajectory(), r.trajectory());
            assert_eq!(view.prefix(), r.prefix());
            assert_eq!(bincode::serde::encode_to_vec(&view, config).unwrap(), bytes);
            let mut long = bytes.clone();
            long.push(0);
            assert!(decode_view(&long).is_err(), "trailing bytes are refused");
        }
    }

    #[test]
    fn accessors_and_display() {
        let r = Record::TokenPrefix {
            trajectory: "t".into(),
            request: "r".into(),
            prefix: 4,
            tokens: vec![1],
        };
        assert_eq!(r.trajectory(), "t");
        assert_eq!(r.prefix(), 4);
        assert_eq!(RecordId(12).to_string(), "@12");
        assert_eq!(RecordId(12).offset(), 12);
    }
}
