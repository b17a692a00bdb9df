//! Capture an overlay upper layer changed through a real overlay mount, install it into a
//! fresh upper directory, mount that over the same lower directory, and check that both
//! merged views (and both upper directories) have the same canonical digest.

mod common;

use std::ffi::OsStr;
use std::fs::{self, File, FileTimes};
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{chown, lchown, symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use belayer_overlay::{
    capture_upper, install_upper, is_mountpoint, tree_digest, tree_listing, InstallLimits,
    OverlayMount,
};
use common::{assert_same_tree, set_mtime};
use rustix::fs::{FileType, Mode, XattrFlags, CWD};

struct Layers {
    upper: PathBuf,
    work: PathBuf,
    merged: PathBuf,
}

fn layers(root: &Path, name: &str) -> Layers {
    let l = Layers {
        upper: root.join(format!("{name}-upper")),
        work: root.join(format!("{name}-work")),
        merged: root.join(format!("{name}-merged")),
    };
    for dir in [&l.upper, &l.work, &l.merged] {
        fs::create_dir(dir).unwrap();
    }
    l
}

fn build_lower(lower: &Path) {
    fs::create_dir(lower).unwrap();
    fs::write(lower.join("keep.txt"), b"keep").unwrap();
    fs::write(lower.join("gone.txt"), b"to be deleted").unwrap();
    fs::write(lower.join("gone2.txt"), b"also deleted").unwrap();
    fs::write(lower.join("rename_me.txt"), b"renamed content").unwrap();
    fs::write(lower.join("chmod_me"), b"#!/bin/sh\n").unwrap();
    fs::write(lower.join("xattr_me"), b"attrs").unwrap();
    fs::write(lower.join("append_me"), vec![7u8; 300_000]).unwrap();
    fs::create_dir_all(lower.join("olddir/sub")).unwrap();
    fs::write(lower.join("olddir/a"), b"old a").unwrap();
    fs::write(lower.join("olddir/sub/c"), b"old c").unwrap();
    fs::create_dir(lower.join("mixed")).unwrap();
    fs::write(lower.join("mixed/lower_file"), b"from lower").unwrap();
    fs::create_dir_all(lower.join("etc")).unwrap();
    fs::write(lower.join("etc/hosts"), b"127.0.0.1 localhost\n").unwrap();
}

fn setxattr(path: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(path, name, value, XattrFlags::empty()).unwrap();
}

/// Every kind of change the layer format must carry, made through the merged view.
fn change_through_merged(m: &Path) {
    // Whiteouts (overlayfs may hardlink them to one shared whiteout inode).
    fs::remove_file(m.join("gone.txt")).unwrap();
    fs::remove_file(m.join("gone2.txt")).unwrap();
    // Opaque directory: remove a lower directory, create one of the same name.
    fs::remove_dir_all(m.join("olddir")).unwrap();
    fs::create_dir(m.join("olddir")).unwrap();
    fs::write(m.join("olddir/new"), b"new content").unwrap();
    // Rename of a lower file (copy-up plus whiteout).
    fs::rename(m.join("rename_me.txt"), m.join("renamed.txt")).unwrap();
    // Hardlink pair, created in the upper layer.
    fs::write(m.join("hl1"), b"linked").unwrap();
    fs::hard_link(m.join("hl1"), m.join("hl2")).unwrap();
    // Symlinks: relative, dangling, absolute to a host file.
    symlink("keep.txt", m.join("link_ok")).unwrap();
    symlink("nowhere/missing", m.join("dangling")).unwrap();
    symlink("/etc/passwd", m.join("passwd_link")).unwrap();
    set_mtime(&m.join("passwd_link"), 1_600_000_000, 42);
    // user.* xattrs on a copied-up file, a new file, a new directory.
    setxattr(&m.join("xattr_me"), "user.origin", b"lower");
    fs::write(m.join("new_with_xattr"), b"x").unwrap();
    setxattr(&m.join("new_with_xattr"), "user.a", b"1");
    setxattr(
        &m.join("new_with_xattr"),
        "user.binary",
        &[0, 1, 2, 255, b'\n'],
    );
    setxattr(&m.join("new_with_xattr"), "user.with=equals", b"eq");
    fs::create_dir(m.join("xdir")).unwrap();
    setxattr(&m.join("xdir"), "user.dir", b"yes");
    // chmod with setuid.
    fs::set_permissions(m.join("chmod_me"), fs::Permissions::from_mode(0o4751)).unwrap();
    // Copy-up of a bigger file with an append.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(m.join("append_me"))
        .unwrap();
    f.write_all(b"tail").unwrap();
    drop(f);
    // Empty file and a file with a hole.
    File::create(m.join("empty")).unwrap();
    let mut holey = File::create(m.join("holey")).unwrap();
    holey.seek(SeekFrom::Start(10 << 20)).unwrap();
    holey.write_all(b"end").unwrap();
    holey.set_len((12 << 20) + 5).unwrap();
    drop(holey);
    // Owner, nanosecond mtime, pre-epoch mtime.
    fs::write(m.join("owned"), b"owned").unwrap();
    chown(m.join("owned"), Some(1234), Some(5678)).unwrap();
    lchown(m.join("dangling"), Some(4321), Some(8765)).unwrap();
    let when = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
    File::options()
        .write(true)
        .open(m.join("owned"))
        .unwrap()
        .set_times(FileTimes::new().set_modified(when))
        .unwrap();
    fs::write(m.join("ancient"), b"old").unwrap();
    set_mtime(&m.join("ancient"), -86_400 * 365, 250_000_000);
    // Sticky world-writable directory; read-only directory with content.
    fs::create_dir(m.join("tmpdir")).unwrap();
    fs::set_permissions(m.join("tmpdir"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::create_dir_all(m.join("ro/inner")).unwrap();
    fs::write(m.join("ro/inner/file"), b"inside read-only dirs").unwrap();
    fs::set_permissions(m.join("ro/inner"), fs::Permissions::from_mode(0o500)).unwrap();
    fs::set_permissions(m.join("ro"), fs::Permissions::from_mode(0o555)).unwrap();
    // A file added to a lower directory (merged, not opaque) and a changed lower file.
    fs::write(m.join("mixed/upper_file"), b"from upper").unwrap();
    fs::write(m.join("etc/hosts"), b"10.0.0.1 sandbox\n").unwrap();
    // Fifo.
    rustix::fs::mknodat(
        CWD,
        m.join("fifo"),
        FileType::Fifo,
        Mode::from_raw_mode(0o640),
        0,
    )
    .unwrap();
    // Long names: a 255-byte component, a path over 100 bytes, a non-UTF-8 name.
    fs::write(m.join("L".repeat(255)), b"long name").unwrap();
    let deep = m.join("deep").join("d".repeat(60)).join("e".repeat(60));
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("f".repeat(80)), b"deep").unwrap();
    symlink("t".repeat(300), m.join("long_target")).unwrap();
    fs::write(m.join(OsStr::from_bytes(b"caf\xe9")), b"latin-1 name").unwrap();
    // Root directory metadata.
    fs::set_permissions(m, fs::Permissions::from_mode(0o751)).unwrap();
}

#[test]
fn capture_install_and_remount_reproduce_the_merged_view() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let lower = root.join("lower");
    build_lower(&lower);

    let first = layers(root, "first");
    let mount1 = OverlayMount::mount(&lower, &first.upper, &first.work, &first.merged).unwrap();
    assert!(is_mountpoint(&first.merged).unwrap());
    change_through_merged(&first.merged);

    // What the upper layer now holds, as overlayfs made it.
    let wh = fs::symlink_metadata(first.upper.join("gone.txt")).unwrap();
    assert!(
        wh.file_type().is_char_device() && wh.rdev() == 0,
        "whiteout"
    );
    let opaque = rustix::fs::lgetxattr(
        first.upper.join("olddir"),
        "trusted.overlay.opaque",
        &mut [0u8; 8][..],
    );
    assert_eq!(opaque, Ok(1));

    // Capture while mounted, as the checkpoint does.
    let archive = root.join("upper.tar");
    let captured = capture_upper(&first.upper, &archive).unwrap();
    assert!(captured.entries > 30, "{captured:?}");
    assert_eq!(captured.bytes, fs::metadata(&archive).unwrap().len());
    assert!(captured.content_bytes > 12 << 20);

    let second = layers(root, "second");
    let installed = install_upper(&archive, &second.upper, &InstallLimits::default()).unwrap();
    assert_eq!(installed.entries, captured.entries);
    assert_eq!(installed.content_bytes, captured.content_bytes);

    // The installed upper is the same layer (overlay bookkeeping xattrs aside).
    assert_same_tree(&first.upper, &second.upper, &[]);
    let wh = fs::symlink_metadata(second.upper.join("gone.txt")).unwrap();
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
    let ino = |upper: &Path, name: &str| fs::symlink_metadata(upper.join(name)).unwrap().ino();
    assert_eq!(
        ino(&first.upper, "gone.txt") == ino(&first.upper, "gone2.txt"),
        ino(&second.upper, "gone.txt") == ino(&second.upper, "gone2.txt"),
        "whiteout sharing reproduced"
    );
    let mut value = [0u8; 8];
    let n = rustix::fs::lgetxattr(
        second.upper.join("olddir"),
        "trusted.overlay.opaque",
        &mut value[..],
    )
    .unwrap();
    assert_eq!(&value[..n], b"y");
    let ro = fs::symlink_metadata(second.upper.join("ro/inner")).unwrap();
    assert_eq!(ro.mode() & 0o7777, 0o500);
    assert_eq!(
        fs::read(second.upper.join("ro/inner/file")).unwrap(),
        b"inside read-only dirs"
    );

    let mount2 = OverlayMount::mount(&lower, &second.upper, &second.work, &second.merged).unwrap();
    assert_same_tree(&first.merged, &second.merged, &[]);

    // Spot checks through the restored merged view.
    let m = &second.merged;
    assert!(!m.join("gone.txt").exists());
    assert!(!m.join("gone2.txt").exists());
    assert!(!m.join("rename_me.txt").exists());
    assert_eq!(fs::read(m.join("renamed.txt")).unwrap(), b"renamed content");
    let mut olddir = common::names(&m.join("olddir"));
    olddir.sort();
    assert_eq!(olddir, ["new"], "opaque directory hides the lower content");
    assert_eq!(
        common::names(&m.join("mixed")),
        ["lower_file", "upper_file"]
    );
    assert_eq!(
        fs::read_link(m.join("passwd_link")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        fs::read_link(m.join("dangling")).unwrap(),
        Path::new("nowhere/missing")
    );
    let (h1, h2) = (
        fs::metadata(m.join("hl1")).unwrap(),
        fs::metadata(m.join("hl2")).unwrap(),
    );
    assert_eq!(h1.ino(), h2.ino(), "hardlink pair restored");
    let owned = fs::metadata(m.join("owned")).unwrap();
    assert_eq!(
        (owned.uid(), owned.gid(), owned.mtime_nsec()),
        (1234, 5678, 123_456_789)
    );
    assert_eq!(
        fs::metadata(m.join("chmod_me")).unwrap().mode() & 0o7777,
        0o4751
    );
    assert_eq!(fs::metadata(m.join("holey")).unwrap().len(), (12 << 20) + 5);
    assert!(fs::symlink_metadata(m.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(fs::symlink_metadata(m).unwrap().mode() & 0o7777, 0o751);

    // Digests see lower content through both mounts and react to a change in one of them.
    let before = tree_digest(m, &[]).unwrap();
    fs::write(m.join("keep.txt"), b"KEEP").unwrap();
    assert_ne!(tree_digest(m, &[]).unwrap(), before);
    assert_eq!(
        tree_listing(m, &[]).unwrap().len(),
        tree_listing(&first.merged, &[]).unwrap().len()
    );

    drop(mount2);
    assert!(!is_mountpoint(&second.merged).unwrap());
    let target = mount1.leak();
    assert!(is_mountpoint(&target).unwrap());
    assert!(belayer_overlay::unmount(&target).unwrap());
    assert!(!belayer_overlay::unmount(&target).unwrap());
}

#[test]
fn capture_is_deterministic_and_install_is_a_fixed_point() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let lower = root.join("lower");
    build_lower(&lower);
    let first = layers(root, "first");
    let mount = OverlayMount::mount(&lower, &first.upper, &first.work, &first.merged).unwrap();
    change_through_merged(&first.merged);
    drop(mount);
    let a = root.join("a.tar");
    capture_upper(&first.upper, &a).unwrap();
    let again = root.join("again");
    fs::create_dir(&again).unwrap();
    install_upper(&a, &again, &InstallLimits::default()).unwrap();
    assert_eq!(
        tree_listing(&first.upper, &[]).unwrap(),
        tree_listing(&again, &[]).unwrap()
    );
    // Two captures of the same (unmounted) layer are byte-identical.
    let (b, c) = (root.join("b.tar"), root.join("c.tar"));
    capture_upper(&again, &b).unwrap();
    capture_upper(&again, &c).unwrap();
    assert!(
        fs::read(&b).unwrap() == fs::read(&c).unwrap(),
        "captures differ"
    );
    // Installing the re-capture gives the same layer again.
    let third = root.join("third");
    fs::create_dir(&third).unwrap();
    install_upper(&b, &third, &InstallLimits::default()).unwrap();
    assert_same_tree(&again, &third, &[]);
}
