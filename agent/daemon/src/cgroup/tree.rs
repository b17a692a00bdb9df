//! The directory tree side of sandbox cgroups: relative-path validation, directory creation,
//! v2 controller delegation along the path, pid collection and removal, in every hierarchy.

use std::io;
use std::path::{Component, Path, PathBuf};

use super::limits::Limits;
use super::sys::{read_file, read_pids, write_file};
use super::CgroupError;

pub(super) fn limit_for(limits: &Limits, controller: &str) -> Option<u64> {
    match controller {
        "memory" => limits.memory_max,
        _ => limits.pids_max,
    }
}

/// Checks that `rel` is a relative path of plain names and returns it as a path.
pub(super) fn validate_rel(rel: &str) -> Result<PathBuf, CgroupError> {
    let invalid = || CgroupError::InvalidPath {
        rel: rel.to_owned(),
    };
    if rel.is_empty() || rel.contains('\0') || rel.split('/').any(|c| c.is_empty()) {
        return Err(invalid());
    }
    let path = PathBuf::from(rel);
    if path.components().all(|c| matches!(c, Component::Normal(_)))
        && !rel.split('/').any(|c| c == "." || c == "..")
    {
        Ok(path)
    } else {
        Err(invalid())
    }
}

pub(super) fn mkdir_p(dir: &Path) -> Result<(), CgroupError> {
    std::fs::create_dir_all(dir).map_err(|source| CgroupError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })
}

/// Makes the parents of `dir` as needed and `dir` itself, which must not exist yet.
pub(super) fn make_leaf(dir: &Path) -> Result<(), CgroupError> {
    if let Some(parent) = dir.parent() {
        mkdir_p(parent)?;
    }
    std::fs::create_dir(dir).map_err(|source| match source.kind() {
        io::ErrorKind::AlreadyExists => CgroupError::AlreadyExists {
            path: dir.to_path_buf(),
        },
        _ => CgroupError::CreateDir {
            path: dir.to_path_buf(),
            source,
        },
    })
}

/// Enables `controller` in `cgroup.subtree_control` of the v2 root and of every ancestor of the
/// leaf `rel` below it, where not enabled yet.
pub(super) fn enable_v2_controller(
    root: &Path,
    rel: &Path,
    controller: &str,
) -> Result<(), CgroupError> {
    // `rel.ancestors()` yields the leaf, its parents, then "" (the root itself): skip the leaf.
    let mut ancestors: Vec<PathBuf> = rel.ancestors().skip(1).map(|a| root.join(a)).collect();
    ancestors.reverse();
    for dir in ancestors {
        let file = dir.join("cgroup.subtree_control");
        let enabled = read_file(&file)?;
        if !enabled.split_whitespace().any(|c| c == controller) {
            write_file(&file, &format!("+{controller}"))?;
        }
    }
    Ok(())
}

/// Appends the pids of `dir` and of every cgroup below it.
pub(super) fn collect_pids(dir: &Path, pids: &mut Vec<i32>) -> Result<(), CgroupError> {
    pids.extend(read_pids(&dir.join("cgroup.procs"))?);
    for child in child_cgroups(dir)? {
        collect_pids(&child, pids)?;
    }
    Ok(())
}

/// The child cgroup directories of `dir`.
pub(super) fn child_cgroups(dir: &Path) -> Result<Vec<PathBuf>, CgroupError> {
    let read_err = |source| CgroupError::Read {
        path: dir.to_path_buf(),
        source,
    };
    let mut children = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_err)? {
        let entry = entry.map_err(read_err)?;
        if entry.file_type().map_err(read_err)?.is_dir() {
            children.push(entry.path());
        }
    }
    Ok(children)
}

/// `rmdir` of `dir` after its child cgroups; a missing directory is fine.
pub(super) fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    let children = match child_cgroups(dir) {
        Ok(children) => children,
        Err(CgroupError::Read { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(())
        }
        Err(err) => return Err(err),
    };
    for child in children {
        remove_tree(&child)?;
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CgroupError::RemoveDir {
            path: dir.to_path_buf(),
            source,
        }),
    }
}
