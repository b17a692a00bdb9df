//! Image layers: OCI whiteouts and opaque markers unpacked by `install_oci_layer` and seen
//! through real overlay mounts (writable, idmapped, read-only), the tar semantics of
//! repeated names, and a large layer. Needs root (whiteouts, `trusted.*` attributes,
//! mounts).

mod oci_common;

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Instant;

use belayer_overlay::{InstallError, LayerStats, MountOptions, OverlayMount};
use oci_common::{listing, names, unpack, userns_fd, xattr, Layer, Scratch};

fn base_layer() -> Vec<u8> {
    Layer::new()
        .root()
        .dir("etc/")
        .file("etc/passwd", b"root")
        .file("etc/motd", b"hello")
        .file("etc/gone", b"bye")
        .dir("usr/")
        .dir("usr/lib/")
        .file("usr/lib/libc.so", b"libc")
        .dir("usr/bin/")
        .file("usr/bin/sh", b"sh")
        .hardlink("usr/bin/bash", "usr/bin/sh")
        .symlink("lib", "usr/lib")
        .dir("var/")
        .dir("var/cache/")
        .file("var/cache/a", b"a")
        .dir("opt/")
        .file("opt/old", b"old")
        .dir("opt/sub/")
        .file("opt/sub/deep", b"deep")
        .finish()
}

fn change_layer() -> Vec<u8> {
    Layer::new()
        .dir("etc/")
        .file("etc/.wh.gone", b"")
        .file("etc/motd", b"changed")
        .file(".wh.var", b"")
        .dir("opt/")
        .file("opt/.wh..wh..opq", b"")
        .file("opt/new", b"new")
        .dir(".wh..wh.plnk/")
        .file(".wh..wh.plnk/1234.5678", b"aufs")
        .finish()
}

fn readd_layer() -> Vec<u8> {
    Layer::new()
        .dir("var/")
        .file("var/fresh", b"fresh")
        .dir("etc/")
        .file("etc/gone", b"again")
        .finish()
}

const MERGED: &[&str] = &[
    "etc/",
    "etc/gone=again",
    "etc/motd=changed",
    "etc/passwd=root",
    "lib -> usr/lib",
    "opt/",
    "opt/new=new",
    "usr/",
    "usr/bin/",
    "usr/bin/bash=sh",
    "usr/bin/sh=sh",
    "usr/lib/",
    "usr/lib/libc.so=libc",
    "var/",
    "var/fresh=fresh",
];

fn assert_read_only(merged: &Path) {
    let err = fs::write(merged.join("etc/new"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
}

#[test]
fn layers_merge_through_real_overlay_mounts() {
    let tmp = tempfile::tempdir().unwrap();
    let r = tmp.path();
    for d in [
        "l1", "l2", "l3", "upper", "work", "upper2", "work2", "merged",
    ] {
        fs::create_dir(r.join(d)).unwrap();
    }
    let (l1, l2, l3) = (r.join("l1"), r.join("l2"), r.join("l3"));
    let s1 = unpack(&base_layer(), &l1).unwrap();
    assert_eq!(s1.whiteouts + s1.opaque_dirs + s1.skipped_aufs, 0);
    assert_eq!(s1.entries, 19);
    let s2 = unpack(&change_layer(), &l2).unwrap();
    assert_eq!(
        s2,
        LayerStats {
            entries: 6,
            content_bytes: 10,
            whiteouts: 2,
            opaque_dirs: 1,
            skipped_aufs: 2,
        }
    );
    unpack(&readd_layer(), &l3).unwrap();

    // On disk: overlayfs's own whiteouts and opaque directories, no `.wh.` name left.
    assert_eq!(
        listing(&l2),
        [
            "etc/",
            "etc/gone c 0:0",
            "etc/motd=changed",
            "opt/",
            "opt/new=new",
            "var c 0:0"
        ]
    );
    for whiteout in [l2.join("etc/gone"), l2.join("var")] {
        let meta = fs::symlink_metadata(&whiteout).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o7777), (0, 0, 0));
    }
    assert_eq!(
        xattr(&l2.join("opt"), "trusted.overlay.opaque").unwrap(),
        b"y"
    );
    assert_eq!(xattr(&l2.join("etc"), "trusted.overlay.opaque"), None);
    let sh = fs::metadata(l1.join("usr/bin/sh")).unwrap();
    assert_eq!(sh.nlink(), 2);
    assert_eq!(
        fs::metadata(l1.join("usr/bin/bash")).unwrap().ino(),
        sh.ino()
    );

    let lowers = [l3.as_path(), l2.as_path(), l1.as_path()];
    let merged = r.join("merged");
    let mount =
        OverlayMount::mount_layers(&lowers, &r.join("upper"), &r.join("work"), &merged).unwrap();
    assert_eq!(listing(&merged), MERGED);
    assert_eq!(fs::read(merged.join("lib/libc.so")).unwrap(), b"libc");
    drop(mount);

    // Idmapped lower layers: the same tree, owned by the namespace's root.
    let userns = userns_fd();
    let opts = MountOptions {
        idmap: Some(userns.as_fd()),
        ..MountOptions::default()
    };
    let mount =
        OverlayMount::mount_with(&lowers, &r.join("upper2"), &r.join("work2"), &merged, &opts)
            .unwrap();
    assert_eq!(listing(&merged), MERGED);
    assert_eq!(
        fs::metadata(merged.join("etc/passwd")).unwrap().uid(),
        100_000
    );
    drop(mount);

    // Read-only: the same merged view, nothing writable.
    let mount = OverlayMount::mount_lowers_readonly(&lowers, &merged).unwrap();
    assert_eq!(listing(&merged), MERGED);
    assert_read_only(&merged);
    mount.unmount().unwrap();

    // Two layers, and one alone (bind-mounted: whiteouts show as what they are).
    let mount = OverlayMount::mount_lowers_readonly(&[&l2, &l1], &merged).unwrap();
    assert_eq!(
        listing(&merged),
        [
            "etc/",
            "etc/motd=changed",
            "etc/passwd=root",
            "lib -> usr/lib",
            "opt/",
            "opt/new=new",
            "usr/",
            "usr/bin/",
            "usr/bin/bash=sh",
            "usr/bin/sh=sh",
            "usr/lib/",
            "usr/lib/libc.so=libc",
        ]
    );
    drop(mount);
    let mount = OverlayMount::mount_lowers_readonly(&[&l2], &merged).unwrap();
    assert_eq!(listing(&merged), listing(&l2));
    assert_read_only(&merged);
    drop(mount);
    assert!(names(&merged).is_empty(), "mounts detached");
}

#[test]
fn repeated_names_replace_without_writing_through() {
    let s = Scratch::new();
    let canary_file = format!("{}/keep", s.canary());
    let layer = Layer::new()
        .root()
        .file("f", b"one")
        .hardlink("g", "f")
        .file("f", b"two")
        .symlink("s", &canary_file)
        .file("s", b"mine")
        .dir_mode("d/", 0o700)
        .file("d/x", b"x")
        .dir_mode("d/", 0o750)
        .dir("e/")
        .file("e", b"now a file")
        .file("h", b"file")
        .dir("h/")
        .symlink("l", "/")
        .dir("l/")
        .file("l/inside", b"inside")
        .symlink("t", "f")
        .symlink("t", "g")
        .root()
        .finish();
    let stats = s.unpack(layer).unwrap();
    assert_eq!(stats.entries, 19);
    assert_eq!(
        listing(&s.target),
        [
            "d/",
            "d/x=x",
            "e=now a file",
            "f=two",
            "g=one",
            "h/",
            "l/",
            "l/inside=inside",
            "s=mine",
            "t -> g"
        ]
    );
    let mode = |p: &str| fs::symlink_metadata(s.target.join(p)).unwrap().mode() & 0o7777;
    assert_eq!(
        mode("d"),
        0o750,
        "the later directory member's mode applies"
    );
    assert_ne!(
        fs::metadata(s.target.join("f")).unwrap().ino(),
        fs::metadata(s.target.join("g")).unwrap().ino()
    );

    // A non-directory over a directory with entries is refused.
    let s = Scratch::new();
    let layer = Layer::new()
        .dir("k/")
        .file("k/c", b"c")
        .file("k", b"x")
        .finish();
    match s.unpack(layer).unwrap_err() {
        InstallError::ReplacesDirectory { path } => assert_eq!(path, Path::new("k")),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn missing_parents_are_created_and_merged_later() {
    let s = Scratch::new();
    let layer = Layer::new()
        .file("deep/er/file", b"f")
        .file("gone/.wh.x", b"")
        .file("new/.wh..wh..opq", b"")
        .dir_mode("deep/", 0o700)
        .dir_mode("new/", 0o711)
        .finish();
    let stats = s.unpack(layer).unwrap();
    assert_eq!((stats.whiteouts, stats.opaque_dirs), (1, 1));
    assert_eq!(
        listing(&s.target),
        [
            "deep/",
            "deep/er/",
            "deep/er/file=f",
            "gone/",
            "gone/x c 0:0",
            "new/"
        ]
    );
    let meta = |p: &str| fs::symlink_metadata(s.target.join(p)).unwrap();
    assert_eq!(meta("deep").mode() & 0o7777, 0o700);
    assert_eq!(meta("deep/er").mode() & 0o7777, 0o755);
    assert_eq!(
        (meta("gone").uid(), meta("gone").mode() & 0o7777),
        (0, 0o755)
    );
    assert_eq!(meta("new").mode() & 0o7777, 0o711);
    assert_eq!(
        xattr(&s.target.join("new"), "trusted.overlay.opaque").unwrap(),
        b"y"
    );
    // Opaque at the layer root, and on a directory listed before the marker.
    let s = Scratch::new();
    let layer = Layer::new()
        .dir("a/")
        .file("a/.wh..wh..opq", b"")
        .file(".wh..wh..opq", b"")
        .finish();
    s.unpack(layer).unwrap();
    assert_eq!(xattr(&s.target, "trusted.overlay.opaque").unwrap(), b"y");
    assert_eq!(
        xattr(&s.target.join("a"), "trusted.overlay.opaque").unwrap(),
        b"y"
    );
    assert_eq!(
        fs::metadata(s.target.join("a"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
}

#[test]
fn a_layer_of_100_000_entries_unpacks() {
    let mut layer = Layer::new().root();
    for d in 0..1000 {
        layer = layer.dir(&format!("d{d:04}/"));
        for f in 0..99 {
            layer = layer.file(&format!("d{d:04}/f{f:02}"), b"x");
        }
    }
    let layer = layer.finish();
    let layer2 = layer.clone();
    let s = Scratch::new();
    let started = Instant::now();
    let stats = s.unpack(layer).unwrap();
    println!(
        "unpacked a layer of {} entries in {:?}",
        stats.entries,
        started.elapsed()
    );
    assert_eq!(stats.entries, 100_001);
    if std::env::var_os("CMP").is_some() {
        let t = tempfile::tempdir().unwrap();
        let started = Instant::now();
        belayer_overlay::install_image(&layer2[..], Path::new("x"), t.path(), &Default::default())
            .unwrap();
        println!("install_image {:?}", started.elapsed());
    }
    assert_eq!(stats.content_bytes, 99_000);
}
