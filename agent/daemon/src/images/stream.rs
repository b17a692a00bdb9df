//! Byte streams of image sources: positional reads of a client's file ([`RangeReader`]: the
//! descriptor's shared offset never moves, and a blob of a docker archive is a byte range of
//! it), decompression chosen by magic bytes ([`decompress`]), and digests computed while the
//! bytes pass ([`Hashing`]).

use std::io::{self, BufRead, BufReader, Cursor, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use sha2::{Digest as _, Sha256};

/// Reads `[offset, end)` of a file with `pread`, never moving the descriptor's shared file
/// offset (the client may still use it). A file that ends before `end` reads short, which
/// the caller's size and digest checks catch.
#[derive(Debug)]
pub struct RangeReader {
    fd: Arc<OwnedFd>,
    offset: u64,
    end: u64,
}

impl RangeReader {
    /// The whole file from `offset` on.
    pub fn from(fd: Arc<OwnedFd>, offset: u64) -> RangeReader {
        RangeReader {
            fd,
            offset,
            end: u64::MAX,
        }
    }

    /// `len` bytes from `offset`.
    pub fn range(fd: Arc<OwnedFd>, offset: u64, len: u64) -> RangeReader {
        RangeReader {
            fd,
            offset,
            end: offset.saturating_add(len),
        }
    }
}

impl Read for RangeReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.offset);
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let n = rustix::io::pread(self.fd.as_fd(), &mut buf[..want], self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

/// How a stream is compressed, by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar.
    None,
    /// gzip (`1f 8b`).
    Gzip,
    /// zstd (`28 b5 2f fd`).
    Zstd,
}

/// Wraps `reader` in the decompressor its first bytes call for (plain, gzip or zstd) and
/// returns it with what was detected. The bytes peeked at are read again by the result.
///
/// Errors: reading the first bytes, or setting up zstd.
pub fn decompress<'a, R: Read + Send + 'a>(
    mut reader: R,
) -> io::Result<(Box<dyn Read + Send + 'a>, Compression)> {
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < magic.len() {
        match reader.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let joined = BufReader::with_capacity(1 << 20, Cursor::new(magic[..n].to_vec()).chain(reader));
    Ok(if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        (
            Box::new(flate2::read::MultiGzDecoder::new(joined)),
            Compression::Gzip,
        )
    } else if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        (
            Box::new(zstd::stream::read::Decoder::with_buffer(joined)?),
            Compression::Zstd,
        )
    } else {
        (Box::new(joined), Compression::None)
    })
}

/// A reader that hashes (SHA-256) and counts every byte read through it; [`Hashing::digest`]
/// names the result as OCI does (`sha256:<hex>`).
#[derive(Debug)]
pub struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    bytes: u64,
    failure: Option<String>,
}

impl<R> Hashing<R> {
    /// Starts hashing what `inner` yields.
    pub fn new(inner: R) -> Hashing<R> {
        Hashing {
            inner,
            hasher: Sha256::new(),
            bytes: 0,
            failure: None,
        }
    }

    /// The first read error of the inner stream, if one failed (a failed read of the source,
    /// as opposed to a refusal of what it yielded).
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Bytes read so far.
    pub fn count(&self) -> u64 {
        self.bytes
    }

    /// `sha256:<hex>` of the bytes read so far.
    pub fn digest(&self) -> String {
        format!("sha256:{}", hex(&self.hasher.clone().finalize()))
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = match self.inner.read(buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Err(e),
            Err(e) => {
                self.failure.get_or_insert_with(|| e.to_string());
                return Err(e);
            }
        };
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// Reads `reader` to its end, discarding the bytes (they still pass through any
/// [`Hashing`] below it); returns how many there were.
pub fn drain<R: Read + ?Sized>(reader: &mut R) -> io::Result<u64> {
    io::copy(reader, &mut io::sink())
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

/// Whether `digest` is `sha256:` and 64 lowercase hex digits (the only algorithm accepted:
/// digests become file names of the layer store).
pub fn valid_sha256(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A [`BufRead`] adapter is what the tar reader wants; this keeps the import of the trait
/// in one place for callers that pass a decompressed stream on.
pub fn buffered<'a, R: Read + 'a>(reader: R) -> impl BufRead + 'a {
    BufReader::with_capacity(256 << 10, reader)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_and_hashes() {
        let plain = b"hello tar".to_vec();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &plain).unwrap();
        let gz = gz.finish().unwrap();
        let zst = zstd::encode_all(&plain[..], 1).unwrap();
        for (bytes, kind) in [
            (plain.clone(), Compression::None),
            (gz, Compression::Gzip),
            (zst, Compression::Zstd),
        ] {
            let mut outer = Hashing::new(Cursor::new(bytes.clone()));
            let (mut r, got) = decompress(&mut outer).unwrap();
            assert_eq!(got, kind);
            let mut inner = Hashing::new(&mut r);
            let mut out = Vec::new();
            inner.read_to_end(&mut out).unwrap();
            assert_eq!(out, plain);
            assert_eq!(inner.digest(), sha256_digest(&plain));
            drop(r);
            assert_eq!(outer.digest(), sha256_digest(&bytes));
        }
        // Shorter than the magic.
        let (mut r, kind) = decompress(Cursor::new(vec![0x1f])).unwrap();
        assert_eq!(kind, Compression::None);
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        assert_eq!(out, vec![0x1f]);
    }

    #[test]
    fn digests() {
        assert!(valid_sha256(&sha256_digest(b"")));
        for bad in ["sha256:", "sha512:00", "sha256:ABC", "sha256:../../x"] {
            assert!(!valid_sha256(bad), "{bad}");
        }
    }
}
