//! Round trips and hostile archives against the real file system (temporary directories): the
//! extractor never writes outside its destination, whatever the archive says.

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;

use rustix::fs::{Mode, OFlags};
use tar::{EntryType, Header};

use super::*;

/// A raw member: `name` written into the header as it is (no checks), with `kind`, `data` and
/// an optional link target.
fn raw(
    builder: &mut tar::Builder<Vec<u8>>,
    name: &[u8],
    kind: EntryType,
    data: &[u8],
    link: &[u8],
) {
    let mut h = Header::new_gnu();
    h.as_old_mut().name[..name.len()].copy_from_slice(name);
    h.as_old_mut().linkname[..link.len()].copy_from_slice(link);
    h.set_entry_type(kind);
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_cksum();
    builder.append(&h, data).unwrap();
}

fn archive(members: &[(&str, EntryType, &str, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, data, link) in members {
        raw(
            &mut b,
            name.as_bytes(),
            *kind,
            data.as_bytes(),
            link.as_bytes(),
        );
    }
    b.into_inner().unwrap()
}

fn open(dir: &Path) -> rustix::fd::OwnedFd {
    rustix::fs::open(dir, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap()
}

fn into(dir: &Path) -> Destination {
    Destination::Into(open(dir))
}

/// A host directory with a canary file, and the canary's content.
struct Canary {
    dir: tempfile::TempDir,
}

impl Canary {
    fn new() -> Canary {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("canary"), b"untouched").unwrap();
        Canary { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn assert_untouched(&self) {
        let names: Vec<_> = fs::read_dir(self.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            ["canary"],
            "something was created next to the canary"
        );
        assert_eq!(fs::read(self.path().join("canary")).unwrap(), b"untouched");
    }
}

#[test]
fn a_tree_round_trips_with_modes_times_symlinks_and_hard_links() {
    let src = tempfile::tempdir().unwrap();
    let top = src.path().join("top");
    fs::create_dir_all(top.join("sub/deeper")).unwrap();
    fs::write(top.join("a.txt"), b"alpha").unwrap();
    fs::write(top.join("sub/deeper/b.bin"), vec![7u8; 100_000]).unwrap();
    fs::set_permissions(top.join("a.txt"), fs::Permissions::from_mode(0o4751)).unwrap();
    fs::hard_link(top.join("a.txt"), top.join("sub/a-again")).unwrap();
    symlink("/etc/passwd", top.join("abs-link")).unwrap();
    symlink("../a.txt", top.join("sub/rel-link")).unwrap();
    rustix::fs::mknodat(
        open(&top).as_fd(),
        "fifo",
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let old = filetime(&top.join("a.txt"), 1_000_000_000);

    let source = resolve_source(
        rustix::fs::CWD,
        top.as_os_str().as_encoded_bytes(),
        Resolution::Host,
    )
    .unwrap();
    let mut tar = Vec::new();
    let packed = pack(&source, &mut tar).unwrap();
    assert_eq!(packed.skipped, 1, "the fifo is left out");
    assert_eq!(packed.bytes, 5 + 100_000);

    let out = tempfile::tempdir().unwrap();
    let dest = resolve_destination(
        rustix::fs::CWD,
        out.path().join("copy").as_os_str().as_encoded_bytes(),
        Resolution::Host,
        true,
    )
    .unwrap();
    let got = unpack(tar.as_slice(), &dest, true).unwrap();
    assert_eq!(got.bytes, packed.bytes);
    let copy = out.path().join("copy");
    assert_eq!(fs::read(copy.join("a.txt")).unwrap(), b"alpha");
    assert_eq!(
        fs::read(copy.join("sub/deeper/b.bin")).unwrap(),
        vec![7u8; 100_000]
    );
    let meta = fs::metadata(copy.join("a.txt")).unwrap();
    assert_eq!(
        meta.mode() & 0o7777,
        0o751,
        "set-user-ID dropped, the rest kept"
    );
    assert_eq!(meta.mtime(), old);
    assert_eq!(
        meta.ino(),
        fs::metadata(copy.join("sub/a-again")).unwrap().ino()
    );
    assert_eq!(
        fs::read_link(copy.join("abs-link")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        fs::read_link(copy.join("sub/rel-link")).unwrap(),
        Path::new("../a.txt")
    );
    assert!(!copy.join("fifo").exists());

    // Into an existing directory: under the source's own name; again: files are replaced.
    let got = unpack(tar.as_slice(), &into(out.path()), true).unwrap();
    assert_eq!(got.files, packed.files);
    assert_eq!(fs::read(out.path().join("top/a.txt")).unwrap(), b"alpha");
    unpack(tar.as_slice(), &into(out.path()), true).unwrap();
}

fn filetime(path: &Path, secs: i64) -> i64 {
    let t = rustix::fs::Timespec {
        tv_sec: secs,
        tv_nsec: 0,
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &rustix::fs::Timestamps {
            last_access: t,
            last_modification: t,
        },
        rustix::fs::AtFlags::empty(),
    )
    .unwrap();
    secs
}

#[test]
fn escaping_names_are_refused_before_anything_is_written() {
    let canary = Canary::new();
    let out = tempfile::tempdir().unwrap();
    let inside = out.path().join("in");
    fs::create_dir(&inside).unwrap();
    let up = format!("../../../../../../..{}/canary", canary.path().display());
    let abs = format!("{}/canary", canary.path().display());
    for name in [up.as_str(), abs.as_str(), "a/../../x", ".."] {
        let tar = archive(&[(name, EntryType::Regular, "pwned", "")]);
        let err = unpack(tar.as_slice(), &into(&inside), false).unwrap_err();
        assert!(
            matches!(err, TransferError::BadName { .. }),
            "{name}: {err:?}"
        );
        assert_eq!(err.class(), ErrorClass::Refused);
    }
    canary.assert_untouched();
    assert_eq!(fs::read_dir(&inside).unwrap().count(), 0);
}

#[test]
fn a_symlink_member_is_never_a_parent() {
    let canary = Canary::new();
    let out = tempfile::tempdir().unwrap();
    let target = canary.path().to_str().unwrap();
    let tar = archive(&[
        ("a", EntryType::Symlink, "", target),
        ("a/x", EntryType::Regular, "pwned", ""),
    ]);
    let err = unpack(tar.as_slice(), &into(out.path()), false).unwrap_err();
    assert!(matches!(err, TransferError::Parent { .. }), "{err:?}");
    canary.assert_untouched();
    // The link itself was created, as a link.
    assert_eq!(fs::read_link(out.path().join("a")).unwrap(), canary.path());
}

#[test]
fn existing_symlinks_in_the_destination_are_replaced_never_followed() {
    let canary = Canary::new();
    let out = tempfile::tempdir().unwrap();
    symlink(canary.path().join("canary"), out.path().join("f")).unwrap();
    symlink(canary.path(), out.path().join("d")).unwrap();
    let tar = archive(&[("f", EntryType::Regular, "new", "")]);
    unpack(tar.as_slice(), &into(out.path()), false).unwrap();
    assert_eq!(fs::read(out.path().join("f")).unwrap(), b"new");
    assert!(!fs::symlink_metadata(out.path().join("f"))
        .unwrap()
        .is_symlink());
    // A directory member at a symlink's name replaces the link; its children follow it.
    let tar = archive(&[
        ("d/", EntryType::Directory, "", ""),
        ("d/canary", EntryType::Regular, "pwned", ""),
    ]);
    unpack(tar.as_slice(), &into(out.path()), false).unwrap();
    assert!(fs::symlink_metadata(out.path().join("d")).unwrap().is_dir());
    // A parent that is a pre-existing symlink is refused.
    symlink(canary.path(), out.path().join("e")).unwrap();
    let tar = archive(&[("e/canary", EntryType::Regular, "pwned", "")]);
    assert!(matches!(
        unpack(tar.as_slice(), &into(out.path()), false),
        Err(TransferError::Parent { .. })
    ));
    canary.assert_untouched();
}

#[test]
fn hard_links_must_name_a_file_of_the_archive() {
    let canary = Canary::new();
    let out = tempfile::tempdir().unwrap();
    let abs = format!("{}/canary", canary.path().display());
    for target in [abs.as_str(), "../canary", "never-extracted"] {
        let tar = archive(&[("t/link", EntryType::Link, "", target)]);
        let err = unpack(tar.as_slice(), &into(out.path()), false).unwrap_err();
        assert!(
            matches!(err, TransferError::HardLinkTarget { .. }),
            "{target}: {err:?}"
        );
    }
    let tar = archive(&[
        ("t/f", EntryType::Regular, "data", ""),
        ("t/g", EntryType::Link, "", "t/f"),
        ("t/g", EntryType::Regular, "over", ""),
    ]);
    unpack(tar.as_slice(), &into(out.path()), false).unwrap();
    assert_eq!(
        fs::read(out.path().join("t/f")).unwrap(),
        b"data",
        "replaced, not written through"
    );
    assert_eq!(fs::read(out.path().join("t/g")).unwrap(), b"over");
    canary.assert_untouched();
}

#[test]
fn devices_and_fifos_are_refused() {
    let out = tempfile::tempdir().unwrap();
    for (kind, name) in [
        (EntryType::Char, "character device"),
        (EntryType::Block, "block device"),
        (EntryType::Fifo, "fifo"),
    ] {
        let tar = archive(&[("dev", kind, "", "")]);
        match unpack(tar.as_slice(), &into(out.path()), false) {
            Err(TransferError::SpecialMember { kind, .. }) => assert_eq!(kind, name),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(fs::read_dir(out.path()).unwrap().count(), 0);
}

#[test]
fn a_single_tree_stays_under_its_top_and_is_renamed() {
    let canary = Canary::new();
    let parent = canary.path();
    let tar = archive(&[
        ("top/", EntryType::Directory, "", ""),
        ("top/x", EntryType::Regular, "x", ""),
        ("other", EntryType::Regular, "pwned", ""),
    ]);
    let dest = Destination::Rename {
        parent: open(parent),
        name: b"renamed".to_vec(),
    };
    let err = unpack(tar.as_slice(), &dest, true).unwrap_err();
    assert!(matches!(err, TransferError::OutsideTree { .. }), "{err:?}");
    assert_eq!(fs::read(parent.join("renamed/x")).unwrap(), b"x");
    assert!(!parent.join("other").exists() && !parent.join("top").exists());
}

#[test]
fn a_directory_is_never_replaced_by_a_file() {
    let out = tempfile::tempdir().unwrap();
    fs::create_dir(out.path().join("d")).unwrap();
    fs::write(out.path().join("d/keep"), b"k").unwrap();
    let tar = archive(&[("d", EntryType::Regular, "x", "")]);
    assert!(matches!(
        unpack(tar.as_slice(), &into(out.path()), false),
        Err(TransferError::DirectoryInTheWay { .. })
    ));
    assert_eq!(fs::read(out.path().join("d/keep")).unwrap(), b"k");
}

#[test]
fn a_truncated_stream_is_an_error() {
    let tar = archive(&[("f", EntryType::Regular, &"y".repeat(5000), "")]);
    let out = tempfile::tempdir().unwrap();
    let err = unpack(&tar[..2048], &into(out.path()), false).unwrap_err();
    assert!(matches!(err, TransferError::ReadArchive { .. }), "{err:?}");
}

#[test]
fn a_file_that_shrinks_or_grows_while_packed_keeps_the_stream_well_formed() {
    // The size is taken at open: a file truncated by then reads short and is padded.
    let src = tempfile::tempdir().unwrap();
    let f = src.path().join("f");
    fs::write(&f, vec![1u8; 10_000]).unwrap();
    let fd = fs::File::open(&f).unwrap();
    let st = rustix::fs::fstat(&fd).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(100)
        .unwrap();
    let mut packer = crate::pack::Packer::new(Vec::new());
    packer.file(fd.into(), &st, b"f").unwrap();
    let (tar, summary) = packer.finish().unwrap();
    assert_eq!(summary.changed, 1);
    let mut a = tar::Archive::new(tar.as_slice());
    let mut e = a.entries().unwrap().next().unwrap().unwrap();
    let mut data = Vec::new();
    std::io::Read::read_to_end(&mut e, &mut data).unwrap();
    assert_eq!(data.len(), 10_000);
    assert!(data[..100].iter().all(|b| *b == 1) && data[100..].iter().all(|b| *b == 0));
}

#[test]
fn a_download_stream_may_only_hold_the_requested_tree() {
    // A forged stream for the source `out` whose member is the neighbour `canary` of an
    // existing destination directory is refused; the neighbour stays.
    let out = tempfile::tempdir().unwrap();
    fs::write(out.path().join("canary"), b"untouched").unwrap();
    let tar = archive(&[("canary", EntryType::Regular, "PWNED", "")]);
    let err = crate::unpack_tree(&tar[..], &into(out.path()), b"out").unwrap_err();
    assert!(matches!(err, TransferError::OutsideTree { .. }), "{err:?}");
    assert_eq!(fs::read(out.path().join("canary")).unwrap(), b"untouched");
    let tar = archive(&[("out", EntryType::Regular, "data", "")]);
    crate::unpack_tree(&tar[..], &into(out.path()), b"out").unwrap();
    assert_eq!(fs::read(out.path().join("out")).unwrap(), b"data");
}

#[test]
fn runs_of_zeros_are_extracted_as_holes() {
    // 16 MiB of zeros, then a byte: the file reads back the same and takes (almost) no space.
    let mut data = vec![0u8; 16 << 20];
    data.push(7);
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    b.append_data(&mut h, "sparse", &data[..]).unwrap();
    let tar = b.into_inner().unwrap();
    let out = tempfile::tempdir().unwrap();
    unpack(&tar[..], &into(out.path()), false).unwrap();
    let got = out.path().join("sparse");
    assert_eq!(fs::read(&got).unwrap(), data);
    let st = rustix::fs::stat(&got).unwrap();
    assert!(
        (st.st_blocks as u64) * 512 < 1 << 20,
        "{} blocks",
        st.st_blocks
    );
    // All zeros to the end: the length comes from the truncate.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1 << 20);
    h.set_mode(0o644);
    b.append_data(&mut h, "zeros", &vec![0u8; 1 << 20][..])
        .unwrap();
    let tar = b.into_inner().unwrap();
    unpack(&tar[..], &into(out.path()), false).unwrap();
    assert_eq!(
        fs::metadata(out.path().join("zeros")).unwrap().len(),
        1 << 20
    );
}
