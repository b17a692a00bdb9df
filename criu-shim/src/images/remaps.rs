//! The link remaps of a dump ([`DumpRequest::link_remap`](crate::DumpRequest::link_remap)):
//! files open under a removed name while another hard link keeps them, which CRIU hard-linked
//! as `link_remap.<id>` into the dumped tree's file system.
//!
//! Fields used (CRIU `images/remap-file-path.proto`, `regfile.proto`): remap entry 1
//! `orig_id`, 2 `remap_id`, 3 `remap_type` (0 linked); file entries of type `REG` with their
//! reg file 1 `id`, 6 `name`, 7 `mnt_id` (through the same decoder as the path check).

use std::collections::HashMap;
use std::path::Path;

use super::entries::{self, Files, RemapKind, FILES_MAGIC, REMAP_FPATH_MAGIC};
use super::error::{read_optional, ImageReadError};

/// One link remap: where CRIU put the link and which removed name it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkRemap {
    /// The link's path in the tree's mount namespace (`/dir/link_remap.<id>`).
    pub link: String,
    /// The removed name the file was open under.
    pub original: String,
    /// Mount id of the link's mount at dump time.
    pub mnt_id: i32,
}

/// The link remaps in the images in `images_dir` (none without a `remap-fpath.img`).
///
/// Errors: [`ImageReadError`] when an image cannot be read or decoded, or a remap names a file
/// entry the images do not hold.
pub fn link_remaps(images_dir: &Path) -> Result<Vec<LinkRemap>, ImageReadError> {
    let remap_path = images_dir.join("remap-fpath.img");
    let Some(remaps) = read_optional(&remap_path, REMAP_FPATH_MAGIC)? else {
        return Ok(Vec::new());
    };
    let mut linked = Vec::new();
    for (base, msg) in remaps.entries() {
        let r = entries::remap(msg, base).map_err(|w| ImageReadError::wire(&remap_path, w))?;
        if r.kind == RemapKind::Linked {
            linked.push(r);
        }
    }
    if linked.is_empty() {
        return Ok(Vec::new());
    }
    let files_path = images_dir.join("files.img");
    let mut files = Files::default();
    if let Some(img) = read_optional(&files_path, FILES_MAGIC)? {
        for (base, msg) in img.entries() {
            entries::file_entry(msg, base, &mut files)
                .map_err(|w| ImageReadError::wire(&files_path, w))?;
        }
    }
    let by_id: HashMap<u32, &entries::RegFile> = files.regs.iter().map(|f| (f.id, f)).collect();
    let name = |id: u32| {
        by_id.get(&id).copied().ok_or_else(|| ImageReadError {
            path: files_path.clone(),
            what: format!("a link remap names file {id}, which is not in the image"),
        })
    };
    linked
        .iter()
        .map(|r| {
            let link = name(r.remap_id)?;
            let original = name(r.orig_id)?;
            Ok(LinkRemap {
                link: String::from_utf8_lossy(&link.name).into_owned(),
                original: String::from_utf8_lossy(&original.name).into_owned(),
                mnt_id: link.mnt_id,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::{enc, write_image};

    fn reg(id: u64, name: &[u8]) -> Vec<u8> {
        let rf = enc(&[(1, Ok(id)), (6, Err(name)), (7, Ok(10))]); // mnt_id 5, zigzag
        enc(&[(1, Ok(1)), (2, Ok(id)), (3, Err(&rf))])
    }

    #[test]
    fn names_each_linked_remap() {
        let dir = tempfile::tempdir().unwrap();
        write_image(
            dir.path(),
            "files.img",
            FILES_MAGIC,
            &[
                reg(3, b"/work/a"),
                reg(9, b"/work/link_remap.9"),
                reg(4, b"/tmp/g"),
            ],
        );
        let remaps = [
            enc(&[(1, Ok(3)), (2, Ok(9)), (3, Ok(0))]),  // linked
            enc(&[(1, Ok(4)), (2, Ok(10)), (3, Ok(1))]), // ghost: not listed
        ];
        write_image(dir.path(), "remap-fpath.img", REMAP_FPATH_MAGIC, &remaps);
        assert_eq!(
            link_remaps(dir.path()).unwrap(),
            [LinkRemap {
                link: "/work/link_remap.9".into(),
                original: "/work/a".into(),
                mnt_id: 5
            }]
        );
    }

    #[test]
    fn none_without_a_remap_image_and_an_error_for_a_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(link_remaps(dir.path()).unwrap(), []);
        let remaps = [enc(&[(1, Ok(3)), (2, Ok(9)), (3, Ok(0))])];
        write_image(dir.path(), "remap-fpath.img", REMAP_FPATH_MAGIC, &remaps);
        assert!(link_remaps(dir.path()).is_err());
    }
}
