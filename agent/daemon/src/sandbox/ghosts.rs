//! Deleted-but-open files of a sandbox: what a CRIU dump copies into its images as ghost
//! files (`st_nlink` 0: the data exists nowhere else), counted before the dump so the dump
//! stage reserves room for them (`dump_stage_bytes`).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

/// Allocated bytes (`st_blocks * 512`: a sparse file counts its data only, as CRIU counts
/// it) of the distinct deleted-but-open regular files that the tasks `pids` hold open,
/// each counted at most `limit` bytes (a larger one fails the dump anyway, see
/// [`belayer_criu::FileRefusal::GhostTooLarge`]).
///
/// Reads `/proc/<pid>/fd` and `stat`s each entry whose link ends in ` (deleted)` through the
/// magic link (no open): O(open fds), run before the freeze. Tasks and fds that vanish
/// meanwhile are skipped; an estimate, CRIU's own check is the authority.
pub(crate) fn deleted_open_bytes(pids: &[i32], limit: u64) -> u64 {
    let mut seen = HashSet::new();
    let mut total = 0u64;
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let path = fd.path();
            let deleted = std::fs::read_link(&path)
                .is_ok_and(|t| t.as_os_str().as_encoded_bytes().ends_with(b" (deleted)"));
            if !deleted {
                continue;
            }
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if meta.is_file() && meta.nlink() == 0 && seen.insert((meta.dev(), meta.ino())) {
                total = total.saturating_add(meta.blocks().saturating_mul(512).min(limit));
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn counts_each_deleted_open_file_once_up_to_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![1u8; 1 << 20]).unwrap();
        f.sync_all().unwrap();
        let again = std::fs::File::open(&path).unwrap();
        let me = [std::process::id() as i32];
        assert_eq!(deleted_open_bytes(&me, u64::MAX), 0, "not deleted yet");
        std::fs::remove_file(&path).unwrap();
        let bytes = deleted_open_bytes(&me, u64::MAX);
        assert!(bytes >= 1 << 20, "{bytes}");
        assert_eq!(deleted_open_bytes(&me, 4096), 4096);
        drop((f, again));
    }
}
