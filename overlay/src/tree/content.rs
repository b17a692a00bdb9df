//! Where the tree builder reads regular-file content from: a seekable tar archive (copied
//! with `copy_file_range`), the blob store of the layer format (extents placed with
//! `copy_file_range`, holes left as holes, blobs optionally re-hashed), or a tar stream (read
//! through a bounded buffer). [`ContentSource::fill`] writes one new file from its source.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};

use super::error::{path_of, InstallError};
use crate::layer::blobs::BlobStore;
use crate::layer::manifest::{BlobId, Extent};
use crate::sys::{self, Call};

/// Bytes copied per read from a streamed member.
const STREAM_CHUNK: usize = 256 << 10;

/// Where a regular file's content comes from.
pub(crate) enum RegularData {
    /// `size` bytes at `offset` of the tar archive being installed.
    Archive { offset: u64 },
    /// The data extents of the file, filled from one blob of the store (the extents'
    /// bytes concatenated); the rest of the file is holes.
    Blob {
        blob: Option<BlobId>,
        extents: Vec<Extent>,
    },
    /// `size` bytes read from the member's reader in a tar stream.
    Stream,
}

impl RegularData {
    /// Bytes of data the file holds (holes excluded), given its apparent size.
    pub(super) fn data_bytes(&self, size: u64) -> u64 {
        match self {
            RegularData::Archive { .. } | RegularData::Stream => size,
            RegularData::Blob { extents, .. } => extents.iter().map(|e| e.len).sum(),
        }
    }
}

/// Where the builder reads regular-file content from.
pub(crate) enum ContentSource<'a> {
    /// The tar archive file (members carry [`RegularData::Archive`]).
    Archive(&'a File),
    /// The blob store (members carry [`RegularData::Blob`]); `verify` re-hashes every
    /// blob while copying it.
    Blobs { store: &'a BlobStore, verify: bool },
    /// A tar stream (members carry [`RegularData::Stream`]; the content reader comes with
    /// each member, see [`Installer::install_from`](super::Installer::install_from)).
    Stream,
}

impl ContentSource<'_> {
    /// Writes the content of a new regular file of `size` bytes (`buf`: the copy buffer for
    /// streamed content, allocated on first use); returns the data bytes written (holes are
    /// left as holes) and, of those, the bytes placed with `copy_file_range` (extents
    /// possibly shared with the source).
    pub(super) fn fill(
        &self,
        fd: BorrowedFd<'_>,
        raw: &[u8],
        size: u64,
        data: &RegularData,
        reader: Option<&mut dyn Read>,
        buf: &mut Vec<u8>,
    ) -> Result<(u64, u64), InstallError> {
        match (data, self) {
            (RegularData::Stream, ContentSource::Stream) => match reader {
                Some(reader) => fill_from_stream(buf, fd, raw, size, reader).map(|n| (n, 0)),
                None => Err(InstallError::UnsupportedEntry {
                    path: path_of(raw),
                    kind: '0',
                }),
            },
            (RegularData::Archive { offset }, ContentSource::Archive(archive)) => {
                if size == 0 {
                    return Ok((0, 0));
                }
                let copied =
                    sys::copy_range(archive.as_fd(), *offset, fd, 0, size).map_err(|source| {
                        InstallError::CopyContent {
                            path: path_of(raw),
                            source,
                        }
                    })?;
                if copied < size {
                    return Err(InstallError::ArchiveTruncated {
                        path: path_of(raw),
                        expected: size,
                        copied,
                    });
                }
                Ok((size, size))
            }
            (RegularData::Blob { blob, extents }, ContentSource::Blobs { store, verify }) => {
                let covered = extents.last().map_or(0, |e| e.offset + e.len);
                if covered < size {
                    // Trailing hole: the file gets its apparent size without data.
                    rustix::fs::ftruncate(fd, size)
                        .call("ftruncate")
                        .map_err(|source| InstallError::CopyContent {
                            path: path_of(raw),
                            source,
                        })?;
                }
                match blob {
                    Some(blob) => {
                        store
                            .write_extents(blob, extents, fd, *verify)
                            .map_err(|source| InstallError::Blob {
                                path: path_of(raw),
                                source,
                            })
                    }
                    None => Ok((0, 0)),
                }
            }
            _ => Err(InstallError::UnsupportedEntry {
                path: path_of(raw),
                kind: '0',
            }),
        }
    }
}

/// Copies exactly `size` bytes from `reader` into the new file `fd`.
fn fill_from_stream(
    buf: &mut Vec<u8>,
    fd: BorrowedFd<'_>,
    raw: &[u8],
    size: u64,
    reader: &mut dyn Read,
) -> Result<u64, InstallError> {
    if buf.is_empty() {
        *buf = vec![0; STREAM_CHUNK];
    }
    let mut copied = 0u64;
    while copied < size {
        let want = (size - copied).min(buf.len() as u64) as usize;
        let n = match reader.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(InstallError::ArchiveTruncated {
                    path: path_of(raw),
                    expected: size,
                    copied,
                })
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(source) => {
                return Err(InstallError::ReadMember {
                    path: path_of(raw),
                    source,
                })
            }
        };
        sys::write_all_at(fd, &buf[..n], copied).map_err(|source| InstallError::CopyContent {
            path: path_of(raw),
            source,
        })?;
        copied += n as u64;
    }
    Ok(size)
}
