//! The restore side: the images dir CRIU reads, with R_k's pages files rebuilt from the
//! page packs (see [`super`]).

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, OpenOptions};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use belayer_overlay::layer::{BlobId, BlobStore, PackRange};

use super::format::PageMap;
use super::{io, system_page_size, PageError, MAP_SUFFIX};
use crate::store::Manifest;

/// What [`assemble`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AssembleStats {
    /// Pages files rebuilt.
    pub files: u64,
    /// Runs of consecutive pages copied (`copy_file_range` calls, at least).
    pub runs: u64,
    /// Bytes of the pages files.
    pub bytes: u64,
    /// Of those, bytes of pages files that are a hard link to their pack (nothing copied).
    pub linked_bytes: u64,
}

/// Whether the pages file `map` describes is, byte for byte, its one pack: every page in
/// pack order from the first, and the pack no longer (checked against the pack's length).
fn is_whole_pack(map: &PageMap, pack_len: u64) -> bool {
    let Some(first) = map.pages.first() else {
        return false;
    };
    map.pages
        .iter()
        .enumerate()
        .all(|(i, p)| p.pack == first.pack && u64::from(p.page) == i as u64)
        && pack_len == map.file_bytes()
}

/// Bytes of checkpoint `m`'s pages files (their maps in `criu_dir`) that are each one
/// whole pack of `blobs` readable by all
/// ([`belayer_overlay::layer::PACK_MODE`]): what [`assemble`] with `link`
/// hard-links instead of copying. A map or pack that cannot be read counts 0 (the assembly
/// reports it).
pub fn linkable_bytes(m: &Manifest, criu_dir: &Path, blobs: &BlobStore) -> u64 {
    m.criu
        .iter()
        .filter_map(|a| a.path.strip_prefix("criu/"))
        .filter(|name| !name.contains('/') && name.ends_with(MAP_SUFFIX))
        .filter_map(|name| {
            let map = PageMap::decode(&fs::read(criu_dir.join(name)).ok()?).ok()?;
            linkable_pack(&map, blobs).map(|_| map.file_bytes())
        })
        .sum()
}

/// The pack file to hard-link as the pages file `map` describes, if it is one whole pack
/// readable by all.
fn linkable_pack(map: &PageMap, blobs: &BlobStore) -> Option<std::path::PathBuf> {
    let id = map.packs.get(map.pages.first()?.pack as usize)?;
    let (path, len) = blobs.pack_file(id).ok()?;
    let mode = fs::symlink_metadata(&path).ok()?.permissions().mode();
    (is_whole_pack(map, len) && mode & 0o004 != 0).then_some(path)
}

/// Makes `dest` (removed first if it exists, then created mode 0755) the images dir of
/// checkpoint `m`, whose files are in `criu_dir`: every artifact of R_k hard-linked (copied
/// across file systems) except the page maps, and for each page map `pages-<n>.pmap` the
/// pages file `pages-<n>.img` it describes (mode 0644: CRIU reads pages as the restored
/// tasks' user namespace root too, which a pack, mode 0400, would refuse), copied out of the
/// packs in `blobs` by the kernel (shared extents on btrfs); with `link` (`dest` on the
/// blob store's file system), a pages file that is one whole pack ([`linkable_bytes`]) is a
/// hard link to it instead (falling back to the copy where the kernel refuses the link).
/// The manifest's pack list must name every pack a map refers to. Nothing is hashed here: the restore's
/// verifier checks the maps (artifact digests) and the packs (hashed against their ids)
/// before CRIU runs.
///
/// Errors: [`PageError::Map`], [`PageError::PageSize`], [`PageError::UnlistedPack`],
/// [`PageError::Blob`] (a missing pack, a page beyond its pack's end), [`PageError::Io`].
pub fn assemble(
    m: &Manifest,
    criu_dir: &Path,
    blobs: &BlobStore,
    dest: &Path,
    link: bool,
) -> Result<AssembleStats, PageError> {
    match belayer_overlay::remove_dir_all(dest) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove", dest)(e)),
    }
    // Readable like the checkpoint's own `criu/` (CRIU opens some images after dropping to
    // the restored tasks' credentials); the sandbox dir above keeps others out.
    fs::DirBuilder::new()
        .mode(0o755)
        .create(dest)
        .map_err(io("mkdir", dest))?;
    let listed: HashSet<BlobId> = m
        .memory
        .as_ref()
        .map(|mem| mem.pack_ids().collect())
        .unwrap_or_default();
    let mut stats = AssembleStats::default();
    for a in &m.criu {
        let Some(name) = a.path.strip_prefix("criu/").filter(|n| !n.contains('/')) else {
            continue;
        };
        let src = criu_dir.join(name);
        match name.strip_suffix(MAP_SUFFIX) {
            Some(stem) => {
                let bytes = fs::read(&src).map_err(io("read", &src))?;
                let map = PageMap::decode(&bytes).map_err(|source| PageError::Map {
                    path: src.clone(),
                    source,
                })?;
                let system = system_page_size();
                if map.page_size != system {
                    return Err(PageError::PageSize {
                        path: src,
                        found: map.page_size,
                        system,
                    });
                }
                if let Some(p) = map.packs.iter().find(|p| !listed.contains(p)) {
                    return Err(PageError::UnlistedPack {
                        path: src,
                        pack: p.to_hex(),
                    });
                }
                let out = dest.join(format!("{stem}.img"));
                let pack = link.then(|| linkable_pack(&map, blobs)).flatten();
                match pack.map(|pack| fs::hard_link(pack, &out)) {
                    Some(Ok(())) => {
                        stats.files += 1;
                        stats.bytes += map.file_bytes();
                        stats.linked_bytes += map.file_bytes();
                    }
                    // Another file system or subvolume (EXDEV), a link limit: copy.
                    Some(Err(_)) | None => rebuild(&map, blobs, &out, &mut stats)?,
                }
            }
            None => {
                let to = dest.join(name);
                crate::store::copy::link_or_copy(&src, &to).map_err(io("link", &to))?
            }
        }
    }
    Ok(stats)
}

fn rebuild(
    map: &PageMap,
    blobs: &BlobStore,
    out: &Path,
    stats: &mut AssembleStats,
) -> Result<(), PageError> {
    stats.files += 1;
    stats.bytes += map.file_bytes();
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(out)
        .map_err(io("create", out))?;
    file.set_len(map.file_bytes())
        .map_err(io("truncate", out))?;
    let ps = u64::from(map.page_size);
    // Runs of pages consecutive in both the file and one pack, grouped by pack.
    let mut runs: BTreeMap<u32, Vec<PackRange>> = BTreeMap::new();
    let mut last: Option<(u32, u64, u64)> = None;
    for (i, p) in map.pages.iter().enumerate() {
        let (src, dst) = (u64::from(p.page) * ps, i as u64 * ps);
        if let Some((pack, s, d)) = last {
            if pack == p.pack && s == src && d == dst {
                if let Some(r) = runs.get_mut(&pack).and_then(|v| v.last_mut()) {
                    r.len += ps;
                }
                last = Some((pack, src + ps, dst + ps));
                continue;
            }
        }
        runs.entry(p.pack)
            .or_default()
            .push(PackRange { src, dst, len: ps });
        last = Some((p.pack, src + ps, dst + ps));
    }
    for (pack, ranges) in runs {
        stats.runs += ranges.len() as u64;
        blobs.copy_out(&map.packs[pack as usize], &ranges, file.as_fd())?;
    }
    Ok(())
}
