//! The tree builder under the rules of an image layer (tar semantics, as container runtimes
//! apply a layer): a member whose name an earlier member already took replaces it, a
//! directory listed again is merged into, missing parent directories are created, and
//! whiteouts (0:0 character devices) and other members never share a name.
//!
//! Replacing never writes through what is there: the old name is examined with
//! `fstatat(AT_SYMLINK_NOFOLLOW)` and removed with `unlinkat` (an empty directory with
//! `AT_REMOVEDIR`; a directory with children is refused, as GNU tar does), then the new
//! member is created with the usual exclusive calls. A symlink is replaced as a symlink, never
//! followed.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Uid};

use super::{join, DeferredDir, Installer, RESOLVE};
use crate::sys::{self, Call, SyscallError};
use crate::tree::error::{path_of, InstallError};
use crate::tree::member::{Member, MemberKind};

/// The attribute that makes a directory of a layer opaque, and its value.
const OPAQUE: (&[u8], &[u8]) = (b"trusted.overlay.opaque", b"y");

/// Mode of the directories created for parents a layer did not list.
const IMPLICIT_DIR_MODE: u32 = 0o755;

impl Installer<'_> {
    /// Switches to the rules of an image layer (see the module docs): repeated names
    /// replace, repeated directories merge, missing parents are created (mode 0755, owner
    /// root, the mtime of the member that needed them; each counts as an entry), and a
    /// whiteout never replaces nor is replaced by another member
    /// ([`InstallError::WhiteoutConflict`]).
    pub(crate) fn with_layer_rules(mut self) -> Self {
        self.layer = true;
        self
    }

    /// Makes `components` (a directory, relative to the target) opaque: sets
    /// `trusted.overlay.opaque=y` on it, creating it (mode 0755, owner root) when missing.
    /// `raw` names the marker member in errors. Layer rules only.
    pub(crate) fn mark_opaque(
        &mut self,
        components: &[Vec<u8>],
        raw: &[u8],
        mtime: (i64, u32),
    ) -> Result<(), InstallError> {
        let meta_err = |source| InstallError::SetMetadata {
            path: path_of(raw),
            source,
        };
        let fd = if components.is_empty() {
            None
        } else {
            match self.open_beneath(components, OFlags::RDONLY) {
                Ok(fd) => Some(fd),
                Err(source) if source.errno() == Some(Errno::NOENT.raw_os_error()) => {
                    return self.install(Member {
                        raw: raw.to_vec(),
                        components: components.to_vec(),
                        kind: MemberKind::Directory,
                        mode: IMPLICIT_DIR_MODE,
                        uid: 0,
                        gid: 0,
                        mtime,
                        xattrs: vec![(OPAQUE.0.to_vec(), OPAQUE.1.to_vec())],
                    });
                }
                Err(source) => {
                    return Err(InstallError::ResolveParent {
                        path: path_of(raw),
                        source,
                    })
                }
            }
        };
        let fd = match &fd {
            Some(fd) => fd.as_fd(),
            None => self.target.as_fd(),
        };
        sys::set_xattr_fd(fd, OPAQUE.0, OPAQUE.1).map_err(meta_err)
    }

    /// Clears `name` in `dir` for `member` (joined path `full`) when an earlier member took
    /// it. `Ok(true)`: it is a directory and `member` one too, to be merged into.
    pub(super) fn make_room(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &[u8],
        member: &Member,
        full: &[u8],
    ) -> Result<bool, InstallError> {
        let create_err = |source| InstallError::Create {
            path: path_of(&member.raw),
            source,
        };
        let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(stat) => stat,
            Err(Errno::NOENT) => return Ok(false),
            Err(errno) => return Err(create_err(SyscallError::new("fstatat", errno))),
        };
        let file_type = FileType::from_raw_mode(stat.st_mode);
        // Under layer rules no device node other than a whiteout is ever created.
        let was_whiteout = file_type == FileType::CharacterDevice && stat.st_rdev == 0;
        if was_whiteout != matches!(member.kind, MemberKind::Whiteout) {
            return Err(InstallError::WhiteoutConflict {
                path: path_of(&member.raw),
            });
        }
        if file_type == FileType::Directory {
            if matches!(member.kind, MemberKind::Directory) {
                return Ok(true);
            }
            match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
                Ok(()) => {}
                Err(Errno::NOTEMPTY | Errno::EXIST) => {
                    return Err(InstallError::ReplacesDirectory {
                        path: path_of(&member.raw),
                    })
                }
                Err(errno) => {
                    return Err(create_err(SyscallError::new(
                        "unlinkat(AT_REMOVEDIR)",
                        errno,
                    )))
                }
            }
            if let Some(i) = self.dir_index.remove(full) {
                self.dirs[i].removed = true;
            }
            // The chain may hold the removed directory.
            self.chain.clear();
        } else {
            rustix::fs::unlinkat(dir, name, AtFlags::empty())
                .call("unlinkat")
                .map_err(create_err)?;
            self.installed.remove(full);
        }
        tracing::trace!(path = %path_of(&member.raw).display(), "replacing an earlier member");
        Ok(false)
    }

    /// Records a directory whose mode and times [`finish`](Installer::finish) applies;
    /// under layer rules, a directory listed again replaces its earlier record.
    pub(super) fn record_dir(&mut self, full: Vec<u8>, dir: DeferredDir) {
        if self.layer {
            if let Some(&i) = self.dir_index.get(&full) {
                self.dirs[i] = dir;
                return;
            }
            self.dir_index.insert(full, self.dirs.len());
        }
        self.dirs.push(dir);
    }

    /// Opens `parent` beneath the target one component at a time, creating the missing
    /// ones (mode 0755 once finished, owner root, `mtime`); `raw` names the member that
    /// needs them. Each component is opened with the same `openat2` resolve flags as a
    /// whole path, so a symlink or another filesystem on the way fails as usual.
    pub(super) fn create_parents(
        &mut self,
        parent: &[Vec<u8>],
        raw: &[u8],
        mtime: (i64, u32),
    ) -> Result<OwnedFd, InstallError> {
        let target = self.target.clone();
        let resolve_err = |source| InstallError::ResolveParent {
            path: path_of(raw),
            source,
        };
        let create_err = |source| InstallError::Create {
            path: path_of(raw),
            source,
        };
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let mut current: Option<OwnedFd> = None;
        for (i, component) in parent.iter().enumerate() {
            let at = match &current {
                Some(fd) => fd.as_fd(),
                None => target.as_fd(),
            };
            let next = match rustix::fs::openat2(
                at,
                component.as_slice(),
                flags,
                Mode::empty(),
                RESOLVE,
            ) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    self.count_entry(raw)?;
                    rustix::fs::mkdirat(at, component.as_slice(), Mode::from_raw_mode(0o700))
                        .call("mkdirat")
                        .map_err(create_err)?;
                    let fd = rustix::fs::openat(
                        at,
                        component.as_slice(),
                        flags | OFlags::NOFOLLOW,
                        Mode::empty(),
                    )
                    .call("openat")
                    .map_err(create_err)?;
                    rustix::fs::fchown(&fd, Some(Uid::ROOT), Some(Gid::ROOT))
                        .call("fchown")
                        .map_err(|source| InstallError::SetMetadata {
                            path: path_of(raw),
                            source,
                        })?;
                    let components = parent[..=i].to_vec();
                    let joined = join(&components);
                    tracing::trace!(path = %path_of(&joined).display(), "creating a parent the layer did not list");
                    self.record_dir(
                        joined.clone(),
                        DeferredDir {
                            components,
                            raw: joined,
                            mode: IMPLICIT_DIR_MODE,
                            mtime,
                            removed: false,
                        },
                    );
                    fd
                }
                Err(errno) => return Err(resolve_err(SyscallError::new("openat2", errno))),
            };
            current = Some(next);
        }
        current.ok_or_else(|| resolve_err(SyscallError::new("openat2", Errno::NOENT)))
    }
}
