//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use std::path::Path;

use belayer_overlay::{first_difference, tree_digest, tree_listing};
use rustix::fs::{AtFlags, Timespec, Timestamps, CWD};

/// Asserts that two trees have the same digest, printing the first differing listing line
/// otherwise.
pub fn assert_same_tree(left: &Path, right: &Path, exclude: &[&str]) {
    let (a, b) = (
        tree_digest(left, exclude).unwrap(),
        tree_digest(right, exclude).unwrap(),
    );
    if a != b {
        let (la, lb) = (
            tree_listing(left, exclude).unwrap(),
            tree_listing(right, exclude).unwrap(),
        );
        let diff = first_difference(&la, &lb);
        panic!(
            "trees differ: {} vs {}\nfirst difference: {diff:#?}",
            left.display(),
            right.display()
        );
    }
}

/// Sets the mtime (and atime) of `path` without following a symlink.
pub fn set_mtime(path: &Path, sec: i64, nsec: i64) {
    let t = Timespec {
        tv_sec: sec,
        tv_nsec: nsec,
    };
    let times = Timestamps {
        last_access: t,
        last_modification: t,
    };
    rustix::fs::utimensat(CWD, path, &times, AtFlags::SYMLINK_NOFOLLOW).unwrap();
}

/// Names directly inside `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
