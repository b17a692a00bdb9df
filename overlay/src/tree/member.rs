//! One member of a tree to install ([`Member`], [`MemberKind`]), decoded from a tar header or
//! a manifest entry, and the checks every member passes before anything is created: names
//! ([`parse_name`]: no `..`, no absolute path, at most 255 bytes per component and 4096 in
//! total), link targets, extended attributes and device numbers.

use super::content::RegularData;
use super::error::{lossy, path_of, InstallError};
use crate::format::{is_layer_xattr, MAX_NAME_BYTES, MAX_PATH_BYTES, MAX_XATTR_VALUE_BYTES};
use crate::sys::Xattr;

/// One member (archive member or manifest entry), decoded and checked, not yet installed.
pub(crate) struct Member {
    /// The name as written (for error messages).
    pub raw: Vec<u8>,
    /// Normalised components; empty for the root.
    pub components: Vec<Vec<u8>>,
    pub kind: MemberKind,
    /// Permission and setuid/setgid/sticky bits.
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Modification time: seconds and nanoseconds.
    pub mtime: (i64, u32),
    pub xattrs: Vec<Xattr>,
}

/// What a member is.
pub(crate) enum MemberKind {
    Directory,
    /// A regular file of `size` bytes (apparent size, holes included).
    Regular {
        size: u64,
        data: RegularData,
    },
    Symlink {
        target: Vec<u8>,
    },
    Hardlink {
        target: Vec<Vec<u8>>,
    },
    Whiteout,
    Fifo,
    /// A character or block device node as read from an archive, before the caller's rules
    /// (whiteout, refused, dropped) decided about it; never created.
    Device {
        block: bool,
        major: u32,
        minor: u32,
    },
}

/// Why a member name is rejected.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NameError {
    Invalid(&'static str),
    TooLong(usize),
    ComponentTooLong(usize),
}

/// Splits a member name into components (empty for the root: `.`, `./`), rejecting
/// everything that could leave the target or is ambiguous.
pub(crate) fn parse_name(raw: &[u8], is_dir: bool) -> Result<Vec<Vec<u8>>, NameError> {
    if raw.is_empty() {
        return Err(NameError::Invalid("empty name"));
    }
    if raw.len() > MAX_PATH_BYTES {
        return Err(NameError::TooLong(raw.len()));
    }
    if raw.contains(&0) {
        return Err(NameError::Invalid("NUL byte"));
    }
    if raw[0] == b'/' {
        return Err(NameError::Invalid("absolute path"));
    }
    let mut name = raw;
    if name == b"." {
        name = b"";
    } else if let Some(rest) = name.strip_prefix(b"./") {
        name = rest;
    }
    if let Some(rest) = name.strip_suffix(b"/") {
        if !is_dir {
            return Err(NameError::Invalid("trailing slash on a non-directory"));
        }
        name = rest;
    }
    if name.is_empty() {
        return Ok(Vec::new());
    }
    name.split(|b| *b == b'/')
        .map(|component| match component {
            b"" => Err(NameError::Invalid("empty component")),
            b"." => Err(NameError::Invalid("`.` component")),
            b".." => Err(NameError::Invalid("`..` component")),
            c if c.len() > MAX_NAME_BYTES => Err(NameError::ComponentTooLong(c.len())),
            c => Ok(c.to_vec()),
        })
        .collect()
}

pub(crate) fn name_error(raw: &[u8], err: NameError) -> InstallError {
    let path = path_of(raw);
    match err {
        NameError::Invalid(reason) => InstallError::InvalidName { path, reason },
        NameError::TooLong(len) => InstallError::NameTooLong {
            path,
            len,
            max: MAX_PATH_BYTES,
        },
        NameError::ComponentTooLong(len) => InstallError::ComponentTooLong {
            path,
            len,
            max: MAX_NAME_BYTES,
        },
    }
}

pub(crate) fn check_xattr(raw: &[u8], name: &[u8], value: &[u8]) -> Result<(), InstallError> {
    let reason = if name.is_empty() || name.len() > MAX_NAME_BYTES || name.contains(&0) {
        Some("invalid name")
    } else if !is_layer_xattr(name) {
        Some("namespace not allowed")
    } else if value.len() > MAX_XATTR_VALUE_BYTES {
        Some("value larger than 64 KiB")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(InstallError::ForbiddenXattr {
            path: path_of(raw),
            name: lossy(name),
            reason,
        }),
        None => Ok(()),
    }
}

/// Checks a symlink target: not empty, no NUL, at most 4096 bytes. The target itself is
/// never resolved, so any other content is allowed (absolute, `..`, dangling).
pub(crate) fn check_symlink_target(raw: &[u8], target: &[u8]) -> Result<(), InstallError> {
    let reason = if target.is_empty() {
        "empty"
    } else if target.contains(&0) {
        "NUL byte"
    } else if target.len() > MAX_PATH_BYTES {
        "longer than 4096 bytes"
    } else {
        return Ok(());
    };
    Err(InstallError::InvalidLinkTarget {
        path: path_of(raw),
        target: lossy(target),
        reason,
    })
}

/// Parses a hardlink target with the member-name rules; the root is not a valid target.
pub(crate) fn parse_hardlink_target(
    raw: &[u8],
    target: &[u8],
) -> Result<Vec<Vec<u8>>, InstallError> {
    let invalid = |reason| InstallError::InvalidLinkTarget {
        path: path_of(raw),
        target: lossy(target),
        reason,
    };
    match parse_name(target, false) {
        Ok(c) if c.is_empty() => Err(invalid("the root")),
        Ok(c) => Ok(c),
        Err(NameError::Invalid(reason)) => Err(invalid(reason)),
        Err(NameError::TooLong(_)) => Err(invalid("longer than 4096 bytes")),
        Err(NameError::ComponentTooLong(_)) => Err(invalid("a component longer than 255 bytes")),
    }
}

/// Accepts only overlay whiteouts: 0:0 character devices.
pub(crate) fn check_device(
    raw: &[u8],
    block: bool,
    major: u32,
    minor: u32,
) -> Result<(), InstallError> {
    if block || major != 0 || minor != 0 {
        return Err(InstallError::ForbiddenDevice {
            path: path_of(raw),
            kind: if block { "block" } else { "character" },
            major,
            minor,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(name: &str, is_dir: bool) -> Result<Vec<String>, NameError> {
        parse_name(name.as_bytes(), is_dir).map(|c| {
            c.into_iter()
                .map(|c| String::from_utf8(c).unwrap())
                .collect()
        })
    }

    #[test]
    fn names_are_normalised() {
        assert_eq!(parts("./", true).unwrap(), Vec::<String>::new());
        assert_eq!(parts(".", true).unwrap(), Vec::<String>::new());
        assert_eq!(parts("a/b/", true).unwrap(), ["a", "b"]);
        assert_eq!(parts("./a/b", false).unwrap(), ["a", "b"]);
        assert_eq!(parts("a..b/..c", false).unwrap(), ["a..b", "..c"]);
    }

    #[test]
    fn hostile_names_are_rejected() {
        let invalid = |name: &str, is_dir| match parts(name, is_dir) {
            Err(NameError::Invalid(reason)) => reason,
            other => panic!("{name:?}: {other:?}"),
        };
        assert_eq!(invalid("", false), "empty name");
        assert_eq!(invalid("/etc/passwd", false), "absolute path");
        assert_eq!(invalid("../escape", false), "`..` component");
        assert_eq!(invalid("a/../../b", false), "`..` component");
        assert_eq!(invalid("a/..", true), "`..` component");
        assert_eq!(invalid("a//b", false), "empty component");
        assert_eq!(invalid(".//b", false), "empty component");
        assert_eq!(invalid("a/./b", false), "`.` component");
        assert_eq!(invalid("a\0b", false), "NUL byte");
        assert_eq!(invalid("file/", false), "trailing slash on a non-directory");
        let long = "x".repeat(256);
        assert_eq!(parts(&long, false), Err(NameError::ComponentTooLong(256)));
        let deep = ["y"; 2100].join("/");
        assert_eq!(parts(&deep, false), Err(NameError::TooLong(4199)));
    }
}
