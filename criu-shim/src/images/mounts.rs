//! The mount image: the restored mount tree and the paths CRIU uses to build it.
//!
//! CRIU (mount engine v2, `criu/mount-v2.c`) mounts each file system on a plain mount point
//! `<yard>/mnt-<id>` of a service mount namespace whose root is the host's, then moves each
//! mount onto its mount point inside the restored namespace. Host-context paths derived from
//! the image here: the `--root` bind, a fresh tmpfs filled by `tar --extract` (see
//! `TarTree`), the bind source of a deleted bind mount (`<yard>/mnt-<src>/<root>`,
//! re-created with `mkdir`/`open(O_CREAT|O_EXCL)` and its parents, removed afterwards), and
//! `stat` of every mount point. With `--mntns-compat-mode` (v1, kernels without
//! `MOVE_MOUNT_SET_GROUP`) mounts happen directly at `<yard>/<ns>/<mount point>` from the host
//! root, so a mount point must never pass a symbolic link either.
//!
//! Modelled file systems: the namespace root (it is the `--root` directory, whatever its type),
//! bind mounts of it, tmpfs (content from its archive) and procfs. Anything else, external
//! mounts (`--ext-mount-map`, which binds host paths) and plugin mounts are refused.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::Path;

use super::entries::{Mnt, FSTYPE_PROC, FSTYPE_TMPFS};
use super::error::{PathOp, UnsafeImagePath, UnsafeKind};
use super::fs::{show, split, Comps, Entry, Fs, Mount, WalkError, World};
use super::tmpfs::{TarError, TarTree};

/// Mounts checked and tmpfs members read.
#[derive(Debug, Default)]
pub(crate) struct MountSummary {
    pub mounts: usize,
    pub tmpfs_members: usize,
}

/// Context for errors of one mount image.
struct Ctx<'a> {
    images_dir: &'a Path,
    image: &'a str,
}

impl Ctx<'_> {
    fn unsafe_(&self, op: PathOp, path: &[u8], kind: UnsafeKind) -> UnsafeImagePath {
        UnsafeImagePath::Unsafe {
            image: self.image.to_string(),
            op,
            path: String::from_utf8_lossy(path).into_owned(),
            kind,
        }
    }

    fn walk(&self, op: PathOp, path: &[u8], e: WalkError) -> UnsafeImagePath {
        super::validate::walk_error(self.image, op, path, e)
    }
}

/// A mount's `root` or `mountpoint`: absolute, split.
fn abs(path: &[u8]) -> Result<Comps, UnsafeKind> {
    if path.first() != Some(&b'/') {
        return Err(UnsafeKind::Malformed);
    }
    split(path)
}

/// Builds `world`'s file systems and mounts from the entries of mount image `image`, checking
/// every mount point, tmpfs archive and deleted bind source. `root` becomes the file system of
/// the namespace root.
pub(crate) fn build(
    world: &mut World,
    images_dir: &Path,
    image: &str,
    mnts: &[Mnt],
    root: OwnedFd,
) -> Result<MountSummary, UnsafeImagePath> {
    let ctx = Ctx { images_dir, image };
    let mut summary = MountSummary::default();
    let mut parsed = Vec::with_capacity(mnts.len());
    for m in mnts {
        let root = abs(&m.root).map_err(|k| ctx.unsafe_(PathOp::BuildMounts, &m.root, k))?;
        let mp = abs(&m.mountpoint).map_err(|k| ctx.unsafe_(PathOp::MountAt, &m.mountpoint, k))?;
        if m.external {
            let kind = UnsafeKind::ExternalMount { mnt_id: m.mnt_id };
            return Err(ctx.unsafe_(PathOp::MountAt, &m.mountpoint, kind));
        }
        parsed.push((m, root, mp));
    }
    let mut roots = parsed.iter().filter(|(_, _, mp)| mp.is_empty());
    let (ns_root, ns_root_dir) = match (roots.next(), roots.next()) {
        (Some((m, r, _)), None) => (*m, r.clone()),
        _ => return Err(ctx.unsafe_(PathOp::BuildMounts, b"/", UnsafeKind::Malformed)),
    };
    world.fss.push(Fs::Root {
        fd: root,
        no_xdev: true,
    });
    let mut fs_of_dev: HashMap<u32, usize> = HashMap::from([(ns_root.root_dev, 0)]);
    world.mounts.push(Mount {
        mnt_id: ns_root.mnt_id,
        fs: 0,
        root: Vec::new(),
        mountpoint: Vec::new(),
    });
    summary.mounts = 1;

    // Parents before children: each round places the mounts whose parent is placed.
    let mut pending: Vec<_> = parsed
        .iter()
        .filter(|(m, _, _)| m.mnt_id != ns_root.mnt_id)
        .collect();
    while !pending.is_empty() {
        let before = pending.len();
        let mut rest = Vec::new();
        for item in pending {
            let (m, fs_root, mp) = item;
            let Some(parent) = world
                .mounts
                .iter()
                .find(|p| p.mnt_id == m.parent_mnt_id)
                .cloned()
            else {
                rest.push(item);
                continue;
            };
            let fs = match fs_of_dev.get(&m.root_dev) {
                Some(&fs) => fs,
                None => {
                    let fs = new_fs(&ctx, m, &mut summary)?;
                    world.fss.push(fs);
                    fs_of_dev.insert(m.root_dev, world.fss.len() - 1);
                    world.fss.len() - 1
                }
            };
            // Paths in the root file system are relative to the --root directory.
            let inner = if fs == 0 {
                match fs_root.strip_prefix(ns_root_dir.as_slice()) {
                    Some(rel) => rel.to_vec(),
                    None => {
                        let kind = UnsafeKind::OutsideMount {
                            mnt_id: ns_root.mnt_id as i32,
                        };
                        return Err(ctx.unsafe_(PathOp::BuildMounts, &m.root, kind));
                    }
                }
            } else {
                fs_root.clone()
            };
            check_mountpoint(&ctx, world, m, &parent, mp)?;
            if m.deleted {
                check_deleted_source(&ctx, world, m, fs, &inner)?;
            }
            world.mounts.push(Mount {
                mnt_id: m.mnt_id,
                fs,
                root: inner,
                mountpoint: mp.clone(),
            });
            summary.mounts += 1;
        }
        if rest.len() == before {
            let (m, _, _) = rest[0];
            let kind = UnsafeKind::UnknownMount {
                mnt_id: m.parent_mnt_id as i32,
            };
            return Err(ctx.unsafe_(PathOp::MountAt, &m.mountpoint, kind));
        }
        pending = rest;
    }
    Ok(summary)
}

/// The model of a new (non-root) file system: procfs, or a tmpfs read from its archive.
fn new_fs(ctx: &Ctx<'_>, m: &Mnt, summary: &mut MountSummary) -> Result<Fs, UnsafeImagePath> {
    match m.fstype {
        FSTYPE_PROC => Ok(Fs::Proc),
        FSTYPE_TMPFS => {
            // CRIU's names: by device first, by mount id for old images.
            let by_dev = format!("tmpfs-dev-{}.tar.gz.img", m.root_dev);
            let by_id = format!("tmpfs-{}.tar.gz.img", m.mnt_id);
            let (name, file) = match File::open(ctx.images_dir.join(&by_dev)) {
                Ok(f) => (by_dev, f),
                Err(_) => match File::open(ctx.images_dir.join(&by_id)) {
                    Ok(f) => (by_id, f),
                    Err(_) => {
                        let kind = UnsafeKind::MissingArchive { image: by_dev };
                        return Err(ctx.unsafe_(PathOp::ExtractTmpfs, &m.mountpoint, kind));
                    }
                },
            };
            let tree = TarTree::read(std::io::BufReader::new(file)).map_err(|e| match e {
                TarError::Member { name: member, kind } => UnsafeImagePath::Unsafe {
                    image: name.clone(),
                    op: PathOp::ExtractTmpfs,
                    path: member,
                    kind,
                },
                TarError::Read { offset, what } => UnsafeImagePath::DecodeImage {
                    image: ctx.images_dir.join(&name),
                    offset,
                    what,
                },
            })?;
            summary.tmpfs_members += tree.members;
            Ok(Fs::Tar(tree))
        }
        fstype => Err(ctx.unsafe_(
            PathOp::MountAt,
            &m.mountpoint,
            UnsafeKind::UnsupportedFs { fstype },
        )),
    }
}

/// A mount point must be an existing directory (or, for a file bind, a non-directory) inside
/// its parent mount, reached without symbolic links.
fn check_mountpoint(
    ctx: &Ctx<'_>,
    world: &mut World,
    m: &Mnt,
    parent: &Mount,
    mp: &Comps,
) -> Result<(), UnsafeImagePath> {
    let rel = match mp.strip_prefix(parent.mountpoint.as_slice()) {
        Some(rel) if !rel.is_empty() => rel.to_vec(),
        _ => {
            let kind = UnsafeKind::OutsideMount {
                mnt_id: parent.mnt_id as i32,
            };
            return Err(ctx.unsafe_(PathOp::MountAt, &m.mountpoint, kind));
        }
    };
    let walk = world
        .walk_fs(parent.fs, &parent.root, &rel, &parent.mountpoint)
        .map_err(|e| ctx.walk(PathOp::MountAt, &m.mountpoint, e))?;
    let at = || show(mp);
    let kind = match walk.leaf {
        Entry::Dir | Entry::Other | Entry::Proc => return Ok(()),
        Entry::Missing => UnsafeKind::MissingParent { at: at() },
        Entry::Symlink(_) => UnsafeKind::Symlink { at: at() },
        Entry::MagicLink => UnsafeKind::Procfs { at: at() },
    };
    Err(ctx.unsafe_(PathOp::MountAt, &m.mountpoint, kind))
}

/// The source of a deleted bind mount is re-created (with missing parents) as host root and
/// removed after the mount: its parents must be directories, it must not exist.
fn check_deleted_source(
    ctx: &Ctx<'_>,
    world: &mut World,
    m: &Mnt,
    fs: usize,
    inner: &Comps,
) -> Result<(), UnsafeImagePath> {
    let op = PathOp::RecreateBindSource;
    if matches!(world.fss[fs], Fs::Proc) {
        let kind = UnsafeKind::Procfs { at: show(inner) };
        return Err(ctx.unsafe_(op, &m.root, kind));
    }
    let walk = world
        .walk_fs(fs, &[], inner, &[])
        .map_err(|e| ctx.walk(op, &m.root, e))?;
    if walk.leaf != Entry::Missing {
        let kind = UnsafeKind::Exists { at: show(inner) };
        return Err(ctx.unsafe_(op, &m.root, kind));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use tar::EntryType as T;

    use crate::images::entries::{FILES_MAGIC, GHOST_FILE_MAGIC, MNTS_MAGIC, REMAP_FPATH_MAGIC};
    use crate::images::testutil::{enc, tar_gz, write_image};
    use crate::{validate_restore_paths, ImagePathReport, PathOp, UnsafeImagePath};

    use super::*;

    /// A sandbox-like images dir (root overlay, /proc, /proc/sys, /dev tmpfs) and root tree.
    struct Scene {
        _t: tempfile::TempDir,
        root: PathBuf,
        images: PathBuf,
        mounts: Vec<Vec<u8>>,
        tar: Vec<(&'static str, T, &'static str)>,
    }

    fn mnt(fstype: u64, id: u64, dev: u64, parent: u64, root: &str, mp: &str) -> Vec<u8> {
        enc(&[
            (1, Ok(fstype)),
            (2, Ok(id)),
            (3, Ok(dev)),
            (4, Ok(parent)),
            (6, Err(root.as_bytes())),
            (7, Err(mp.as_bytes())),
        ])
    }

    impl Scene {
        fn new() -> Scene {
            let t = tempfile::tempdir().unwrap();
            let root = t.path().join("root");
            let images = t.path().join("images");
            for d in ["proc", "dev", "tmp"] {
                std::fs::create_dir_all(root.join(d)).unwrap();
            }
            std::fs::create_dir(&images).unwrap();
            Scene {
                _t: t,
                root,
                images,
                mounts: vec![
                    mnt(17, 114, 65, 66, "/", "/"),
                    mnt(1, 68, 68, 114, "/", "/proc"),
                    mnt(1, 69, 68, 68, "/sys", "/proc/sys"),
                    mnt(5, 70, 69, 114, "/", "/dev"),
                ],
                tar: vec![
                    ("./", T::Directory, ""),
                    ("./shm/", T::Directory, ""),
                    ("./null", T::Char, "3"),
                    ("./fd", T::Symlink, "/proc/self/fd"),
                ],
            }
        }

        fn run(&self) -> Result<ImagePathReport, UnsafeImagePath> {
            write_image(&self.images, "mountpoints-12.img", MNTS_MAGIC, &self.mounts);
            std::fs::write(
                self.images.join("tmpfs-dev-69.tar.gz.img"),
                tar_gz(&self.tar),
            )
            .unwrap();
            validate_restore_paths(&self.images, &self.root)
        }

        fn refused(&self) -> (PathOp, UnsafeKind) {
            match self.run() {
                Err(UnsafeImagePath::Unsafe { op, kind, .. }) => (op, kind),
                r => panic!("expected a refusal, got {r:?}"),
            }
        }

        /// A regular file entry (and, with `ghost`, its ghost remap and image).
        fn file(&self, name: &str, mnt_id: u64, ghost: Option<u32>) {
            let reg = enc(&[
                (1, Ok(9)),
                (2, Ok(0)),
                (6, Err(name.as_bytes())),
                (7, Ok(mnt_id * 2)),
            ]);
            let fe = enc(&[(1, Ok(1)), (2, Ok(9)), (3, Err(&reg))]);
            write_image(&self.images, "files.img", FILES_MAGIC, &[fe]);
            if let Some(mode) = ghost {
                let r = enc(&[(1, Ok(9)), (2, Ok(1)), (3, Ok(1))]);
                write_image(&self.images, "remap-fpath.img", REMAP_FPATH_MAGIC, &[r]);
                let g = enc(&[(1, Ok(0)), (2, Ok(0)), (3, Ok(u64::from(mode)))]);
                write_image(&self.images, "ghost-file-1.img", GHOST_FILE_MAGIC, &[g]);
            }
        }

        /// A unix socket entry bound at `name`.
        fn socket(&self, name: &str, deleted: bool) {
            let sk = enc(&[
                (1, Ok(4)),
                (3, Ok(1)),
                (4, Ok(10)),
                (11, Err(name.as_bytes())),
                (15, Ok(deleted as u64)),
            ]);
            let fe = enc(&[(1, Ok(5)), (2, Ok(4)), (16, Err(&sk))]);
            write_image(&self.images, "files.img", FILES_MAGIC, &[fe]);
        }
    }

    #[test]
    fn a_sandbox_mount_tree_passes() {
        let s = Scene::new();
        let r = s.run().unwrap();
        assert_eq!((r.mounts, r.tmpfs_members), (4, 4));
    }

    #[test]
    fn mount_points_must_be_directories_reached_without_links() {
        let s = Scene::new();
        std::fs::remove_dir(s.root.join("dev")).unwrap();
        std::os::unix::fs::symlink("/etc", s.root.join("dev")).unwrap();
        let (op, kind) = s.refused();
        assert_eq!(op, PathOp::MountAt);
        assert_eq!(kind, UnsafeKind::Symlink { at: "/dev".into() });
        std::fs::remove_file(s.root.join("dev")).unwrap();
        assert_eq!(
            s.refused().1,
            UnsafeKind::MissingParent { at: "/dev".into() }
        );
    }

    #[test]
    fn host_mounts_unknown_file_systems_and_missing_archives_are_refused() {
        let mut s = Scene::new();
        let mut ext = mnt(5, 80, 90, 114, "/", "/tmp");
        ext.extend(enc(&[(13, Ok(1))]));
        s.mounts.push(ext);
        assert_eq!(s.refused().1, UnsafeKind::ExternalMount { mnt_id: 80 });
        s.mounts.pop();
        s.mounts.push(mnt(2, 81, 91, 114, "/", "/tmp"));
        assert_eq!(s.refused().1, UnsafeKind::UnsupportedFs { fstype: 2 });
        s.mounts.pop();
        s.mounts.push(mnt(5, 82, 92, 114, "/", "/tmp"));
        assert!(matches!(s.refused().1, UnsafeKind::MissingArchive { .. }));
        s.mounts.pop();
        s.mounts.push(mnt(5, 83, 69, 999, "/", "/tmp"));
        assert_eq!(s.refused().1, UnsafeKind::UnknownMount { mnt_id: 999 });
        s.mounts.pop();
        write_image(&s.images, "mountpoints-13.img", MNTS_MAGIC, &s.mounts);
        assert_eq!(s.refused().1, UnsafeKind::SeveralMountNamespaces);
    }

    #[test]
    fn a_deleted_bind_source_is_recreated_only_beneath_directories() {
        let mut s = Scene::new();
        let mut m = mnt(5, 71, 69, 114, "/a/null", "/tmp");
        m.extend(enc(&[(16, Ok(1))]));
        s.mounts.push(m);
        s.tar.push(("./a/", T::Directory, ""));
        s.run().unwrap();
        s.tar.pop();
        s.tar.push(("./a", T::Symlink, "/etc"));
        let (op, kind) = s.refused();
        assert_eq!(op, PathOp::RecreateBindSource);
        assert_eq!(kind, UnsafeKind::Symlink { at: "/a".into() });
    }

    #[test]
    fn ghosts_on_the_dev_tmpfs_are_checked_against_its_archive() {
        let mut s = Scene::new();
        s.file("/dev/shm/x", 70, Some(0o100644));
        assert_eq!(
            s.run().unwrap().ghosts,
            vec!["/dev/shm/x.cr.1.ghost".to_string()]
        );
        s.tar[1] = ("./shm", T::Symlink, "/etc");
        let (op, kind) = s.refused();
        assert_eq!(op, PathOp::CreateGhost);
        assert_eq!(
            kind,
            UnsafeKind::Symlink {
                at: "/dev/shm".into()
            }
        );
        // A ghost block device or an unknown character device would be made with mknod.
        s.tar[1] = ("./shm/", T::Directory, "");
        s.file("/dev/shm/x", 70, Some(0o060644));
        assert!(matches!(s.refused().1, UnsafeKind::Device { .. }));
        // A file whose mount is not in the images.
        s.file("/dev/shm/x", 77, Some(0o100644));
        assert_eq!(s.refused().1, UnsafeKind::UnknownMount { mnt_id: 77 });
    }

    #[test]
    fn files_and_sockets_never_pass_procfs_magic_links() {
        let s = Scene::new();
        s.file("/proc/1/root/etc/passwd", 68, None);
        assert_eq!(
            s.refused(),
            (
                PathOp::OpenFile,
                UnsafeKind::Procfs {
                    at: "/proc/1/root".into()
                }
            )
        );
        s.file("/proc/1/status", 68, None);
        s.run().unwrap();
        s.file("/dev/fd/3", 70, None);
        assert!(matches!(s.refused().1, UnsafeKind::Symlink { .. }));
        s.socket("/dev/fd/3/x.sock", false);
        assert!(matches!(
            s.refused(),
            (PathOp::BindSocket, UnsafeKind::Procfs { .. })
        ));
        s.socket("/tmp/x.sock", false);
        assert_eq!(s.run().unwrap().unix_sockets, 1);
        s.socket("/tmp/gone/x.sock", false);
        assert_eq!(
            s.refused().1,
            UnsafeKind::MissingParent {
                at: "/tmp/gone".into()
            }
        );
        s.socket("/tmp/gone/x.sock", true);
        s.run().unwrap();
    }
}
