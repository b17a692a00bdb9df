//! The limits of a removal ([`RemoveOptions`]) and what it removed ([`RemoveStats`]).

/// Limits of [`remove_tree_with`](super::remove_tree_with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoveOptions {
    /// Most directory fds held at once (at least 2); deeper levels are flattened.
    pub max_open_dirs: usize,
    /// Most directory entries examined (an entry seen in two passes counts twice).
    pub max_entries: u64,
}

impl Default for RemoveOptions {
    /// 32 open directories (a quarter of a page of fds in the worst case, so removals on
    /// many threads fit the default `RLIMIT_NOFILE` of 1024); 2^28 entries, more than the
    /// inodes of the filesystems a state dir lives on.
    fn default() -> Self {
        RemoveOptions {
            max_open_dirs: 32,
            max_entries: 1 << 28,
        }
    }
}

/// What [`remove_tree`](super::remove_tree) removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoveStats {
    /// Entries removed, the root included.
    pub entries: u64,
    /// Bytes of storage the removed entries held (`statx` blocks × 512; a file that keeps
    /// a link elsewhere counts nothing).
    pub bytes: u64,
    /// Directories moved to the top of the tree to keep the open fds bounded.
    pub flattened: u64,
}
