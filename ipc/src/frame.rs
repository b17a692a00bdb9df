//! Framing: a 16-byte header followed by a bincode payload.
//!
//! ```text
//! offset  size  field
//!      0     4  magic  b"BLYR"
//!      4     2  protocol version, u16 little-endian (PROTOCOL_VERSION)
//!      6     1  kind: 1 = request, 2 = response, 3 = event, 4 = memory request,
//!               5 = memory response
//!      7     1  flags, reserved, must be 0
//!      8     4  payload length in bytes, u32 little-endian
//!     12     4  CRC32 (IEEE, as computed by crc32fast) of the payload, u32 little-endian
//!     16     n  payload: bincode 2 (`config::standard()`, serde mode) of an `Envelope<T>`
//! ```
//!
//! Readers validate the header field by field (magic, version, kind, flags, length against the
//! maximum frame size) before they allocate anything for the payload, then grow the payload
//! buffer only as bytes actually arrive, check the CRC, and decode with a bincode byte limit
//! derived from the maximum frame size.

use std::fmt;
use std::io::{self, Read, Write};

use bincode::config::Config;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::message::{Envelope, Event, Request, Response};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"BLYR";

/// The protocol version this crate speaks; frames carrying any other version are refused.
pub const PROTOCOL_VERSION: u16 = 12;

/// Size of the frame header in bytes.
pub const HEADER_LEN: usize = 16;

/// Default maximum payload length in bytes (16 MiB); the 16-byte header is not counted.
pub const DEFAULT_MAX_FRAME: u32 = 16 * 1024 * 1024;

/// What a frame carries, byte 6 of the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// A client request (`Envelope<Request>`).
    Request = 1,
    /// A daemon response (`Envelope<Response>`).
    Response = 2,
    /// An asynchronous event (`Envelope<Event>`, id 0).
    Event = 3,
    /// A memory-server request (`Envelope<MemRequest>`, see [`crate::memory`]).
    MemRequest = 4,
    /// A memory-server response (`Envelope<MemResponse>`, region fds attached by
    /// `SCM_RIGHTS`).
    MemResponse = 5,
}

impl Kind {
    /// The kind with wire value `byte`, or `None` for an unknown value.
    pub fn from_byte(byte: u8) -> Option<Kind> {
        match byte {
            1 => Some(Kind::Request),
            2 => Some(Kind::Response),
            3 => Some(Kind::Event),
            4 => Some(Kind::MemRequest),
            5 => Some(Kind::MemResponse),
            _ => None,
        }
    }

    /// The wire value of this kind.
    pub fn byte(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Request => "request",
            Kind::Response => "response",
            Kind::Event => "event",
            Kind::MemRequest => "memory request",
            Kind::MemResponse => "memory response",
        })
    }
}

/// A message type that travels in frames of one fixed [`Kind`].
pub trait Message: Serialize + DeserializeOwned {
    /// The frame kind that carries this message type.
    const KIND: Kind;
}

impl Message for Request {
    const KIND: Kind = Kind::Request;
}

impl Message for Response {
    const KIND: Kind = Kind::Response;
}

impl Message for Event {
    const KIND: Kind = Kind::Event;
}

/// Why a frame could not be encoded, read, written or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {got:02x?}, expected \"BLYR\"")]
    BadMagic {
        /// The four bytes received.
        got: [u8; 4],
    },
    /// The header carries a protocol version other than [`PROTOCOL_VERSION`].
    #[error("unsupported protocol version {got} (supported: {supported})")]
    UnsupportedVersion {
        /// Version in the header.
        got: u16,
        /// Version this side speaks.
        supported: u16,
    },
    /// The kind byte is not one of 1 to 5.
    #[error("unknown message kind {got}")]
    UnknownKind {
        /// Kind byte in the header.
        got: u8,
    },
    /// A valid kind, but not the one the reader expected (e.g. a response sent to the server).
    #[error("unexpected {got} frame, expected a {expected} frame")]
    UnexpectedKind {
        /// Kind the reader wanted.
        expected: Kind,
        /// Kind in the header.
        got: Kind,
    },
    /// The reserved flags byte is not zero.
    #[error("reserved flags {got:#04x} are not zero")]
    NonzeroFlags {
        /// Flags byte in the header.
        got: u8,
    },
    /// The payload length exceeds the maximum frame size.
    #[error("payload of {len} bytes exceeds the maximum frame size of {max} bytes")]
    TooLarge {
        /// Payload length in bytes (claimed by the header, or produced by the encoder).
        len: u64,
        /// Maximum payload length in bytes.
        max: u32,
    },
    /// The CRC32 of the payload differs from the one in the header.
    #[error("payload crc32 mismatch: header says {expected:#010x}, payload has {actual:#010x}")]
    CrcMismatch {
        /// CRC32 from the header.
        expected: u32,
        /// CRC32 computed over the received payload.
        actual: u32,
    },
    /// The stream ended in the middle of a frame.
    #[error("stream ended mid-frame: got {got} of {expected} {part} bytes")]
    Truncated {
        /// `"header"` or `"payload"`.
        part: &'static str,
        /// Bytes the part should have.
        expected: usize,
        /// Bytes received before the end of the stream.
        got: usize,
    },
    /// The stream ended cleanly before the first byte of a frame.
    #[error("connection closed")]
    Closed,
    /// bincode could not encode the envelope.
    #[error("encoding the payload failed")]
    Encode {
        /// The bincode error.
        #[source]
        source: bincode::error::EncodeError,
    },
    /// bincode could not decode the payload (malformed, unknown variant, over the byte limit).
    #[error("decoding the {kind} payload failed")]
    Decode {
        /// Kind of the frame being decoded.
        kind: Kind,
        /// The bincode error.
        #[source]
        source: bincode::error::DecodeError,
    },
    /// The payload holds bytes after the encoded envelope.
    #[error("payload has {trailing} bytes after the encoded message")]
    TrailingBytes {
        /// Number of unused bytes.
        trailing: usize,
    },
    /// Reading from the stream failed.
    #[error("reading a frame failed")]
    Read {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Writing to the stream failed.
    #[error("writing a frame failed")]
    Write {
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// A parsed and validated frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the payload carries.
    pub kind: Kind,
    /// Payload length in bytes.
    pub len: u32,
    /// CRC32 of the payload.
    pub crc: u32,
}

impl Header {
    /// The 16 wire bytes of this header (magic, [`PROTOCOL_VERSION`], kind, zero flags, length,
    /// CRC).
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[0..4].copy_from_slice(&MAGIC);
        bytes[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        bytes[6] = self.kind.byte();
        bytes[7] = 0;
        bytes[8..12].copy_from_slice(&self.len.to_le_bytes());
        bytes[12..16].copy_from_slice(&self.crc.to_le_bytes());
        bytes
    }

    /// Parses and validates 16 header bytes: magic, version, kind, flags and length (at most
    /// `max_frame` bytes), in that order.
    ///
    /// Errors: [`FrameError::BadMagic`], [`FrameError::UnsupportedVersion`],
    /// [`FrameError::UnknownKind`], [`FrameError::NonzeroFlags`], [`FrameError::TooLarge`].
    pub fn parse(bytes: &[u8; HEADER_LEN], max_frame: u32) -> Result<Header, FrameError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { got: magic });
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion {
                got: version,
                supported: PROTOCOL_VERSION,
            });
        }
        let kind = Kind::from_byte(bytes[6]).ok_or(FrameError::UnknownKind { got: bytes[6] })?;
        if bytes[7] != 0 {
            return Err(FrameError::NonzeroFlags { got: bytes[7] });
        }
        let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if len > max_frame {
            return Err(FrameError::TooLarge {
                len: u64::from(len),
                max: max_frame,
            });
        }
        let crc = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        Ok(Header { kind, len, crc })
    }
}

/// A frame whose header and CRC were checked but whose payload is not decoded yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    /// Kind from the header.
    pub kind: Kind,
    /// The payload bytes (CRC verified).
    pub payload: Vec<u8>,
}

impl RawFrame {
    /// Decodes the payload as an `Envelope<M>`, checking that the frame kind is `M::KIND`.
    ///
    /// `max_frame` bounds what bincode may allocate for claimed lengths inside the payload.
    ///
    /// Errors: [`FrameError::UnexpectedKind`], [`FrameError::Decode`],
    /// [`FrameError::TrailingBytes`].
    pub fn decode<M: Message>(&self, max_frame: u32) -> Result<Envelope<M>, FrameError> {
        if self.kind != M::KIND {
            return Err(FrameError::UnexpectedKind {
                expected: M::KIND,
                got: self.kind,
            });
        }
        decode_payload(self.kind, &self.payload, max_frame)
    }
}

/// Encodes `envelope` into one frame (header and payload), ready to be written.
///
/// Errors: [`FrameError::Encode`], or [`FrameError::TooLarge`] when the payload exceeds
/// `max_frame` bytes.
pub fn encode_frame<M: Message>(
    envelope: &Envelope<M>,
    max_frame: u32,
) -> Result<Vec<u8>, FrameError> {
    let payload = bincode::serde::encode_to_vec(envelope, bincode::config::standard())
        .map_err(|source| FrameError::Encode { source })?;
    let len = match u32::try_from(payload.len()) {
        Ok(len) if len <= max_frame => len,
        _ => {
            return Err(FrameError::TooLarge {
                len: payload.len() as u64,
                max: max_frame,
            })
        }
    };
    let header = Header {
        kind: M::KIND,
        len,
        crc: crc32fast::hash(&payload),
    };
    let mut frame = Vec::with_capacity(HEADER_LEN + payload.len());
    frame.extend_from_slice(&header.to_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Decodes one frame of kind `M::KIND` from the start of `bytes`; returns the envelope and the
/// number of bytes the frame occupied.
///
/// Errors: as [`read_frame`]; a slice that ends mid-frame gives [`FrameError::Truncated`] (an
/// empty slice gives [`FrameError::Closed`]).
pub fn decode_frame<M: Message>(
    bytes: &[u8],
    max_frame: u32,
) -> Result<(Envelope<M>, usize), FrameError> {
    let mut reader = bytes;
    let envelope = read_frame(&mut reader, max_frame)?;
    Ok((envelope, bytes.len() - reader.len()))
}

/// Reads one frame from `reader` and checks its header and CRC, without decoding the payload.
///
/// The payload buffer grows only as bytes arrive, so a header claiming a large length costs no
/// memory until the data is really sent.
///
/// Errors: [`FrameError::Closed`] when the stream ends before the first byte,
/// [`FrameError::Truncated`] when it ends later, the header errors of [`Header::parse`],
/// [`FrameError::CrcMismatch`], [`FrameError::Read`].
pub fn read_raw_frame<R: Read>(reader: &mut R, max_frame: u32) -> Result<RawFrame, FrameError> {
    let mut header_bytes = [0u8; HEADER_LEN];
    let got = read_full(reader, &mut header_bytes)?;
    if got == 0 {
        return Err(FrameError::Closed);
    }
    if got < HEADER_LEN {
        return Err(FrameError::Truncated {
            part: "header",
            expected: HEADER_LEN,
            got,
        });
    }
    let header = Header::parse(&header_bytes, max_frame)?;
    let expected = header.len as usize;
    let mut payload = Vec::new();
    reader
        .take(u64::from(header.len))
        .read_to_end(&mut payload)
        .map_err(|source| FrameError::Read { source })?;
    if payload.len() < expected {
        return Err(FrameError::Truncated {
            part: "payload",
            expected,
            got: payload.len(),
        });
    }
    let actual = crc32fast::hash(&payload);
    if actual != header.crc {
        return Err(FrameError::CrcMismatch {
            expected: header.crc,
            actual,
        });
    }
    Ok(RawFrame {
        kind: header.kind,
        payload,
    })
}

/// Reads one frame of kind `M::KIND` from `reader` and decodes its envelope.
///
/// Errors: those of [`read_raw_frame`] and [`RawFrame::decode`].
pub fn read_frame<M: Message, R: Read>(
    reader: &mut R,
    max_frame: u32,
) -> Result<Envelope<M>, FrameError> {
    read_raw_frame(reader, max_frame)?.decode(max_frame)
}

/// Encodes `envelope` and writes the whole frame to `writer` (one `write_all`), then flushes.
///
/// Errors: those of [`encode_frame`], [`FrameError::Write`].
pub fn write_frame<M: Message, W: Write>(
    writer: &mut W,
    envelope: &Envelope<M>,
    max_frame: u32,
) -> Result<(), FrameError> {
    let frame = encode_frame(envelope, max_frame)?;
    writer
        .write_all(&frame)
        .and_then(|()| writer.flush())
        .map_err(|source| FrameError::Write { source })
}

/// Writes `event` as an event frame (kind 3, envelope id 0).
///
/// Errors: those of [`write_frame`].
pub fn send_event<W: Write>(
    writer: &mut W,
    event: &Event,
    max_frame: u32,
) -> Result<(), FrameError> {
    let envelope = Envelope {
        id: 0,
        body: event.clone(),
    };
    write_frame(writer, &envelope, max_frame)
}

/// Reads one event frame (kind 3) and returns its event.
///
/// Errors: those of [`read_frame`]; a frame of another kind gives
/// [`FrameError::UnexpectedKind`].
pub fn recv_event<R: Read>(reader: &mut R, max_frame: u32) -> Result<Event, FrameError> {
    read_frame::<Event, R>(reader, max_frame).map(|envelope| envelope.body)
}

/// Reads until `buf` is full or the stream ends; returns the number of bytes read.
fn read_full<R: Read>(reader: &mut R, buf: &mut [u8]) -> Result<usize, FrameError> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => return Err(FrameError::Read { source }),
        }
    }
    Ok(filled)
}

/// Decodes `payload` as an `Envelope<T>` with a bincode byte limit of at least `max_frame`.
///
/// bincode takes its limit as a const generic, so the limit is the smallest of a fixed ladder
/// (64 KiB, then ×4 up to 4 GiB) that is at least `max_frame` (exactly `max_frame` for the
/// default 16 MiB). The limit caps what a claimed length inside the payload may allocate.
fn decode_payload<T: DeserializeOwned>(
    kind: Kind,
    payload: &[u8],
    max_frame: u32,
) -> Result<Envelope<T>, FrameError> {
    let limit = u64::from(max_frame).max(payload.len() as u64);
    let standard = bincode::config::standard();
    let decoded = if limit <= 1 << 16 {
        decode_with(payload, standard.with_limit::<{ 1 << 16 }>())
    } else if limit <= 1 << 18 {
        decode_with(payload, standard.with_limit::<{ 1 << 18 }>())
    } else if limit <= 1 << 20 {
        decode_with(payload, standard.with_limit::<{ 1 << 20 }>())
    } else if limit <= 1 << 22 {
        decode_with(payload, standard.with_limit::<{ 1 << 22 }>())
    } else if limit <= 1 << 24 {
        decode_with(payload, standard.with_limit::<{ 1 << 24 }>())
    } else if limit <= 1 << 26 {
        decode_with(payload, standard.with_limit::<{ 1 << 26 }>())
    } else if limit <= 1 << 28 {
        decode_with(payload, standard.with_limit::<{ 1 << 28 }>())
    } else if limit <= 1 << 30 {
        decode_with(payload, standard.with_limit::<{ 1 << 30 }>())
    } else {
        decode_with(payload, standard.with_limit::<{ 1 << 32 }>())
    };
    let (envelope, used) = decoded.map_err(|source| FrameError::Decode { kind, source })?;
    if used != payload.len() {
        return Err(FrameError::TrailingBytes {
            trailing: payload.len() - used,
        });
    }
    Ok(envelope)
}

fn decode_with<T: DeserializeOwned, C: Config>(
    payload: &[u8],
    config: C,
) -> Result<(Envelope<T>, usize), bincode::error::DecodeError> {
    bincode::serde::decode_from_slice(payload, config)
}

#[cfg(test)]
mod tests;
