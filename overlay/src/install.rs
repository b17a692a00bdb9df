//! Install: unpack an archive made by [`capture_upper`](crate::capture_upper) into a fresh,
//! empty upper directory.
//!
//! The archive is hostile input (it holds whatever the sandbox left in its upper layer, and
//! the file could have been altered on disk). Nothing is ever resolved through a symlink:
//! every parent directory is opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` relative to the target, every leaf is created
//! with an `*at` call relative to that parent fd (`O_CREAT | O_EXCL | O_NOFOLLOW`,
//! `mkdirat`, `symlinkat`, `mknodat`, `linkat`), and metadata is set through the new fd or
//! with `AT_SYMLINK_NOFOLLOW`. Names, entry types, devices, extended attributes and sizes
//! are checked before anything is created; see [`InstallError`] for every rejection.

use std::fs::File;
use std::io::BufReader;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Instant;

use crate::sys;
use crate::tree::{check_device, open_empty_target, ContentSource, Installer, MemberKind};
pub use crate::tree::{InstallError, InstallLimits, InstallStats};
use crate::unpack::{for_each_member, Content};

/// Installs `archive` (made by [`capture_upper`](crate::capture_upper)) into `target`, an
/// existing empty directory that becomes an overlay upper directory.
///
/// Recreates directories (opaque ones keep `trusted.overlay.opaque`), regular files (holes
/// are written as zeros), symlinks (targets verbatim, never followed), hardlinks (`linkat`
/// to an earlier member), whiteouts (0:0 character devices) and fifos, with owner, mode
/// (setuid/setgid/sticky included), nanosecond mtime and extended attributes. Directory
/// modes and times are applied last, children first, so read-only directories and their
/// mtimes come out right. The root member's metadata is applied to `target` itself, except
/// `trusted.overlay.uuid`: the installed layer is a new overlay instance and the kernel
/// gives it its own uuid on first mount.
///
/// Needs root (or `CAP_CHOWN`, `CAP_MKNOD`, `CAP_SYS_ADMIN` for `trusted.*`, and
/// `CAP_FOWNER`). Kernel ≥ 5.6 (`openat2`). Errors: [`InstallError`].
pub fn install_upper(
    archive: &Path,
    target: &Path,
    limits: &InstallLimits,
) -> Result<InstallStats, InstallError> {
    let started = Instant::now();
    let file = File::open(archive).map_err(|source| InstallError::OpenArchive {
        path: archive.to_path_buf(),
        source,
    })?;
    let target_fd = open_empty_target(target)?;
    let mut installer = Installer::new(target_fd, ContentSource::Archive(&file), limits);
    let read_err = |source| InstallError::ReadArchive {
        path: archive.to_path_buf(),
        source,
    };
    let mut tar = tar::Archive::new(BufReader::with_capacity(64 << 10, &file));
    let entries = tar.entries_with_seek().map_err(read_err)?;
    let end = for_each_member(entries, archive, Content::Seek, |mut member, _| {
        if let MemberKind::Device {
            block,
            major,
            minor,
        } = member.kind
        {
            check_device(&member.raw, block, major, minor)?;
            member.kind = MemberKind::Whiteout;
        }
        installer.install(member)
    })?;
    let mut marker = [0u8; 1024];
    let n = sys::read_full_at(file.as_fd(), &mut marker, end).map_err(|e| read_err(e.source))?;
    if n < marker.len() || marker.iter().any(|b| *b != 0) {
        return Err(InstallError::MissingEndOfArchive {
            path: archive.to_path_buf(),
            offset: end,
        });
    }
    let stats = installer.finish()?;
    tracing::debug!(
        archive = %archive.display(),
        target = %target.display(),
        entries = stats.entries,
        content_bytes = stats.content_bytes,
        elapsed_us = started.elapsed().as_micros() as u64,
        "installed upper layer"
    );
    Ok(stats)
}
