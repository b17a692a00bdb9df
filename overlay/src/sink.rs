//! Where capture writes a tar: [`ArchiveWriter`] (a file, with positioned writes so the
//! kernel can copy file content straight into it) and [`StreamWriter`] (any forward-only
//! stream, such as the pipe of an image import), behind the [`Sink`] trait.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd};

use crate::sys::{self, SyscallError};

/// Where capture writes: header bytes through [`Write`], file content by [`append_content`].
///
/// [`append_content`]: Sink::append_content
pub(crate) trait Sink: Write {
    /// Appends up to `size` bytes of `src` (from offset 0) and the zero padding to the next
    /// 512-byte block; returns the bytes of content copied (less than `size` only when
    /// `src` ended early, in which case no padding is written).
    fn append_content(&mut self, src: BorrowedFd<'_>, size: u64) -> Result<u64, SyscallError>;
    /// Bytes written so far, buffered ones included.
    fn position(&self) -> u64;
}

/// The archive file behind a 1 MiB buffer, written with positioned writes so that file
/// content can be copied in by the kernel at the right offset.
pub(crate) struct ArchiveWriter {
    file: File,
    buf: Vec<u8>,
    /// Bytes already in the file.
    written: u64,
}

impl std::fmt::Debug for ArchiveWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArchiveWriter")
            .field("written", &self.written)
            .field("buffered", &self.buf.len())
            .finish()
    }
}

const BUFFER_BYTES: usize = 1 << 20;
/// Files up to this size are read into the buffer; larger ones are copied by the kernel.
pub(crate) const INLINE_MAX_BYTES: u64 = 256 << 10;
const BLOCK: u64 = 512;

impl ArchiveWriter {
    pub(crate) fn new(file: File) -> Self {
        Self {
            file,
            buf: Vec::with_capacity(BUFFER_BYTES),
            written: 0,
        }
    }

    fn flush_buffer(&mut self) -> Result<(), SyscallError> {
        if !self.buf.is_empty() {
            sys::write_all_at(self.file.as_fd(), &self.buf, self.written)?;
            self.written += self.buf.len() as u64;
            self.buf.clear();
        }
        Ok(())
    }
}

impl Sink for ArchiveWriter {
    fn position(&self) -> u64 {
        self.written + self.buf.len() as u64
    }

    fn append_content(&mut self, src: BorrowedFd<'_>, size: u64) -> Result<u64, SyscallError> {
        let copied = if size <= INLINE_MAX_BYTES {
            let size = size as usize;
            if self.buf.len() + size > self.buf.capacity() {
                self.flush_buffer()?;
            }
            let start = self.buf.len();
            self.buf.resize(start + size, 0);
            let n = sys::read_full_at(src, &mut self.buf[start..], 0)?;
            self.buf.truncate(start + n);
            n as u64
        } else {
            self.flush_buffer()?;
            let n = sys::copy_range(src, 0, self.file.as_fd(), self.written, size)?;
            self.written += n;
            n
        };
        if copied == size {
            let pad = (BLOCK - size % BLOCK) % BLOCK;
            self.buf.extend(std::iter::repeat_n(0u8, pad as usize));
        }
        Ok(copied)
    }
}

/// A forward-only stream (a pipe) behind the caller's buffering: content is read from the
/// source with `pread` in 256 KiB chunks and written on.
pub(crate) struct StreamWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
    written: u64,
}

impl<W: Write> StreamWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        Self {
            out,
            buf: vec![0; INLINE_MAX_BYTES as usize],
            written: 0,
        }
    }
}

impl<W: Write> Write for StreamWriter<W> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = self.out.write(data)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl<W: Write> Sink for StreamWriter<W> {
    fn position(&self) -> u64 {
        self.written
    }

    fn append_content(&mut self, src: BorrowedFd<'_>, size: u64) -> Result<u64, SyscallError> {
        let mut copied = 0u64;
        while copied < size {
            let want = (size - copied).min(self.buf.len() as u64) as usize;
            let n = sys::read_full_at(src, &mut self.buf[..want], copied)?;
            self.out
                .write_all(&self.buf[..n])
                .map_err(|e| SyscallError::new("write", e))?;
            self.written += n as u64;
            copied += n as u64;
            if n < want {
                return Ok(copied);
            }
        }
        let pad = ((BLOCK - size % BLOCK) % BLOCK) as usize;
        self.buf[..pad].fill(0);
        self.out
            .write_all(&self.buf[..pad])
            .map_err(|e| SyscallError::new("write", e))?;
        self.written += pad as u64;
        Ok(copied)
    }
}

impl Write for ArchiveWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if self.buf.len() + data.len() > self.buf.capacity() {
            self.flush_buffer().map_err(|e| e.source)?;
        }
        if data.len() >= self.buf.capacity() {
            sys::write_all_at(self.file.as_fd(), data, self.written).map_err(|e| e.source)?;
            self.written += data.len() as u64;
        } else {
            self.buf.extend_from_slice(data);
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.flush_buffer().map_err(|e| e.source)
    }
}
