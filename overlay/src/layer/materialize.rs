//! Restore side: recreate an upper directory from a [`LayerManifest`] and the blob store.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Instant, SystemTime};

use super::blobs::BlobStore;
use super::capture::LayerCaptureOptions;
use super::extents::extents_valid;
use super::manifest::{EntryKind, LayerEntry, LayerManifest};
use crate::tree::{
    check_device, check_symlink_target, check_xattr, name_error, open_empty_target,
    parse_hardlink_target, parse_name, path_of, ContentSource, InstallError, InstallLimits,
    InstallStats, Installer, Member, MemberKind, RegularData,
};
use crate::walk::{walk, WalkEntry, WalkErrorSink, WalkFailure};

/// Options of [`materialize_layer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaterializeOptions {
    /// Bounds on entries and data (as for a capture).
    pub limits: InstallLimits,
    /// Re-hash every blob while copying it (one pass: read, hash, write) and fail on a
    /// mismatch; without it uncompressed blobs are copied by the kernel.
    pub verify_blobs: bool,
}

impl Default for MaterializeOptions {
    /// Default limits, blobs verified.
    fn default() -> Self {
        MaterializeOptions {
            limits: InstallLimits::default(),
            verify_blobs: true,
        }
    }
}

/// Recreates the layer `manifest` in `target`, an existing empty directory that becomes an
/// overlay upper directory, copying file data out of `store` (never hardlinking a blob: the
/// sandbox may write its files). Returns what was installed and the manifest re-keyed to
/// the new inodes, the base for the next incremental capture of `target`.
///
/// The manifest is hostile input, checked entry by entry before anything is created: the
/// first entry must be the root directory; names follow the archive rules (no `..`, `.`,
/// empty components, absolute paths, NUL, components over 255 or paths over 4096 bytes);
/// symlink targets are stored verbatim and never followed; hardlinks must name an earlier
/// non-directory; only 0:0 whiteouts are allowed as devices; attributes only in the layer
/// namespaces; extents sorted, disjoint and within the size; limits on entries, data and
/// sizes. Everything is created beneath `target` with `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS | ...)` and exclusive, no-follow `*at` calls, so a crafted manifest
/// cannot write outside it.
///
/// Errors: [`InstallError`] naming the entry; the target may hold a partial layer
/// afterwards (the caller discards it), nothing outside it was touched.
pub fn materialize_layer(
    manifest: &LayerManifest,
    store: &BlobStore,
    target: &Path,
    opts: &MaterializeOptions,
) -> Result<(InstallStats, LayerManifest), InstallError> {
    let started = Instant::now();
    let target_fd = open_empty_target(target)?;
    let content = ContentSource::Blobs {
        store,
        verify: opts.verify_blobs,
    };
    if manifest.entries.is_empty() {
        return Err(InstallError::InvalidName {
            path: target.to_path_buf(),
            reason: "the manifest has no root entry",
        });
    }
    let mut installer = Installer::new(target_fd, content, &opts.limits);
    for (i, entry) in manifest.entries.iter().enumerate() {
        installer.install(member_of(entry, i == 0)?)?;
    }
    let stats = installer.finish()?;
    // Let the racy window pass, so the entries just written count as unchanged for the next
    // capture (see `LayerCaptureOptions::racy_window`): a short wait here saves reading
    // the most recently restored files again at the next checkpoint.
    std::thread::sleep(LayerCaptureOptions::default().racy_window);
    let rekeyed = rekey(manifest, target, opts.limits.max_entries)?;
    tracing::debug!(
        target = %target.display(),
        entries = stats.entries,
        content_bytes = stats.content_bytes,
        elapsed_us = started.elapsed().as_micros() as u64,
        "materialized upper layer"
    );
    Ok((stats, rekeyed))
}

/// Checks one manifest entry and turns it into a member for the tree builder.
fn member_of(entry: &LayerEntry, first: bool) -> Result<Member, InstallError> {
    let raw = entry.path.clone();
    let shown: &[u8] = if raw.is_empty() { b"." } else { &raw };
    let invalid = |field: &'static str, value: String| InstallError::InvalidField {
        path: path_of(shown),
        field,
        value,
    };
    let components = if raw.is_empty() {
        if !first {
            return Err(InstallError::DuplicateEntry {
                path: path_of(shown),
            });
        }
        Vec::new()
    } else {
        parse_name(&raw, false).map_err(|e| name_error(&raw, e))?
    };
    if first && !components.is_empty() {
        return Err(InstallError::InvalidName {
            path: path_of(shown),
            reason: "the first entry must be the root",
        });
    }
    if components.is_empty() && entry.kind != EntryKind::Directory {
        return Err(InstallError::RootNotDirectory {
            path: path_of(shown),
        });
    }
    if entry.mode & !0o7777 != 0 {
        return Err(invalid("mode", format!("{:o}", entry.mode)));
    }
    // u32::MAX is -1, "leave unchanged", for chown.
    if entry.uid == u32::MAX {
        return Err(invalid("uid", entry.uid.to_string()));
    }
    if entry.gid == u32::MAX {
        return Err(invalid("gid", entry.gid.to_string()));
    }
    if entry.mtime.1 >= 1_000_000_000 {
        return Err(invalid("mtime", format!("{:?}", entry.mtime)));
    }
    for (name, value) in &entry.xattrs {
        check_xattr(shown, name, value)?;
    }
    let kind = match &entry.kind {
        EntryKind::Directory => MemberKind::Directory,
        EntryKind::Regular {
            size,
            extents,
            blob,
        } => {
            extents_valid(extents, *size)
                .map_err(|reason| invalid("extents", reason.to_string()))?;
            if blob.is_some() == extents.is_empty() {
                return Err(invalid(
                    "blob",
                    "a blob is needed exactly when the file has data".into(),
                ));
            }
            MemberKind::Regular {
                size: *size,
                data: RegularData::Blob {
                    blob: *blob,
                    extents: extents.clone(),
                },
            }
        }
        EntryKind::Symlink { target } => {
            check_symlink_target(shown, target)?;
            MemberKind::Symlink {
                target: target.clone(),
            }
        }
        EntryKind::Hardlink { target } => MemberKind::Hardlink {
            target: parse_hardlink_target(shown, target)?,
        },
        EntryKind::Whiteout { major, minor } => {
            check_device(shown, false, *major, *minor)?;
            MemberKind::Whiteout
        }
        EntryKind::Fifo => MemberKind::Fifo,
    };
    Ok(Member {
        raw: shown.to_vec(),
        components,
        kind,
        mode: entry.mode,
        uid: entry.uid,
        gid: entry.gid,
        mtime: entry.mtime,
        xattrs: entry.xattrs.clone(),
    })
}

struct RekeyError(InstallError);

impl WalkErrorSink for RekeyError {
    fn walk_error(path: std::path::PathBuf, failure: WalkFailure) -> Self {
        RekeyError(match failure {
            WalkFailure::Syscall(source) => InstallError::OpenTarget { path, source },
            WalkFailure::TooDeep { max } => InstallError::TooDeep { path, max },
            WalkFailure::TooManyEntries { max } => InstallError::TooManyEntries { path, max },
            WalkFailure::Moved => InstallError::TargetMoved { path },
        })
    }
}

/// The manifest with every entry's key read from the materialized tree, and the capture
/// time set to the start of that walk (so entries written in the last racy window are read
/// again by the next capture).
fn rekey(
    manifest: &LayerManifest,
    target: &Path,
    max_names: u64,
) -> Result<LayerManifest, InstallError> {
    // Before the walk: every entry was written before this instant, and a later change moves
    // its ctime past it.
    let d = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mut keys = HashMap::with_capacity(manifest.entries.len());
    walk(target, &[], max_names, |e: &WalkEntry<'_>| {
        keys.insert(e.rel.to_vec(), super::capture::key_of(e.stat));
        Ok(())
    })
    .map_err(|RekeyError(e)| e)?;
    let mut out = manifest.clone();
    out.captured_at = (d.as_secs() as i64, d.subsec_nanos());
    for entry in &mut out.entries {
        entry.key = keys.get(&entry.path).copied().unwrap_or_default();
    }
    out.removed.clear();
    out.base = None;
    Ok(out)
}
