//! The [`Installer`]: creates checked members, in pre-order, beneath one fresh target
//! directory, and never writes outside it (see the `tree` module docs), enforcing
//! [`InstallLimits`] as it goes; directory modes and times are applied last
//! ([`Installer::finish`]). An existing name is a duplicate and refused, unless the builder
//! follows the rules of an image layer ([`Installer::with_layer_rules`], child module
//! `layer`): then a later member replaces an earlier one and missing parents are created.

mod layer;

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::rc::Rc;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use super::content::ContentSource;
use super::error::{lossy, path_of, InstallError};
use super::limits::{InstallLimits, InstallStats};
use super::member::{check_device, Member, MemberKind};
use crate::sys::{self, Call, SyscallError, Xattr};

/// Opens `target`, which must be an existing, empty directory (not a symlink to one).
pub(crate) fn open_empty_target(target: &std::path::Path) -> Result<OwnedFd, InstallError> {
    let open_target = |source| InstallError::OpenTarget {
        path: target.to_path_buf(),
        source,
    };
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(rustix::fs::CWD, target, flags, Mode::empty())
        .call("openat")
        .map_err(open_target)?;
    if !sys::sorted_names(&fd).map_err(open_target)?.is_empty() {
        return Err(InstallError::TargetNotEmpty {
            path: target.to_path_buf(),
        });
    }
    Ok(fd)
}

/// A directory whose mode and times are applied after all members are installed.
struct DeferredDir {
    components: Vec<Vec<u8>>,
    raw: Vec<u8>,
    mode: u32,
    mtime: (i64, u32),
    /// Removed again (replaced by a non-directory, layer rules only): nothing to apply.
    removed: bool,
}

/// Creates members, in pre-order, beneath one target directory.
pub(crate) struct Installer<'a> {
    target: Rc<OwnedFd>,
    content: ContentSource<'a>,
    limits: &'a InstallLimits,
    stats: InstallStats,
    total_bytes: u64,
    /// Normalised paths of installed non-directories (hardlink targets).
    installed: HashSet<Vec<u8>>,
    dirs: Vec<DeferredDir>,
    root: Option<DeferredDir>,
    /// Open directories down to the last parent used: each element is a child of the
    /// previous one, at most [`CHAIN_MAX`] of them (the deepest; shallower parents are
    /// resolved again). Saves an `openat2` per member in pre-order archives.
    chain: Vec<(Vec<Vec<u8>>, Rc<OwnedFd>)>,
    /// Copy buffer for streamed content (allocated on first use).
    buf: Vec<u8>,
    /// Image-layer rules: later members replace earlier ones, missing parents are created.
    layer: bool,
    /// Layer rules only: index in `dirs` of each directory created (joined path), so a
    /// directory listed again updates its deferred metadata.
    dir_index: HashMap<Vec<u8>, usize>,
}

/// Most directory fds the installer's chain holds, whatever the depth of the layer (a
/// 2048-deep layer would otherwise hold 2048 fds of the daemon while it is materialized).
const CHAIN_MAX: usize = 16;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

fn join(components: &[Vec<u8>]) -> Vec<u8> {
    components.join(&b'/')
}

fn timestamps((sec, nsec): (i64, u32)) -> Timestamps {
    let time = Timespec {
        tv_sec: sec,
        tv_nsec: i64::from(nsec),
    };
    Timestamps {
        last_access: time,
        last_modification: time,
    }
}

impl<'a> Installer<'a> {
    /// A builder for `target` (an open, empty directory).
    pub(crate) fn new(
        target: OwnedFd,
        content: ContentSource<'a>,
        limits: &'a InstallLimits,
    ) -> Self {
        Installer {
            target: Rc::new(target),
            content,
            limits,
            stats: InstallStats::default(),
            total_bytes: 0,
            installed: HashSet::new(),
            dirs: Vec::new(),
            root: None,
            chain: Vec::new(),
            buf: Vec::new(),
            layer: false,
            dir_index: HashMap::new(),
        }
    }

    /// Members installed so far (directories created for missing parents included).
    pub(crate) fn entries(&self) -> u64 {
        self.stats.entries
    }

    /// Opens `components` (a directory path relative to the target) beneath the target.
    fn open_beneath(&self, components: &[Vec<u8>], flags: OFlags) -> Result<OwnedFd, SyscallError> {
        let path = join(components);
        rustix::fs::openat2(
            &*self.target,
            path.as_slice(),
            // RESOLVE_NO_SYMLINKS covers the last component too (ELOOP); O_NOFOLLOW would
            // turn that into a less telling ENOTDIR.
            flags | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )
        .call("openat2")
    }

    /// The open parent directory `parent` (relative to the target), from the chain or
    /// resolved beneath the target.
    /// Under layer rules, missing directories are created (see [`Installer::with_layer_rules`];
    /// `mtime` is theirs).
    fn parent(
        &mut self,
        parent: &[Vec<u8>],
        raw: &[u8],
        mtime: (i64, u32),
    ) -> Result<Rc<OwnedFd>, InstallError> {
        while let Some((path, _)) = self.chain.last() {
            if parent.starts_with(path) {
                break;
            }
            self.chain.pop();
        }
        if parent.is_empty() {
            return Ok(self.target.clone());
        }
        if let Some((path, fd)) = self.chain.last() {
            if path.as_slice() == parent {
                return Ok(fd.clone());
            }
        }
        let fd = match self.open_beneath(parent, OFlags::PATH) {
            Ok(fd) => fd,
            Err(source) if self.layer && source.errno() == Some(Errno::NOENT.raw_os_error()) => {
                self.create_parents(parent, raw, mtime)?
            }
            Err(source) => {
                return Err(InstallError::ResolveParent {
                    path: path_of(raw),
                    source,
                })
            }
        };
        let fd = Rc::new(fd);
        // The chain must stay a line from the target down; restart it from here.
        self.chain.clear();
        self.chain.push((parent.to_vec(), fd.clone()));
        Ok(fd)
    }

    /// Counts one more entry against [`InstallLimits::max_entries`].
    fn count_entry(&mut self, raw: &[u8]) -> Result<(), InstallError> {
        if self.stats.entries >= self.limits.max_entries {
            return Err(InstallError::TooManyEntries {
                path: path_of(raw),
                max: self.limits.max_entries,
            });
        }
        self.stats.entries += 1;
        Ok(())
    }

    fn check_limits(&mut self, member: &Member) -> Result<(), InstallError> {
        let path = || path_of(&member.raw);
        if self.stats.entries >= self.limits.max_entries {
            return Err(InstallError::TooManyEntries {
                path: path(),
                max: self.limits.max_entries,
            });
        }
        if let MemberKind::Regular { size, data } = &member.kind {
            if *size > self.limits.max_apparent_bytes {
                return Err(InstallError::ApparentSizeTooLarge {
                    path: path(),
                    size: *size,
                    max: self.limits.max_apparent_bytes,
                });
            }
            let bytes = data.data_bytes(*size);
            if bytes > self.limits.max_file_bytes {
                return Err(InstallError::FileTooLarge {
                    path: path(),
                    size: bytes,
                    max: self.limits.max_file_bytes,
                });
            }
            let total = self.total_bytes.saturating_add(bytes);
            if total > self.limits.max_total_bytes {
                return Err(InstallError::TotalBytesExceeded {
                    path: path(),
                    total,
                    max: self.limits.max_total_bytes,
                });
            }
            self.total_bytes = total;
        }
        self.stats.entries += 1;
        Ok(())
    }

    /// Creates one member (parents must already exist).
    pub(crate) fn install(&mut self, member: Member) -> Result<(), InstallError> {
        self.install_from(member, None)
    }

    /// Creates one member whose content (for [`RegularData::Stream`](super::RegularData::Stream))
    /// is read from `reader`.
    pub(crate) fn install_from(
        &mut self,
        member: Member,
        reader: Option<&mut dyn Read>,
    ) -> Result<(), InstallError> {
        if let MemberKind::Device {
            block,
            major,
            minor,
        } = member.kind
        {
            // The caller's rules turn 0:0 into a whiteout or refuse the member; a device
            // that reaches this point is never created.
            check_device(&member.raw, block, major, minor)?;
            return Err(InstallError::UnsupportedEntry {
                path: path_of(&member.raw),
                kind: '3',
            });
        }
        self.check_limits(&member)?;
        let raw = member.raw.as_slice();
        let path = || path_of(raw);
        let create_err = |source: SyscallError| {
            if source.errno() == Some(Errno::EXIST.raw_os_error()) {
                InstallError::DuplicateEntry { path: path_of(raw) }
            } else {
                InstallError::Create {
                    path: path_of(raw),
                    source,
                }
            }
        };
        let meta_err = |source| InstallError::SetMetadata {
            path: path_of(raw),
            source,
        };

        let Some((name, parent)) = member.components.split_last() else {
            // The root member: metadata for the target itself (again, under layer rules).
            if self.root.is_some() && !self.layer {
                return Err(InstallError::DuplicateEntry { path: path() });
            }
            let xattrs: Vec<Xattr> = member
                .xattrs
                .iter()
                .filter(|(n, _)| n.as_slice() != b"trusted.overlay.uuid")
                .cloned()
                .collect();
            set_owner_and_xattrs_fd(self.target.as_fd(), &member, &xattrs).map_err(meta_err)?;
            self.root = Some(DeferredDir {
                components: Vec::new(),
                raw: member.raw.clone(),
                mode: member.mode,
                mtime: member.mtime,
                removed: false,
            });
            return Ok(());
        };
        let parent_fd = self.parent(parent, raw, member.mtime)?;
        let dir = parent_fd.as_fd();
        let name = name.as_slice();
        let full = join(&member.components);
        // Layer rules: whatever an earlier member left at this name goes first (a
        // directory listed again is merged into).
        let merge = self.layer && self.make_room(dir, name, &member, &full)?;

        match &member.kind {
            MemberKind::Directory => {
                if !merge {
                    rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o700))
                        .call("mkdirat")
                        .map_err(create_err)?;
                }
                let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(dir, name, flags, Mode::empty())
                    .call("openat")
                    .map_err(create_err)?;
                set_owner_and_xattrs_fd(fd.as_fd(), &member, &member.xattrs).map_err(meta_err)?;
                self.record_dir(
                    full,
                    DeferredDir {
                        components: member.components.clone(),
                        raw: member.raw.clone(),
                        mode: member.mode,
                        mtime: member.mtime,
                        removed: false,
                    },
                );
                // `self.parent` left the chain ending at this directory's parent.
                self.chain.push((member.components.clone(), Rc::new(fd)));
                if self.chain.len() > CHAIN_MAX {
                    self.chain.remove(0);
                }
                return Ok(());
            }
            MemberKind::Regular { size, data } => {
                let flags = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let fd = rustix::fs::openat(dir, name, flags, Mode::from_raw_mode(0o600))
                    .call("openat")
                    .map_err(create_err)?;
                let (written, shared) =
                    self.content
                        .fill(fd.as_fd(), raw, *size, data, reader, &mut self.buf)?;
                self.stats.content_bytes += written;
                self.stats.shared_bytes += shared;
                set_owner_and_xattrs_fd(fd.as_fd(), &member, &member.xattrs).map_err(meta_err)?;
                rustix::fs::fchmod(&fd, Mode::from_raw_mode(member.mode))
                    .call("fchmod")
                    .map_err(meta_err)?;
                rustix::fs::futimens(&fd, &timestamps(member.mtime))
                    .call("futimens")
                    .map_err(meta_err)?;
            }
            MemberKind::Symlink { target } => {
                rustix::fs::symlinkat(target.as_slice(), dir, name)
                    .call("symlinkat")
                    .map_err(create_err)?;
                set_metadata_at(dir, name, &member, false).map_err(meta_err)?;
            }
            MemberKind::Device { .. } => {
                return Err(InstallError::UnsupportedEntry {
                    path: path(),
                    kind: '3',
                })
            }
            MemberKind::Whiteout | MemberKind::Fifo => {
                let file_type = if matches!(member.kind, MemberKind::Fifo) {
                    FileType::Fifo
                } else {
                    FileType::CharacterDevice
                };
                rustix::fs::mknodat(dir, name, file_type, Mode::from_raw_mode(0o600), 0)
                    .call("mknodat")
                    .map_err(create_err)?;
                set_metadata_at(dir, name, &member, true).map_err(meta_err)?;
            }
            MemberKind::Hardlink { target } => {
                let target_path = join(target);
                if !self.installed.contains(&target_path) {
                    return Err(InstallError::HardlinkTargetMissing {
                        path: path(),
                        target: lossy(&target_path),
                    });
                }
                let (target_name, target_parent) = target
                    .split_last()
                    .expect("hardlink targets are never the root");
                let target_dir = if target_parent.is_empty() {
                    None
                } else {
                    Some(
                        self.open_beneath(target_parent, OFlags::PATH)
                            .map_err(|source| InstallError::ResolveParent {
                                path: path(),
                                source,
                            })?,
                    )
                };
                let target_dir = match &target_dir {
                    Some(fd) => fd.as_fd(),
                    None => self.target.as_fd(),
                };
                rustix::fs::linkat(
                    target_dir,
                    target_name.as_slice(),
                    dir,
                    name,
                    AtFlags::empty(),
                )
                .call("linkat")
                .map_err(create_err)?;
            }
        }
        self.installed.insert(full);
        Ok(())
    }

    /// Applies directory modes and times, deepest first, then the root's; returns what was
    /// installed.
    pub(crate) fn finish(mut self) -> Result<InstallStats, InstallError> {
        self.chain.clear();
        for dir in self.dirs.iter().rev().filter(|d| !d.removed) {
            let meta_err = |source| InstallError::SetMetadata {
                path: path_of(&dir.raw),
                source,
            };
            let fd = self
                .open_beneath(&dir.components, OFlags::RDONLY)
                .map_err(meta_err)?;
            finish_dir(fd.as_fd(), dir).map_err(meta_err)?;
        }
        if let Some(root) = &self.root {
            finish_dir(self.target.as_fd(), root).map_err(|source| InstallError::SetMetadata {
                path: path_of(&root.raw),
                source,
            })?;
        }
        Ok(self.stats)
    }
}

fn finish_dir(fd: BorrowedFd<'_>, dir: &DeferredDir) -> Result<(), SyscallError> {
    rustix::fs::fchmod(fd, Mode::from_raw_mode(dir.mode)).call("fchmod")?;
    rustix::fs::futimens(fd, &timestamps(dir.mtime)).call("futimens")
}

/// Owner, then extended attributes (a chown clears `security.capability`), through `fd`.
fn set_owner_and_xattrs_fd(
    fd: BorrowedFd<'_>,
    member: &Member,
    xattrs: &[Xattr],
) -> Result<(), SyscallError> {
    rustix::fs::fchown(
        fd,
        Some(Uid::from_raw(member.uid)),
        Some(Gid::from_raw(member.gid)),
    )
    .call("fchown")?;
    for (name, value) in xattrs {
        sys::set_xattr_fd(fd, name, value)?;
    }
    Ok(())
}

/// Owner, extended attributes, mode (unless a symlink) and times of `name` in `dir`,
/// never following `name` if it is a symlink.
fn set_metadata_at(
    dir: BorrowedFd<'_>,
    name: &[u8],
    member: &Member,
    chmod: bool,
) -> Result<(), SyscallError> {
    rustix::fs::chownat(
        dir,
        name,
        Some(Uid::from_raw(member.uid)),
        Some(Gid::from_raw(member.gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .call("fchownat")?;
    if !member.xattrs.is_empty() {
        let path = sys::proc_fd_path(dir, name);
        for (xname, value) in &member.xattrs {
            sys::set_xattr_path(&path, xname, value)?;
        }
    }
    if chmod {
        // `name` was just created by mknodat in a directory only this installer writes.
        rustix::fs::chmodat(
            dir,
            name,
            Mode::from_raw_mode(member.mode),
            AtFlags::empty(),
        )
        .call("fchmodat")?;
    }
    rustix::fs::utimensat(
        dir,
        name,
        &timestamps(member.mtime),
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .call("utimensat")
}
