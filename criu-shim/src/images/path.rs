//! Paths as the image checks see them: split into components ([`split`], refusing NUL, `..`
//! and over-long paths), shown back as `/a/b` ([`show`]), and what a name resolves to
//! ([`Entry`]). Shared by the model of the restored tree (`fs`) and the tmpfs archives
//! (`tmpfs`).

use super::error::UnsafeKind;

/// Path components (no `/`, never empty, `.` or `..`).
pub(crate) type Comps = Vec<Vec<u8>>;

/// Longest path accepted (CRIU builds paths of up to `PATH_MAX` = 4096 bytes with a yard
/// prefix and suffixes, and silently truncates longer ones).
pub(crate) const MAX_PATH: usize = 3800;

/// What a name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Entry {
    Dir,
    Symlink(Vec<u8>),
    /// Anything else: file, fifo, socket, device.
    Other,
    Missing,
    /// A procfs entry that is not a magic link (its kind is not known, traversal is allowed).
    Proc,
    /// A procfs magic link or symlink (`self`, `<pid>/cwd`, `<pid>/fd/<n>`, ...).
    MagicLink,
}

/// Splits a path into components, dropping empty and `.` ones; refuses NUL, `..` and paths
/// longer than [`MAX_PATH`].
pub(crate) fn split(path: &[u8]) -> Result<Comps, UnsafeKind> {
    if path.len() > MAX_PATH {
        return Err(UnsafeKind::TooLong { len: path.len() });
    }
    if path.contains(&0) {
        return Err(UnsafeKind::Nul);
    }
    let mut out = Vec::new();
    for c in path.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err(UnsafeKind::DotDot),
            c => out.push(c.to_vec()),
        }
    }
    Ok(out)
}

/// `/a/b` for display.
pub(crate) fn show(comps: &[Vec<u8>]) -> String {
    if comps.is_empty() {
        return "/".into();
    }
    let mut s = String::new();
    for c in comps {
        s.push('/');
        s.push_str(&String::from_utf8_lossy(c));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(p: &str) -> Comps {
        split(p.as_bytes()).unwrap()
    }

    #[test]
    fn split_drops_noise_and_refuses_dotdot_and_nul() {
        assert_eq!(c("/a//b/./c/"), c("a/b/c"));
        assert_eq!(split(b"/a/../b"), Err(UnsafeKind::DotDot));
        assert_eq!(split(b"/a\0b"), Err(UnsafeKind::Nul));
        assert!(matches!(
            split(&[b'a'; 5000]),
            Err(UnsafeKind::TooLong { .. })
        ));
    }
}
