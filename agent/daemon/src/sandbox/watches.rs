//! inotify watches on deleted inodes: CRIU dumps them, but the restored watch is dropped at
//! once (the restored fd gets `IN_IGNORED` and no further events), so a checkpoint of a
//! sandbox holding one is refused instead of losing the watch silently.
//!
//! A watch pins its inode; a watched file that is unlinked while something keeps it open
//! (or a watched directory that is some task's cwd) stays watched with `st_nlink` 0. The
//! watches are read from `/proc/<pid>/fdinfo/<fd>` of every inotify fd (`inotify wd:.. ino:..
//! sdev:.. f_handle:..`) and each watched inode is opened by its handle through the
//! sandbox's overlay mount (`open_by_handle_at`, which overlayfs decodes with
//! `nfs_export=on`) to read its link count.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A watch on a deleted inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeletedWatch {
    /// Host pid of the task holding the inotify fd.
    pub pid: i32,
    /// The inotify fd.
    pub fd: u32,
    /// The watched inode's number.
    pub ino: u64,
}

/// The first watch of the tasks `pids` whose inode has no name left, if any. `mount` is a
/// path on the sandbox's overlay (its merged dir on the host). Watches whose handle cannot
/// be opened (another file system, an inode gone meanwhile) are skipped; so are tasks and
/// fds that vanish. O(inotify watches), run before the freeze.
pub(crate) fn deleted_watch(pids: &[i32], mount: &Path) -> Option<DeletedWatch> {
    let mount = std::fs::File::open(mount).ok()?;
    for &pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let is_inotify = std::fs::read_link(fd.path())
                .is_ok_and(|t| t.as_os_str().as_encoded_bytes() == b"anon_inode:inotify");
            let Some(n) = fd.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            if !is_inotify {
                continue;
            }
            let Ok(info) = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{n}")) else {
                continue;
            };
            for watch in info.lines().filter_map(parse_watch) {
                if link_count(&mount, &watch) == Some(0) {
                    return Some(DeletedWatch {
                        pid,
                        fd: n,
                        ino: watch.ino,
                    });
                }
            }
        }
    }
    None
}

/// One `inotify` line of an fdinfo file.
#[derive(Debug, PartialEq, Eq)]
struct Watch {
    ino: u64,
    handle_type: i32,
    handle: Vec<u8>,
}

/// Parses `inotify wd:1 ino:119 sdev:4b mask:2 ignored_mask:0 fhandle-bytes:2c
/// fhandle-type:f8 f_handle:00...` (numbers in hex).
fn parse_watch(line: &str) -> Option<Watch> {
    let rest = line.strip_prefix("inotify ")?;
    let field = |key: &str| {
        rest.split_whitespace()
            .find_map(|f| f.strip_prefix(key)?.strip_prefix(':'))
    };
    let ino = u64::from_str_radix(field("ino")?, 16).ok()?;
    let bytes = usize::from_str_radix(field("fhandle-bytes")?, 16).ok()?;
    let handle_type = i32::from_str_radix(field("fhandle-type")?, 16).ok()?;
    let hex = field("f_handle")?;
    if hex.len() != bytes * 2 || bytes > 128 {
        return None;
    }
    let handle = (0..bytes)
        .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    Some(Watch {
        ino,
        handle_type,
        handle,
    })
}

/// `st_nlink` of the watched inode, opened by handle through `mount` (`O_PATH`).
fn link_count(mount: &std::fs::File, watch: &Watch) -> Option<u64> {
    // struct file_handle { unsigned int handle_bytes; int handle_type; unsigned char f_handle[]; }
    let mut buf = Vec::with_capacity(8 + watch.handle.len());
    buf.extend_from_slice(&(watch.handle.len() as u32).to_ne_bytes());
    buf.extend_from_slice(&watch.handle_type.to_ne_bytes());
    buf.extend_from_slice(&watch.handle);
    // u32-aligned storage for the header.
    let mut words = vec![0u32; buf.len().div_ceil(4)];
    // SAFETY: `words` holds at least `buf.len()` bytes; the regions do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(buf.as_ptr(), words.as_mut_ptr().cast::<u8>(), buf.len());
    }
    // SAFETY: `words` is a valid, aligned `struct file_handle` whose `handle_bytes` matches
    // the bytes that follow its header; the kernel only reads it. The returned fd, if any, is
    // new and owned here.
    let fd = unsafe {
        libc::open_by_handle_at(
            mount.as_raw_fd(),
            words.as_mut_ptr().cast::<libc::file_handle>(),
            libc::O_PATH | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by open_by_handle_at and is owned by nobody else.
    let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.metadata().ok().map(|m| m.nlink())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_an_overlay_watch_line() {
        let line = "inotify wd:3 ino:28a513 sdev:4b mask:2 ignored_mask:0 fhandle-bytes:4 \
                    fhandle-type:f8 f_handle:00a1ff10";
        assert_eq!(
            parse_watch(line),
            Some(Watch {
                ino: 0x28a513,
                handle_type: 0xf8,
                handle: vec![0, 0xa1, 0xff, 0x10],
            })
        );
    }

    #[test]
    fn refuses_malformed_lines() {
        for line in [
            "pos: 0",
            "inotify wd:3 ino:zz fhandle-bytes:1 fhandle-type:1 f_handle:00",
            "inotify wd:3 ino:1 fhandle-bytes:2 fhandle-type:1 f_handle:00",
            "inotify wd:3 ino:1 fhandle-bytes:1 fhandle-type:1 f_handle:é0",
        ] {
            assert_eq!(parse_watch(line), None, "{line}");
        }
    }

    #[test]
    fn a_watched_file_unlinked_while_open_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        let keep = std::fs::File::create(&path).unwrap();
        // SAFETY: plain syscalls on fds this test owns; the path is NUL-terminated.
        let ifd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        assert!(ifd >= 0);
        let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: as above.
        let wd = unsafe { libc::inotify_add_watch(ifd, cpath.as_ptr(), libc::IN_MODIFY) };
        assert!(wd >= 0);
        let me = [std::process::id() as i32];
        // The temp dir's file system may not decode handles; then nothing is reported.
        let before = deleted_watch(&me, dir.path());
        assert_eq!(before, None);
        std::fs::remove_file(&path).unwrap();
        if let Some(w) = deleted_watch(&me, dir.path()) {
            assert_eq!(w.fd, ifd as u32);
            assert_eq!(w.ino, keep.metadata().unwrap().ino());
        }
        // SAFETY: closing the inotify fd this test opened.
        unsafe { libc::close(ifd) };
    }
}
