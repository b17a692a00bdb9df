//! File header and record framing: `[u32 LE length][u32 LE crc32][payload]`.
//!
//! [`read_frame`] checks a whole frame held in memory (a record read back by one `pread`);
//! [`parse_head`] the header alone (the streaming scan on open, which reads the payload only
//! once the header said how long it is).

/// Magic at the start of every context log.
pub(super) const MAGIC: [u8; 8] = *b"BLYCTXL\0";

/// Format version written in the header; a reader refuses other versions.
pub const FORMAT_VERSION: u32 = 1;

/// Size of the file header: magic (8 bytes) + version (u32 LE), bytes.
pub const HEADER_BYTES: u64 = 12;

/// Size of a frame header: payload length (u32 LE) + crc32 (u32 LE), bytes.
pub const FRAME_HEADER_BYTES: u64 = 8;

/// Largest payload of one record, bytes (64 MiB). A frame announcing more is treated as damage.
pub const MAX_RECORD_BYTES: u32 = 64 << 20;

/// The header of a new log.
pub(super) fn header() -> [u8; HEADER_BYTES as usize] {
    let mut h = [0u8; HEADER_BYTES as usize];
    h[..8].copy_from_slice(&MAGIC);
    h[8..].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    h
}

/// What the first bytes of a file say.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HeaderCheck {
    /// Complete header of this version.
    Valid,
    /// Shorter than a header but a prefix of one: a creation that was cut short.
    Torn,
    /// Not a context log.
    BadMagic,
    /// A context log of another version.
    Version(u32),
}

pub(super) fn check_header(bytes: &[u8]) -> HeaderCheck {
    let expected = header();
    if bytes.len() < expected.len() {
        return if expected.starts_with(bytes) {
            HeaderCheck::Torn
        } else {
            HeaderCheck::BadMagic
        };
    }
    if bytes[..8] != MAGIC {
        return HeaderCheck::BadMagic;
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version == FORMAT_VERSION {
        HeaderCheck::Valid
    } else {
        HeaderCheck::Version(version)
    }
}

/// Fills the frame header (`buf[..8]`) of the payload `buf[8..]` (whose length the caller has
/// bounded by [`MAX_RECORD_BYTES`]), so a frame is built in one buffer without a copy.
pub(super) fn seal_frame(buf: &mut [u8]) {
    let (head, payload) = buf.split_at_mut(FRAME_HEADER_BYTES as usize);
    let len = u32::try_from(payload.len()).expect("payload bounded by MAX_RECORD_BYTES");
    head[..4].copy_from_slice(&len.to_le_bytes());
    head[4..].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
}

/// A frame around `payload` (whose length the caller has bounded by [`MAX_RECORD_BYTES`]).
#[cfg(test)]
pub(super) fn encode_frame(payload: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; FRAME_HEADER_BYTES as usize];
    out.extend_from_slice(payload);
    seal_frame(&mut out);
    out
}

/// What a frame header says: the payload length and crc32, or a length no frame has.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum FrameHead {
    /// A plausible header.
    Valid {
        /// Payload length, bytes (1 ..= [`MAX_RECORD_BYTES`]).
        len: u32,
        /// Stored crc32 of the payload.
        crc: u32,
    },
    /// The announced payload length is 0 or above [`MAX_RECORD_BYTES`].
    BadLength {
        /// The announced length.
        len: u32,
    },
}

/// Parses a frame header.
pub(super) fn parse_head(head: &[u8; FRAME_HEADER_BYTES as usize]) -> FrameHead {
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    // No record encodes to 0 bytes; a zero length is what a zero-filled tail after a crash reads as.
    if len == 0 || len > MAX_RECORD_BYTES {
        FrameHead::BadLength { len }
    } else {
        FrameHead::Valid { len, crc }
    }
}

/// Result of reading the frame at the start of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum FrameRead<'a> {
    /// No bytes left.
    End,
    /// A complete frame whose CRC matches; `frame_len` counts header and payload.
    Frame { payload: &'a [u8], frame_len: usize },
    /// The buffer ends inside the frame header or payload.
    Short,
    /// The announced payload length is 0 or above [`MAX_RECORD_BYTES`].
    BadLength { len: u32 },
    /// The payload's crc32 differs from the stored one.
    Crc { stored: u32, computed: u32 },
}

pub(super) fn read_frame(buf: &[u8]) -> FrameRead<'_> {
    if buf.is_empty() {
        return FrameRead::End;
    }
    let Some(head) = buf
        .get(..FRAME_HEADER_BYTES as usize)
        .and_then(|h| <&[u8; FRAME_HEADER_BYTES as usize]>::try_from(h).ok())
    else {
        return FrameRead::Short;
    };
    let (len, stored) = match parse_head(head) {
        FrameHead::Valid { len, crc } => (len, crc),
        FrameHead::BadLength { len } => return FrameRead::BadLength { len },
    };
    let frame_len = FRAME_HEADER_BYTES as usize + len as usize;
    let Some(payload) = buf.get(FRAME_HEADER_BYTES as usize..frame_len) else {
        return FrameRead::Short;
    };
    let computed = crc32fast::hash(payload);
    if computed != stored {
        return FrameRead::Crc { stored, computed };
    }
    FrameRead::Frame { payload, frame_len }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_checks() {
        let h = header();
        assert_eq!(check_header(&h), HeaderCheck::Valid);
        assert_eq!(check_header(&h[..5]), HeaderCheck::Torn);
        assert_eq!(check_header(&[]), HeaderCheck::Torn);
        assert_eq!(check_header(b"XYZ"), HeaderCheck::BadMagic);
        assert_eq!(check_header(b"not a context log"), HeaderCheck::BadMagic);
        let mut v2 = h;
        v2[8] = 2;
        assert_eq!(check_header(&v2), HeaderCheck::Version(2));
    }

    #[test]
    fn frame_round_trip_and_damage() {
        let f = encode_frame(b"hello");
        assert_eq!(f.len(), 13);
        assert_eq!(
            read_frame(&f),
            FrameRead::Frame {
                payload: b"hello",
                frame_len: 13
            }
        );
        for cut in 1..f.len() {
            assert_eq!(read_frame(&f[..cut]), FrameRead::Short, "cut at {cut}");
        }
        assert_eq!(read_frame(&[]), FrameRead::End);
        let mut bad = f.clone();
        bad[10] ^= 0x01;
        assert!(matches!(read_frame(&bad), FrameRead::Crc { .. }));
        assert_eq!(read_frame(&[0u8; 16]), FrameRead::BadLength { len: 0 });
        let mut huge = f;
        huge[..4].copy_from_slice(&(MAX_RECORD_BYTES + 1).to_le_bytes());
        assert_eq!(
            read_frame(&huge),
            FrameRead::BadLength {
                len: MAX_RECORD_BYTES + 1
            }
        );
    }
}
