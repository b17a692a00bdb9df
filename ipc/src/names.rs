//! The one rule for the names clients choose (images, trajectory ids, memory-server worker
//! ids and regions): `[A-Za-z0-9._-]`, 1 to a per-kind maximum of bytes, and, where a name
//! becomes a file name, not starting with a dot.

/// Longest image (or tag) name, bytes.
pub const MAX_IMAGE_NAME: usize = 64;

/// Longest trajectory id of a context log, bytes.
pub const MAX_TRAJECTORY_NAME: usize = 128;

/// Whether `name` is 1 to `max_len` bytes of `[A-Za-z0-9._-]`, and, unless `leading_dot`, does
/// not start with a dot (a name that becomes a file name must not be `.`, `..` or hidden).
pub fn valid_name(name: &str, max_len: usize, leading_dot: bool) -> bool {
    !name.is_empty()
        && name.len() <= max_len
        && (leading_dot || !name.starts_with('.'))
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("bookworm-python_3.11", 64, false));
        for bad in ["", ".", "..", ".hidden", "a/b", "a b", "é"] {
            assert!(!valid_name(bad, 64, false), "{bad:?}");
        }
        assert!(valid_name(".x", 8, true));
        assert!(!valid_name("abcdefghi", 8, true));
    }
}
