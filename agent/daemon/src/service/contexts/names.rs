//! Trajectory ids on the wire, their owners' namespaces, and where their logs lie on disk.
//!
//! A wire id is `<name>` or `<name>@<uid>`; `<name>` is `[A-Za-z0-9._-]{1,128}` not starting
//! with a dot. Plain `<name>` is the trajectory of that name in the caller's own namespace;
//! `<name>@<uid>` the one in uid's (which only root and uid itself may act on). Root's logs
//! lie in `contexts/<name>.ctxlog` (where every log was before logs had owners, so those
//! older logs are root's); another uid's in `contexts/u<uid>/<name>.ctxlog`. The directory is
//! the record of ownership: created once, never renamed, in a state dir only root enters.

use std::path::{Path, PathBuf};

/// Suffix of a log file.
const SUFFIX: &str = ".ctxlog";

/// A trajectory: its owner's uid and its name in the owner's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    /// Uid of the peer that created it (0 for logs older than ownership).
    pub(super) owner: u32,
    /// Name, valid per [`valid_name`].
    pub(super) name: String,
}

/// A parsed wire id.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct WireId<'a> {
    /// The trajectory's name.
    pub(super) name: &'a str,
    /// The namespace it names (`@<uid>`), `None`: the caller's.
    pub(super) owner: Option<u32>,
}

/// Whether `name` is a valid trajectory name: `[A-Za-z0-9._-]{1,128}`, not starting with a dot.
pub(super) fn valid_name(name: &str) -> bool {
    belayer_ipc::names::valid_name(name, belayer_ipc::names::MAX_TRAJECTORY_NAME, false)
}

/// Parses a wire id; `None` when it is not `<name>` or `<name>@<decimal uid>`.
pub(super) fn parse(id: &str) -> Option<WireId<'_>> {
    let (name, owner) = match id.split_once('@') {
        None => (id, None),
        Some((name, uid)) => {
            if uid.is_empty() || uid.len() > 10 || !uid.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            (name, Some(uid.parse::<u32>().ok()?))
        }
    };
    valid_name(name).then_some(WireId { name, owner })
}

/// The name of `key`'s log file in its owner's directory: `<name>.ctxlog`.
pub(super) fn file_name(key: &Key) -> String {
    format!("{}{SUFFIX}", key.name)
}

/// The log file of `key` relative to the contexts dir: `<name>.ctxlog` for root,
/// `u<uid>/<name>.ctxlog` for another uid.
pub(super) fn rel_path(key: &Key) -> PathBuf {
    let file = file_name(key);
    match key.owner {
        0 => PathBuf::from(file),
        uid => Path::new(&owner_dir(uid)).join(file),
    }
}

/// The log file of `key` under the contexts dir `dir`.
pub(super) fn path(dir: &Path, key: &Key) -> PathBuf {
    dir.join(rel_path(key))
}

/// The directory (relative to the contexts dir) of the logs of non-root `uid`.
pub(super) fn owner_dir(uid: u32) -> String {
    format!("u{uid}")
}

/// The trajectory name of a log file's name (`<name>.ctxlog`), `None` if it is none.
pub(super) fn log_name(file_name: &str) -> Option<&str> {
    file_name.strip_suffix(SUFFIX).filter(|n| valid_name(n))
}

/// The owner of a directory named `u<uid>` (canonical decimal, not 0), `None` if it is none.
pub(super) fn owner_of_dir(dir_name: &str) -> Option<u32> {
    let digits = dir_name.strip_prefix('u')?;
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let uid = digits.parse::<u32>().ok().filter(|uid| *uid != 0)?;
    // `u05001` is not the directory of 5001 (which `owner_dir` names `u5001`).
    (owner_dir(uid) == dir_name).then_some(uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_ids_name_a_namespace_or_the_callers() {
        assert_eq!(
            parse("traj-1.a_b"),
            Some(WireId {
                name: "traj-1.a_b",
                owner: None
            })
        );
        assert_eq!(
            parse("t@5001"),
            Some(WireId {
                name: "t",
                owner: Some(5001)
            })
        );
        assert_eq!(parse("t@0").unwrap().owner, Some(0));
        for bad in [
            "",
            ".hidden",
            "../x",
            "a/b",
            "t@",
            "t@-1",
            "t@+1",
            "t@1@2",
            "t@99999999999",
            "t@4294967296",
            "@5",
            "t@ 1",
            &"x".repeat(129),
        ] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
        assert!(parse(&"x".repeat(128)).is_some());
    }

    #[test]
    fn root_logs_stay_where_logs_were_and_others_get_a_dir_each() {
        let dir = Path::new("/s/contexts");
        let key = |owner, name: &str| Key {
            owner,
            name: name.into(),
        };
        assert_eq!(
            path(dir, &key(0, "t")),
            PathBuf::from("/s/contexts/t.ctxlog")
        );
        assert_eq!(
            path(dir, &key(5001, "t")),
            PathBuf::from("/s/contexts/u5001/t.ctxlog")
        );
        assert_eq!(rel_path(&key(7, "t")), PathBuf::from("u7/t.ctxlog"));
        assert_eq!(log_name("t.ctxlog"), Some("t"));
        for not_a_log in ["t", ".t.ctxlog", ".ctxlog", "a b.ctxlog", "t.ctxlog.tmp"] {
            assert_eq!(log_name(not_a_log), None, "{not_a_log:?}");
        }
        assert_eq!(owner_of_dir("u5001"), Some(5001));
        for not_an_owner in ["u0", "u", "u05001", "u-1", "u4294967296", "x5001", "u5001x"] {
            assert_eq!(owner_of_dir(not_an_owner), None, "{not_an_owner:?}");
        }
    }
}
