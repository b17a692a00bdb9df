//! Where a transfer reads from and writes to: [`resolve_source`] and [`resolve_destination`],
//! the same decision on both sides (`docker cp` semantics).
//!
//! Destination: if DST exists and is a directory, the tree goes inside it under its own name
//! ([`Destination::Into`]); otherwise the tree *becomes* DST ([`Destination::Rename`]): DST's
//! parent must exist, and the tree's top-level member is renamed to DST's last component. A
//! DST that ends in `/` must be an existing directory.
//!
//! Paths are resolved in one of two ways ([`Resolution`]): on the host, as the user's own paths
//! (symlinks followed like any program the user runs), except the destination's last
//! component, which is never followed (a symlink there may come from an earlier download of a
//! hostile sandbox: the tree replaces it); inside a sandbox, relative to the
//! sandbox root with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`, so a symlink on the
//! path, absolute or a `../..` chain, resolves inside the root and a `/proc` magic link is
//! refused.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{lossy, TransferError};
use crate::name::{last_component, parent_of};

/// How paths are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// The host user's own path, relative to the base fd (or absolute), symlinks followed.
    Host,
    /// Beneath the base fd taken as the root: leading `/` stripped, symlinks resolved inside
    /// it (`RESOLVE_IN_ROOT`), magic links refused (`RESOLVE_NO_MAGICLINKS`).
    InRoot,
}

/// Where an archive is extracted ([`crate::unpack`]).
#[derive(Debug)]
pub enum Destination {
    /// Members are created inside this directory under their own names.
    Into(OwnedFd),
    /// Members are created inside `parent`, the tree's top-level component renamed to `name`.
    Rename {
        /// The directory the tree is created in.
        parent: OwnedFd,
        /// The new name of the tree's top-level member.
        name: Vec<u8>,
    },
}

impl Destination {
    /// The directory members are created in.
    pub fn dir(&self) -> BorrowedFd<'_> {
        match self {
            Destination::Into(fd) | Destination::Rename { parent: fd, .. } => fd.as_fd(),
        }
    }

    /// The top-level rename, if any.
    pub fn rename(&self) -> Option<&[u8]> {
        match self {
            Destination::Into(_) => None,
            Destination::Rename { name, .. } => Some(name),
        }
    }
}

/// A tree to archive ([`crate::pack`]): the name `name` in the directory `parent`, opened
/// once; the tree's top-level member in the archive is `name`.
#[derive(Debug)]
pub struct Source {
    /// The directory holding the source.
    pub parent: OwnedFd,
    /// The source's name in `parent` (a normal component), and the archive's top-level name.
    pub name: Vec<u8>,
}

/// Opens the directory `path` (as resolved by `how` from `base`) as an `O_PATH` fd.
pub(crate) fn open_dir(
    base: BorrowedFd<'_>,
    path: &[u8],
    how: Resolution,
) -> Result<OwnedFd, Errno> {
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    match how {
        Resolution::Host => rustix::fs::openat(base, path, flags, Mode::empty()),
        Resolution::InRoot => {
            let mut rel = path;
            while let [b'/', rest @ ..] = rel {
                rel = rest;
            }
            let rel: &[u8] = if rel.is_empty() { b"." } else { rel };
            rustix::fs::openat2(
                base,
                rel,
                flags,
                Mode::empty(),
                ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
            )
        }
    }
}

/// Decides where an archive sent to `path` goes (see the module docs). `single_tree`: the
/// archive holds one tree that may become `path`; without it (an arbitrary archive) `path`
/// must be an existing directory.
///
/// Errors: [`TransferError::DestinationNotDirectory`] (a trailing `/`, or an arbitrary
/// archive, and no such directory), [`TransferError::DestinationName`],
/// [`TransferError::DestinationParent`].
pub fn resolve_destination(
    base: BorrowedFd<'_>,
    path: &[u8],
    how: Resolution,
    single_tree: bool,
) -> Result<Destination, TransferError> {
    let shown = || lossy(path);
    if path.is_empty() || path.contains(&0) {
        return Err(TransferError::DestinationName { path: shown() });
    }
    let parent_error = |e: Errno| TransferError::DestinationParent {
        path: shown(),
        source: e.into(),
    };
    // On the host the last component is never followed: a symlink there (say, one an earlier
    // download of a hostile sandbox left) is not a directory to copy into, so the tree
    // replaces it (the unpacker replaces a file or link in its way, never writes through it),
    // or with a trailing `/` or an arbitrary archive the destination is refused. The parent
    // is the user's own path.
    let mut host_parent = None;
    let opened = match (how, last_component(path)) {
        (Resolution::Host, Some(name)) => {
            let parent = open_dir(base, parent_of(path), how).map_err(parent_error)?;
            let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let opened = rustix::fs::openat(&parent, name, flags, Mode::empty());
            host_parent = Some(parent);
            opened
        }
        _ => open_dir(base, path, how),
    };
    match opened {
        Ok(fd) => return Ok(Destination::Into(fd)),
        Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => {}
        Err(e) => return Err(parent_error(e)),
    }
    if !single_tree || path.ends_with(b"/") {
        return Err(TransferError::DestinationNotDirectory { path: shown() });
    }
    let name =
        last_component(path).ok_or_else(|| TransferError::DestinationName { path: shown() })?;
    let parent = match host_parent {
        Some(parent) => parent,
        None => open_dir(base, parent_of(path), how).map_err(parent_error)?,
    };
    Ok(Destination::Rename {
        parent,
        name: name.to_vec(),
    })
}

/// Opens the parent of the source `path` (as resolved by `how` from `base`) and checks that
/// the source exists there and is a regular file, a directory or a symlink (archived as the
/// link itself, never followed).
///
/// Errors: [`TransferError::SourceName`], [`TransferError::Source`],
/// [`TransferError::SourceSpecial`].
pub fn resolve_source(
    base: BorrowedFd<'_>,
    path: &[u8],
    how: Resolution,
) -> Result<Source, TransferError> {
    let shown = || lossy(path);
    if path.contains(&0) {
        return Err(TransferError::SourceName { path: shown() });
    }
    let name = last_component(path).ok_or_else(|| TransferError::SourceName { path: shown() })?;
    let parent = open_dir(base, parent_of(path), how).map_err(|e| TransferError::Source {
        path: shown(),
        source: e.into(),
    })?;
    let stat = rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| {
        TransferError::Source {
            path: shown(),
            source: e.into(),
        }
    })?;
    if let Some(kind) = special_kind(FileType::from_raw_mode(stat.st_mode)) {
        return Err(TransferError::SourceSpecial {
            path: shown(),
            kind,
        });
    }
    Ok(Source {
        parent,
        name: name.to_vec(),
    })
}

/// The name of a file type that is never archived nor extracted, `None` for regular files,
/// directories and symlinks.
pub(crate) fn special_kind(kind: FileType) -> Option<&'static str> {
    match kind {
        FileType::RegularFile | FileType::Directory | FileType::Symlink => None,
        FileType::CharacterDevice => Some("character device"),
        FileType::BlockDevice => Some("block device"),
        FileType::Fifo => Some("fifo"),
        FileType::Socket => Some("socket"),
        FileType::Unknown => Some("file of unknown type"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    fn dest(
        root: &std::path::Path,
        path: &str,
        single: bool,
    ) -> Result<Destination, TransferError> {
        let base = rustix::fs::open(root, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        resolve_destination(base.as_fd(), path.as_bytes(), Resolution::InRoot, single)
    }

    #[test]
    fn an_existing_directory_takes_the_tree_inside_else_the_tree_becomes_it() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("d")).unwrap();
        std::fs::write(t.path().join("f"), b"x").unwrap();
        assert!(matches!(
            dest(t.path(), "/d", true),
            Ok(Destination::Into(_))
        ));
        assert!(matches!(
            dest(t.path(), "/", true),
            Ok(Destination::Into(_))
        ));
        match dest(t.path(), "/d/new", true) {
            Ok(Destination::Rename { name, .. }) => assert_eq!(name, b"new"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            dest(t.path(), "/f", true),
            Ok(Destination::Rename { .. })
        ));
        assert!(matches!(
            dest(t.path(), "/new/", true),
            Err(TransferError::DestinationNotDirectory { .. })
        ));
        assert!(matches!(
            dest(t.path(), "/new", false),
            Err(TransferError::DestinationNotDirectory { .. })
        ));
        assert!(matches!(
            dest(t.path(), "/missing/new", true),
            Err(TransferError::DestinationParent { .. })
        ));
        assert!(matches!(
            dest(t.path(), "/d/..", true),
            Ok(Destination::Into(_))
        ));
    }

    #[test]
    fn symlinks_on_the_destination_resolve_inside_the_root() {
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        symlink(outside.path(), root.path().join("abs")).unwrap();
        symlink("../../../../../../..", root.path().join("up")).unwrap();
        // `abs` points at a host path: inside the root that path does not exist, so the tree
        // replaces the link instead of entering the host directory.
        match dest(root.path(), "/abs", true) {
            Ok(Destination::Rename { name, .. }) => assert_eq!(name, b"abs"),
            other => panic!("{other:?}"),
        }
        // `up` climbs to the root and stops there.
        let Ok(Destination::Into(fd)) = dest(root.path(), "/up", true) else {
            panic!("up is the root");
        };
        let st = rustix::fs::fstat(&fd).unwrap();
        let rt = rustix::fs::stat(root.path()).unwrap();
        assert_eq!((st.st_dev, st.st_ino), (rt.st_dev, rt.st_ino));
        assert!(matches!(
            dest(root.path(), "/abs/x", true),
            Err(TransferError::DestinationParent { .. })
        ));
    }

    #[test]
    fn on_the_host_the_last_component_of_the_destination_is_never_followed() {
        let t = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        symlink(elsewhere.path(), t.path().join("link")).unwrap();
        std::fs::create_dir(t.path().join("real")).unwrap();
        symlink(t.path().join("real"), t.path().join("via")).unwrap();
        let host = |path: std::path::PathBuf, single| {
            let cwd = rustix::fs::CWD;
            resolve_destination(
                cwd,
                path.as_os_str().as_encoded_bytes(),
                Resolution::Host,
                single,
            )
        };
        match host(t.path().join("link"), true) {
            Ok(Destination::Rename { name, .. }) => assert_eq!(name, b"link"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            host(t.path().join("link/"), true),
            Err(TransferError::DestinationNotDirectory { .. })
        ));
        assert!(matches!(
            host(t.path().join("link"), false),
            Err(TransferError::DestinationNotDirectory { .. })
        ));
        // Symlinks above the last component are the user's path and followed.
        assert!(matches!(
            host(t.path().join("via/."), true),
            Ok(Destination::Into(_))
        ));
        assert!(matches!(
            host(t.path().join("real"), true),
            Ok(Destination::Into(_))
        ));
    }

    #[test]
    fn sources_must_be_named_and_not_special() {
        let t = tempfile::tempdir().unwrap();
        let base =
            rustix::fs::open(t.path(), OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        std::fs::write(t.path().join("f"), b"x").unwrap();
        let src = resolve_source(base.as_fd(), b"/f", Resolution::InRoot).unwrap();
        assert_eq!(src.name, b"f");
        assert!(matches!(
            resolve_source(base.as_fd(), b"/", Resolution::InRoot),
            Err(TransferError::SourceName { .. })
        ));
        assert!(matches!(
            resolve_source(base.as_fd(), b"/nope", Resolution::InRoot),
            Err(TransferError::Source { .. })
        ));
        rustix::fs::mknodat(&base, "fifo", FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();
        assert!(matches!(
            resolve_source(base.as_fd(), b"fifo", Resolution::InRoot),
            Err(TransferError::SourceSpecial { kind: "fifo", .. })
        ));
    }
}
