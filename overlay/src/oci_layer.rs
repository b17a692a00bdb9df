//! OCI image layers: unpack one layer of a container image (a tar stream from a registry,
//! fully hostile) into a directory that becomes one lower layer of an overlay, with the
//! whiteout semantics of the OCI image specification (`layer.md`, "Whiteouts") turned into
//! overlayfs's own.
//!
//! Everything [`install_image`](crate::install_image) checks is checked here, with the same
//! hardened tree builder: names (no `..`, no absolute names, at most 255 bytes per component
//! and 4096 in total), parents opened component by component with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` and never followed, hardlinks only to
//! earlier non-directory members, [`InstallLimits`], extension headers, member types, the
//! end-of-archive marker, and no `trusted.overlay.*` attribute in the archive
//! ([`InstallError::ForbiddenXattr`]). On top, the layer rules:
//!
//! - **Whiteouts**: `DIR/.wh.NAME` (a member of any type, usually an empty regular file;
//!   its content is skipped) becomes an overlay whiteout, a 0:0 character device `DIR/NAME`
//!   owned by root with mode 0. `NAME` must be a normal name component
//!   ([`InstallError::InvalidWhiteout`] for an empty name, `.` or `..`), and a `.wh.` name
//!   is never a parent directory.
//! - **Opaque directories**: `DIR/.wh..wh..opq` sets `trusted.overlay.opaque=y` on `DIR`,
//!   creating it (mode 0755, owner root) when the layer did not list it before. A `DIR`
//!   that is a symlink fails like any symlinked parent ([`InstallError::ResolveParent`]).
//! - **aufs bookkeeping**: other `.wh..wh.*` names (`.wh..wh.plnk/…`, `.wh..wh.aufs`) and
//!   everything below them are skipped and counted ([`LayerStats::skipped_aufs`], and
//!   against [`InstallLimits::max_entries`]); a hardlink to or into a `.wh.` name is
//!   refused ([`InstallError::InvalidLinkTarget`]).
//! - **Device nodes** (character or block, any numbers, 0:0 given directly included) are
//!   refused ([`InstallError::DeviceInLayer`]): a layer reaches every sandbox of its image.
//! - **One name, one meaning**: a member and a whiteout for the same name in one layer, or a
//!   member below a whited-out name, are refused ([`InstallError::WhiteoutConflict`]); a
//!   hardlink to a whiteout too.
//! - **Tar semantics for repeated names**: a member repeated later replaces the earlier one,
//!   which is unlinked first (never written through: a symlink is replaced, not followed; an
//!   earlier hardlink keeps the old content); a directory listed again is merged into (its
//!   new owner, attributes, mode and times apply, its entries stay); a non-directory over a
//!   directory with entries is refused ([`InstallError::ReplacesDirectory`]).
//! - **Missing parents** are created, mode 0755, owner root, like container runtimes do (a
//!   directory listed later merges into it).
//!
//! The layer is unpacked as root sees it: owners and modes verbatim, setuid files allowed
//! (they matter only inside sandboxes, whose root is already root there).

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;
use std::time::Instant;

use crate::tree::{
    lossy, open_empty_target, path_of, ContentSource, InstallError, InstallLimits, Installer,
    Member, MemberKind,
};
use crate::unpack::{check_end_marker, for_each_member, Content, Counting};

/// Prefix of a whiteout name.
const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// Prefix of aufs bookkeeping names (and of the opaque marker).
const AUFS_PREFIX: &[u8] = b".wh..wh.";
/// The name that makes its directory opaque.
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// How [`install_oci_layer`] treats a layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerOptions {
    /// Bounds on members and bytes ([`InstallLimits::default`] by default).
    pub limits: InstallLimits,
}

/// What [`install_oci_layer`] created and left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries created: members (the root directory entry included), whiteouts, and
    /// directories created for parents the layer did not list. A member replacing an
    /// earlier one counts again.
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub content_bytes: u64,
    /// Whiteouts created (`.wh.NAME` members).
    pub whiteouts: u64,
    /// Opaque markers applied (`.wh..wh..opq` members).
    pub opaque_dirs: u64,
    /// Members skipped as aufs bookkeeping (`.wh..wh.*` names other than the opaque
    /// marker, and everything below them).
    pub skipped_aufs: u64,
}

/// Unpacks the OCI layer `reader` (a plain tar stream: decompress before) into `target`, an
/// existing empty directory, turning whiteouts and opaque markers into overlayfs's (see the
/// module docs for every rule). `label` names the stream in errors. Reads the stream to its
/// end-of-archive marker (two zero blocks) and no further.
///
/// Needs root (`CAP_MKNOD` for whiteouts, `CAP_CHOWN`, `CAP_FOWNER`, `CAP_SYS_ADMIN` for
/// `trusted.*` attributes). Kernel ≥ 5.6 (`openat2`). Errors: [`InstallError`] naming the
/// member; the target may then hold a partial tree, which the caller discards. Nothing
/// outside it is ever written.
pub fn install_oci_layer<R: Read>(
    reader: R,
    label: &Path,
    target: &Path,
    options: &LayerOptions,
) -> Result<LayerStats, InstallError> {
    let started = Instant::now();
    let target_fd = open_empty_target(target)?;
    let limits = &options.limits;
    let mut installer = Installer::new(target_fd, ContentSource::Stream, limits).with_layer_rules();
    let mut counted = Counting::new(reader);
    let mut stats = LayerStats::default();
    // Joined paths of this layer's whiteouts: nothing may be created at or below them.
    let mut whiteouts: HashSet<Vec<u8>> = HashSet::new();
    let mut archive = tar::Archive::new(&mut counted);
    let entries = archive
        .entries()
        .map_err(|source| InstallError::ReadArchive {
            path: label.to_path_buf(),
            source,
        })?;
    let end = for_each_member(entries, label, Content::Stream, |member, entry| {
        if let Some((name, _)) = member
            .xattrs
            .iter()
            .find(|(name, _)| name.starts_with(b"trusted.overlay."))
        {
            return Err(InstallError::ForbiddenXattr {
                path: path_of(&member.raw),
                name: lossy(name),
                reason: "overlay attribute in an image layer",
            });
        }
        match classify(&member)? {
            Role::Aufs => {
                if installer.entries() + stats.skipped_aufs >= limits.max_entries {
                    return Err(InstallError::TooManyEntries {
                        path: path_of(&member.raw),
                        max: limits.max_entries,
                    });
                }
                tracing::trace!(path = %path_of(&member.raw).display(), "skipping aufs bookkeeping");
                stats.skipped_aufs += 1;
                Ok(())
            }
            Role::Opaque => {
                let dir = &member.components[..member.components.len() - 1];
                if whited_out(&whiteouts, dir) {
                    return Err(InstallError::WhiteoutConflict {
                        path: path_of(&member.raw),
                    });
                }
                installer.mark_opaque(dir, &member.raw, member.mtime)?;
                stats.opaque_dirs += 1;
                Ok(())
            }
            Role::Whiteout => {
                let mut components = member.components;
                let last = components.last_mut().expect("whiteouts have a name");
                last.drain(..WHITEOUT_PREFIX.len());
                if whited_out(&whiteouts, &components[..components.len() - 1]) {
                    return Err(InstallError::WhiteoutConflict {
                        path: path_of(&member.raw),
                    });
                }
                let joined = components.join(&b'/');
                installer.install(Member {
                    raw: member.raw,
                    components,
                    kind: MemberKind::Whiteout,
                    mode: 0,
                    uid: 0,
                    gid: 0,
                    mtime: member.mtime,
                    xattrs: Vec::new(),
                })?;
                whiteouts.insert(joined);
                stats.whiteouts += 1;
                Ok(())
            }
            Role::Member => {
                check_member(&member, &whiteouts)?;
                installer.install_from(member, Some(entry as &mut dyn Read))
            }
        }
    })?;
    check_end_marker(&mut counted, end, label)?;
    let installed = installer.finish()?;
    stats.entries = installed.entries;
    stats.content_bytes = installed.content_bytes;
    tracing::debug!(
        source = %label.display(),
        target = %target.display(),
        entries = stats.entries,
        content_bytes = stats.content_bytes,
        whiteouts = stats.whiteouts,
        opaque_dirs = stats.opaque_dirs,
        skipped_aufs = stats.skipped_aufs,
        elapsed_us = started.elapsed().as_micros() as u64,
        "installed image layer"
    );
    Ok(stats)
}

/// What a member of a layer stands for.
#[derive(Debug, PartialEq, Eq)]
enum Role {
    /// Itself: created as it is.
    Member,
    /// `DIR/.wh.NAME`: a whiteout named `NAME` in `DIR`.
    Whiteout,
    /// `DIR/.wh..wh..opq`: `DIR` is opaque.
    Opaque,
    /// aufs bookkeeping: skipped.
    Aufs,
}

/// Sorts a member by its name (its type does not matter for `.wh.` names).
fn classify(member: &Member) -> Result<Role, InstallError> {
    let Some((last, parents)) = member.components.split_last() else {
        return Ok(Role::Member);
    };
    let invalid = |reason| InstallError::InvalidWhiteout {
        path: path_of(&member.raw),
        reason,
    };
    for parent in parents {
        if parent.starts_with(AUFS_PREFIX) {
            return Ok(Role::Aufs);
        }
        if parent.starts_with(WHITEOUT_PREFIX) {
            return Err(invalid("a whiteout name used as a parent directory"));
        }
    }
    if last.as_slice() == OPAQUE_MARKER {
        return Ok(Role::Opaque);
    }
    if last.starts_with(AUFS_PREFIX) {
        return Ok(Role::Aufs);
    }
    match last.strip_prefix(WHITEOUT_PREFIX) {
        None => Ok(Role::Member),
        Some(b"") => Err(invalid("empty name")),
        Some(b".") => Err(invalid("`.` name")),
        Some(b"..") => Err(invalid("`..` name")),
        Some(_) => Ok(Role::Whiteout),
    }
}

/// The layer rules for a member created as itself: no device node, no hardlink to a `.wh.`
/// name, a whiteout or itself, nothing at or below a whiteout.
fn check_member(member: &Member, whiteouts: &HashSet<Vec<u8>>) -> Result<(), InstallError> {
    match &member.kind {
        MemberKind::Device {
            block,
            major,
            minor,
        } => {
            return Err(InstallError::DeviceInLayer {
                path: path_of(&member.raw),
                kind: if *block { "block" } else { "character" },
                major: *major,
                minor: *minor,
            })
        }
        MemberKind::Hardlink { target } => {
            let reason = if target.iter().any(|c| c.starts_with(WHITEOUT_PREFIX)) {
                Some("a whiteout or aufs name")
            } else if *target == member.components {
                Some("the member itself")
            } else if whited_out(whiteouts, target) {
                Some("a whiteout")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(InstallError::InvalidLinkTarget {
                    path: path_of(&member.raw),
                    target: lossy(&target.join(&b'/')),
                    reason,
                });
            }
        }
        _ => {}
    }
    if whited_out(whiteouts, &member.components) {
        return Err(InstallError::WhiteoutConflict {
            path: path_of(&member.raw),
        });
    }
    Ok(())
}

/// Whether `components`, or a directory above it, is one of `whiteouts` (joined paths).
fn whited_out(whiteouts: &HashSet<Vec<u8>>, components: &[Vec<u8>]) -> bool {
    if whiteouts.is_empty() {
        return false;
    }
    let mut joined = Vec::new();
    for component in components {
        if !joined.is_empty() {
            joined.push(b'/');
        }
        joined.extend_from_slice(component);
        if whiteouts.contains(&joined) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::parse_name;

    fn role(name: &str) -> Result<Role, String> {
        let member = Member {
            raw: name.as_bytes().to_vec(),
            components: parse_name(name.as_bytes(), true).unwrap(),
            kind: MemberKind::Fifo,
            mode: 0,
            uid: 0,
            gid: 0,
            mtime: (0, 0),
            xattrs: Vec::new(),
        };
        classify(&member).map_err(|e| match e {
            InstallError::InvalidWhiteout { reason, .. } => reason.to_owned(),
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn names_are_sorted_by_their_whiteout_prefixes() {
        assert_eq!(role("./"), Ok(Role::Member));
        assert_eq!(role("etc/passwd"), Ok(Role::Member));
        assert_eq!(role("etc/.whx"), Ok(Role::Member));
        assert_eq!(role("etc/x.wh.y"), Ok(Role::Member));
        assert_eq!(role("etc/.wh.passwd"), Ok(Role::Whiteout));
        assert_eq!(role(".wh.etc"), Ok(Role::Whiteout));
        assert_eq!(role(".wh...."), Ok(Role::Whiteout));
        assert_eq!(role("opt/.wh..wh..opq"), Ok(Role::Opaque));
        assert_eq!(role(".wh..wh..opq"), Ok(Role::Opaque));
        assert_eq!(role(".wh..wh.plnk"), Ok(Role::Aufs));
        assert_eq!(role(".wh..wh.plnk/123.456"), Ok(Role::Aufs));
        assert_eq!(role("a/.wh..wh.aufs"), Ok(Role::Aufs));
        assert_eq!(role(".wh..wh..opq/x"), Ok(Role::Aufs));
        assert_eq!(role("a/.wh."), Err("empty name".into()));
        assert_eq!(role(".wh.."), Err("`.` name".into()));
        assert_eq!(role(".wh..."), Err("`..` name".into()));
        assert_eq!(
            role(".wh.x/y"),
            Err("a whiteout name used as a parent directory".into())
        );
    }

    #[test]
    fn whited_out_covers_the_name_and_what_is_below() {
        let set: HashSet<Vec<u8>> = [b"a/b".to_vec()].into();
        let c = |s: &str| parse_name(s.as_bytes(), false).unwrap();
        assert!(whited_out(&set, &c("a/b")));
        assert!(whited_out(&set, &c("a/b/c")));
        assert!(!whited_out(&set, &c("a")));
        assert!(!whited_out(&set, &c("a/bc")));
        assert!(!whited_out(&HashSet::new(), &c("a/b")));
    }
}
