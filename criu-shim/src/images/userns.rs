//! The user-namespace images of a dump (`userns-<id>.img`, `criu/namespaces.c`
//! `dump_user_ns`): the only host ids CRIU keeps in its images.
//!
//! CRIU records every id of the tree as its user namespace sees it (credentials,
//! file owners of ghosts and memfds, tmpfs archives made inside the namespace, IPC and socket
//! owners: `userns_uid()` at dump), and the namespace's `uid_map`/`gid_map` once, as extents
//! `(first, lower_first, count)` whose `lower_first` is a host id. The restore writes those
//! maps into the namespace it recreates. So restoring a dump into another host id range (a
//! fork: each child has its own range) takes rewriting these images and nothing else of R_k
//! ([`rebase_userns_images`]).
//!
//! Format: `userns_entry { repeated uid_gid_extent uid_map = 1; repeated uid_gid_extent
//! gid_map = 2; }`, `uid_gid_extent { required uint32 first = 1; required uint32 lower_first
//! = 2; required uint32 count = 3; }` (`images/userns.proto`), one entry per image.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::wire::{Fields, Image, ImageError, COMMON_MAGIC};

/// `USERNS_MAGIC` (`criu/include/magic.h`).
const USERNS_MAGIC: u32 = 0x5547_4906;

/// One map extent: ids `first..first + count` of the namespace are host ids
/// `lower_first..lower_first + count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdExtent {
    /// First id inside the namespace.
    pub first: u32,
    /// First host id.
    pub lower_first: u32,
    /// Ids in the extent.
    pub count: u32,
}

/// Why the user-namespace images could not be rebased (nothing was changed).
#[derive(Debug, thiserror::Error)]
pub enum UsernsImageError {
    /// Reading or writing an image failed.
    #[error("{op} {path}")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The image.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The image does not decode.
    #[error("{path}: malformed user-namespace image at byte {offset}: {what}")]
    Malformed {
        /// The image.
        path: PathBuf,
        /// Byte offset in the file.
        offset: u64,
        /// What was wrong.
        what: &'static str,
    },
    /// A map is not the one extent the caller said the dumped namespace had.
    #[error("{path}: {map} is {found:?}, expected [{expected:?}]")]
    UnexpectedMap {
        /// The image.
        path: PathBuf,
        /// `uid_map` or `gid_map`.
        map: &'static str,
        /// What the image holds.
        found: Vec<IdExtent>,
        /// The extent expected.
        expected: IdExtent,
    },
}

/// The `userns-*.img` files of `images_dir`, sorted.
fn userns_images(images_dir: &Path) -> Result<Vec<PathBuf>, UsernsImageError> {
    let io = |source| UsernsImageError::Io {
        op: "list",
        path: images_dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for e in fs::read_dir(images_dir).map_err(io)? {
        let e = e.map_err(io)?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("userns-") && name.ends_with(".img") {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// The uid and gid maps of one user-namespace image.
fn read_maps(path: &Path) -> Result<(Vec<IdExtent>, Vec<IdExtent>), UsernsImageError> {
    let malformed = |offset, what| UsernsImageError::Malformed {
        path: path.to_path_buf(),
        offset,
        what,
    };
    let image = Image::read(path, USERNS_MAGIC, true).map_err(|e| match e {
        ImageError::Io(source) => UsernsImageError::Io {
            op: "read",
            path: path.to_path_buf(),
            source,
        },
        ImageError::Wire(w) => malformed(w.offset, w.what),
    })?;
    let mut entries = image.entries();
    let (base, msg) = entries.next().ok_or_else(|| malformed(8, "no entry"))?;
    if entries.next().is_some() {
        return Err(malformed(base, "more than one entry"));
    }
    let (mut uid, mut gid) = (Vec::new(), Vec::new());
    for field in Fields::new(msg, base) {
        let (n, v) = field.map_err(|w| malformed(w.offset, w.what))?;
        let list = match n {
            1 => &mut uid,
            2 => &mut gid,
            _ => continue,
        };
        let ext = v
            .bytes()
            .ok_or_else(|| malformed(base, "map extent is not a message"))?;
        let (mut first, mut lower, mut count) = (None, None, None);
        for f in Fields::new(ext, base) {
            let (n, v) = f.map_err(|w| malformed(w.offset, w.what))?;
            let slot = match n {
                1 => &mut first,
                2 => &mut lower,
                3 => &mut count,
                _ => continue,
            };
            *slot = Some(
                v.u32()
                    .ok_or_else(|| malformed(base, "extent field not a varint"))?,
            );
        }
        match (first, lower, count) {
            (Some(first), Some(lower_first), Some(count)) => list.push(IdExtent {
                first,
                lower_first,
                count,
            }),
            _ => return Err(malformed(base, "extent lacks a required field")),
        }
    }
    Ok((uid, gid))
}

/// Appends `v` as a protobuf varint.
pub(crate) fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// The image bytes of a namespace whose uid and gid maps are both `[extent]`.
fn encode(extent: IdExtent) -> Vec<u8> {
    let mut ext = Vec::new();
    for (n, v) in [
        (1u64, extent.first),
        (2, extent.lower_first),
        (3, extent.count),
    ] {
        varint(n << 3, &mut ext);
        varint(u64::from(v), &mut ext);
    }
    let mut msg = Vec::new();
    for n in [1u64, 2] {
        varint((n << 3) | 2, &mut msg);
        varint(ext.len() as u64, &mut msg);
        msg.extend_from_slice(&ext);
    }
    let mut out = Vec::with_capacity(12 + msg.len());
    out.extend_from_slice(&COMMON_MAGIC.to_le_bytes());
    out.extend_from_slice(&USERNS_MAGIC.to_le_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&msg);
    out
}

/// Rewrites every user-namespace image of `images_dir` whose maps are exactly `from` (uid
/// and gid alike) so that they map the same ids onto host ids starting at `to_lower_first`.
/// Each image is replaced by a new file (written, fsync'd, renamed over the old name), so a
/// hard link to the old one elsewhere (the checkpoint it was copied from) keeps its content.
/// Returns how many images were rewritten (0: the dump kept the host's user namespace).
///
/// Every image is checked before any is written: on an error nothing is changed.
///
/// Errors: [`UsernsImageError::Io`], [`UsernsImageError::Malformed`],
/// [`UsernsImageError::UnexpectedMap`] (a map other than `[from]`).
pub fn rebase_userns_images(
    images_dir: &Path,
    from: IdExtent,
    to_lower_first: u32,
) -> Result<usize, UsernsImageError> {
    let images = userns_images(images_dir)?;
    for path in &images {
        let (uid, gid) = read_maps(path)?;
        for (map, found) in [("uid_map", uid), ("gid_map", gid)] {
            if found != [from] {
                return Err(UsernsImageError::UnexpectedMap {
                    path: path.clone(),
                    map,
                    found,
                    expected: from,
                });
            }
        }
    }
    let data = encode(IdExtent {
        lower_first: to_lower_first,
        ..from
    });
    for path in &images {
        let io = |op| {
            let path = path.clone();
            move |source| UsernsImageError::Io { op, path, source }
        };
        let tmp = path.with_extension("img.rebase");
        let mut f = fs::File::create(&tmp).map_err(io("create"))?;
        f.write_all(&data)
            .and_then(|()| f.sync_all())
            .map_err(io("write"))?;
        fs::rename(&tmp, path).map_err(io("rename"))?;
    }
    Ok(images.len())
}

/// The uid map of the first user-namespace image of `images_dir`, if there is one (for
/// checks and tests).
///
/// Errors: as [`rebase_userns_images`].
pub fn userns_uid_map(images_dir: &Path) -> Result<Option<Vec<IdExtent>>, UsernsImageError> {
    match userns_images(images_dir)?.first() {
        Some(path) => Ok(Some(read_maps(path)?.0)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::{enc, write_image};

    const FROM: IdExtent = IdExtent {
        first: 0,
        lower_first: 1 << 30,
        count: 65536,
    };

    fn ext(e: IdExtent) -> Vec<u8> {
        enc(&[
            (1, Ok(u64::from(e.first))),
            (2, Ok(u64::from(e.lower_first))),
            (3, Ok(u64::from(e.count))),
        ])
    }

    #[test]
    fn maps_move_and_a_hard_link_keeps_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let e = ext(FROM);
        let msg = enc(&[(1, Err(&e)), (2, Err(&e))]);
        write_image(dir.path(), "userns-11.img", USERNS_MAGIC, &[msg]);
        let keep = dir.path().join("kept");
        fs::hard_link(dir.path().join("userns-11.img"), &keep).unwrap();
        let before = fs::read(&keep).unwrap();
        let to = (1 << 30) + 65536;
        assert_eq!(rebase_userns_images(dir.path(), FROM, to).unwrap(), 1);
        let map = userns_uid_map(dir.path()).unwrap().unwrap();
        assert_eq!(
            map,
            [IdExtent {
                lower_first: to,
                ..FROM
            }]
        );
        assert_eq!(read_maps(&dir.path().join("userns-11.img")).unwrap().1, map);
        assert_eq!(fs::read(&keep).unwrap(), before);
    }

    #[test]
    fn another_map_or_garbage_is_refused_and_nothing_changes() {
        let dir = tempfile::tempdir().unwrap();
        let other = ext(IdExtent { count: 10, ..FROM });
        let good = ext(FROM);
        let msg = enc(&[(1, Err(&good)), (2, Err(&other))]);
        write_image(dir.path(), "userns-11.img", USERNS_MAGIC, &[msg]);
        let before = fs::read(dir.path().join("userns-11.img")).unwrap();
        assert!(matches!(
            rebase_userns_images(dir.path(), FROM, 7),
            Err(UsernsImageError::UnexpectedMap { map: "gid_map", .. })
        ));
        assert_eq!(fs::read(dir.path().join("userns-11.img")).unwrap(), before);
        fs::write(dir.path().join("userns-10.img"), b"garbage!garbage!").unwrap();
        assert!(matches!(
            rebase_userns_images(dir.path(), FROM, 7),
            Err(UsernsImageError::Malformed { .. })
        ));
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(rebase_userns_images(empty.path(), FROM, 7).unwrap(), 0);
        assert_eq!(userns_uid_map(empty.path()).unwrap(), None);
    }
}
