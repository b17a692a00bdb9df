//! Unit tests of content-addressed memory images: split then assemble gives the pages files
//! back byte for byte; a second checkpoint stores only the changed pages; hostile or damaged
//! maps and packs are refused.

use std::fs;
use std::path::Path;

use belayer_overlay::layer::BlobStore;

use super::*;
use crate::store::{artifact, Artifact, Manifest};

const PS: u32 = 4096;

/// Deterministic page contents: page `i` of a file seeded `seed`.
fn page(seed: u64, i: u64) -> Vec<u8> {
    let mut out = vec![0u8; PS as usize];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i.wrapping_add(1);
    for chunk in out.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    out
}

fn write_pages(dir: &Path, name: &str, pages: &[Vec<u8>]) -> Vec<u8> {
    let bytes: Vec<u8> = pages.concat();
    fs::write(dir.join(name), &bytes).unwrap();
    bytes
}

/// A manifest whose criu artifacts are the files of `dir` (named `criu/<file>`).
fn manifest_of(dir: &Path, memory: Option<MemoryImages>) -> Manifest {
    let root = dir.parent().unwrap();
    let ctx = root.join("context.bin");
    fs::write(&ctx, b"ctx").unwrap();
    let art = |rel: &str| artifact(root, rel).unwrap();
    let mut m = Manifest::for_test(
        "c000001-k1",
        1,
        1,
        None,
        art("context.bin"),
        art("context.bin"),
    );
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    m.criu = names
        .iter()
        .map(|n| art(&format!("criu/{n}")))
        .collect::<Vec<Artifact>>();
    m.memory = memory;
    m
}

struct Fixture {
    _tmp: tempfile::TempDir,
    blobs: BlobStore,
    root: std::path::PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let blobs = BlobStore::open(&tmp.path().join("blobs")).unwrap();
    let root = tmp.path().to_path_buf();
    Fixture {
        _tmp: tmp,
        blobs,
        root,
    }
}

fn images_dir(f: &Fixture, name: &str) -> std::path::PathBuf {
    let d = f.root.join(name).join("criu");
    fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn split_then_assemble_round_trips() {
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    let f = fixture();
    let dir = images_dir(&f, "c1");
    let one: Vec<Vec<u8>> = (0..64).map(|i| page(1, i)).collect();
    // The second process shares half its pages with the first.
    let two: Vec<Vec<u8>> = (0..64)
        .map(|i| if i % 2 == 0 { page(1, i) } else { page(2, i) })
        .collect();
    let b1 = write_pages(&dir, "pages-1.img", &one);
    let b2 = write_pages(&dir, "pages-2.img", &two);
    fs::write(dir.join("pagemap-1.img"), b"map").unwrap();
    let mut index = PageIndex::default();
    let mem = split_pages(&dir, &mut index, PS, &f.blobs).unwrap();
    assert_eq!(mem.pages, 128);
    // The shared half is stored once, but for the first shared pages of the second file
    // (`FOUND_ALLOWANCE`, 8, and the new ones between them): stored whole until then.
    assert_eq!(mem.new_pages, 64 + 32 + 8, "the shared half is stored once");
    assert_eq!(mem.new_bytes, 104 * u64::from(PS));
    assert!(!dir.join("pages-1.img").exists());
    assert!(dir.join("pages-1.pmap").is_file());
    let m = manifest_of(&dir, Some(mem));
    let dest = f.root.join("restore");
    let stats = assemble(&m, &dir, &f.blobs, &dest, false).unwrap();
    assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), b1);
    assert_eq!(fs::read(dest.join("pages-2.img")).unwrap(), b2);
    assert_eq!(fs::read(dest.join("pagemap-1.img")).unwrap(), b"map");
    assert!(!dest.join("pages-1.pmap").exists());
    assert_eq!(
        (stats.files, stats.runs),
        (2, 1 + 1 + 48),
        "one run, then one over the part stored whole, then alternating packs"
    );
    // Again into the same dir: it is made afresh.
    assemble(&m, &dir, &f.blobs, &dest, false).unwrap();
    assert_eq!(fs::read(dest.join("pages-2.img")).unwrap(), b2);
}

#[test]
fn a_pages_file_that_is_its_whole_pack_is_linked_not_copied() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    let f = fixture();
    let dir = images_dir(&f, "c1");
    let one: Vec<Vec<u8>> = (0..32).map(|i| page(7, i)).collect();
    // The second file's pages are all the first's: past the allowance it refers to the
    // first file's pack.
    let b1 = write_pages(&dir, "pages-1.img", &one);
    let b2 = write_pages(&dir, "pages-2.img", &one[..20]);
    let mut index = PageIndex::default();
    let mem = split_pages(&dir, &mut index, PS, &f.blobs).unwrap();
    let m = manifest_of(&dir, Some(mem));
    assert_eq!(linkable_bytes(&m, &dir, &f.blobs), 32 * u64::from(PS));
    let dest = f.root.join("restore");
    let stats = assemble(&m, &dir, &f.blobs, &dest, true).unwrap();
    assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), b1);
    assert_eq!(fs::read(dest.join("pages-2.img")).unwrap(), b2);
    assert_eq!(stats.linked_bytes, 32 * u64::from(PS));
    let linked = fs::metadata(dest.join("pages-1.img")).unwrap();
    let pack = m
        .memory
        .as_ref()
        .unwrap()
        .pack_ids()
        .find(|p| fs::metadata(f.blobs.blob_path(p)).unwrap().len() == 32 * u64::from(PS))
        .unwrap();
    let pack_meta = fs::metadata(f.blobs.blob_path(&pack)).unwrap();
    assert_eq!(
        linked.ino(),
        pack_meta.ino(),
        "pages-1.img is the pack itself"
    );
    assert_eq!(pack_meta.permissions().mode() & 0o777, 0o444);
    assert_eq!(
        fs::metadata(dest.join("pages-2.img")).unwrap().nlink(),
        1,
        "a part of a pack is copied"
    );
    // A pack only its owner may read (an older store's) is copied, not linked.
    fs::set_permissions(f.blobs.blob_path(&pack), fs::Permissions::from_mode(0o400)).unwrap();
    assert_eq!(linkable_bytes(&m, &dir, &f.blobs), 0);
    let stats = assemble(&m, &dir, &f.blobs, &dest, true).unwrap();
    assert_eq!(stats.linked_bytes, 0);
    assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), b1);
    assert_eq!(fs::metadata(dest.join("pages-1.img")).unwrap().nlink(), 1);
}

#[test]
fn a_second_checkpoint_stores_only_the_dirtied_pages() {
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    let f = fixture();
    let first = images_dir(&f, "c1");
    let pages: Vec<Vec<u8>> = (0..1000).map(|i| page(7, i)).collect();
    write_pages(&first, "pages-1.img", &pages);
    let mut index = PageIndex::default();
    let m1 = split_pages(&first, &mut index, PS, &f.blobs).unwrap();
    // 1% dirtied, scattered.
    let second = images_dir(&f, "c2");
    let dirtied: Vec<Vec<u8>> = (0..1000)
        .map(|i| {
            if i % 100 == 37 {
                page(8, i)
            } else {
                page(7, i)
            }
        })
        .collect();
    let b2 = write_pages(&second, "pages-1.img", &dirtied);
    let parent = [first.join("pages-1.pmap")];
    let mut index = PageIndex::of_maps(parent.iter().map(|p| p.as_path()), PS, &f.blobs);
    assert_eq!(index.len(), 1000);
    let m2 = split_pages(&second, &mut index, PS, &f.blobs).unwrap();
    assert_eq!(
        m2.new_pages, 10,
        "a checkpoint with a parent stores no page twice"
    );
    let map_bytes = fs::metadata(second.join("pages-1.pmap")).unwrap().len();
    let stored = m2.new_bytes + map_bytes;
    assert!(
        stored * 20 <= m1.new_bytes,
        "2nd checkpoint {stored} bytes, 1st {}",
        m1.new_bytes
    );
    assert_eq!(m2.packs.len(), 2, "its own pack and the first's");
    let m = manifest_of(&second, Some(m2));
    let dest = f.root.join("restore");
    let stats = assemble(&m, &second, &f.blobs, &dest, false).unwrap();
    assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), b2);
    assert!(stats.runs <= 21, "{} runs", stats.runs);
}

#[test]
fn an_unchanged_file_gets_its_parent_s_map_byte_for_byte() {
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    // The second file shares 4 pages with the first: a first checkpoint stores it whole
    // (those 4 twice); a second checkpoint of the same memory must refer to the very places
    // the parent's maps name, so that its maps equal the parent's.
    let f = fixture();
    let one: Vec<Vec<u8>> = (0..40).map(|i| page(11, i)).collect();
    let mut two: Vec<Vec<u8>> = (0..40).map(|i| page(12, i)).collect();
    two[10..14].clone_from_slice(&one[20..24]);
    let mut maps = Vec::new();
    for (n, name) in ["c1", "c2"].iter().enumerate() {
        let dir = images_dir(&f, name);
        write_pages(&dir, "pages-1.img", &one);
        write_pages(&dir, "pages-2.img", &two);
        let mut index = if n == 0 {
            PageIndex::default()
        } else {
            let parent = [
                f.root.join("c1/criu/pages-1.pmap"),
                f.root.join("c1/criu/pages-2.pmap"),
            ];
            PageIndex::of_maps(parent.iter().map(|p| p.as_path()), PS, &f.blobs)
        };
        let mem = split_pages(&dir, &mut index, PS, &f.blobs).unwrap();
        if n == 0 {
            assert_eq!(
                mem.new_pages, 80,
                "a first checkpoint stores each file whole"
            );
        } else {
            assert_eq!(mem.new_pages, 0);
        }
        maps.push([
            fs::read(dir.join("pages-1.pmap")).unwrap(),
            fs::read(dir.join("pages-2.pmap")).unwrap(),
        ]);
    }
    assert_eq!(
        maps[0], maps[1],
        "the maps of unchanged memory are the parent's"
    );
}

#[test]
fn identical_pages_are_referred_to_in_runs() {
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    // A buffer of equal pages (touched once each, as a bytearray filled by a stride): each
    // page of the second checkpoint could refer to any page of the first; the place after
    // the previous page's is chosen, so the restore copies one run, not one per page.
    let f = fixture();
    let first = images_dir(&f, "c1");
    let same: Vec<Vec<u8>> = (0..512).map(|_| page(3, 0)).collect();
    let bytes = write_pages(&first, "pages-1.img", &same);
    let mut index = PageIndex::default();
    split_pages(&first, &mut index, PS, &f.blobs).unwrap();
    let second = images_dir(&f, "c2");
    write_pages(&second, "pages-1.img", &same);
    let parent = [first.join("pages-1.pmap")];
    let mut index = PageIndex::of_maps(parent.iter().map(|p| p.as_path()), PS, &f.blobs);
    let m2 = split_pages(&second, &mut index, PS, &f.blobs).unwrap();
    assert_eq!(m2.new_pages, 0);
    let m = manifest_of(&second, Some(m2));
    let dest = f.root.join("restore");
    let stats = assemble(&m, &second, &f.blobs, &dest, false).unwrap();
    assert_eq!(fs::read(dest.join("pages-1.img")).unwrap(), bytes);
    assert_eq!(stats.runs, 1);
}

#[test]
fn a_missing_or_unlisted_pack_and_a_damaged_map_are_refused() {
    if system_page_size() != PS {
        eprintln!("skipped: the system's pages are not 4 KiB");
        return;
    }
    let f = fixture();
    let dir = images_dir(&f, "c1");
    write_pages(&dir, "pages-1.img", &[page(1, 0), page(1, 1)]);
    let mem = split_pages(&dir, &mut PageIndex::default(), PS, &f.blobs).unwrap();
    let dest = f.root.join("restore");
    // The manifest does not list the pack the map names.
    let unlisted = manifest_of(
        &dir,
        Some(MemoryImages {
            packs: vec![],
            ..mem.clone()
        }),
    );
    assert!(matches!(
        assemble(&unlisted, &dir, &f.blobs, &dest, false),
        Err(PageError::UnlistedPack { .. })
    ));
    // A map cut short.
    let listed = manifest_of(&dir, Some(mem.clone()));
    let map = dir.join("pages-1.pmap");
    let good = fs::read(&map).unwrap();
    fs::write(&map, &good[..good.len() - 1]).unwrap();
    assert!(matches!(
        assemble(&listed, &dir, &f.blobs, &dest, false),
        Err(PageError::Map { .. })
    ));
    fs::write(&map, &good).unwrap();
    // The pack collected.
    let pack = mem.pack_ids().next().unwrap();
    let (path, _) = f.blobs.pack_file(&pack).unwrap();
    fs::remove_file(path).unwrap();
    assert!(matches!(
        assemble(&listed, &dir, &f.blobs, &dest, false),
        Err(PageError::Blob(
            belayer_overlay::layer::BlobError::Missing { .. }
        ))
    ));
    // ... and the next checkpoint, whose parent's pack is gone, stores its pages again.
    let next = images_dir(&f, "c2");
    write_pages(&next, "pages-1.img", &[page(1, 0), page(1, 1)]);
    let mut index = PageIndex::of_maps([map.as_path()], PS, &f.blobs);
    assert!(index.is_empty());
    let again = split_pages(&next, &mut index, PS, &f.blobs).unwrap();
    assert_eq!(again.new_pages, 2);
}

#[test]
fn a_pages_file_that_is_not_whole_pages_is_kept() {
    let f = fixture();
    let dir = images_dir(&f, "c1");
    fs::write(dir.join("pages-1.img"), vec![1u8; 100]).unwrap();
    fs::write(dir.join("pages-x.img"), vec![1u8; 4096]).unwrap();
    let mem = split_pages(&dir, &mut PageIndex::default(), PS, &f.blobs).unwrap();
    assert_eq!(mem.pages, 0);
    assert!(dir.join("pages-1.img").is_file());
    assert!(
        dir.join("pages-x.img").is_file(),
        "not a CRIU pages file name"
    );
}

#[test]
fn pages_stems() {
    assert_eq!(pages_stem("pages-12.img"), Some("pages-12"));
    assert_eq!(pages_stem("pages-.img"), None);
    assert_eq!(pages_stem("pages-1.img.tmp"), None);
    assert_eq!(pages_stem("pagemap-1.img"), None);
    assert_eq!(pages_stem("pages-../1.img"), None);
}
