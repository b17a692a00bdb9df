//! [`validate_restore_paths`]: every path a `criu restore` of an images dir will create, open,
//! bind or remove, checked against the fresh root before CRIU runs.

use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use super::entries::{
    self, Files, Ghost, RegFile, Remap, RemapKind, UnixSk, FILES_MAGIC, GHOST_FILE_MAGIC,
    MNTS_MAGIC, REMAP_FPATH_MAGIC,
};
use super::error::{PathOp, UnsafeImagePath, UnsafeKind};
use super::fs::{refuse, walk_error, Fs, Mount, Walk, WalkError, World};
use super::mounts::{self, AllowedBind};
use super::path::{show, split, Comps, Entry};
use super::tmpfs::ALLOWED_CHAR_DEVICES;
use super::wire::{self, Image, ImageError, WireError};
use crate::sys::SyscallError;

/// What [`validate_restore_paths`] checked.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImagePathReport {
    /// Mounts of the restored namespace (0 for images without a mount namespace).
    pub mounts: usize,
    /// Members of tmpfs archives.
    pub tmpfs_members: usize,
    /// Where CRIU will create each ghost file or directory, as a path in the restored
    /// namespace (after CRIU's move to the deepest existing parent).
    pub ghosts: Vec<String>,
    /// Regular-file entries (file descriptors, cwds, roots, executables, mappings, fifos).
    pub files: usize,
    /// Unix sockets with a path name.
    pub unix_sockets: usize,
    /// Ptys (each re-created by index in a fresh devpts).
    pub ptys: usize,
    /// Descriptors of `/dev/tty` (a task's controlling terminal opened by that name; CRIU's
    /// `CTTY` ttys), which CRIU re-opens and `fchown`s at restore: it fails unless the
    /// restored `/dev/tty` is on a writable mount.
    pub dev_tty: usize,
    /// `openat2` lookups made in the root.
    pub lookups: usize,
    /// Wall time of the check.
    pub elapsed: Duration,
}

/// `O_NOFOLLOW` (x86-64, aarch64 differ; take the libc value).
const O_NOFOLLOW: u32 = libc::O_NOFOLLOW as u32;
/// `uflags` bit of an external unix socket (not bound by CRIU).
const USK_EXTERN: u32 = 1;
const SOCK_DGRAM: u32 = 2;
const TCP_ESTABLISHED: u32 = 1;

/// Checks, before `criu restore --root <root>` runs, every path of the images in `images_dir`
/// that the restore will create, open, mkdir, bind, link or remove, against the tree at `root`
/// (the freshly materialized merged dir of the new instance; nothing of the sandbox runs yet, so
/// the tree cannot change between this check and CRIU's run). Reads the images and looks paths
/// up; creates and changes nothing.
///
/// What is checked (see the module docs for the CRIU code behind each rule):
/// - **mounts**: only the namespace root (`root`), its bind mounts, tmpfs, procfs and devpts; no
///   external or plugin mounts; every mount point an existing directory or file inside its
///   parent mount, reached without symbolic links; each tmpfs archive's members (no absolute
///   names, `..`, members below links or files, foreign hard links, block devices, character
///   devices outside [`ALLOWED_CHAR_DEVICES`]); deleted bind sources re-creatable beneath
///   directories;
/// - **ghost files** (unlinked open files, deleted cwds and roots): created by CRIU as host
///   root at `<mount>/<path>.cr.<id>.ghost` (directories at `<path>`): every existing component
///   from the mount's root to the parent must be a directory, never a symbolic link, and the
///   name must not exist (a ghost directory may reuse a directory); missing parents are fine
///   (CRIU uses the deepest existing one, or creates them for a directory). Ghost devices must
///   be allowed character devices; link remaps are refused (Belayer never dumps with
///   `--link-remap`);
/// - **files** reopened by path: relative to the namespace root, no `..`/NUL, no symbolic link
///   or procfs magic link on the way, no symbolic link as the leaf unless opened `O_NOFOLLOW`;
/// - **unix sockets** bound by path (CRIU binds and unlinks inside `chroot(<restored root>)`):
///   resolved with chroot semantics, following symbolic links beneath the root; never into
///   procfs (magic links escape a chroot); the parent must exist unless the socket's file was
///   deleted (CRIU then creates the dirs);
/// - **ptys**: each index must be one CRIU reaches in a fresh devpts instance, whatever the
///   order it opens them in (below [`PTY_OPEN_TRIES`](super::PTY_OPEN_TRIES)).
///
/// Images without a mount image (a tree restored in the caller's mount namespace) are
/// checked against `root` as the root of every path, strictly (CRIU then works from its own
/// root with no chroot): pass `/` for them.
///
/// Errors: [`UnsafeImagePath::Unsafe`] (with image, operation, path and kind),
/// [`UnsafeImagePath::DecodeImage`], [`UnsafeImagePath::ReadImage`],
/// [`UnsafeImagePath::OpenRoot`], [`UnsafeImagePath::Lookup`].
pub fn validate_restore_paths(
    images_dir: &Path,
    root: &Path,
) -> Result<ImagePathReport, UnsafeImagePath> {
    validate_restore_paths_allowing(images_dir, root, &[])
}

/// [`validate_restore_paths`] for a tree that also holds binds of host paths the caller put
/// there on purpose (`allowed`: e.g. `/dev/null` over a device placeholder, an empty host
/// directory over a masked `/proc` directory): CRIU records them as external mounts and binds
/// the same host paths again at restore. Those mount points are checked like any other; the
/// restore may create nothing below them; every other external mount is refused.
pub fn validate_restore_paths_allowing(
    images_dir: &Path,
    root: &Path,
    allowed: &[AllowedBind<'_>],
) -> Result<ImagePathReport, UnsafeImagePath> {
    let started = Instant::now();
    let root_fd: OwnedFd = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| UnsafeImagePath::OpenRoot {
        root: root.to_path_buf(),
        source: SyscallError::new("open", e),
    })?;
    let mut report = ImagePathReport::default();
    let mut world = World::default();

    let mount_images = mount_images(images_dir)?;
    let mntns = match mount_images.as_slice() {
        [] => {
            world.fss.push(Fs::Root {
                fd: root_fd,
                no_xdev: false,
            });
            world.mounts.push(Mount {
                mnt_id: 0,
                fs: 0,
                root: Vec::new(),
                mountpoint: Vec::new(),
            });
            false
        }
        [name] => {
            let img = read(images_dir, name, MNTS_MAGIC, true)?;
            let mnts = decode_all(images_dir, name, &img, entries::mnt)?;
            let summary = mounts::build(&mut world, images_dir, name, &mnts, root_fd, allowed)?;
            report.mounts = summary.mounts;
            report.tmpfs_members = summary.tmpfs_members;
            true
        }
        [first, ..] => {
            return Err(UnsafeImagePath::Unsafe {
                image: first.clone(),
                op: PathOp::BuildMounts,
                path: "/".into(),
                kind: UnsafeKind::SeveralMountNamespaces,
            })
        }
    };

    let files = read_files(images_dir)?;
    let remaps = match optional(images_dir, "remap-fpath.img", REMAP_FPATH_MAGIC)? {
        Some(img) => decode_all(images_dir, "remap-fpath.img", &img, entries::remap)?,
        None => Vec::new(),
    };
    let mut check = Check {
        images_dir,
        world,
        mntns,
        files: &files,
        report,
    };
    check.ghosts(&remaps)?;
    check.reg_files()?;
    check.sockets()?;
    (check.report.ptys, check.report.dev_tty) = super::ttys::check_ptys(images_dir)?;
    let mut report = check.report;
    report.lookups = check.world.lookups;
    report.elapsed = started.elapsed();
    tracing::debug!(
        images = %images_dir.display(),
        ms = report.elapsed.as_secs_f64() * 1e3,
        lookups = report.lookups,
        ghosts = report.ghosts.len(),
        "criu image paths checked"
    );
    Ok(report)
}

/// The state of one check.
struct Check<'a> {
    images_dir: &'a Path,
    world: World,
    mntns: bool,
    files: &'a Files,
    report: ImagePathReport,
}

/// A regular file's `name`: `/` then the path from the namespace root.
fn reg_path(name: &[u8]) -> Result<Comps, UnsafeKind> {
    if name.first() != Some(&b'/') {
        return Err(UnsafeKind::Malformed);
    }
    split(name)
}

impl Check<'_> {
    /// The mount a file entry names (`mnt_id`), or the only one without a mount namespace.
    fn mount_of(&self, mnt_id: i32) -> Result<Mount, UnsafeKind> {
        if !self.mntns {
            return Ok(self.world.mounts[0].clone());
        }
        self.world
            .mounts
            .iter()
            .find(|m| i64::from(m.mnt_id) == i64::from(mnt_id))
            .cloned()
            .ok_or(UnsafeKind::UnknownMount { mnt_id })
    }

    /// Ghost remaps, in image order: each is created once, by its first file.
    fn ghosts(&mut self, remaps: &[Remap]) -> Result<(), UnsafeImagePath> {
        const IMAGE: &str = "remap-fpath.img";
        let by_id: HashMap<u32, &RegFile> = self.files.regs.iter().map(|f| (f.id, f)).collect();
        let mut made = HashSet::new();
        for r in remaps {
            let reg = by_id.get(&r.orig_id).copied();
            let (op, remap_type) = match r.kind {
                RemapKind::Procfs => continue,
                RemapKind::Ghost => (PathOp::CreateGhost, 1),
                RemapKind::Linked => (PathOp::LinkRemap, 0),
                RemapKind::Unknown(t) => (PathOp::LinkRemap, t),
            };
            let Some(reg) = reg else {
                return Err(refuse(
                    IMAGE,
                    op,
                    b"",
                    UnsafeKind::UnknownFile { id: r.orig_id },
                ));
            };
            if op != PathOp::CreateGhost {
                return Err(refuse(
                    IMAGE,
                    op,
                    &reg.name,
                    UnsafeKind::Remap { remap_type },
                ));
            }
            if !made.insert(r.remap_id) {
                continue;
            }
            let ghost_image = format!("ghost-file-{:x}.img", r.remap_id);
            let ghost = self.read_ghost(&ghost_image)?;
            let at = self
                .create_ghost(&reg.name, reg.mnt_id, r.remap_id, ghost)
                .map_err(|e| walk_error(&ghost_image, op, &reg.name, e))?;
            self.report.ghosts.push(at);
        }
        Ok(())
    }

    fn read_ghost(&self, name: &str) -> Result<Ghost, UnsafeImagePath> {
        let path = self.images_dir.join(name);
        let (base, msg) = wire::read_first_entry(&path, GHOST_FILE_MAGIC, true)
            .map_err(|e| image_error(&path, e))?;
        entries::ghost(&msg, base).map_err(|e| decode_error(&path, e))
    }

    /// Checks one ghost and records what CRIU creates; returns where it lands.
    fn create_ghost(
        &mut self,
        name: &[u8],
        mnt_id: i32,
        remap_id: u32,
        ghost: Ghost,
    ) -> Result<String, WalkError> {
        let comps = reg_path(name)?;
        let mount = self.mount_of(mnt_id)?;
        let rel = comps
            .strip_prefix(mount.mountpoint.as_slice())
            .ok_or(UnsafeKind::OutsideMount { mnt_id })?
            .to_vec();
        if self.world.fss[mount.fs].refuses_creation() {
            return Err(UnsafeKind::Procfs { at: show(&comps) }.into());
        }
        check_ghost_device(ghost)?;
        let fmt = ghost.mode & libc::S_IFMT;
        let landed = if fmt == libc::S_IFDIR {
            // mkdir -p of the path itself; an existing directory is reused.
            let walk = self
                .world
                .walk_fs(mount.fs, &mount.root, &rel, &mount.mountpoint)?;
            match &walk.leaf {
                Entry::Missing | Entry::Dir => {}
                e => return Err(leaf_error(e, &in_ns(&mount, &walk.path()))),
            }
            let mut made = walk.parent.clone();
            for c in &walk.missing {
                made.push(c.clone());
                self.world.create(mount.fs, made.clone(), Entry::Dir);
            }
            walk.path()
        } else {
            let Some((last, dirs)) = rel.split_last() else {
                return Err(UnsafeKind::Malformed.into());
            };
            let mut leaf = last.clone();
            leaf.extend_from_slice(format!(".cr.{remap_id:x}.ghost").as_bytes());
            let mut ghost_rel = dirs.to_vec();
            ghost_rel.push(leaf.clone());
            let walk = self
                .world
                .walk_fs(mount.fs, &mount.root, &ghost_rel, &mount.mountpoint)?;
            // A missing parent: CRIU retries in the grandparent, up to the deepest existing dir.
            let mut at = walk.parent.clone();
            at.push(leaf);
            let e = if walk.missing.len() > 1 {
                self.world.lookup(mount.fs, &at)?
            } else {
                walk.leaf.clone()
            };
            if e != Entry::Missing {
                let at = in_ns(&mount, &at);
                return Err(UnsafeKind::Exists { at }.into());
            }
            let kind = if fmt == libc::S_IFLNK {
                Entry::Symlink(Vec::new())
            } else {
                Entry::Other
            };
            self.world.create(mount.fs, at.clone(), kind);
            at
        };
        Ok(in_ns(&mount, &landed))
    }

    /// Every regular-file entry, as the task reopens it inside the restored namespace.
    fn reg_files(&mut self) -> Result<(), UnsafeImagePath> {
        const IMAGE: &str = "files.img";
        let files = self.files;
        for f in &files.regs {
            let op = PathOp::OpenFile;
            let comps = reg_path(&f.name).map_err(|k| refuse(IMAGE, op, &f.name, k))?;
            if self.mntns && f.mnt_id != -1 {
                let m = self
                    .mount_of(f.mnt_id)
                    .map_err(|k| refuse(IMAGE, op, &f.name, k))?;
                if !comps.starts_with(&m.mountpoint) {
                    let kind = UnsafeKind::OutsideMount { mnt_id: f.mnt_id };
                    return Err(refuse(IMAGE, op, &f.name, kind));
                }
            }
            let walk = self
                .world
                .walk_ns(&comps, false)
                .map_err(|e| walk_error(IMAGE, op, &f.name, e))?;
            match &walk.leaf {
                Entry::Symlink(_) if f.flags & O_NOFOLLOW == 0 => {
                    let e = leaf_error(&walk.leaf, &show(&comps));
                    return Err(walk_error(IMAGE, op, &f.name, e));
                }
                Entry::MagicLink => {
                    let e = leaf_error(&walk.leaf, &show(&comps));
                    return Err(walk_error(IMAGE, op, &f.name, e));
                }
                _ => {}
            }
            self.report.files += 1;
        }
        Ok(())
    }

    /// Unix sockets bound (or only unlinked) by path.
    fn sockets(&mut self) -> Result<(), UnsafeImagePath> {
        let files = self.files;
        for sk in &files.unix {
            // Trailing NULs (an address length covering all of sun_path) are not part of it.
            let end = sk.name.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
            let name = &sk.name[..end];
            if sk.uflags & USK_EXTERN != 0 || sk.name.first().is_none_or(|b| *b == 0) {
                continue; // external, unnamed or abstract
            }
            let op = if sk.sk_type != SOCK_DGRAM && sk.state == TCP_ESTABLISHED {
                PathOp::UnlinkSocket
            } else {
                PathOp::BindSocket
            };
            self.socket(sk, name, op)
                .map_err(|e| walk_error("files.img", op, name, e))?;
            self.report.unix_sockets += 1;
        }
        Ok(())
    }

    /// One socket: `unlink_sk` (`stat`, `unlink` of a socket file) and unless it is a
    /// connected stream socket, `bind`; for a deleted one first `mkdirpat` of the name's
    /// dirname, which `mkdir`s each literal prefix (an existing one, a link included, is
    /// skipped with `EEXIST`). All inside `chroot(<restored root>)`, after `chdir(name_dir)`
    /// for a relative name.
    fn socket(&mut self, sk: &UnixSk, name: &[u8], op: PathOp) -> Result<(), WalkError> {
        let base = match (&sk.name_dir, name.first()) {
            (Some(dir), Some(c)) if *c != b'/' => split(dir)?,
            _ => Vec::new(),
        };
        let rel = split(name)?;
        let follow = self.mntns;
        if !base.is_empty() {
            let walk = self.world.walk_ns(&base, follow)?;
            self.refuse_procfs(&walk, &base)?;
            if walk.leaf != Entry::Dir {
                return Err(missing_or_leaf(&walk, &base));
            }
        }
        let full: Comps = base.iter().chain(&rel).cloned().collect();
        if op == PathOp::BindSocket && sk.deleted {
            for i in 1..rel.len() {
                let prefix: Comps = base.iter().chain(&rel[..i]).cloned().collect();
                let walk = self.world.walk_ns(&prefix, follow)?;
                self.refuse_procfs(&walk, &prefix)?;
                match walk.leaf {
                    Entry::Missing if walk.missing.len() == 1 => {
                        self.world.create(walk.fs, walk.path(), Entry::Dir)
                    }
                    Entry::Dir | Entry::Symlink(_) => {}
                    _ => return Err(missing_or_leaf(&walk, &prefix)),
                }
            }
        }
        let walk = self.world.walk_ns(&full, follow)?;
        self.refuse_procfs(&walk, &full)?;
        match walk.leaf {
            Entry::Missing | Entry::Other => {}
            ref e => return Err(leaf_error(e, &show(&full))),
        }
        if op == PathOp::BindSocket {
            if walk.missing.len() > 1 {
                return Err(missing_or_leaf(&walk, &full));
            }
            self.world.create(walk.fs, walk.path(), Entry::Other);
        }
        Ok(())
    }

    /// Nothing of a socket's path may resolve into procfs (magic links leave the chroot).
    fn refuse_procfs(&self, walk: &Walk, path: &[Vec<u8>]) -> Result<(), WalkError> {
        if self.world.fss[walk.fs].refuses_creation() {
            return Err(UnsafeKind::Procfs { at: show(path) }.into());
        }
        Ok(())
    }
}

/// A walk whose parent is missing names the first missing component; otherwise the leaf.
fn missing_or_leaf(walk: &Walk, path: &[Vec<u8>]) -> WalkError {
    if walk.missing.len() > 1 || walk.leaf == Entry::Missing {
        let mut at = walk.shown.clone();
        at.extend(walk.missing.first().cloned());
        return UnsafeKind::MissingParent { at: show(&at) }.into();
    }
    leaf_error(&walk.leaf, &show(path))
}

/// Ghost device nodes are made with `mknod` as host root: only allowed character devices.
fn check_ghost_device(ghost: Ghost) -> Result<(), UnsafeKind> {
    let fmt = ghost.mode & libc::S_IFMT;
    if fmt != libc::S_IFCHR && fmt != libc::S_IFBLK {
        return Ok(());
    }
    let rdev = u64::from(ghost.rdev.unwrap_or(0));
    let (major, minor) = (libc::major(rdev), libc::minor(rdev));
    if fmt == libc::S_IFCHR && ALLOWED_CHAR_DEVICES.contains(&(major, minor)) {
        return Ok(());
    }
    Err(UnsafeKind::Device { major, minor })
}

/// A path of a mount's file system shown from the namespace root.
fn in_ns(mount: &Mount, fs_path: &[Vec<u8>]) -> String {
    let inner = fs_path.get(mount.root.len()..).unwrap_or_default();
    show(
        &mount
            .mountpoint
            .iter()
            .chain(inner)
            .cloned()
            .collect::<Vec<_>>(),
    )
}

fn leaf_error(e: &Entry, at: &str) -> WalkError {
    let at = at.to_string();
    match e {
        Entry::Symlink(_) => UnsafeKind::Symlink { at },
        Entry::MagicLink | Entry::Proc => UnsafeKind::Procfs { at },
        Entry::Other => UnsafeKind::NotDirectory { at },
        Entry::Dir | Entry::Missing => UnsafeKind::Exists { at },
    }
    .into()
}

/// The mount images of the dir (`mountpoints-<ns id>.img`), sorted.
fn mount_images(images_dir: &Path) -> Result<Vec<String>, UnsafeImagePath> {
    let read_err = |source| UnsafeImagePath::ReadImage {
        image: images_dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir(images_dir).map_err(read_err)? {
        let name = e.map_err(read_err)?.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("mountpoints-") && name.ends_with(".img") {
            out.push(name.into_owned());
        }
    }
    out.sort();
    Ok(out)
}

fn read_files(images_dir: &Path) -> Result<Files, UnsafeImagePath> {
    let mut files = Files::default();
    match optional(images_dir, "files.img", FILES_MAGIC)? {
        Some(img) => {
            let path = images_dir.join("files.img");
            for (base, msg) in img.entries() {
                entries::file_entry(msg, base, &mut files).map_err(|e| decode_error(&path, e))?;
            }
        }
        None if images_dir.join("reg-files.img").exists() => {
            return Err(UnsafeImagePath::DecodeImage {
                image: images_dir.join("reg-files.img"),
                offset: 0,
                what: "per-type file images of a criu before 3.x are not checked",
            })
        }
        None => {}
    }
    Ok(files)
}

fn read(dir: &Path, name: &str, magic: u32, common: bool) -> Result<Image, UnsafeImagePath> {
    let path = dir.join(name);
    Image::read(&path, magic, common).map_err(|e| image_error(&path, e))
}

/// An image CRIU reads only when present.
fn optional(dir: &Path, name: &str, magic: u32) -> Result<Option<Image>, UnsafeImagePath> {
    match Image::read(&dir.join(name), magic, true) {
        Err(ImageError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        r => r.map(Some).map_err(|e| image_error(&dir.join(name), e)),
    }
}

fn decode_all<T>(
    dir: &Path,
    name: &str,
    img: &Image,
    decode: fn(&[u8], u64) -> Result<T, WireError>,
) -> Result<Vec<T>, UnsafeImagePath> {
    img.entries()
        .map(|(base, msg)| decode(msg, base).map_err(|e| decode_error(&dir.join(name), e)))
        .collect()
}

fn image_error(path: &Path, e: ImageError) -> UnsafeImagePath {
    match e {
        ImageError::Io(source) => UnsafeImagePath::ReadImage {
            image: path.to_path_buf(),
            source,
        },
        ImageError::Wire(w) => decode_error(path, w),
    }
}

fn decode_error(path: &Path, e: WireError) -> UnsafeImagePath {
    UnsafeImagePath::DecodeImage {
        image: PathBuf::from(path),
        offset: e.offset,
        what: e.what,
    }
}
