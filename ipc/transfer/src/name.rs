//! Member names: a tar member's path split into normal components, or refused.
//!
//! A name is accepted when it is relative and every component is a normal name: empty and `.`
//! components are dropped (`./a//b/` is `a/b`), `..` anywhere, a leading `/`, a NUL byte, an
//! empty name and names longer than `PATH_MAX` are refused. A name of only `.` components is
//! the archive's root (no components).

use crate::error::{lossy, TransferError};

/// Longest member name accepted, bytes (`PATH_MAX`).
pub const MAX_NAME_BYTES: usize = 4096;

/// The normal components of the member name `raw`.
///
/// Errors: [`TransferError::BadName`].
pub fn components(raw: &[u8]) -> Result<Vec<Vec<u8>>, TransferError> {
    let refuse = |reason| TransferError::BadName {
        member: lossy(raw),
        reason,
    };
    if raw.is_empty() {
        return Err(refuse("empty name"));
    }
    if raw.len() > MAX_NAME_BYTES {
        return Err(refuse("name longer than PATH_MAX"));
    }
    if raw.contains(&0) {
        return Err(refuse("NUL byte in the name"));
    }
    if raw[0] == b'/' {
        return Err(refuse("absolute name"));
    }
    let mut out = Vec::new();
    for part in raw.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(refuse("`..` component")),
            name => out.push(name.to_vec()),
        }
    }
    Ok(out)
}

/// The last normal component of the path `path` (trailing slashes ignored), `None` when there
/// is none (`/`, `..`, `a/..`, empty, `.`).
pub fn last_component(path: &[u8]) -> Option<&[u8]> {
    let trimmed = trim_trailing_slashes(path);
    let name = match trimmed.iter().rposition(|b| *b == b'/') {
        Some(i) => &trimmed[i + 1..],
        None => trimmed,
    };
    (!matches!(name, b"" | b"." | b"..")).then_some(name)
}

/// `path` without its last component (and without trailing slashes): `a/b/c` → `a/b`, `/c` →
/// `/`, `c` → `.` (the relative base).
pub fn parent_of(path: &[u8]) -> &[u8] {
    let trimmed = trim_trailing_slashes(path);
    match trimmed.iter().rposition(|b| *b == b'/') {
        Some(0) => b"/",
        Some(i) => trim_trailing_slashes(&trimmed[..i]),
        None => b".",
    }
}

/// `path` without trailing slashes, keeping a lone `/`.
fn trim_trailing_slashes(path: &[u8]) -> &[u8] {
    let mut end = path.len();
    while end > 1 && path[end - 1] == b'/' {
        end -= 1;
    }
    &path[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(raw: &str) -> Vec<String> {
        components(raw.as_bytes())
            .unwrap()
            .into_iter()
            .map(|c| String::from_utf8(c).unwrap())
            .collect()
    }

    #[test]
    fn normal_names_split_and_drop_dots() {
        assert_eq!(ok("a/b/c"), ["a", "b", "c"]);
        assert_eq!(ok("./a//b/"), ["a", "b"]);
        assert_eq!(ok("."), Vec::<String>::new());
        assert_eq!(ok("..."), ["..."]);
        assert_eq!(ok("a/.b"), ["a", ".b"]);
    }

    #[test]
    fn escaping_names_are_refused() {
        for bad in ["", "/etc/passwd", "a/../b", "..", "../x", "a/..", "//x"] {
            assert!(
                matches!(
                    components(bad.as_bytes()),
                    Err(TransferError::BadName { .. })
                ),
                "{bad:?} accepted"
            );
        }
        assert!(components(b"a\0b").is_err());
        assert!(components(&vec![b'a'; MAX_NAME_BYTES + 1]).is_err());
    }

    #[test]
    fn last_components_and_parents() {
        assert_eq!(last_component(b"/a/b/"), Some(&b"b"[..]));
        assert_eq!(last_component(b"b"), Some(&b"b"[..]));
        assert_eq!(last_component(b"/"), None);
        assert_eq!(last_component(b"a/.."), None);
        assert_eq!(last_component(b"."), None);
        assert_eq!(parent_of(b"/a/b/"), b"/a");
        assert_eq!(parent_of(b"/a"), b"/");
        assert_eq!(parent_of(b"a"), b".");
        assert_eq!(parent_of(b"a//b"), b"a");
    }

    proptest::proptest! {
        #[test]
        fn accepted_names_never_escape(raw in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::strategy::Just(b'/'),
                proptest::strategy::Just(b'.'),
                proptest::strategy::Just(b'a'),
                proptest::strategy::Just(0u8),
            ],
            0..24,
        )) {
            if let Ok(parts) = components(&raw) {
                for p in parts {
                    proptest::prop_assert!(!p.is_empty());
                    proptest::prop_assert!(p != b"." && p != b"..");
                    proptest::prop_assert!(!p.contains(&b'/') && !p.contains(&0));
                }
            }
        }
    }
}
