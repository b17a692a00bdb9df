//! The two layers of a CRIU image file, read without generated code.
//!
//! **Framing** (CRIU's `criu/image.c`): a protobuf image starts with two little-endian `u32`
//! magics, the image-set magic ([`COMMON_MAGIC`]) and the image type's own (for example
//! `0x56303138` for `files.img`); `inventory.img` has only its type magic. Then come entries,
//! each a little-endian `u32` byte count followed by that many bytes of one protobuf message.
//! Some images (ghost files) carry raw data after their first entry.
//!
//! **Messages** use the protobuf wire format (proto2 as protobuf-c writes it): a sequence of
//! `(key, value)` pairs where the key is a varint `field_number << 3 | wire_type`. Wire types:
//! 0 varint, 1 fixed 64-bit, 2 length-delimited (strings, bytes, nested messages, packed
//! repeated fields), 5 fixed 32-bit. Groups (3, 4) are not used by CRIU and are refused.
//! `sint32` fields are zigzag-encoded varints. Unknown fields are skipped, as protobuf readers
//! do, so images from a CRIU that added fields still decode.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// First magic of every CRIU protobuf image except the inventory (`IMG_COMMON_MAGIC`).
pub(crate) const COMMON_MAGIC: u32 = 0x5456_4319;

/// Largest single entry accepted (CRIU's own messages are far below this).
const MAX_ENTRY: usize = 16 << 20;

/// Largest image file read whole (files.img of a tree with many open files stays far below).
pub(crate) const MAX_IMAGE: u64 = 256 << 20;

/// A malformed image or message: what was wrong and at which byte of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WireError {
    pub offset: u64,
    pub what: &'static str,
}

/// One field value, undecoded beyond its wire type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Value<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

impl<'a> Value<'a> {
    /// The value of a `uint32`/`enum`/`bool` field, if this is a varint.
    pub(crate) fn u32(self) -> Option<u32> {
        match self {
            // proto2 truncates a wider varint to the field's width.
            Value::Varint(v) => Some(v as u32),
            _ => None,
        }
    }

    /// The value of a `uint64` field, if this is a varint.
    pub(crate) fn u64(self) -> Option<u64> {
        match self {
            Value::Varint(v) => Some(v),
            _ => None,
        }
    }

    /// The value of a `sint32` field (zigzag), if this is a varint.
    pub(crate) fn sint32(self) -> Option<i32> {
        self.u32().map(|n| ((n >> 1) as i32) ^ -((n & 1) as i32))
    }

    /// The value of a `bool` field, if this is a varint.
    pub(crate) fn bool(self) -> Option<bool> {
        self.u64().map(|v| v != 0)
    }

    /// The bytes of a `string`/`bytes`/message field, if length-delimited.
    pub(crate) fn bytes(self) -> Option<&'a [u8]> {
        match self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }
}

/// Iterator over the fields of one message. `base` is the message's offset in its file, for
/// error positions.
#[derive(Debug, Clone)]
pub(crate) struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
    base: u64,
    failed: bool,
}

impl<'a> Fields<'a> {
    pub(crate) fn new(buf: &'a [u8], base: u64) -> Self {
        Fields {
            buf,
            pos: 0,
            base,
            failed: false,
        }
    }

    fn err(&mut self, what: &'static str) -> WireError {
        self.failed = true;
        WireError {
            offset: self.base + self.pos as u64,
            what,
        }
    }

    fn varint(&mut self) -> Result<u64, WireError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let Some(&b) = self.buf.get(self.pos) else {
                return Err(self.err("truncated varint"));
            };
            self.pos += 1;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        match self.pos.checked_add(n).filter(|end| *end <= self.buf.len()) {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err("field runs past the end of its message")),
        }
    }

    /// Offset (in the file) of the field last returned.
    pub(crate) fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.pos >= self.buf.len() {
            return None;
        }
        let one = (|| {
            let key = self.varint()?;
            let field = u32::try_from(key >> 3).map_err(|_| self.err("field number too large"))?;
            if field == 0 {
                return Err(self.err("field number 0"));
            }
            let value = match key & 7 {
                0 => Value::Varint(self.varint()?),
                1 => {
                    let b = self.take(8)?;
                    Value::Fixed64(u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                }
                2 => {
                    let n = self.varint()?;
                    let n = usize::try_from(n).map_err(|_| self.err("length too large"))?;
                    Value::Bytes(self.take(n)?)
                }
                5 => {
                    let b = self.take(4)?;
                    Value::Fixed32(u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
                }
                _ => return Err(self.err("unsupported wire type (group)")),
            };
            Ok((field, value))
        })();
        Some(one)
    }
}

/// Why an image could not be read: the file, or its framing.
#[derive(Debug)]
pub(crate) enum ImageError {
    Io(io::Error),
    Wire(WireError),
}

impl From<WireError> for ImageError {
    fn from(e: WireError) -> Self {
        ImageError::Wire(e)
    }
}

/// A whole image file in memory, split into its entries after the magics.
#[derive(Debug)]
pub(crate) struct Image {
    data: Vec<u8>,
    /// `(offset, len)` of each entry's message bytes.
    entries: Vec<(usize, usize)>,
}

impl Image {
    /// Reads `path` (at most [`MAX_IMAGE`] bytes), checks its magics (`type_magic`, after
    /// [`COMMON_MAGIC`] when `common`) and splits it into entries.
    pub(crate) fn read(path: &Path, type_magic: u32, common: bool) -> Result<Image, ImageError> {
        let file = File::open(path).map_err(ImageError::Io)?;
        let mut data = Vec::new();
        file.take(MAX_IMAGE + 1)
            .read_to_end(&mut data)
            .map_err(ImageError::Io)?;
        if data.len() as u64 > MAX_IMAGE {
            return Err(WireError {
                offset: MAX_IMAGE,
                what: "image larger than this check reads",
            }
            .into());
        }
        let mut pos = check_magics(&data, type_magic, common)?;
        let mut entries = Vec::new();
        while pos < data.len() {
            let len = entry_len(&data, pos)?;
            let start = pos + 4;
            if start + len > data.len() {
                return Err(WireError {
                    offset: pos as u64,
                    what: "entry runs past the end of the image",
                }
                .into());
            }
            entries.push((start, len));
            pos = start + len;
        }
        Ok(Image { data, entries })
    }

    /// The entries' messages, each with its offset in the file.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        self.entries
            .iter()
            .map(|&(off, len)| (off as u64, &self.data[off..off + len]))
    }
}

/// Reads only the first entry of `path` (for images whose payload follows it, like ghost
/// files, which may be hundreds of MiB): its magics, its length and its bytes.
pub(crate) fn read_first_entry(
    path: &Path,
    type_magic: u32,
    common: bool,
) -> Result<(u64, Vec<u8>), ImageError> {
    let mut file = File::open(path).map_err(ImageError::Io)?;
    let head_len = if common { 12 } else { 8 };
    let mut head = vec![0u8; head_len];
    file.read_exact(&mut head).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => ImageError::Wire(WireError {
            offset: 0,
            what: "image shorter than its header",
        }),
        _ => ImageError::Io(e),
    })?;
    let pos = check_magics(&head, type_magic, common)?;
    let len = entry_len(&head, pos)?;
    let mut msg = vec![0u8; len];
    file.read_exact(&mut msg).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => ImageError::Wire(WireError {
            offset: head_len as u64,
            what: "first entry runs past the end of the image",
        }),
        _ => ImageError::Io(e),
    })?;
    Ok((head_len as u64, msg))
}

fn le_u32(data: &[u8], pos: usize) -> Option<u32> {
    data.get(pos..pos + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Checks the magics at the start of `data`; returns the offset of the first entry.
fn check_magics(data: &[u8], type_magic: u32, common: bool) -> Result<usize, WireError> {
    let mut pos = 0;
    if common {
        if le_u32(data, 0) != Some(COMMON_MAGIC) {
            return Err(WireError {
                offset: 0,
                what: "not a criu image (image-set magic)",
            });
        }
        pos = 4;
    }
    if le_u32(data, pos) != Some(type_magic) {
        return Err(WireError {
            offset: pos as u64,
            what: "image type magic does not match its name",
        });
    }
    Ok(pos + 4)
}

fn entry_len(data: &[u8], pos: usize) -> Result<usize, WireError> {
    let len = le_u32(data, pos).ok_or(WireError {
        offset: pos as u64,
        what: "truncated entry length",
    })? as usize;
    if len > MAX_ENTRY {
        return Err(WireError {
            offset: pos as u64,
            what: "entry larger than 16 MiB",
        });
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(b: &[u8]) -> Vec<(u32, Value<'_>)> {
        Fields::new(b, 0).collect::<Result<_, _>>().unwrap()
    }

    #[test]
    fn decodes_each_wire_type() {
        // 1: varint 150; 2: bytes "hi"; 3: fixed32 7; 4: fixed64 9
        let msg = [
            0x08, 0x96, 0x01, 0x12, 2, b'h', b'i', 0x1d, 7, 0, 0, 0, 0x21, 9, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(
            fields(&msg),
            vec![
                (1, Value::Varint(150)),
                (2, Value::Bytes(b"hi")),
                (3, Value::Fixed32(7)),
                (4, Value::Fixed64(9)),
            ]
        );
    }

    #[test]
    fn zigzag_sint32() {
        assert_eq!(Value::Varint(140).sint32(), Some(70));
        assert_eq!(Value::Varint(1).sint32(), Some(-1));
        assert_eq!(Value::Varint(3).sint32(), Some(-2));
        assert_eq!(Value::Varint(0).sint32(), Some(0));
    }

    #[test]
    fn truncated_and_hostile_input_is_an_error_not_a_panic() {
        for bad in [
            &[0x08][..],          // key, no value
            &[0x12, 5, b'a'][..], // length past the end
            &[0x0b][..],          // group start
            &[0x00, 0x01][..],    // field 0
            &[0xff; 11][..],      // overlong varint
            &[
                0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ][..],
        ] {
            let r: Result<Vec<_>, _> = Fields::new(bad, 100).collect();
            let e = r.unwrap_err();
            assert!(e.offset >= 100, "{e:?}");
        }
    }

    #[test]
    fn framing_checks_magics_and_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.img");
        let mut data = Vec::new();
        data.extend_from_slice(&COMMON_MAGIC.to_le_bytes());
        data.extend_from_slice(&0x1234u32.to_le_bytes());
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&[0x08, 0x05]);
        std::fs::write(&p, &data).unwrap();
        let img = Image::read(&p, 0x1234, true).unwrap();
        let e: Vec<_> = img.entries().collect();
        assert_eq!(e, vec![(12, &[0x08u8, 0x05][..])]);
        assert!(matches!(
            Image::read(&p, 0x9999, true),
            Err(ImageError::Wire(_))
        ));
        assert_eq!(read_first_entry(&p, 0x1234, true).unwrap().1, vec![8, 5]);
        data.extend_from_slice(&9u32.to_le_bytes());
        std::fs::write(&p, &data).unwrap();
        assert!(matches!(
            Image::read(&p, 0x1234, true),
            Err(ImageError::Wire(_))
        ));
    }
}
