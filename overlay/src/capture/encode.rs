//! The tar encoding of a capture (format in the crate docs): the [`Capture`] writer, which
//! turns each walked entry into a GNU header plus, when needed, one PAX extension header
//! (`path`, `linkpath`, `mtime`, `SCHILY.xattr.*`), appends it through the `tar` crate's
//! [`Builder`] over a [`Sink`] (an archive file or a stream), and copies file content after
//! it; and [`CaptureStats`], what it wrote.

use std::collections::HashMap;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;

use rustix::fs::Statx;
use tar::{Builder, EntryType, Header};

use super::error::{rel_path, CaptureError};
use crate::format::{
    format_mtime, xattr_key, MAX_EXTENSION_BYTES, PAX_LINKPATH, PAX_MTIME, PAX_PATH,
};
use crate::sink::Sink;
use crate::sys::Xattr;
use crate::tree::InstallLimits;

/// What [`capture_upper`](super::capture_upper) or [`archive_tree`](super::archive_tree)
/// wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Archive members (directories, files, links, special files; PAX records not counted).
    pub entries: u64,
    /// Size of the archive file, in bytes.
    pub bytes: u64,
    /// Bytes of regular-file content archived (each hardlinked inode once).
    pub content_bytes: u64,
    /// Unix-domain socket files skipped (tar cannot hold them; a process that binds again
    /// after restore recreates its socket file).
    pub skipped_sockets: u64,
}

/// One capture in progress: the tar builder over its sink and what was written so far.
pub(super) struct Capture<S: Sink> {
    pub(super) builder: Builder<S>,
    pub(super) archive: PathBuf,
    /// First archived path of every inode with more than one link, by (device, inode).
    pub(super) links: HashMap<(u32, u32, u64), Vec<u8>>,
    pub(super) stats: CaptureStats,
    pub(super) limits: InstallLimits,
}

/// What one archive member describes besides the common metadata.
pub(super) enum Member<'a> {
    Directory,
    Regular {
        fd: BorrowedFd<'a>,
        size: u64,
    },
    Symlink {
        target: &'a [u8],
    },
    Hardlink {
        target: &'a [u8],
    },
    Device {
        kind: EntryType,
        major: u32,
        minor: u32,
    },
    Fifo,
}

impl<S: Sink> Capture<S> {
    /// Writes one member: checks the limits, builds its GNU header and PAX records (long
    /// names and link targets, nanosecond mtimes, extended attributes), appends both, then
    /// copies a regular file's content straight into the archive.
    pub(super) fn append(
        &mut self,
        name: &[u8],
        stat: &Statx,
        xattrs: &[Xattr],
        member: Member<'_>,
    ) -> Result<(), CaptureError> {
        let write_err = |source| CaptureError::WriteArchive {
            path: self.archive.clone(),
            source,
        };
        if self.stats.entries >= self.limits.max_entries {
            return Err(CaptureError::TooManyEntries {
                path: rel_path(name),
                max: self.limits.max_entries,
            });
        }
        if let Member::Regular { size, .. } = member {
            if size > self.limits.max_file_bytes {
                return Err(CaptureError::FileTooLarge {
                    path: rel_path(name),
                    size,
                    max: self.limits.max_file_bytes,
                });
            }
            let total = self.stats.content_bytes.saturating_add(size);
            if total > self.limits.max_total_bytes {
                return Err(CaptureError::TotalBytesExceeded {
                    path: rel_path(name),
                    total,
                    max: self.limits.max_total_bytes,
                });
            }
        }
        let mut header = Header::new_gnu();
        header.set_mode(u32::from(stat.stx_mode) & 0o7777);
        header.set_uid(u64::from(stat.stx_uid));
        header.set_gid(u64::from(stat.stx_gid));
        let (sec, nsec) = (stat.stx_mtime.tv_sec, stat.stx_mtime.tv_nsec);
        header.set_mtime(u64::try_from(sec).unwrap_or(0));
        header.set_size(0);
        let mut pax: Vec<(String, &[u8])> = Vec::new();
        if !set_name_field(&mut header.as_old_mut().name, name) {
            pax.push((PAX_PATH.to_owned(), name));
        }
        let mtime_text;
        if nsec != 0 || sec < 0 {
            mtime_text = format_mtime(sec, nsec);
            pax.push((PAX_MTIME.to_owned(), mtime_text.as_bytes()));
        }
        let mut data: Option<(BorrowedFd<'_>, u64)> = None;
        match member {
            Member::Directory => header.set_entry_type(EntryType::Directory),
            Member::Regular { fd, size } => {
                header.set_entry_type(EntryType::Regular);
                header.set_size(size);
                data = Some((fd, size));
            }
            Member::Symlink { target } | Member::Hardlink { target } => {
                let kind = if matches!(member, Member::Symlink { .. }) {
                    EntryType::Symlink
                } else {
                    EntryType::Link
                };
                header.set_entry_type(kind);
                if !set_name_field(&mut header.as_old_mut().linkname, target) {
                    pax.push((PAX_LINKPATH.to_owned(), target));
                }
            }
            Member::Device { kind, major, minor } => {
                header.set_entry_type(kind);
                header.set_device_major(major).map_err(write_err)?;
                header.set_device_minor(minor).map_err(write_err)?;
            }
            Member::Fifo => header.set_entry_type(EntryType::Fifo),
        }
        let xattr_bytes: usize = xattrs.iter().map(|(n, v)| n.len() + v.len()).sum();
        if xattr_bytes as u64 > MAX_EXTENSION_BYTES / 2 {
            return Err(CaptureError::XattrsTooLarge {
                path: rel_path(name),
                size: xattr_bytes,
                max: MAX_EXTENSION_BYTES / 2,
            });
        }
        for (xname, value) in xattrs {
            pax.push((xattr_key(xname), value));
        }
        if !pax.is_empty() {
            self.builder
                .append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), *v)))
                .map_err(write_err)?;
        }
        header.set_cksum();
        // The header goes through the builder; file content follows it directly below.
        self.builder
            .append(&header, io::empty())
            .map_err(write_err)?;
        self.stats.entries += 1;
        if let Some((fd, size)) = data {
            let copied = self
                .builder
                .get_mut()
                .append_content(fd, size)
                .map_err(|source| CaptureError::CopyContent {
                    path: rel_path(name),
                    source,
                })?;
            if copied < size {
                return Err(CaptureError::FileShrank {
                    path: rel_path(name),
                    expected: size,
                    copied,
                });
            }
            self.stats.content_bytes += size;
        }
        Ok(())
    }

    /// Writes the end-of-archive marker, flushes, and returns the stats.
    pub(super) fn finish(&mut self) -> Result<CaptureStats, CaptureError> {
        let write_err = |source| CaptureError::WriteArchive {
            path: self.archive.clone(),
            source,
        };
        self.builder.finish().map_err(write_err)?;
        let writer = self.builder.get_mut();
        writer.flush().map_err(write_err)?;
        self.stats.bytes = writer.position();
        Ok(self.stats)
    }
}

/// Writes `value` into a NUL-padded header name field; returns false (after writing the
/// first bytes that fit) when it does not fit and needs a PAX record.
fn set_name_field(field: &mut [u8], value: &[u8]) -> bool {
    let n = value.len().min(field.len());
    field[..n].copy_from_slice(&value[..n]);
    field[n..].fill(0);
    value.len() <= field.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_fields_hold_short_names_and_flag_long_ones() {
        let mut field = [0xffu8; 100];
        assert!(set_name_field(&mut field, b"abc"));
        assert_eq!(&field[..4], b"abc\0");
        assert!(field[3..].iter().all(|b| *b == 0));
        assert!(set_name_field(&mut field, &[b'x'; 100]));
        assert!(!set_name_field(&mut field, &[b'y'; 101]));
        assert!(field.iter().all(|b| *b == b'y'));
    }
}
