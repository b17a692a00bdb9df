//! Capture in the portable tar form: archive an overlay upper directory into a tar file
//! ([`capture_upper`]), or any directory into a tar stream ([`archive_tree`], how images are
//! imported from a directory). Format in the crate docs.
//!
//! Runs inside the frozen window of a checkpoint, so it is built for speed: metadata goes
//! through a 1 MiB buffer written with `pwrite`, small files are read straight into that
//! buffer, and larger files are copied by the kernel (`copy_file_range`) into the archive at
//! the right offset.
//!
//! This file holds the entry points and the read side (one no-follow walk, each entry
//! opened relative to its parent); `encode` turns entries into tar headers, PAX records and
//! content; `error` holds [`CaptureError`], which the layer form shares.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Instant;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, StatxFlags};
use tar::{Builder, EntryType};

use crate::format::MAX_NAME_BYTES;
use crate::sink::{ArchiveWriter, Sink, StreamWriter};
use crate::sys::{self, Call};
use crate::tree::InstallLimits;
use crate::walk::{file_type, walk, walk_fd, WalkEntry};

mod encode;
mod error;

pub use encode::CaptureStats;
use encode::{Capture, Member};
pub use error::CaptureError;
pub(crate) use error::{check_path_len, rel_path};

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

impl<S: Sink> Capture<S> {
    /// Reads one entry of the walk (no-follow: opened relative to its parent, symlinks with
    /// `readlinkat`, attributes of fd-less entries through `/proc/self/fd`) and appends it.
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
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::sink::INLINE_MAX_BYTES;

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
