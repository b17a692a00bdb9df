//! Images: unpack a tar stream into a fresh directory that becomes the read-only lower layer
//! of sandboxes, with the hardened tree builder of [`install_upper`](crate::install_upper).
//!
//! The stream is hostile: it comes from a socket client (an archive it passed, or a tree a process
//! running with its credentials walked). Everything [`install_upper`](crate::install_upper) checks
//! is checked here (names, `..`, symlinked parents, link targets, sizes, extension headers, entry
//! types, the end marker), and what a flat image must not hold is refused on top:
//!
//! - **device nodes** (character or block, any numbers): a device node in an image gives
//!   every sandbox of it raw access to a host device. Those under the image's top-level
//!   device directory (`dev/` by default) are *dropped* and counted: every sandbox mounts a
//!   private tmpfs `/dev` over that directory, and a debootstrap tree carries `dev/null`,
//!   `dev/console`, ... Anywhere else they are refused ([`InstallError::DeviceInImage`]),
//!   and so is a hardlink to a dropped one outside that directory;
//! - **overlay whiteouts** (0:0 character devices) are refused like any device outside
//!   `dev/` ([`InstallError::WhiteoutInImage`]);
//! - **overlay attributes** (`trusted.overlay.*`): overlayfs would read redirects, opaque
//!   markers and origins of a lower layer ([`InstallError::ForbiddenXattr`]).
//!
//! What is *accepted*: any owner and mode (setuid files included: an image is reached only
//! through sandboxes, whose root is already root inside), hardlinks to earlier members,
//! fifos (any sandbox can make one; they reach nothing on the host), symlinks with any
//! target (never followed here). Unix sockets cannot be in a tar stream.

use std::io::Read;
use std::path::Path;
use std::time::Instant;

use crate::tree::{
    lossy, open_empty_target, path_of, ContentSource, InstallError, InstallLimits, Installer,
    MemberKind,
};
use crate::unpack::{check_end_marker, for_each_member, Content, Counting};

/// How [`install_image`] treats a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageOptions {
    /// Bounds on members and bytes.
    pub limits: InstallLimits,
    /// Top-level directory (one name component) whose device nodes are dropped instead of
    /// refused; `None` refuses every device node.
    pub device_dir: Option<String>,
}

impl Default for ImageOptions {
    /// [`InstallLimits::default`], device nodes under `dev/` dropped.
    fn default() -> Self {
        ImageOptions {
            limits: InstallLimits::default(),
            device_dir: Some("dev".to_owned()),
        }
    }
}

/// What [`install_image`] created and left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageStats {
    /// Members installed (the root directory entry included).
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub content_bytes: u64,
    /// Device nodes (and hardlinks to them) under the device directory left out.
    pub dropped_devices: u64,
}

/// Unpacks the tar stream `reader` (plain: decompress before) into `target`, an existing
/// empty directory, as a flat image (see the module docs for what is refused and dropped).
/// `label` names the stream in errors. Reads the stream to its end-of-archive marker (two
/// zero blocks) and no further.
///
/// Needs root (`CAP_CHOWN`, `CAP_FOWNER`, `CAP_SYS_ADMIN` for `trusted.*` attributes).
/// Kernel ≥ 5.6 (`openat2`). Errors: [`InstallError`]; the target may then hold a partial
/// tree, which the caller discards. Nothing outside it is ever written.
pub fn install_image<R: Read>(
    reader: R,
    label: &Path,
    target: &Path,
    options: &ImageOptions,
) -> Result<ImageStats, InstallError> {
    let started = Instant::now();
    let target_fd = open_empty_target(target)?;
    let mut installer = Installer::new(target_fd, ContentSource::Stream, &options.limits);
    let mut counted = Counting::new(reader);
    let mut dropped_devices = 0u64;
    // Normalised paths of dropped device nodes, with their numbers: a hardlink to one is a
    // device node too.
    let mut dropped: std::collections::HashMap<Vec<u8>, (bool, u32, u32)> = Default::default();
    let device_dir = options.device_dir.as_deref().map(str::as_bytes);
    let mut archive = tar::Archive::new(&mut counted);
    let entries = archive
        .entries()
        .map_err(|source| InstallError::ReadArchive {
            path: label.to_path_buf(),
            source,
        })?;
    let end = for_each_member(entries, label, Content::Stream, |member, entry| {
        let in_device_dir = |components: &[Vec<u8>]| {
            components.len() >= 2 && device_dir.is_some_and(|d| components[0] == d)
        };
        match &member.kind {
            MemberKind::Device {
                block,
                major,
                minor,
            } => {
                if in_device_dir(&member.components) {
                    tracing::debug!(path = %path_of(&member.raw).display(), major, minor, "dropping device node of an image");
                    dropped.insert(member.components.join(&b'/'), (*block, *major, *minor));
                    dropped_devices += 1;
                    return Ok(());
                }
                if !*block && *major == 0 && *minor == 0 {
                    return Err(InstallError::WhiteoutInImage {
                        path: path_of(&member.raw),
                    });
                }
                return Err(device_error(
                    &member.raw,
                    *block,
                    *major,
                    *minor,
                    device_dir,
                ));
            }
            MemberKind::Hardlink { target } => {
                if let Some((block, major, minor)) = dropped.get(&target.join(&b'/')) {
                    if in_device_dir(&member.components) {
                        dropped_devices += 1;
                        return Ok(());
                    }
                    return Err(device_error(
                        &member.raw,
                        *block,
                        *major,
                        *minor,
                        device_dir,
                    ));
                }
            }
            _ => {}
        }
        if let Some((name, _)) = member
            .xattrs
            .iter()
            .find(|(name, _)| name.starts_with(b"trusted.overlay."))
        {
            return Err(InstallError::ForbiddenXattr {
                path: path_of(&member.raw),
                name: lossy(name),
                reason: "overlay attribute in an image",
            });
        }
        installer.install_from(member, Some(entry as &mut dyn Read))
    })?;
    check_end_marker(&mut counted, end, label)?;
    let stats = installer.finish()?;
    let stats = ImageStats {
        entries: stats.entries,
        content_bytes: stats.content_bytes,
        dropped_devices,
    };
    tracing::debug!(
        source = %label.display(),
        target = %target.display(),
        entries = stats.entries,
        content_bytes = stats.content_bytes,
        dropped_devices,
        elapsed_us = started.elapsed().as_micros() as u64,
        "installed image"
    );
    Ok(stats)
}

fn device_error(
    raw: &[u8],
    block: bool,
    major: u32,
    minor: u32,
    device_dir: Option<&[u8]>,
) -> InstallError {
    InstallError::DeviceInImage {
        path: path_of(raw),
        kind: if block { "block" } else { "character" },
        major,
        minor,
        dir: device_dir.map(lossy).unwrap_or_default(),
    }
}
