//! Bounds on what one install may create ([`InstallLimits`], also enforced by every capture so
//! that what is captured can be installed again) and what an install created
//! ([`InstallStats`]).

/// Bounds on what one archive may install. Exceeding any is an error naming the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstallLimits {
    /// Most archive members (each directory, file, link and special file counts one).
    pub max_entries: u64,
    /// Most bytes of regular-file content, all files together.
    pub max_total_bytes: u64,
    /// Most bytes of content in a single regular file (its data: holes of a sparse file
    /// captured as sparse do not count).
    pub max_file_bytes: u64,
    /// Largest apparent size of a single regular file, holes included (a sparse file
    /// costs nothing to create, so this only has to fit the host's filesystem).
    pub max_apparent_bytes: u64,
}

impl Default for InstallLimits {
    /// 1 000 000 entries, 64 GiB in total, 16 GiB of data per file, 16 TiB apparent size
    /// per file (ext4's largest file).
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_total_bytes: 64 << 30,
            max_file_bytes: 16 << 30,
            max_apparent_bytes: 16 << 40,
        }
    }
}

/// What [`install_upper`](crate::install_upper) (or another user of the tree builder:
/// [`install_image`](crate::install_image),
/// [`materialize_layer`](crate::layer::materialize_layer)) created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InstallStats {
    /// Archive members installed (the root directory entry included).
    pub entries: u64,
    /// Bytes of regular-file content written.
    pub content_bytes: u64,
    /// Of those, bytes placed with `copy_file_range` from a blob or an archive: on btrfs the
    /// extents are shared with the source, and a simple quota (which charges whoever
    /// allocated an extent) does not charge them to the target's volume.
    pub shared_bytes: u64,
}
