//! Encoding one record as a frame ready to append, with what the index keeps of it.

use serde::Serialize;

use super::frame;
use super::record::{Record, RecordView};
use super::{ContextLogError, FRAME_HEADER_BYTES, MAX_RECORD_BYTES};

/// What the index keeps of a record besides its place.
#[derive(Debug, Clone)]
pub(super) enum Meta {
    /// A boundary: the blake3 of its context.
    Boundary {
        /// blake3 of the context.
        digest: [u8; 32],
    },
    /// A token prefix: its request and number of tokens.
    Tokens {
        /// Request id.
        request: String,
        /// Tokens in the prefix.
        count: u32,
    },
}

/// One record encoded as a frame, ready to append, with what the index will keep of it.
#[derive(Debug)]
pub struct EncodedRecord {
    frame: Vec<u8>,
    trajectory: String,
    prefix: u64,
    meta: Meta,
}

impl EncodedRecord {
    /// Encodes `record`.
    ///
    /// Errors: [`ContextLogError::Encode`], [`ContextLogError::RecordTooLarge`] (payload above
    /// [`MAX_RECORD_BYTES`]).
    pub fn new(record: &Record) -> Result<EncodedRecord, ContextLogError> {
        let meta = match record {
            Record::Boundary { context, .. } => Meta::Boundary {
                digest: *blake3::hash(context).as_bytes(),
            },
            Record::TokenPrefix {
                request, tokens, ..
            } => Meta::Tokens {
                request: request.clone(),
                count: token_count(tokens),
            },
        };
        encode(record, record.trajectory(), record.prefix(), meta)
    }

    /// Encodes the boundary record of `trajectory` at `prefix` with `context` (borrowed: the
    /// context is copied once, into the frame).
    ///
    /// Errors: as [`new`](Self::new).
    pub fn boundary(
        trajectory: &str,
        prefix: u64,
        context: &[u8],
    ) -> Result<EncodedRecord, ContextLogError> {
        let view = RecordView::Boundary {
            trajectory,
            prefix,
            context,
        };
        let meta = Meta::Boundary {
            digest: *blake3::hash(context).as_bytes(),
        };
        encode(&view, trajectory, prefix, meta)
    }

    /// The frame: header and payload.
    pub(super) fn frame(&self) -> &[u8] {
        &self.frame
    }

    /// The record's trajectory.
    pub(super) fn trajectory(&self) -> &str {
        &self.trajectory
    }

    /// The record's prefix k.
    pub(super) fn prefix(&self) -> u64 {
        self.prefix
    }

    /// Trajectory, prefix and what the index keeps, for indexing it once appended.
    pub(super) fn into_meta(self) -> (String, u64, Meta) {
        (self.trajectory, self.prefix, self.meta)
    }

    /// Bytes the record takes in the file (frame header and payload).
    pub fn frame_bytes(&self) -> u64 {
        self.frame.len() as u64
    }

    /// The blake3 of a boundary's context, lowercase hex (see
    /// [`record_digest`](super::record_digest)); `None` for a token prefix.
    pub fn digest(&self) -> Option<String> {
        match &self.meta {
            Meta::Boundary { digest } => Some(hex(digest)),
            Meta::Tokens { .. } => None,
        }
    }
}

impl Meta {
    /// What the index keeps of the record `view` (a boundary's blake3 is computed here).
    pub(super) fn of_view(view: &RecordView<'_>) -> Meta {
        match view {
            RecordView::Boundary { context, .. } => Meta::Boundary {
                digest: *blake3::hash(context).as_bytes(),
            },
            RecordView::TokenPrefix {
                request, tokens, ..
            } => Meta::Tokens {
                request: (*request).to_owned(),
                count: token_count(tokens),
            },
        }
    }
}

fn token_count(tokens: &[u32]) -> u32 {
    // A record holds at most MAX_RECORD_BYTES of tokens (one byte each at least).
    u32::try_from(tokens.len()).unwrap_or(u32::MAX)
}

fn encode<T: Serialize>(
    value: &T,
    trajectory: &str,
    prefix: u64,
    meta: Meta,
) -> Result<EncodedRecord, ContextLogError> {
    let mut frame = vec![0u8; FRAME_HEADER_BYTES as usize];
    bincode::serde::encode_into_std_write(value, &mut frame, bincode::config::standard())
        .map_err(|source| ContextLogError::Encode { source })?;
    let payload = frame.len() as u64 - FRAME_HEADER_BYTES;
    if payload > u64::from(MAX_RECORD_BYTES) {
        return Err(ContextLogError::RecordTooLarge {
            bytes: payload,
            max: u64::from(MAX_RECORD_BYTES),
        });
    }
    frame::seal_frame(&mut frame);
    Ok(EncodedRecord {
        frame,
        trajectory: trajectory.to_owned(),
        prefix,
        meta,
    })
}

/// A blake3 digest as lowercase hex.
pub(super) fn hex(digest: &[u8; 32]) -> String {
    blake3::Hash::from_bytes(*digest).to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record_digest;

    #[test]
    fn a_borrowed_boundary_encodes_like_the_record() {
        let record = Record::Boundary {
            trajectory: "t".into(),
            prefix: 9,
            context: b"ctx".to_vec(),
        };
        let owned = EncodedRecord::new(&record).unwrap();
        let borrowed = EncodedRecord::boundary("t", 9, b"ctx").unwrap();
        assert_eq!(owned.frame(), borrowed.frame());
        assert_eq!(owned.frame_bytes(), borrowed.frame().len() as u64);
        assert_eq!(borrowed.digest(), Some(record_digest(b"ctx")));
        assert_eq!((borrowed.trajectory(), borrowed.prefix()), ("t", 9));
        let tokens = EncodedRecord::new(&Record::TokenPrefix {
            trajectory: "t".into(),
            request: "r".into(),
            prefix: 0,
            tokens: vec![1, 2],
        })
        .unwrap();
        assert_eq!(tokens.digest(), None);
    }
}
