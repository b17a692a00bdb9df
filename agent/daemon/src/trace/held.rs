//! What a sandbox holds that can change its files with no syscall at all, read from `/proc`
//! at the end of each step (both tracer kinds; see the table in `ebpf/bpf/file_activity.h`):
//!
//! - a shared writable mapping (`rw?s` in `/proc/<pid>/maps`) of a regular file whose link
//!   count is above 0 (`stat` of `/proc/<pid>/map_files/<range>`, which also sees the real
//!   upper-layer file behind an overlayfs mapping): stores through it are plain memory
//!   writes, and so are `process_vm_writev`, ptrace pokes, `read()` into it, futex and robust
//!   list updates; memfds, SysV and anonymous shared memory have a link count of 0 and are
//!   process memory, not files;
//! - an io_uring: an `anon_inode:[io_uring]` descriptor (in any task's table) or ring mapping,
//!   or an `iou-sqp-*` / `iou-wrk-*` kernel thread: an SQPOLL ring submits without syscalls,
//!   linked and deferred requests run after the syscall that queued them;
//! - a Linux AIO context (its `/[aio]` ring mapping): requests in flight complete later.
//!
//! The walk is bounded: [`BUDGET`] entries (maps lines, tasks, descriptors) over all
//! processes together; a sandbox past it counts as holding a writer, so a hostile process
//! tree cannot make the check slow, only its own steps dirty.

use std::io::{BufRead, BufReader};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;

/// Entries (maps lines, tasks, descriptors) one scan reads at most, all processes together.
pub const BUDGET: usize = 1 << 16;

/// Something through which a sandbox process may change files without a syscall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writer {
    /// A shared writable mapping of a regular file with a name.
    FileMapping {
        /// Host pid of the process.
        pid: i32,
        /// Inode number of the mapped file (the upper layer's, under overlayfs).
        inode: u64,
    },
    /// An io_uring descriptor, ring mapping or worker thread.
    IoUring {
        /// Host pid of the process.
        pid: i32,
    },
    /// A Linux AIO context.
    Aio {
        /// Host pid of the process.
        pid: i32,
    },
    /// Processes that used io_uring or Linux AIO and are still alive (the BPF counter
    /// `async_procs`; they may hold a ring or context that `/proc` no longer shows).
    AsyncIo {
        /// How many.
        processes: u64,
    },
    /// A live process whose `/proc` entries could not be read (`pid`), or the scan went over
    /// [`BUDGET`] (`pid` 0): assumed to hold one.
    Unknown {
        /// Host pid of the process, 0 for an exhausted budget.
        pid: i32,
    },
}

impl std::fmt::Display for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Writer::FileMapping { pid, inode } => {
                write!(
                    f,
                    "process {pid} maps file inode {inode} shared and writable"
                )
            }
            Writer::IoUring { pid } => write!(f, "process {pid} holds an io_uring"),
            Writer::Aio { pid } => write!(f, "process {pid} holds a Linux AIO context"),
            Writer::AsyncIo { processes } => {
                write!(
                    f,
                    "{processes} process(es) used io_uring or Linux AIO and live on"
                )
            }
            Writer::Unknown { pid: 0 } => f.write_str("too many mappings and descriptors to check"),
            Writer::Unknown { pid } => write!(f, "process {pid} could not be checked"),
        }
    }
}

/// The `/proc` name of an io_uring file (descriptor link target and mapping path).
const IO_URING: &[u8] = b"anon_inode:[io_uring]";
/// The mapping path of a Linux AIO ring.
const AIO_RING: &[u8] = b"/[aio] (deleted)";

/// The first writer held by any of `pids` (host pids of the sandbox's processes), `None`
/// when none holds one. Processes that exit meanwhile are skipped.
pub fn scan(pids: &[i32]) -> Option<Writer> {
    let mut budget = BUDGET;
    pids.iter().find_map(|&pid| scan_process(pid, &mut budget))
}

/// Whether an error reading `/proc/<pid>/...` means that the process (or the mapping, task
/// or descriptor) is gone.
fn gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

fn spend(budget: &mut usize) -> bool {
    match budget.checked_sub(1) {
        Some(left) => {
            *budget = left;
            true
        }
        None => false,
    }
}

fn scan_process(pid: i32, budget: &mut usize) -> Option<Writer> {
    mappings(pid, budget).or_else(|| tasks(pid, budget))
}

/// The fields of a maps line that matter: address range, permissions, path (may be empty).
fn fields(line: &[u8]) -> Option<(&[u8], &[u8], &[u8])> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let mut rest = line;
    let mut take = || {
        let start = rest.iter().position(|b| *b != b' ')?;
        let s = &rest[start..];
        let end = s.iter().position(|b| *b == b' ').unwrap_or(s.len());
        rest = &s[end..];
        Some(&s[..end])
    };
    let (range, perms) = (take()?, take()?);
    // offset, device, inode
    for _ in 0..3 {
        take()?;
    }
    let path = rest
        .iter()
        .position(|b| *b != b' ')
        .map_or(&b""[..], |i| &rest[i..]);
    Some((range, perms, path))
}

fn mappings(pid: i32, budget: &mut usize) -> Option<Writer> {
    let unknown = Some(Writer::Unknown { pid });
    let file = match std::fs::File::open(format!("/proc/{pid}/maps")) {
        Ok(f) => f,
        Err(e) if gone(&e) => return None,
        Err(_) => return unknown,
    };
    let mut reader = BufReader::new(file);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => return None,
            Ok(_) => {}
            Err(e) if gone(&e) => return None,
            Err(_) => return unknown,
        }
        if !spend(budget) {
            return Some(Writer::Unknown { pid: 0 });
        }
        let Some((range, perms, path)) = fields(&line) else {
            return unknown;
        };
        if perms.get(1) != Some(&b'w') || perms.get(3) != Some(&b's') {
            continue;
        }
        if path == IO_URING {
            return Some(Writer::IoUring { pid });
        }
        if path == AIO_RING {
            return Some(Writer::Aio { pid });
        }
        let link = format!("/proc/{pid}/map_files/{}", String::from_utf8_lossy(range));
        match std::fs::metadata(&link) {
            Ok(m) if m.file_type().is_file() && m.nlink() > 0 => {
                return Some(Writer::FileMapping {
                    pid,
                    inode: m.ino(),
                })
            }
            Ok(_) => {}
            Err(e) if gone(&e) => {}
            Err(_) => return unknown,
        }
    }
}

fn tasks(pid: i32, budget: &mut usize) -> Option<Writer> {
    let unknown = Some(Writer::Unknown { pid });
    let dir = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(d) => d,
        Err(e) if gone(&e) => return None,
        Err(_) => return unknown,
    };
    for entry in dir {
        let tid = match entry {
            Ok(e) => e.file_name(),
            Err(e) if gone(&e) => return None,
            Err(_) => return unknown,
        };
        if !spend(budget) {
            return Some(Writer::Unknown { pid: 0 });
        }
        let task = format!("/proc/{pid}/task/{}", tid.to_string_lossy());
        match std::fs::read(format!("{task}/comm")) {
            Ok(comm) if comm.starts_with(b"iou-sqp-") || comm.starts_with(b"iou-wrk-") => {
                return Some(Writer::IoUring { pid })
            }
            Ok(_) => {}
            Err(e) if gone(&e) => continue,
            Err(_) => return unknown,
        }
        let fds = match std::fs::read_dir(format!("{task}/fd")) {
            Ok(d) => d,
            Err(e) if gone(&e) => continue,
            Err(_) => return unknown,
        };
        for fd in fds {
            let path = match fd {
                Ok(fd) => fd.path(),
                Err(e) if gone(&e) => break,
                Err(_) => return unknown,
            };
            if !spend(budget) {
                return Some(Writer::Unknown { pid: 0 });
            }
            match std::fs::read_link(&path) {
                Ok(target) if target.as_os_str().as_bytes() == IO_URING => {
                    return Some(Writer::IoUring { pid })
                }
                Ok(_) => {}
                Err(e) if gone(&e) => {}
                Err(_) => return unknown,
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_split() {
        let l = b"7f05f9df1000-7f05f9df2000 rw-s 00000000 00:01 370                        /dev/zero (deleted)\n";
        assert_eq!(
            fields(l),
            Some((
                &b"7f05f9df1000-7f05f9df2000"[..],
                &b"rw-s"[..],
                &b"/dev/zero (deleted)"[..]
            ))
        );
        let anon = b"7ffd1000-7ffd2000 rw-p 00000000 00:00 0 \n";
        assert_eq!(fields(anon).map(|f| f.2), Some(&b""[..]));
        assert_eq!(fields(b"garbage"), None);
    }

    /// One test (not several running in parallel threads of this process), since a scan
    /// reports the first writer of the process.
    #[test]
    fn writers_of_this_process_are_seen() {
        let me = std::process::id() as i32;
        assert_eq!(scan(&[me]), None, "the test process holds nothing yet");
        assert!(
            scan(&[i32::MAX]).is_none(),
            "a missing process holds nothing"
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let map = |prot| {
            // SAFETY: a fresh shared mapping of a 4 KiB file we own; unmapped below, never
            // dereferenced.
            let addr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    prot,
                    libc::MAP_SHARED,
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0,
                )
            };
            assert_ne!(addr, libc::MAP_FAILED);
            let seen = scan(&[me]);
            // SAFETY: the mapping made above, of that length.
            unsafe { libc::munmap(addr, 4096) };
            seen
        };
        let ino = std::fs::metadata(&path).unwrap().ino();
        assert_eq!(
            map(libc::PROT_READ | libc::PROT_WRITE),
            Some(Writer::FileMapping {
                pid: me,
                inode: ino
            })
        );
        assert_eq!(map(libc::PROT_READ), None, "a read-only shared mapping");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            map(libc::PROT_READ | libc::PROT_WRITE),
            None,
            "a mapping of an unlinked file is process memory"
        );

        // io_uring_setup(4, params): 120 bytes of parameters, zeroed.
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup with a valid, writable parameter block of its size.
        let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4, params.as_mut_ptr()) };
        if ring >= 0 {
            assert_eq!(scan(&[me]), Some(Writer::IoUring { pid: me }));
            // SAFETY: the descriptor io_uring_setup just returned, closed once.
            unsafe { libc::close(ring as i32) };
        } else {
            eprintln!("io_uring refused here: {}", std::io::Error::last_os_error());
        }

        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup with a valid out-pointer for the context.
        if unsafe { libc::syscall(libc::SYS_io_setup, 8, &mut ctx) } == 0 {
            assert_eq!(scan(&[me]), Some(Writer::Aio { pid: me }));
            // SAFETY: the context io_setup just made, destroyed once.
            unsafe { libc::syscall(libc::SYS_io_destroy, ctx) };
        } else {
            eprintln!(
                "Linux AIO refused here: {}",
                std::io::Error::last_os_error()
            );
        }
        assert_eq!(scan(&[me]), None, "everything released");
    }
}
