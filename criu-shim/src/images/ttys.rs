//! The ptys of the images: whether CRIU can re-create each one in the fresh devpts instance it
//! mounts.
//!
//! CRIU (`criu/tty.c` `__pty_open_ptmx_index`) re-creates pty `n` by opening the instance's
//! `ptmx` until the kernel hands out index `n`, giving up after [`PTY_OPEN_TRIES`] opens or as
//! soon as the index it got lies [`PTY_OPEN_TRIES`] or more below `n`. The kernel hands out the
//! lowest free index, and which indices are still free depends on the order CRIU opens the
//! ptys in (the tasks' descriptor order, not the index order): only an index below
//! [`PTY_OPEN_TRIES`] is reached whatever the order. So images holding a higher index are
//! refused rather than left to fail at restore (a sandbox that has closed its older ptys
//! while a newer one stays open, or that holds more than 32 at once).
//!
//! `tty-info.img` (type magic `0x59453036`), tty info: 1 `id`, 2 `type` (enum: 1 pty, 4 ctty:
//! `/dev/tty`), 12 `pty` (nested: 1 `index`).

use std::path::Path;

use super::error::{PathOp, UnsafeImagePath, UnsafeKind};
use super::wire::{Fields, Image, ImageError, WireError};

/// `tty-info.img` type magic.
const TTY_INFO_MAGIC: u32 = 0x5945_3036;
/// The image's file name.
const TTY_INFO: &str = "tty-info.img";
/// `TTY_TYPE__PTY`.
const TTY_TYPE_PTY: u32 = 1;
/// `TTY_TYPE__CTTY`: a descriptor of `/dev/tty`.
const TTY_TYPE_CTTY: u32 = 4;

/// Opens of `ptmx` CRIU makes at most to re-create one pty (the size of its descriptor array):
/// every pty index below this is restorable in any order.
pub const PTY_OPEN_TRIES: u32 = 32;

/// The indices of the ptys in `images_dir` (none without a `tty-info.img`), in image order,
/// and how many `/dev/tty` entries it holds.
///
/// Errors: [`UnsafeImagePath::ReadImage`], [`UnsafeImagePath::DecodeImage`].
pub(crate) fn pty_indices(images_dir: &Path) -> Result<(Vec<u32>, usize), UnsafeImagePath> {
    let path = images_dir.join(TTY_INFO);
    let img = match Image::read(&path, TTY_INFO_MAGIC, true) {
        Ok(img) => img,
        Err(ImageError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Vec::new(), 0))
        }
        Err(ImageError::Io(source)) => {
            return Err(UnsafeImagePath::ReadImage {
                image: path,
                source,
            })
        }
        Err(ImageError::Wire(e)) => return Err(decode_error(&path, e)),
    };
    let (mut out, mut dev_tty) = (Vec::new(), 0);
    for (base, msg) in img.entries() {
        match pty_index(msg, base).map_err(|e| decode_error(&path, e))? {
            TtyEntry::Pty(index) => out.push(index),
            TtyEntry::DevTtyFd => dev_tty += 1,
            TtyEntry::Other => {}
        }
    }
    Ok((out, dev_tty))
}

/// What one tty-info entry is.
enum TtyEntry {
    /// A pty with this index.
    Pty(u32),
    /// `/dev/tty`.
    DevTtyFd,
    /// Anything else (console, vt, ...).
    Other,
}

/// Refuses images holding a pty CRIU may not reach ([`PTY_OPEN_TRIES`]); returns the number
/// of ptys and of `/dev/tty` entries.
///
/// Errors: [`UnsafeImagePath::Unsafe`] with [`UnsafeKind::PtyOutOfReach`] (path
/// `/dev/pts/<index>`), and those of [`pty_indices`].
pub(crate) fn check_ptys(images_dir: &Path) -> Result<(usize, usize), UnsafeImagePath> {
    let (indices, dev_tty) = pty_indices(images_dir)?;
    if let Some(&index) = indices.iter().filter(|&&i| i >= PTY_OPEN_TRIES).max() {
        return Err(UnsafeImagePath::Unsafe {
            image: TTY_INFO.to_string(),
            op: PathOp::OpenPty,
            path: format!("/dev/pts/{index}"),
            kind: UnsafeKind::PtyOutOfReach {
                index,
                tries: PTY_OPEN_TRIES,
            },
        });
    }
    Ok((indices.len(), dev_tty))
}

/// What one tty-info entry is: a pty (with its index), `/dev/tty`, or another tty.
fn pty_index(msg: &[u8], base: u64) -> Result<TtyEntry, WireError> {
    let (mut kind, mut index) = (None, None);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        let bad = WireError {
            offset: at,
            what: "tty info field of the wrong type",
        };
        match n {
            2 => kind = Some(v.u32().ok_or(bad)?),
            12 => {
                let nested = v.bytes().ok_or(bad)?;
                let mut inner = Fields::new(nested, at);
                while let Some(f) = inner.next() {
                    let (n, v) = f?;
                    if n == 1 {
                        index = Some(v.u32().ok_or(WireError {
                            offset: inner.offset(),
                            what: "pty index of the wrong type",
                        })?);
                    }
                }
            }
            _ => {}
        }
    }
    match (kind, index) {
        (Some(TTY_TYPE_PTY), Some(index)) => Ok(TtyEntry::Pty(index)),
        (Some(TTY_TYPE_PTY), None) => Err(WireError {
            offset: base,
            what: "pty without an index",
        }),
        (Some(TTY_TYPE_CTTY), _) => Ok(TtyEntry::DevTtyFd),
        _ => Ok(TtyEntry::Other),
    }
}

fn decode_error(path: &Path, e: WireError) -> UnsafeImagePath {
    UnsafeImagePath::DecodeImage {
        image: path.to_path_buf(),
        offset: e.offset,
        what: e.what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::{enc, write_image};

    fn pty(index: u64) -> Vec<u8> {
        let inner = enc(&[(1, Ok(index))]);
        enc(&[(1, Ok(index + 0x10)), (2, Ok(1)), (12, Err(&inner))])
    }

    #[test]
    fn indices_below_the_reach_pass() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(check_ptys(dir.path()).unwrap(), (0, 0));
        let console = enc(&[(1, Ok(1)), (2, Ok(2))]);
        let dev_tty = enc(&[(1, Ok(2)), (2, Ok(4))]);
        write_image(
            dir.path(),
            TTY_INFO,
            TTY_INFO_MAGIC,
            &[pty(0), pty(31), console, dev_tty],
        );
        assert_eq!(pty_indices(dir.path()).unwrap(), (vec![0, 31], 1));
        assert_eq!(check_ptys(dir.path()).unwrap(), (2, 1));
    }

    #[test]
    fn an_index_out_of_reach_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        write_image(
            dir.path(),
            TTY_INFO,
            TTY_INFO_MAGIC,
            &[pty(3), pty(40), pty(32)],
        );
        let err = check_ptys(dir.path()).unwrap_err();
        println!("{err}");
        assert!(
            matches!(&err, UnsafeImagePath::Unsafe {
                op: PathOp::OpenPty,
                kind: UnsafeKind::PtyOutOfReach { index: 40, tries: 32 },
                path,
                ..
            } if path == "/dev/pts/40"),
            "{err:?}"
        );
        assert!(err.is_image_fault());
    }

    fn mnt(fstype: u64, id: u64, dev: u64, parent: u64, mp: &str) -> Vec<u8> {
        enc(&[
            (1, Ok(fstype)),
            (2, Ok(id)),
            (3, Ok(dev)),
            (4, Ok(parent)),
            (6, Err(b"/".as_slice())),
            (7, Err(mp.as_bytes())),
        ])
    }

    /// A root with `/dev/pts` mounted as devpts; `files` opened by path on the devpts mount,
    /// `ghost` (a mode) making the first one a ghost file.
    fn devpts_scene(files: &[&str], ghost: Option<u64>) -> Result<(), UnsafeImagePath> {
        use crate::images::entries::{
            FILES_MAGIC, GHOST_FILE_MAGIC, MNTS_MAGIC, REMAP_FPATH_MAGIC,
        };
        let t = tempfile::tempdir().unwrap();
        let (root, images) = (t.path().join("root"), t.path().join("images"));
        std::fs::create_dir_all(root.join("dev/pts")).unwrap();
        std::fs::create_dir(&images).unwrap();
        let mounts = [mnt(17, 114, 65, 66, "/"), mnt(6, 71, 70, 114, "/dev/pts")];
        write_image(&images, "mountpoints-12.img", MNTS_MAGIC, &mounts);
        let entries: Vec<Vec<u8>> = files
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let id = 9 + i as u64;
                let reg = enc(&[
                    (1, Ok(id)),
                    (2, Ok(2)),
                    (6, Err(name.as_bytes())),
                    (7, Ok(142)),
                ]);
                enc(&[(1, Ok(1)), (2, Ok(id)), (3, Err(&reg))])
            })
            .collect();
        write_image(&images, "files.img", FILES_MAGIC, &entries);
        if let Some(mode) = ghost {
            let r = enc(&[(1, Ok(9)), (2, Ok(1)), (3, Ok(1))]);
            write_image(&images, "remap-fpath.img", REMAP_FPATH_MAGIC, &[r]);
            let g = enc(&[(1, Ok(0)), (2, Ok(0)), (3, Ok(mode))]);
            write_image(&images, "ghost-file-1.img", GHOST_FILE_MAGIC, &[g]);
        }
        crate::validate_restore_paths(&images, &root).map(|_| ())
    }

    #[test]
    fn a_devpts_mount_holds_only_ptmx_and_numbered_ptys() {
        devpts_scene(&["/dev/pts/ptmx", "/dev/pts/0", "/dev/pts/17"], None).unwrap();
        // Nothing is ever created in it: a ghost there (a deleted file CRIU would re-create).
        let ghost = devpts_scene(&["/dev/pts/x"], Some(0o100644)).unwrap_err();
        assert!(
            matches!(
                ghost,
                UnsafeImagePath::Unsafe {
                    op: PathOp::CreateGhost,
                    ..
                }
            ),
            "{ghost:?}"
        );
        // A path below a pty node is not a directory.
        let below = devpts_scene(&["/dev/pts/0/x"], None).unwrap_err();
        assert!(
            matches!(
                below,
                UnsafeImagePath::Unsafe {
                    op: PathOp::OpenFile,
                    kind: UnsafeKind::NotDirectory { .. },
                    ..
                }
            ),
            "{below:?}"
        );
    }

    #[test]
    fn a_pty_without_index_is_malformed() {
        let dir = tempfile::tempdir().unwrap();
        let bare = enc(&[(1, Ok(1)), (2, Ok(1))]);
        write_image(dir.path(), TTY_INFO, TTY_INFO_MAGIC, &[bare]);
        assert!(matches!(
            check_ptys(dir.path()),
            Err(UnsafeImagePath::DecodeImage { .. })
        ));
    }
}
