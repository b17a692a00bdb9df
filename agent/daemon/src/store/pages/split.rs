//! The checkpoint side: cut R_k's pages files into pages, store the new ones in page packs,
//! replace each file by its page map (see [`super`]).

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File};
use std::io::Read;
use std::path::Path;

use belayer_overlay::layer::{BlobBatch, BlobId, BlobStore};

use super::format::{PageMap, PageRef};
use super::{io, pages_stem, MemoryImages, PageError, MAP_SUFFIX};

/// A page of the file being split: where the index found it (pack in the index, page;
/// else `None`), its index in the file's own pack when new, its blake3.
type Split = (Option<(u32, u32)>, u32, [u8; 32]);

/// Read buffer, bytes (a multiple of every page size).
const READ_BYTES: usize = 1 << 20;

/// Pages of a file found in the index that [`WholeFile`] stores all the same before it
/// looks at their share.
const FOUND_ALLOWANCE: u64 = 8;

/// Whether a pages file being split is still stored whole: every page appended to its own
/// pack at its place in the file, found elsewhere or not, so that the pack is the pages
/// file byte for byte and a restore hard-links it instead of copying it
/// ([`super::assemble`]). Only a checkpoint without a parent's pages to refer to (a first
/// one) stores its files so: each starts whole and stops once more than
/// [`FOUND_ALLOWANCE`] pages, and more than one page in eight of those seen, were found in
/// the index (equal to pages of a file split before it), so that pages shared between its
/// processes cost at most [`FOUND_ALLOWANCE`] pages stored twice per file. A checkpoint
/// with a parent refers to every page it finds, as it must to store only what changed.
#[derive(Debug, Default)]
struct WholeFile {
    given_up: bool,
    seen: u64,
    found: u64,
}

impl WholeFile {
    /// Counts one page (`found`: in the index); whether it is appended all the same.
    fn keep(&mut self, found: bool) -> bool {
        if self.given_up {
            return false;
        }
        self.seen += 1;
        self.found += u64::from(found);
        if self.found > FOUND_ALLOWANCE && self.found * 8 > self.seen {
            self.given_up = true;
            return false;
        }
        true
    }
}

/// The pages a new checkpoint may refer to instead of storing them: every page of its
/// parent's page maps whose pack is in the store, and the pages stored so far by the
/// checkpoint itself, by blake3.
#[derive(Debug, Default)]
pub struct PageIndex {
    packs: Vec<BlobId>,
    pack_index: HashMap<BlobId, u32>,
    pages: HashMap<[u8; 32], (u32, u32)>,
    /// The blake3 of every known page by its place (pack, page), so that of several places
    /// holding the same bytes the one continuing the previous page's run is chosen.
    places: HashMap<(u32, u32), [u8; 32]>,
    /// Pages that came from the parent's maps ([`PageIndex::of_maps`]).
    parent_pages: usize,
    /// The places of the pages of each of the parent's maps, in file order, by the stem of
    /// the pages file (`pages-<n>`); `None` where its pack is gone.
    by_file: HashMap<String, Vec<Option<(u32, u32)>>>,
}

impl PageIndex {
    /// The pages of the page maps `maps` (read from the parent checkpoint); maps that do
    /// not read or decode, and packs the store does not hold, are left out (their pages
    /// are stored again). `page_size` is the system's: maps of another size are skipped.
    pub fn of_maps<'a>(
        maps: impl IntoIterator<Item = &'a Path>,
        page_size: u32,
        blobs: &BlobStore,
    ) -> PageIndex {
        let mut index = PageIndex::default();
        for path in maps {
            let map = fs::read(path)
                .map_err(|e| e.to_string())
                .and_then(|b| PageMap::decode(&b).map_err(|e| e.to_string()));
            let stem = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(MAP_SUFFIX))
                .map(str::to_owned);
            match map {
                Ok(map) if map.page_size == page_size => index.add_map(&map, blobs, stem),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(map = %path.display(), error = %e, "parent page map unusable: its pages are stored again")
                }
            }
        }
        index
    }

    fn add_map(&mut self, map: &PageMap, blobs: &BlobStore, stem: Option<String>) {
        let present: Vec<Option<u32>> = map
            .packs
            .iter()
            .map(|id| {
                if let Some(i) = self.pack_index.get(id) {
                    return Some(*i);
                }
                blobs.pack_file(id).ok()?;
                Some(self.intern(*id))
            })
            .collect();
        let mut places = Vec::with_capacity(map.pages.len());
        for p in &map.pages {
            let place = present.get(p.pack as usize).copied().flatten();
            if let Some(pack) = place {
                self.add(p.hash, pack, p.page);
                self.parent_pages += 1;
            }
            places.push(place.map(|pack| (pack, p.page)));
        }
        if let Some(stem) = stem {
            self.by_file.insert(stem, places);
        }
    }

    fn intern(&mut self, id: BlobId) -> u32 {
        *self.pack_index.entry(id).or_insert_with(|| {
            self.packs.push(id);
            (self.packs.len() - 1) as u32
        })
    }

    fn add(&mut self, hash: [u8; 32], pack: u32, page: u32) {
        self.pages.entry(hash).or_insert((pack, page));
        self.places.insert((pack, page), hash);
    }

    /// A place holding the page of `hash`: `same` (where the parent's file of the same name
    /// had its page at this position) when it holds the same bytes, so that an unchanged
    /// file gets the parent's map byte for byte (then shared with it as an unchanged image);
    /// else the page after `prev` when it does (the run of pages read at restore goes on);
    /// else the first place seen.
    fn get(
        &self,
        hash: &[u8; 32],
        same: Option<(u32, u32)>,
        prev: Option<(u32, u32)>,
    ) -> Option<(u32, u32)> {
        if let Some(same) = same {
            if self.places.get(&same) == Some(hash) {
                return Some(same);
            }
        }
        if let Some(next) = prev.and_then(|(pack, page)| Some((pack, page.checked_add(1)?))) {
            if self.places.get(&next) == Some(hash) {
                return Some(next);
            }
        }
        self.pages.get(hash).copied()
    }

    /// Distinct pages known.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether no page is known.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

/// Replaces every `pages-<n>.img` in `images` by `pages-<n>.pmap`: pages found in `index`
/// are referred to, the others appended to a new pack per file (then added to `index`, so
/// later files refer to them). The packs are committed to `blobs` (durable) before any
/// pages file is removed; a failure leaves every pages file in place and no map.
/// `page_size` must be the system's. A pages file whose length is not a multiple of the
/// page size is left as it is (an ordinary artifact).
///
/// The caller holds a lease of `blobs` until the manifest naming the packs is published.
///
/// Errors: [`PageError::Io`], [`PageError::Blob`] (a full disk among them).
pub fn split_pages(
    images: &Path,
    index: &mut PageIndex,
    page_size: u32,
    blobs: &BlobStore,
) -> Result<MemoryImages, PageError> {
    let mut names: Vec<String> = fs::read_dir(images)
        .map_err(io("readdir", images))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| pages_stem(n).is_some())
        .collect();
    names.sort();
    let mut batch = BlobBatch::default();
    let mut summary = MemoryImages {
        page_size,
        ..MemoryImages::default()
    };
    let mut packs = BTreeSet::new();
    let mut maps = Vec::new();
    let mut buf = vec![0u8; READ_BYTES];
    for name in names {
        let path = images.join(&name);
        let mut file = File::open(&path).map_err(io("open", &path))?;
        let len = file.metadata().map_err(io("stat", &path))?.len();
        if len % u64::from(page_size) != 0 {
            tracing::warn!(file = %path.display(), len, "pages file not a whole number of pages: kept as it is");
            continue;
        }
        let mut pack = blobs.pack_writer()?;
        let mut refs: Vec<Split> = Vec::new();
        let mut own: Vec<(u32, [u8; 32])> = Vec::new();
        let mut prev = None;
        let parent_file = pages_stem(&name).and_then(|stem| index.by_file.get(stem));
        let mut position = 0usize;
        let mut whole = WholeFile {
            given_up: index.parent_pages > 0,
            ..WholeFile::default()
        };
        loop {
            let n = read_pages(&mut file, &mut buf, page_size).map_err(io("read", &path))?;
            if n == 0 {
                break;
            }
            for page in buf[..n].chunks_exact(page_size as usize) {
                let hash = *blake3::hash(page).as_bytes();
                let same = parent_file.and_then(|places| places.get(position).copied().flatten());
                position += 1;
                prev = index.get(&hash, same, prev);
                let appended_all_the_same = whole.keep(prev.is_some());
                match prev.filter(|_| !appended_all_the_same) {
                    Some(found) => refs.push((Some(found), 0, hash)),
                    None => {
                        let at = pack.append(page)? / u64::from(page_size);
                        let at = u32::try_from(at).unwrap_or(u32::MAX);
                        refs.push((None, at, hash));
                        own.push((at, hash));
                    }
                }
            }
        }
        let own_pack = if pack.is_empty() {
            None
        } else {
            let (id, grown) = pack.finish(&mut batch)?;
            summary.new_bytes += grown;
            Some(id)
        };
        summary.pages += refs.len() as u64;
        summary.new_pages += own.len() as u64;
        let mut map = PageMap {
            page_size,
            packs: Vec::new(),
            pages: Vec::with_capacity(refs.len()),
        };
        let mut table: HashMap<BlobId, u32> = HashMap::new();
        let mut slot = |id: BlobId, map: &mut PageMap| {
            *table.entry(id).or_insert_with(|| {
                map.packs.push(id);
                (map.packs.len() - 1) as u32
            })
        };
        if let Some(id) = own_pack {
            slot(id, &mut map);
        }
        for (found, at, hash) in refs {
            let (pack, page) = match found {
                Some((pack, page)) => (slot(index.packs[pack as usize], &mut map), page),
                None => (0, at),
            };
            map.pages.push(PageRef { pack, page, hash });
        }
        if let Some(id) = own_pack {
            let pack = index.intern(id);
            for (at, hash) in own {
                index.add(hash, pack, at);
            }
        }
        packs.extend(map.packs.iter().map(|p| p.to_hex()));
        maps.push((name, map));
    }
    blobs.commit(batch)?;
    for (name, map) in &maps {
        let stem = pages_stem(name).unwrap_or(name);
        let map_path = images.join(format!("{stem}{MAP_SUFFIX}"));
        fs::write(&map_path, map.encode()).map_err(io("write", &map_path))?;
    }
    for (name, _) in &maps {
        let path = images.join(name);
        fs::remove_file(&path).map_err(io("unlink", &path))?;
    }
    summary.packs = packs.into_iter().collect();
    Ok(summary)
}

/// Fills `buf` with whole pages from `file`; returns the bytes read (0 at the end).
fn read_pages(file: &mut File, buf: &mut [u8], page_size: u32) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    if done % page_size as usize != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "pages file changed length while read",
        ));
    }
    Ok(done)
}

/// [`split_pages`] of the images dir `images` of a new checkpoint against the page maps of
/// its parent `parent` (its manifest, loaded from `store`; none: every page is new). Returns
/// `None` when `images` held no pages file.
///
/// Errors: as [`split_pages`].
pub fn split_against_parent(
    store: &crate::store::CheckpointStore,
    parent: Option<&crate::store::Manifest>,
    images: &Path,
    blobs: &BlobStore,
) -> Result<Option<MemoryImages>, PageError> {
    let page_size = super::system_page_size();
    let maps: Vec<std::path::PathBuf> = parent
        .map(|m| {
            let dir = store.path(&m.checkpoint);
            m.criu
                .iter()
                .filter(|a| a.path_is_safe() && a.path.ends_with(MAP_SUFFIX))
                .map(|a| dir.join(&a.path))
                .collect()
        })
        .unwrap_or_default();
    let mut index = PageIndex::of_maps(maps.iter().map(|p| p.as_path()), page_size, blobs);
    let summary = split_pages(images, &mut index, page_size, blobs)?;
    Ok((summary.pages > 0).then_some(summary))
}
