//! Images: a directory streamed by `archive_tree` through a pipe and unpacked by
//! `install_image`, hostile streams, and the device-node rules of a flat image. Needs root
//! (device nodes, owners, `trusted.*` attributes).

mod common;

use std::fs::{self, File};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use belayer_overlay::{
    archive_tree, install_image, tree_digest, CaptureError, ImageOptions, InstallError,
    InstallLimits,
};
use common::assert_same_tree;
use rustix::fs::{FileType, Mode, CWD};

fn open_dir(path: &Path) -> OwnedFd {
    OwnedFd::from(File::open(path).unwrap())
}

fn mknod(path: &Path, kind: FileType, major: u32, minor: u32) {
    rustix::fs::mknodat(
        CWD,
        path,
        kind,
        Mode::from_raw_mode(0o644),
        rustix::fs::makedev(major, minor),
    )
    .unwrap();
}

/// Streams `src` through a pipe (a writer thread, like the daemon's child) into `target`.
fn stream_into(src: &Path, target: &Path) -> Result<belayer_overlay::ImageStats, InstallError> {
    let (rd, wr) = rustix::pipe::pipe().unwrap();
    let dir = open_dir(src);
    let label = src.to_path_buf();
    let writer = std::thread::spawn(move || {
        let out = std::io::BufWriter::new(File::from(wr));
        archive_tree(dir.as_fd(), &label, out, &InstallLimits::default())
    });
    let result = install_image(
        File::from(rd),
        Path::new("pipe"),
        target,
        &ImageOptions::default(),
    );
    // The writer fails with EPIPE when the installer stopped early: that is expected then.
    let written = writer.join().unwrap();
    if result.is_ok() {
        written.unwrap();
    }
    result
}

fn fresh(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    fs::create_dir(&p).unwrap();
    p
}

#[test]
fn a_tree_streams_through_a_pipe_and_comes_back_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fresh(tmp.path(), "src");
    fs::create_dir_all(src.join("usr/bin")).unwrap();
    fs::write(src.join("usr/bin/busybox"), vec![7u8; 300_000]).unwrap();
    symlink("usr/bin", src.join("bin")).unwrap();
    symlink("busybox", src.join("usr/bin/sh")).unwrap();
    fs::hard_link(src.join("usr/bin/busybox"), src.join("usr/bin/ls")).unwrap();
    fs::write(src.join("setuid"), b"x").unwrap();
    fs::set_permissions(src.join("setuid"), fs::Permissions::from_mode(0o4755)).unwrap();
    rustix::fs::chown(
        src.join("setuid").as_path(),
        Some(rustix::process::Uid::from_raw(1234)),
        Some(rustix::process::Gid::from_raw(5678)),
    )
    .unwrap();
    rustix::fs::setxattr(
        src.join("setuid").as_path(),
        "user.note",
        b"kept",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    let long = "n".repeat(200);
    fs::write(src.join(&long), b"long name").unwrap();
    rustix::fs::mknodat(
        CWD,
        src.join("fifo").as_path(),
        FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let _sock = std::os::unix::net::UnixListener::bind(src.join("sock")).unwrap();

    let target = fresh(tmp.path(), "target");
    let stats = stream_into(&src, &target).unwrap();
    assert_eq!(stats.dropped_devices, 0);
    assert_eq!(stats.content_bytes, 300_000 + 1 + 9);
    fs::remove_file(src.join("sock")).unwrap();
    assert_same_tree(&src, &target, &[]);
    assert_eq!(
        fs::metadata(target.join("usr/bin/ls")).unwrap().ino(),
        fs::metadata(target.join("usr/bin/busybox")).unwrap().ino(),
        "hardlinks stay hardlinks"
    );
}

#[test]
fn device_nodes_under_dev_are_dropped_and_refused_elsewhere() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fresh(tmp.path(), "src");
    fs::create_dir_all(src.join("dev/pts")).unwrap();
    mknod(&src.join("dev/null"), FileType::CharacterDevice, 1, 3);
    mknod(&src.join("dev/sda"), FileType::BlockDevice, 8, 0);
    mknod(&src.join("dev/pts/ptmx"), FileType::CharacterDevice, 5, 2);
    // A hardlink to a dropped node, outside /dev: a device node all the same.
    fs::create_dir(src.join("e")).unwrap();
    symlink("/proc/self/fd", src.join("dev/fd")).unwrap();
    fs::write(src.join("e/file"), b"data").unwrap();

    let target = fresh(tmp.path(), "ok");
    let stats = stream_into(&src, &target).unwrap();
    assert_eq!(stats.dropped_devices, 3);
    assert!(target.join("dev/pts").is_dir(), "directories of /dev stay");
    assert_eq!(
        fs::read_link(target.join("dev/fd")).unwrap(),
        Path::new("/proc/self/fd")
    );
    assert!(fs::symlink_metadata(target.join("dev/null")).is_err());
    assert!(fs::symlink_metadata(target.join("dev/sda")).is_err());

    fs::hard_link(src.join("dev/sda"), src.join("e/disk")).unwrap();
    let target = fresh(tmp.path(), "linked");
    match stream_into(&src, &target) {
        Err(InstallError::DeviceInImage {
            path, kind, major, ..
        }) => {
            assert_eq!(path, Path::new("e/disk"));
            assert_eq!((kind, major), ("block", 8));
        }
        other => panic!("{other:?}"),
    }
    fs::remove_file(src.join("e/disk")).unwrap();

    fs::create_dir(src.join("root")).unwrap();
    mknod(&src.join("root/sda"), FileType::BlockDevice, 8, 0);
    let target = fresh(tmp.path(), "refused");
    let err = stream_into(&src, &target).unwrap_err();
    match &err {
        InstallError::DeviceInImage {
            path,
            kind,
            major,
            minor,
            ..
        } => {
            assert_eq!(path, Path::new("root/sda"));
            assert_eq!((*kind, *major, *minor), ("block", 8, 0));
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("root/sda"), "{err}");
    assert!(fs::symlink_metadata(target.join("root/sda")).is_err());
}

#[test]
fn whiteouts_and_overlay_attributes_are_refused_in_an_image() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fresh(tmp.path(), "src");
    fs::create_dir(src.join("etc")).unwrap();
    mknod(&src.join("etc/gone"), FileType::CharacterDevice, 0, 0);
    let target = fresh(tmp.path(), "a");
    match stream_into(&src, &target) {
        Err(InstallError::WhiteoutInImage { path }) => assert_eq!(path, Path::new("etc/gone")),
        other => panic!("{other:?}"),
    }
    fs::remove_file(src.join("etc/gone")).unwrap();
    rustix::fs::setxattr(
        src.join("etc").as_path(),
        "trusted.overlay.opaque",
        b"y",
        rustix::fs::XattrFlags::empty(),
    )
    .unwrap();
    let target = fresh(tmp.path(), "b");
    match stream_into(&src, &target) {
        Err(InstallError::ForbiddenXattr { path, name, .. }) => {
            assert_eq!(path, Path::new("etc/"));
            assert_eq!(name, "trusted.overlay.opaque");
        }
        other => panic!("{other:?}"),
    }
}

/// A tar stream built by hand: `(name, type, content, link)` members.
fn hand_tar(members: &[(&str, tar::EntryType, &[u8], &str)], end_marker: bool) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, content, link) in members {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o755);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(content.len() as u64);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        if !link.is_empty() {
            h.set_link_name(link).unwrap();
        }
        h.set_cksum();
        b.append(&h, *content).unwrap();
    }
    if !end_marker {
        return b.get_ref().clone();
    }
    // `into_inner` finishes the archive: two zero blocks.
    b.into_inner().unwrap()
}

fn install_bytes(bytes: &[u8], target: &Path) -> Result<(), InstallError> {
    install_image(bytes, Path::new("t.tar"), target, &ImageOptions::default()).map(|_| ())
}

#[test]
fn hostile_streams_never_write_outside_the_target() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let tmp = tempfile::tempdir().unwrap();
    let outside = fresh(tmp.path(), "outside");

    let target = fresh(tmp.path(), "dotdot");
    let bytes = hand_tar(&[("../outside/pwned", Regular, b"x", "")], true);
    assert!(matches!(
        install_bytes(&bytes, &target),
        Err(InstallError::InvalidName { .. })
    ));

    let target = fresh(tmp.path(), "symlinked-parent");
    let link = outside.display().to_string();
    let bytes = hand_tar(
        &[
            ("evil", Symlink, b"", &link),
            ("evil/pwned", Regular, b"x", ""),
        ],
        true,
    );
    let err = install_bytes(&bytes, &target).unwrap_err();
    assert!(matches!(err, InstallError::ResolveParent { .. }), "{err:?}");
    assert!(!outside.join("pwned").exists());

    let target = fresh(tmp.path(), "hardlink-out");
    let bytes = hand_tar(
        &[("h", tar::EntryType::Link, b"", "../../etc/shadow")],
        true,
    );
    assert!(matches!(
        install_bytes(&bytes, &target),
        Err(InstallError::InvalidLinkTarget { .. })
    ));

    let target = fresh(tmp.path(), "no-end");
    let bytes = hand_tar(
        &[("d/", Directory, b"", ""), ("d/f", Regular, b"x", "")],
        false,
    );
    assert!(matches!(
        install_bytes(&bytes, &target),
        Err(InstallError::MissingEndOfArchive { .. })
    ));

    let target = fresh(tmp.path(), "cut");
    let mut bytes = hand_tar(&[("f", Regular, &[1u8; 4096], "")], false);
    bytes.truncate(512 + 1000);
    assert!(matches!(
        install_bytes(&bytes, &target),
        Err(InstallError::ArchiveTruncated { .. }) | Err(InstallError::ReadArchive { .. })
    ));

    assert_eq!(fs::read_dir(&outside).unwrap().count(), 0);
}

#[test]
fn archives_made_by_other_tools_install() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fresh(tmp.path(), "src");
    fs::create_dir_all(src.join("bin")).unwrap();
    fs::write(src.join("bin/busybox"), b"#!busybox").unwrap();
    symlink("busybox", src.join("bin/sh")).unwrap();
    fs::hard_link(src.join("bin/busybox"), src.join("bin/ls")).unwrap();

    // The tar crate's own path-based builder (what the old import test used).
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", &src).unwrap();
    let bytes = b.into_inner().unwrap();
    let target = fresh(tmp.path(), "tar-crate");
    install_bytes(&bytes, &target).unwrap();
    assert_eq!(fs::read(target.join("bin/ls")).unwrap(), b"#!busybox");

    // GNU tar, as a user makes an image archive.
    let out = std::process::Command::new("tar")
        .arg("-C")
        .arg(&src)
        .args(["--xattrs", "-cf", "-", "."])
        .output()
        .unwrap();
    assert!(out.status.success());
    let target = fresh(tmp.path(), "gnu-tar");
    install_bytes(&out.stdout, &target).unwrap();
    assert_same_tree(&src, &target, &[]);
}

#[test]
fn archive_tree_reads_with_the_callers_rights_only_through_the_fd() {
    // An fd opened O_PATH still lists only what this process may read, and a symlinked
    // root is never followed by the walk itself.
    let tmp = tempfile::tempdir().unwrap();
    let src = fresh(tmp.path(), "src");
    fs::write(src.join("f"), b"x").unwrap();
    let path_fd = rustix::fs::open(
        src.as_path(),
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
        Mode::empty(),
    )
    .unwrap();
    let mut out = Vec::new();
    let stats = archive_tree(
        path_fd.as_fd(),
        Path::new("src"),
        &mut out,
        &InstallLimits::default(),
    )
    .unwrap();
    assert_eq!(stats.entries, 2);
    assert_eq!(stats.bytes, out.len() as u64);
    let target = fresh(tmp.path(), "target");
    install_bytes(&out, &target).unwrap();
    assert_eq!(
        tree_digest(&src, &[]).unwrap(),
        tree_digest(&target, &[]).unwrap()
    );

    // Writing into a closed pipe is a typed error, not a signal.
    let (rd, wr) = rustix::pipe::pipe().unwrap();
    drop(rd);
    let big = fresh(tmp.path(), "big");
    fs::write(big.join("data"), vec![0u8; 1 << 20]).unwrap();
    let err = archive_tree(
        open_dir(&big).as_fd(),
        Path::new("big"),
        File::from(wr),
        &InstallLimits::default(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            CaptureError::WriteArchive { .. } | CaptureError::CopyContent { .. }
        ),
        "{err}"
    );
}
