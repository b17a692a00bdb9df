//! The tree digest changes with every attribute it covers and with nothing else.

mod common;

use std::fs;
use std::os::unix::fs::{lchown, symlink, PermissionsExt};
use std::path::Path;

use belayer_overlay::{first_difference, tree_digest, tree_listing};
use common::set_mtime;
use rustix::fs::XattrFlags;

fn build(root: &Path) {
    fs::create_dir_all(root.join("dir/sub")).unwrap();
    fs::write(root.join("dir/file"), b"content").unwrap();
    fs::write(root.join("dir/sub/deep"), b"deep").unwrap();
    fs::write(root.join("a"), b"alpha").unwrap();
    fs::hard_link(root.join("a"), root.join("a_link")).unwrap();
    fs::write(root.join("b"), b"alpha").unwrap();
    symlink("target-one", root.join("sym")).unwrap();
    fs::create_dir(root.join("proc")).unwrap();
    fs::write(root.join("proc/ignored"), b"x").unwrap();
    for p in ["dir/file", "dir/sub/deep", "a", "b", "sym", "proc/ignored"] {
        set_mtime(&root.join(p), 1_650_000_000, 5);
    }
}

fn setxattr(path: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(path, name, value, XattrFlags::empty()).unwrap();
}

/// Applies `change` to a fresh tree and returns (digest before, digest after, first
/// differing listing line after).
fn digest_change(change: impl FnOnce(&Path)) -> (String, String, Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("t");
    build(&root);
    let before = tree_digest(&root, &["proc"]).unwrap();
    let listing_before = tree_listing(&root, &["proc"]).unwrap();
    assert_eq!(tree_digest(&root, &["proc"]).unwrap(), before, "stable");
    change(&root);
    let after = tree_digest(&root, &["proc"]).unwrap();
    let listing_after = tree_listing(&root, &["proc"]).unwrap();
    let diff = first_difference(&listing_before, &listing_after)
        .map(|(_, _, r)| r.unwrap_or("").to_owned());
    (before, after, diff)
}

fn assert_changes(what: &str, change: impl FnOnce(&Path), line_contains: &str) {
    let (before, after, diff) = digest_change(change);
    assert_ne!(before, after, "{what}: digest unchanged");
    let diff = diff.unwrap_or_default();
    assert!(
        diff.contains(line_contains),
        "{what}: first difference {diff:?}"
    );
}

fn assert_unchanged(what: &str, change: impl FnOnce(&Path)) {
    let (before, after, diff) = digest_change(change);
    assert_eq!(
        before, after,
        "{what}: digest changed, first difference {diff:?}"
    );
}

#[test]
fn one_byte_changes_the_digest() {
    assert_changes(
        "byte",
        |r| {
            fs::write(r.join("dir/file"), b"Content").unwrap();
            set_mtime(&r.join("dir/file"), 1_650_000_000, 5);
        },
        "dir/file f",
    );
}

#[test]
fn one_mode_bit_changes_the_digest() {
    assert_changes(
        "mode",
        |r| {
            let mode = fs::metadata(r.join("dir/sub/deep"))
                .unwrap()
                .permissions()
                .mode();
            fs::set_permissions(
                r.join("dir/sub/deep"),
                fs::Permissions::from_mode(mode ^ 0o001),
            )
            .unwrap();
        },
        "dir/sub/deep",
    );
    assert_changes(
        "sticky bit on a directory",
        |r| fs::set_permissions(r.join("dir"), fs::Permissions::from_mode(0o1755)).unwrap(),
        "dir d mode=1755",
    );
}

#[test]
fn one_xattr_changes_the_digest() {
    assert_changes(
        "xattr added",
        |r| setxattr(&r.join("b"), "user.k", b"v"),
        "xattr:user.k=76",
    );
    assert_changes(
        "xattr on a directory",
        |r| setxattr(&r.join("dir/sub"), "user.k", b"v"),
        "dir/sub d",
    );
    assert_changes(
        "trusted xattr on a symlink",
        |r| setxattr(&r.join("sym"), "trusted.k", b"v"),
        "sym l",
    );
    // Overlay bookkeeping is not content.
    assert_unchanged("trusted.overlay xattr", |r| {
        setxattr(&r.join("dir"), "trusted.overlay.impure", b"y")
    });
}

#[test]
fn an_mtime_changes_the_digest() {
    assert_changes(
        "mtime ns",
        |r| set_mtime(&r.join("a"), 1_650_000_000, 6),
        "a f",
    );
    assert_changes(
        "symlink mtime",
        |r| set_mtime(&r.join("sym"), 1, 0),
        "sym l",
    );
    // Directory mtimes follow from their children and are left out.
    assert_unchanged("directory mtime", |r| set_mtime(&r.join("dir"), 1, 0));
}

#[test]
fn a_symlink_target_changes_the_digest() {
    assert_changes(
        "symlink target",
        |r| {
            fs::remove_file(r.join("sym")).unwrap();
            symlink("target-two", r.join("sym")).unwrap();
            set_mtime(&r.join("sym"), 1_650_000_000, 5);
        },
        "target=target-two",
    );
}

#[test]
fn owners_names_types_and_hardlinks_change_the_digest() {
    assert_changes(
        "owner",
        |r| lchown(r.join("sym"), Some(7), None).unwrap(),
        "owner=7:0",
    );
    assert_changes(
        "rename",
        |r| fs::rename(r.join("dir/sub/deep"), r.join("dir/sub/deeper")).unwrap(),
        "dir/sub/deeper",
    );
    assert_changes(
        "hardlink broken into a copy with the same content and metadata",
        |r| {
            fs::remove_file(r.join("a_link")).unwrap();
            fs::write(r.join("a_link"), b"alpha").unwrap();
            set_mtime(&r.join("a_link"), 1_650_000_000, 5);
        },
        "a_link f",
    );
    assert_changes(
        "new empty file",
        |r| fs::write(r.join("dir/empty"), b"").unwrap(),
        "dir/empty f",
    );
}

#[test]
fn excluded_paths_are_ignored() {
    assert_unchanged("change under an excluded top-level path", |r| {
        fs::write(r.join("proc/ignored"), b"changed").unwrap();
        fs::write(r.join("proc/new"), b"new").unwrap();
    });
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let lines = tree_listing(dir.path(), &["proc", "dir/sub"]).unwrap();
    assert!(
        lines
            .iter()
            .all(|l| !l.starts_with("proc") && !l.starts_with("dir/sub")),
        "{lines:#?}"
    );
    assert!(lines.iter().any(|l| l.starts_with("dir/file ")));
    assert_eq!(lines[0].split(' ').next(), Some("."));
}
