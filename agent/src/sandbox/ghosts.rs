//! Deleted-but-open files of a sandbox: what a CRIU dump copies into its images as ghost
//! files (`st_nlink` 0: the data exists nowhere else), counted before the dump so the dump
//! stage reserves room for them (`dump_stage_bytes`); and whether the dump will link-remap one
//! (open under a removed name while another hard link keeps it).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

use belayer_overlay::layer::PendingLayer;

use super::checkpoint::CheckpointError;

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

/// Whether a task of `pids` holds a regular file open, mapped or as its executable under a
/// removed name while another hard link keeps it (`st_nlink` > 0): what CRIU dumps as a link
/// remap. Reads `/proc/<pid>/fd` (a `readlink` per fd), `/proc/<pid>/maps` (one read) and
/// `exe`, and `stat`s through the magic link only what is marked ` (deleted)`; run while
/// frozen (tens of microseconds per process). A miss costs no correctness: the image check
/// after the dump then finds the link gone and refuses the checkpoint.
pub(crate) fn holds_linked_deleted(pids: &[i32]) -> bool {
    let deleted = |link: &std::path::Path| {
        std::fs::read_link(link)
            .is_ok_and(|t| t.as_os_str().as_encoded_bytes().ends_with(b" (deleted)"))
    };
    let linked = |path: &std::path::Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.nlink() > 0)
    };
    pids.iter().any(|pid| {
        let exe = std::path::PathBuf::from(format!("/proc/{pid}/exe"));
        let fds = || {
            std::fs::read_dir(format!("/proc/{pid}/fd")).is_ok_and(|entries| {
                entries
                    .flatten()
                    .any(|e| deleted(&e.path()) && linked(&e.path()))
            })
        };
        let maps = || {
            std::fs::read_to_string(format!("/proc/{pid}/maps")).is_ok_and(|text| {
                text.lines()
                    .filter(|l| l.ends_with(" (deleted)"))
                    .filter_map(|l| l.split_whitespace().next())
                    .any(|range| {
                        linked(std::path::Path::new(&format!(
                            "/proc/{pid}/map_files/{range}"
                        )))
                    })
            })
        };
        (deleted(&exe) && linked(&exe)) || fds() || maps()
    })
}

/// At CRIU's post-dump stage of a dump held for link remaps (see [`holds_linked_deleted`]):
/// the links CRIU made (`link_remap.<id>`, `--link-remap`) exist from its file dump to the end
/// of this stage, so the upper layer is captured again (`capture`) with them, and the restore
/// finds each link where the images say. `None` when the images hold no link remap.
///
/// Errors: [`CheckpointError::RemapImages`] (images unreadable), those of `capture`, and
/// [`CheckpointError::Unsupported`] with
/// [`UnsupportedState::LinkRemapOutsideUpper`](super::unrestorable::UnsupportedState) when a
/// link is not in the captured layer (on the sandbox's `/dev` tmpfs, say).
pub(crate) fn capture_with_link_remaps<'s>(
    id: &str,
    images_dir: &std::path::Path,
    capture: impl FnOnce() -> Result<PendingLayer<'s>, CheckpointError>,
) -> Result<Option<PendingLayer<'s>>, CheckpointError> {
    let remaps =
        belayer_criu::link_remaps(images_dir).map_err(|source| CheckpointError::RemapImages {
            id: id.to_string(),
            source,
        })?;
    if remaps.is_empty() {
        return Ok(None);
    }
    let pending = capture()?;
    if let Some(r) = remaps
        .iter()
        .find(|r| !pending.holds_file(r.link.trim_start_matches('/').as_bytes()))
    {
        return Err(CheckpointError::Unsupported {
            id: id.to_string(),
            state: super::unrestorable::UnsupportedState::LinkRemapOutsideUpper {
                original: r.original.clone(),
                link: r.link.clone(),
            },
        });
    }
    tracing::debug!(sandbox = %id, remaps = remaps.len(), "upper layer captured again with link remaps");
    Ok(Some(pending))
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

    // One test: both cases look at this whole process.
    #[test]
    fn files_open_or_mapped_under_a_removed_name_with_another_link_are_seen() {
        use std::os::fd::AsRawFd;
        open_case();
        let dir = tempfile::tempdir().unwrap();
        let (path, other) = (dir.path().join("m"), dir.path().join("n"));
        let f = std::fs::File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        f.set_len(4096).unwrap();
        // SAFETY: a fresh shared read mapping of a 4 KiB file, unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        drop(f);
        std::fs::hard_link(&path, &other).unwrap();
        std::fs::remove_file(&path).unwrap();
        let me = [std::process::id() as i32];
        let seen = holds_linked_deleted(&me);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(addr, 4096) };
        assert!(seen, "the mapping was not seen");
    }

    fn open_case() {
        let dir = tempfile::tempdir().unwrap();
        let (path, other) = (dir.path().join("f"), dir.path().join("g"));
        let f = std::fs::File::create(&path).unwrap();
        let me = [std::process::id() as i32];
        std::fs::hard_link(&path, &other).unwrap();
        assert!(!holds_linked_deleted(&me), "both names there");
        std::fs::remove_file(&path).unwrap();
        assert!(holds_linked_deleted(&me));
        drop(f);
    }
}
