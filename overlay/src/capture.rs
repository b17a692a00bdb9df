//! Capture: archive an overlay upper directory into a tar file (format in the crate docs).
//!
//! Runs inside the frozen window of a checkpoint, so it is built for speed: metadata goes
//! through a 1 MiB buffer written with `pwrite`, small files are read straight into that
//! buffer, and larger files are copied by the kernel (`copy_file_range`) into the archive at
//! the right offset.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Statx, StatxFlags};
use tar::{Builder, EntryType, Header};

use crate::format::{
    format_mtime, xattr_key, MAX_EXTENSION_BYTES, MAX_NAME_BYTES, MAX_PATH_BYTES, PAX_LINKPATH,
    PAX_MTIME, PAX_PATH,
};
use crate::install::InstallLimits;
use crate::sink::{ArchiveWriter, Sink, StreamWriter};
use crate::sys::{self, Call, SyscallError, Xattr};
use crate::walk::{file_type, walk, walk_fd, WalkEntry, WalkErrorSink, WalkFailure};

/// What [`capture_upper`] wrote.
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

/// Why [`capture_upper`] failed. The partial archive is removed before this is returned.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The archive file could not be created (it must not exist yet).
    #[error("creating archive {path} failed")]
    CreateArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Opening, listing or examining an entry of the upper directory failed (this includes
    /// an `upper` that is a symlink or not a directory).
    #[error("reading {path} in the upper layer failed")]
    ReadUpper {
        /// The entry (upper directory joined with its relative path).
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// An entry's path is longer than install accepts (4096 bytes); capturing it would make
    /// an archive that cannot be restored.
    #[error("path of {path} is {len} bytes, longer than {max}")]
    PathTooLong {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// An entry lies deeper than [`MAX_WALK_DEPTH`](crate::MAX_WALK_DEPTH) levels below the
    /// upper directory: its path could not be restored (the walk stops there, holding a
    /// bounded number of fds).
    #[error("{path} is more than {max} directory levels deep")]
    TooDeep {
        /// The first entry below the limit (upper directory joined with its relative path).
        path: PathBuf,
        /// The limit.
        max: usize,
    },
    /// A directory the walk re-opened through `..` was not the one it had left: the tree
    /// was moved while it was captured.
    #[error("directory {path} moved during capture")]
    DirectoryMoved {
        /// The directory whose parent changed (upper directory joined with its path).
        path: PathBuf,
    },
    /// An entry carries more extended-attribute data than install accepts.
    #[error("extended attributes of {path} take {size} bytes, more than {max}")]
    XattrsTooLarge {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Bytes of names and values.
        size: usize,
        /// The limit.
        max: u64,
    },
    /// The upper layer holds more entries than [`InstallLimits::max_entries`] (or one
    /// directory alone holds more names than that).
    #[error("{path}: more than {max} entries")]
    TooManyEntries {
        /// The first entry over the limit, relative to the upper directory.
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A regular file is larger than [`InstallLimits::max_file_bytes`].
    #[error("{path}: file of {size} bytes is larger than {max}")]
    FileTooLarge {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its size in bytes (holes included).
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The files hold more than [`InstallLimits::max_total_bytes`] together.
    #[error("{path}: content would reach {total} bytes, more than {max}")]
    TotalBytesExceeded {
        /// The first file over the limit, relative to the upper directory.
        path: PathBuf,
        /// Content bytes including this file.
        total: u64,
        /// The limit.
        max: u64,
    },
    /// A regular file's apparent size is larger than [`InstallLimits::max_apparent_bytes`].
    #[error("{path}: file of apparent size {size} bytes is larger than {max}")]
    ApparentSizeTooLarge {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its apparent size in bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// A sparse file with so many data runs that capturing it in at most
    /// [`MAX_EXTENTS_PER_FILE`](crate::layer::MAX_EXTENTS_PER_FILE) extents would store far
    /// more than its data (its holes as zeros).
    #[error("{path}: {data} bytes of data in too many runs: {captured} bytes would be captured")]
    TooFragmented {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Bytes of data the kernel reports.
        data: u64,
        /// Bytes the merged extents would capture.
        captured: u64,
    },
    /// A device node other than an overlay whiteout (0:0 character device): it could never
    /// be restored, and would give the sandbox raw access to a host device.
    #[error("{path}: {kind} device {major}:{minor} is not allowed in an upper layer")]
    ForbiddenDevice {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// `"character"` or `"block"`.
        kind: &'static str,
        /// Device major number.
        major: u32,
        /// Device minor number.
        minor: u32,
    },
    /// Staging or storing blobs failed (or a blob of the base manifest was collected).
    #[error("blob store")]
    Blob(#[source] crate::layer::BlobError),
    /// The entry has a file type the kernel reported as unknown.
    #[error("{path} has an unsupported file type (mode {mode:o})")]
    UnsupportedFileType {
        /// The entry, relative to the upper directory.
        path: PathBuf,
        /// Its raw `st_mode`.
        mode: u32,
    },
    /// A regular file ended before the size it had when it was opened (something wrote to
    /// the upper layer during capture).
    #[error("{path} shrank during capture: {expected} bytes expected, {copied} read")]
    FileShrank {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// Its size when opened.
        expected: u64,
        /// Bytes read before the end of file.
        copied: u64,
    },
    /// Copying a file's content into the archive failed.
    #[error("copying {path} into the archive failed")]
    CopyContent {
        /// The file, relative to the upper directory.
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Writing headers or padding to the archive failed.
    #[error("writing archive {path} failed")]
    WriteArchive {
        /// The archive path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

impl CaptureError {
    /// Whether the capture stopped because the reader of its output stream went away
    /// (`EPIPE` writing to [`archive_tree`]'s output), rather than because of the tree.
    pub fn is_broken_pipe(&self) -> bool {
        let epipe = Some(rustix::io::Errno::PIPE.raw_os_error());
        match self {
            CaptureError::WriteArchive { source, .. } => source.raw_os_error() == epipe,
            CaptureError::CopyContent { source, .. } => source.errno() == epipe,
            _ => false,
        }
    }
}

impl WalkErrorSink for CaptureError {
    fn walk_error(path: PathBuf, failure: WalkFailure) -> Self {
        match failure {
            WalkFailure::Syscall(source) => CaptureError::ReadUpper { path, source },
            WalkFailure::TooDeep { max } => CaptureError::TooDeep { path, max },
            WalkFailure::TooManyEntries { max } => CaptureError::TooManyEntries { path, max },
            WalkFailure::Moved => CaptureError::DirectoryMoved { path },
        }
    }
}

/// Archives the overlay upper directory `upper` into `archive`, a new file (mode 0600;
/// creating it fails if it exists). The file is written but not fsync'd: the caller syncs
/// it outside the frozen window.
///
/// Never follows a symlink: `upper` itself is opened with `O_NOFOLLOW`, everything below
/// it relative to its parent's fd. Records for each entry type, owner, mode (with
/// setuid/setgid/sticky), mtime in nanoseconds and the `user.`, `security.`, `trusted.`
/// (including `trusted.overlay.*`) and POSIX ACL extended attributes; whiteouts (0:0
/// character devices), other device nodes and fifos as such; hardlinks as tar hardlink
/// members. Sockets are skipped and counted in [`CaptureStats::skipped_sockets`].
///
/// Applies [`InstallLimits::default`] (see [`capture_upper_with_limits`]).
///
/// Errors: [`CaptureError`]; on error the partial archive is removed.
pub fn capture_upper(upper: &Path, archive: &Path) -> Result<CaptureStats, CaptureError> {
    capture_upper_with_limits(upper, archive, &InstallLimits::default())
}

/// [`capture_upper`] with explicit limits: the capture fails (before copying the
/// offending file) rather than write an archive that [`install_upper`](crate::install_upper)
/// with the same `limits` would reject. This also bounds what a sandbox can make the host
/// write: a sparse file of 1 TiB costs the sandbox nothing, but is archived as zeros.
///
/// Errors: [`CaptureError`]; on error the partial archive is removed.
pub fn capture_upper_with_limits(
    upper: &Path,
    archive: &Path,
    limits: &InstallLimits,
) -> Result<CaptureStats, CaptureError> {
    let started = Instant::now();
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(archive)
        .map_err(|source| CaptureError::CreateArchive {
            path: archive.to_path_buf(),
            source,
        })?;
    let mut capture = Capture {
        builder: Builder::new(ArchiveWriter::new(file)),
        archive: archive.to_path_buf(),
        links: HashMap::new(),
        stats: CaptureStats::default(),
        limits: *limits,
    };
    let result = walk(upper, &[], limits.max_entries, |entry| capture.add(entry))
        .and_then(|()| capture.finish());
    match result {
        Ok(stats) => {
            tracing::debug!(
                upper = %upper.display(),
                archive = %archive.display(),
                entries = stats.entries,
                bytes = stats.bytes,
                content_bytes = stats.content_bytes,
                elapsed_us = started.elapsed().as_micros() as u64,
                "captured upper layer"
            );
            Ok(stats)
        }
        Err(err) => {
            if let Err(rm) = std::fs::remove_file(archive) {
                tracing::warn!(archive = %archive.display(), error = %rm, "removing partial archive failed");
            }
            Err(err)
        }
    }
}

/// Archives the directory open as `dir` as a tar stream written to `out` (a pipe, a socket,
/// any [`Write`]), in the same format and with the same rules as [`capture_upper`]: never
/// follows a symlink (`dir` is opened again as `.`, everything below relative to its parent's
/// fd), records owners, modes, nanosecond mtimes, extended attributes, hardlinks, device
/// nodes and fifos, skips sockets, and enforces `limits`. File content is read with `pread`
/// and written to `out`, so the stream needs no seeking. Reads happen with the calling
/// process's credentials: run it in a process holding the rights of whoever the tree is read
/// for. `label` names the root in errors.
///
/// Errors: [`CaptureError`] (`WriteArchive` with `label` when `out` fails); what was written
/// before an error is not a complete archive (no end marker).
pub fn archive_tree<W: Write>(
    dir: BorrowedFd<'_>,
    label: &Path,
    out: W,
    limits: &InstallLimits,
) -> Result<CaptureStats, CaptureError> {
    let started = Instant::now();
    let mut capture = Capture {
        builder: Builder::new(StreamWriter::new(out)),
        archive: label.to_path_buf(),
        links: HashMap::new(),
        stats: CaptureStats::default(),
        limits: *limits,
    };
    walk_fd(dir, label, &[], limits.max_entries, |entry| {
        capture.add(entry)
    })?;
    let stats = capture.finish()?;
    tracing::debug!(
        root = %label.display(),
        entries = stats.entries,
        bytes = stats.bytes,
        content_bytes = stats.content_bytes,
        elapsed_us = started.elapsed().as_micros() as u64,
        "archived tree to a stream"
    );
    Ok(stats)
}

struct Capture<S: Sink> {
    builder: Builder<S>,
    archive: PathBuf,
    /// First archived path of every inode with more than one link, by (device, inode).
    links: HashMap<(u32, u32, u64), Vec<u8>>,
    stats: CaptureStats,
    limits: InstallLimits,
}

/// What one archive member describes besides the common metadata.
enum Member<'a> {
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

/// A path relative to the upper directory, for error messages.
pub(crate) fn rel_path(rel: &[u8]) -> PathBuf {
    PathBuf::from(std::ffi::OsStr::from_bytes(rel))
}

/// Refuses an entry whose path is longer than a restore accepts.
pub(crate) fn check_path_len(rel: &[u8]) -> Result<(), CaptureError> {
    if rel.len() > MAX_PATH_BYTES {
        return Err(CaptureError::PathTooLong {
            path: rel_path(rel),
            len: rel.len(),
            max: MAX_PATH_BYTES,
        });
    }
    Ok(())
}

impl<S: Sink> Capture<S> {
    fn add(&mut self, entry: &WalkEntry<'_>) -> Result<(), CaptureError> {
        let rel = entry.rel;
        check_path_len(rel)?;
        debug_assert!(entry.name.to_bytes().len() <= MAX_NAME_BYTES);
        let read_err = |source| CaptureError::ReadUpper {
            path: rel_path(rel),
            source,
        };
        let kind = file_type(entry.stat);
        if kind == FileType::Directory {
            let dir = entry.dir.expect("the walk opens every directory");
            let mut xattrs = sys::xattrs_of_fd(dir).map_err(read_err)?;
            if rel.is_empty() {
                // The root's uuid names the overlay instance, not content: install never
                // restores it, so leaving it out keeps capture(install(a)) == a.
                xattrs.retain(|(n, _)| n.as_slice() != b"trusted.overlay.uuid");
            }
            let mut name = rel.to_vec();
            name.extend_from_slice(if rel.is_empty() { b"./" } else { b"/" });
            return self.append(&name, entry.stat, &xattrs, Member::Directory);
        }
        if kind == FileType::Socket {
            // Before hardlink tracking: a skipped socket must never become a link target.
            tracing::warn!(path = %rel_path(rel).display(), "skipping unix socket in upper layer");
            self.stats.skipped_sockets += 1;
            return Ok(());
        }
        if entry.stat.stx_nlink > 1 {
            let key = (
                entry.stat.stx_dev_major,
                entry.stat.stx_dev_minor,
                entry.stat.stx_ino,
            );
            if let Some(first) = self.links.get(&key).cloned() {
                return self.append(rel, entry.stat, &[], Member::Hardlink { target: &first });
            }
            self.links.insert(key, rel.to_vec());
        }
        let name = entry.name.to_bytes();
        match kind {
            FileType::RegularFile => {
                let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(entry.parent, entry.name, flags, Mode::empty())
                    .call("openat")
                    .map_err(read_err)?;
                // Describe what was opened, not what was looked up.
                let stat =
                    rustix::fs::statx(&fd, c"", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
                        .call("statx")
                        .map_err(read_err)?;
                let xattrs = sys::xattrs_of_fd(fd.as_fd()).map_err(read_err)?;
                let member = Member::Regular {
                    fd: fd.as_fd(),
                    size: stat.stx_size,
                };
                self.append(rel, &stat, &xattrs, member)
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(entry.parent, entry.name, Vec::new())
                    .call("readlinkat")
                    .map_err(read_err)?;
                let xattrs = sys::xattrs_of_path(&sys::proc_fd_path(entry.parent, name))
                    .map_err(read_err)?;
                let member = Member::Symlink {
                    target: target.as_bytes(),
                };
                self.append(rel, entry.stat, &xattrs, member)
            }
            FileType::CharacterDevice | FileType::BlockDevice | FileType::Fifo => {
                let xattrs = sys::xattrs_of_path(&sys::proc_fd_path(entry.parent, name))
                    .map_err(read_err)?;
                let member = match kind {
                    FileType::Fifo => Member::Fifo,
                    _ => Member::Device {
                        kind: if kind == FileType::CharacterDevice {
                            EntryType::Char
                        } else {
                            EntryType::Block
                        },
                        major: entry.stat.stx_rdev_major,
                        minor: entry.stat.stx_rdev_minor,
                    },
                };
                self.append(rel, entry.stat, &xattrs, member)
            }
            _ => Err(CaptureError::UnsupportedFileType {
                path: rel_path(rel),
                mode: u32::from(entry.stat.stx_mode),
            }),
        }
    }

    fn append(
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

    fn finish(&mut self) -> Result<CaptureStats, CaptureError> {
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
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::sink::INLINE_MAX_BYTES;

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

    #[test]
    fn archive_is_readable_by_the_tar_crate() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir_all(upper.join("d")).unwrap();
        std::fs::write(upper.join("d/small"), b"hello").unwrap();
        let big: Vec<u8> = (0..(INLINE_MAX_BYTES as usize * 3 + 7))
            .map(|i| i as u8)
            .collect();
        std::fs::write(upper.join("big"), &big).unwrap();
        std::fs::write(upper.join("empty"), b"").unwrap();
        symlink("/etc/passwd", upper.join("l")).unwrap();
        let long = "n".repeat(150);
        std::fs::write(upper.join(&long), b"long").unwrap();
        let archive = dir.path().join("a.tar");
        let stats = capture_upper(&upper, &archive).unwrap();
        assert_eq!(stats.entries, 7);
        assert_eq!(stats.content_bytes, big.len() as u64 + 9);
        assert_eq!(stats.bytes, std::fs::metadata(&archive).unwrap().len());
        assert_eq!(stats.bytes % 512, 0);

        let mut ar = tar::Archive::new(File::open(&archive).unwrap());
        let mut seen = Vec::new();
        for entry in ar.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = String::from_utf8(entry.path_bytes().into_owned()).unwrap();
            let mut content = Vec::new();
            entry.read_to_end(&mut content).unwrap();
            seen.push((path, content));
        }
        let names: Vec<&str> = seen.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            names,
            ["./", "big", "d/", "d/small", "empty", "l", long.as_str()]
        );
        assert_eq!(seen[1].1, big);
        assert_eq!(seen[3].1, b"hello");
        assert_eq!(seen[6].1, b"long");
    }

    #[test]
    fn limits_stop_the_capture_before_copying() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        // A 1 TiB sparse file costs nothing to make and must not be archived as zeros.
        File::create(upper.join("sparse"))
            .unwrap()
            .set_len(1 << 40)
            .unwrap();
        let archive = dir.path().join("a.tar");
        let err = capture_upper(&upper, &archive).unwrap_err();
        assert!(
            matches!(err, CaptureError::FileTooLarge { size, .. } if size == 1 << 40),
            "{err}"
        );
        assert!(!archive.exists());
        std::fs::remove_file(upper.join("sparse")).unwrap();
        for i in 0..3 {
            std::fs::write(upper.join(format!("f{i}")), [0u8; 100]).unwrap();
        }
        let limits = InstallLimits {
            max_total_bytes: 250,
            ..InstallLimits::default()
        };
        let err = capture_upper_with_limits(&upper, &archive, &limits).unwrap_err();
        assert!(
            matches!(err, CaptureError::TotalBytesExceeded { total: 300, .. }),
            "{err}"
        );
        let limits = InstallLimits {
            max_entries: 3,
            ..InstallLimits::default()
        };
        let err = capture_upper_with_limits(&upper, &archive, &limits).unwrap_err();
        assert!(
            matches!(err, CaptureError::TooManyEntries { max: 3, .. }),
            "{err}"
        );
        assert!(!archive.exists());
    }

    #[test]
    fn sockets_are_skipped_and_never_become_link_targets() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        std::fs::create_dir(&upper).unwrap();
        let _listener = std::os::unix::net::UnixListener::bind(upper.join("a.sock")).unwrap();
        std::fs::hard_link(upper.join("a.sock"), upper.join("b.sock")).unwrap();
        std::fs::write(upper.join("file"), b"x").unwrap();
        let archive = dir.path().join("a.tar");
        let stats = capture_upper(&upper, &archive).unwrap();
        assert_eq!((stats.entries, stats.skipped_sockets), (2, 2));
        let target = dir.path().join("target");
        std::fs::create_dir(&target).unwrap();
        crate::install_upper(&archive, &target, &InstallLimits::default()).unwrap();
        assert_eq!(std::fs::read(target.join("file")).unwrap(), b"x");
        assert!(!target.join("b.sock").exists());
    }

    #[test]
    fn refuses_an_existing_archive_and_a_symlinked_upper() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.tar");
        std::fs::write(&archive, b"keep").unwrap();
        let err = capture_upper(dir.path(), &archive).unwrap_err();
        assert!(matches!(err, CaptureError::CreateArchive { .. }), "{err}");
        assert_eq!(std::fs::read(&archive).unwrap(), b"keep");

        symlink(dir.path(), dir.path().join("link")).unwrap();
        let archive2 = dir.path().join("b.tar");
        let err = capture_upper(&dir.path().join("link"), &archive2).unwrap_err();
        assert!(matches!(err, CaptureError::ReadUpper { .. }), "{err}");
        assert!(!archive2.exists(), "partial archive removed");
    }
}
