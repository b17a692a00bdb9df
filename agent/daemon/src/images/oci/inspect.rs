//! Looks into a layer stack before its image is published: the stack is mounted read-only
//! (overlayfs without an upper layer) on a private directory, `/bin/sh` must resolve inside
//! it, and the config's `User` is resolved against its `/etc/passwd` and `/etc/group`. Every
//! path is resolved with `openat2(RESOLVE_IN_ROOT)` from the mount's root, so the image's
//! symlinks stay inside it; files are opened non-blocking and must be regular, and at most
//! [`MAX_ID_FILE_BYTES`] of each is read.

use std::fs;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use belayer_overlay::OverlayMount;
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

use super::super::ImageError;

/// Most bytes of `/etc/passwd` or `/etc/group` read.
pub const MAX_ID_FILE_BYTES: u64 = 4 << 20;

/// What inspecting a stack found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// Whether `/bin/sh` resolves to a regular file.
    pub has_shell: bool,
    /// The config's `User` as `(uid, gid)`, when it resolves.
    pub user_ids: Option<(u32, u32)>,
}

/// Mounts `lowers` (top-most first) read-only at a fresh directory below `scratch` and
/// inspects the merged view for image `image`; `user` is the config's `User`.
///
/// Errors: [`ImageError::Inspect`], [`ImageError::Store`] (the mount point).
pub fn inspect(
    image: &str,
    scratch: &Path,
    lowers: &[PathBuf],
    user: Option<&str>,
) -> Result<Inspection, ImageError> {
    let target = scratch.join(format!(".inspect-{}", crate::sys::random_hex(6)));
    fs::create_dir(&target).map_err(|source| ImageError::Store {
        path: target.clone(),
        source,
    })?;
    let result = (|| {
        let refs: Vec<&Path> = lowers.iter().map(PathBuf::as_path).collect();
        let mount = OverlayMount::mount_lowers_readonly(&refs, &target).map_err(|source| {
            ImageError::Inspect {
                image: image.to_string(),
                source,
            }
        })?;
        let root = rustix::fs::open(
            &target,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| ImageError::Store {
            path: target.clone(),
            source: e.into(),
        })?;
        let has_shell = open_in_root(&root, "bin/sh", OFlags::PATH)
            .and_then(|fd| rustix::fs::fstat(&fd).ok())
            .is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::RegularFile);
        let user_ids = user.and_then(|u| resolve_user(&root, u));
        drop(root);
        drop(mount);
        Ok(Inspection {
            has_shell,
            user_ids,
        })
    })();
    let _ = fs::remove_dir(&target);
    result
}

fn open_in_root(root: &OwnedFd, path: &str, flags: OFlags) -> Option<OwnedFd> {
    // openat2 refuses O_PATH with any flag but O_CLOEXEC, O_DIRECTORY, O_NOFOLLOW.
    let extra = if flags.contains(OFlags::PATH) {
        OFlags::CLOEXEC
    } else {
        OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK
    };
    rustix::fs::openat2(
        root,
        path,
        flags | extra,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()
}

/// The text of the regular file `path` of the image, at most [`MAX_ID_FILE_BYTES`].
fn read_small(root: &OwnedFd, path: &str) -> Option<String> {
    let fd = open_in_root(root, path, OFlags::RDONLY)?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return None;
    }
    let mut text = String::new();
    fs::File::from(fd)
        .take(MAX_ID_FILE_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// Resolves a config `User` (`user`, `uid`, `user:group`, `uid:gid`, mixed) as runc does:
/// names through the image's `/etc/passwd` and `/etc/group`; a user without a group takes
/// its passwd entry's group, or 0 when it has none.
fn resolve_user(root: &OwnedFd, user: &str) -> Option<(u32, u32)> {
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read_small(root, "etc/passwd").unwrap_or_default();
    let entry = passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        let (name, uid, gid) = (
            f.first()?,
            f.get(2)?.parse::<u32>().ok()?,
            f.get(3)?.parse::<u32>().ok()?,
        );
        (*name == u || u.parse::<u32>().ok() == Some(uid)).then_some((uid, gid))
    });
    let uid = match u.parse::<u32>() {
        Ok(n) => n,
        Err(_) => entry?.0,
    };
    let gid = match g {
        None => entry.map_or(0, |e| e.1),
        Some(g) => match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => {
                let group = read_small(root, "etc/group").unwrap_or_default();
                group.lines().find_map(|line| {
                    let f: Vec<&str> = line.split(':').collect();
                    (f.first() == Some(&g)).then(|| f.get(2)?.parse::<u32>().ok())?
                })?
            }
        },
    };
    Some((uid, gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root_of(dir: &Path) -> OwnedFd {
        rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap()
    }

    #[test]
    fn resolves_users() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        fs::write(
            dir.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001::/home/app:/bin/sh\n",
        )
        .unwrap();
        fs::write(dir.path().join("etc/group"), "root:x:0:\nstaff:x:50:app\n").unwrap();
        let root = root_of(dir.path());
        assert_eq!(resolve_user(&root, "app"), Some((1000, 1001)));
        assert_eq!(resolve_user(&root, "app:staff"), Some((1000, 50)));
        assert_eq!(resolve_user(&root, "1000"), Some((1000, 1001)));
        assert_eq!(resolve_user(&root, "2000"), Some((2000, 0)));
        assert_eq!(resolve_user(&root, "2000:7"), Some((2000, 7)));
        assert_eq!(resolve_user(&root, "nobody"), None);
        assert_eq!(resolve_user(&root, "app:nogroup"), None);
    }

    #[test]
    fn passwd_symlink_stays_inside() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("etc")).unwrap();
        // An absolute link resolves inside the image's root, not the host's /etc/passwd.
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("etc/passwd")).unwrap();
        let root = root_of(dir.path());
        assert_eq!(resolve_user(&root, "root"), None);
    }
}
