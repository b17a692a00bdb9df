//! Upper-layer semantics survive checkpoint → fail-stop → restore: a deleted lower file
//! (whiteout), a lower directory replaced by a new one (opaque), a rename, a hardlink pair, a
//! symlink, xattrs and a mode change.

use std::os::unix::fs::MetadataExt;

use belayer_overlay::tree_digest;
use belayer_tests::{python_rootfs, Daemon};

#[test]
fn whiteouts_opaque_dirs_renames_links_xattrs_modes_survive() {
    let d = Daemon::start();
    // A lower layer with the files the actions will change.
    let img = tempfile::Builder::new()
        .prefix("belayer-img-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let rootfs = img.path().join("rootfs");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(python_rootfs())
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::create_dir_all(rootfs.join("data/dir/sub")).unwrap();
    std::fs::write(rootfs.join("data/deleted.txt"), "lower").unwrap();
    std::fs::write(rootfs.join("data/dir/old.txt"), "old").unwrap();
    std::fs::write(rootfs.join("data/dir/sub/older.txt"), "older").unwrap();
    std::fs::write(rootfs.join("data/rename-src.txt"), "moved").unwrap();
    std::fs::write(rootfs.join("data/mode.txt"), "mode").unwrap();
    d.image("lowered", &rootfs);
    let id = d.create("lowered").id;

    d.sh(&id, "rm /data/deleted.txt");
    d.sh(
        &id,
        "rm -r /data/dir && mkdir /data/dir && echo new > /data/dir/new.txt",
    );
    d.sh(&id, "mv /data/rename-src.txt /data/rename-dst.txt");
    d.sh(&id, "echo linked > /data/h1 && ln /data/h1 /data/h2");
    d.sh(
        &id,
        "ln -s /data/h1 /data/sym && ln -s /nonexistent /data/dangling",
    );
    d.sh(
        &id,
        "python3 -c \"import os; os.setxattr('/data/h1', 'user.belayer', b'xattr-value')\"",
    );
    d.sh(
        &id,
        "chmod 640 /data/mode.txt && chmod 1777 /data/dir && mkfifo /data/fifo",
    );
    let root = d.root(&id);
    let before = tree_digest(&root, &["proc", "dev"]).unwrap();
    d.checkpoint(&id, 1, b"ctx");
    d.sh(
        &id,
        "echo later > /data/later.txt && rm /data/h2 && chmod 600 /data/dir",
    );
    d.fail_stop(&id);
    assert_eq!(d.restore(&id).prefix, Some(1));

    let root = d.root(&id);
    assert_eq!(tree_digest(&root, &["proc", "dev"]).unwrap(), before);
    assert!(!root.join("data/deleted.txt").exists(), "whiteout restored");
    assert!(
        !root.join("data/dir/old.txt").exists(),
        "opaque dir hides lower content"
    );
    assert!(
        !root.join("data/dir/sub").exists(),
        "opaque dir hides lower subdirs"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("data/dir/new.txt")).unwrap(),
        "new\n"
    );
    assert!(!root.join("data/rename-src.txt").exists());
    assert_eq!(
        std::fs::read_to_string(root.join("data/rename-dst.txt")).unwrap(),
        "moved"
    );
    let (h1, h2) = (
        root.join("data/h1").metadata().unwrap(),
        root.join("data/h2").metadata().unwrap(),
    );
    assert_eq!(h1.ino(), h2.ino(), "hardlink pair is one inode");
    assert_eq!(
        std::fs::read_link(root.join("data/sym")).unwrap().to_str(),
        Some("/data/h1")
    );
    assert_eq!(
        d.sh(
            &id,
            "python3 -c \"import os; print(os.getxattr('/data/h1', 'user.belayer').decode())\""
        ),
        "xattr-value"
    );
    assert_eq!(
        root.join("data/mode.txt").metadata().unwrap().mode() & 0o7777,
        0o640
    );
    assert_eq!(
        root.join("data/dir").metadata().unwrap().mode() & 0o7777,
        0o1777
    );
    assert!(!root.join("data/later.txt").exists());
}
