//! Thin safe wrappers around the syscalls this crate needs beyond what `rustix` offers as one
//! call: extended-attribute listing, `/proc/self/fd` paths for `*xattr` on entries that have
//! no usable fd, kernel-side file copies with a read/write fallback, and sorted directory
//! listings. Every failure is a [`SyscallError`] naming the call.

use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Dir, XattrFlags};
use rustix::io::Errno;

use crate::format::{is_layer_xattr, MAX_XATTR_VALUE_BYTES};

/// A failed system call: which one, and the error it returned.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed")]
pub struct SyscallError {
    /// The system call (or libc-level operation) that failed, e.g. `"openat2"`.
    pub call: &'static str,
    /// The error it returned.
    #[source]
    pub source: io::Error,
}

impl SyscallError {
    pub(crate) fn new(call: &'static str, source: impl Into<io::Error>) -> Self {
        Self {
            call,
            source: source.into(),
        }
    }

    /// The errno behind this error, when it came from the kernel.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

/// Shorthand for mapping a `rustix` result into a [`SyscallError`] result.
pub(crate) trait Call<T> {
    fn call(self, name: &'static str) -> Result<T, SyscallError>;
}

impl<T> Call<T> for Result<T, Errno> {
    fn call(self, name: &'static str) -> Result<T, SyscallError> {
        self.map_err(|errno| SyscallError::new(name, errno))
    }
}

impl<T> Call<T> for io::Result<T> {
    fn call(self, name: &'static str) -> Result<T, SyscallError> {
        self.map_err(|err| SyscallError::new(name, err))
    }
}

/// One extended attribute: name and value, both raw bytes.
pub(crate) type Xattr = (Vec<u8>, Vec<u8>);

/// `/proc/self/fd/<dir>/<name>`: a path that reaches `name` inside the directory open as
/// `dir` without resolving anything but that last component. Used only with `l*xattr`
/// calls (which do not follow the last component) on entries that have no fd of their own
/// (symlinks, device nodes, fifos).
pub(crate) fn proc_fd_path(dir: BorrowedFd<'_>, name: &[u8]) -> PathBuf {
    let mut bytes = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
    bytes.extend_from_slice(name);
    PathBuf::from(OsStr::from_bytes(&bytes))
}

/// The extended attributes of the open file `fd` in the namespaces a layer carries
/// ([`is_layer_xattr`]), sorted by name. A filesystem without xattr support yields none.
pub(crate) fn xattrs_of_fd(fd: BorrowedFd<'_>) -> Result<Vec<Xattr>, SyscallError> {
    read_xattrs(
        |buf| rustix::fs::flistxattr(fd, buf),
        |name, buf| rustix::fs::fgetxattr(fd, name, buf),
        ("flistxattr", "fgetxattr"),
    )
}

/// Like [`xattrs_of_fd`] for `path`, without following a symlink in its last component.
pub(crate) fn xattrs_of_path(path: &Path) -> Result<Vec<Xattr>, SyscallError> {
    read_xattrs(
        |buf| rustix::fs::llistxattr(path, buf),
        |name, buf| rustix::fs::lgetxattr(path, name, buf),
        ("llistxattr", "lgetxattr"),
    )
}

fn read_xattrs(
    list: impl Fn(&mut [u8]) -> Result<usize, Errno>,
    get: impl Fn(&CStr, &mut [u8]) -> Result<usize, Errno>,
    calls: (&'static str, &'static str),
) -> Result<Vec<Xattr>, SyscallError> {
    let mut names = vec![0u8; 1024];
    let len = loop {
        match list(&mut names) {
            Ok(len) => break len,
            Err(Errno::RANGE) => {
                let wanted = list(&mut []).call(calls.0)?;
                names.resize(wanted.max(names.len() * 2), 0);
            }
            Err(Errno::NOTSUP) => return Ok(Vec::new()),
            Err(errno) => return Err(SyscallError::new(calls.0, errno)),
        }
    };
    let mut out = Vec::new();
    let mut value = vec![0u8; MAX_XATTR_VALUE_BYTES];
    for name in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if !is_layer_xattr(name) {
            continue;
        }
        let cname = CString::new(name).expect("xattr names from the kernel hold no NUL");
        match get(&cname, &mut value) {
            Ok(n) => out.push((name.to_vec(), value[..n].to_vec())),
            // Removed between list and get.
            Err(Errno::NODATA) => continue,
            Err(errno) => return Err(SyscallError::new(calls.1, errno)),
        }
    }
    out.sort();
    Ok(out)
}

/// Sets extended attribute `name` on the open file `fd`.
pub(crate) fn set_xattr_fd(
    fd: BorrowedFd<'_>,
    name: &[u8],
    value: &[u8],
) -> Result<(), SyscallError> {
    rustix::fs::fsetxattr(fd, name, value, XattrFlags::empty()).call("fsetxattr")
}

/// Sets extended attribute `name` on `path` without following a symlink in its last component.
pub(crate) fn set_xattr_path(path: &Path, name: &[u8], value: &[u8]) -> Result<(), SyscallError> {
    rustix::fs::lsetxattr(path, name, value, XattrFlags::empty()).call("lsetxattr")
}

/// Copies up to `len` bytes from `src` at `src_off` to `dst` at `dst_off` with
/// `copy_file_range` (the kernel moves the data, or shares extents on filesystems that
/// can), falling back to `pread`/`pwrite` where the kernel refuses the pair of files.
/// Neither file offset moves. Returns the bytes copied, less than `len` only when `src`
/// ends first.
pub(crate) fn copy_range(
    src: BorrowedFd<'_>,
    src_off: u64,
    dst: BorrowedFd<'_>,
    dst_off: u64,
    len: u64,
) -> Result<u64, SyscallError> {
    RangeCopier::new(0).copy(src, src_off, dst, dst_off, len)
}

/// Copies many ranges between the same two files: `copy_file_range` for ranges of at least
/// `kernel_min` bytes until the kernel refuses the pair (then never again), `pread`/`pwrite`
/// through one buffer, allocated once, for the others. Many small ranges cost a syscall pair
/// each, not an extent-sharing call (slower than copying 4 KiB) or an allocation.
pub(crate) struct RangeCopier {
    kernel: bool,
    kernel_min: u64,
    buf: Vec<u8>,
}

impl RangeCopier {
    /// A copier that hands ranges of `kernel_min` bytes or more to the kernel.
    pub(crate) fn new(kernel_min: u64) -> RangeCopier {
        RangeCopier {
            kernel: true,
            kernel_min,
            buf: Vec::new(),
        }
    }

    /// Copies up to `len` bytes from `src` at `src_off` to `dst` at `dst_off`; returns the
    /// bytes copied, less than `len` only when `src` ends first. Neither file offset moves.
    pub(crate) fn copy(
        &mut self,
        src: BorrowedFd<'_>,
        mut src_off: u64,
        dst: BorrowedFd<'_>,
        mut dst_off: u64,
        len: u64,
    ) -> Result<u64, SyscallError> {
        const CHUNK: u64 = 1 << 30;
        let mut done = 0u64;
        while self.kernel && len >= self.kernel_min && done < len {
            let want = usize::try_from((len - done).min(CHUNK)).unwrap_or(usize::MAX);
            match rustix::fs::copy_file_range(
                src,
                Some(&mut src_off),
                dst,
                Some(&mut dst_off),
                want,
            ) {
                Ok(0) => return Ok(done),
                Ok(n) => done += n as u64,
                Err(Errno::INTR) => continue,
                Err(Errno::XDEV | Errno::INVAL | Errno::NOSYS | Errno::OPNOTSUPP) => {
                    self.kernel = false;
                }
                Err(errno) => return Err(SyscallError::new("copy_file_range", errno)),
            }
        }
        Ok(done + self.copy_rw(src, src_off, dst, dst_off, len - done)?)
    }

    fn copy_rw(
        &mut self,
        src: BorrowedFd<'_>,
        mut src_off: u64,
        dst: BorrowedFd<'_>,
        mut dst_off: u64,
        len: u64,
    ) -> Result<u64, SyscallError> {
        const BUF: u64 = 1 << 20;
        if len > 0 && self.buf.is_empty() {
            self.buf = vec![0u8; BUF as usize];
        }
        let buf = &mut self.buf;
        let mut done = 0u64;
        while done < len {
            let want = usize::try_from((len - done).min(BUF)).unwrap_or(buf.len());
            let n = match rustix::io::pread(src, &mut buf[..want], src_off) {
                Ok(0) => return Ok(done),
                Ok(n) => n,
                Err(Errno::INTR) => continue,
                Err(errno) => return Err(SyscallError::new("pread", errno)),
            };
            write_all_at(dst, &buf[..n], dst_off)?;
            src_off += n as u64;
            dst_off += n as u64;
            done += n as u64;
        }
        Ok(done)
    }
}

/// Reads from `src` at `offset` until `buf` is full or the file ends; returns the bytes read.
pub(crate) fn read_full_at(
    src: BorrowedFd<'_>,
    buf: &mut [u8],
    offset: u64,
) -> Result<usize, SyscallError> {
    let mut done = 0;
    while done < buf.len() {
        match rustix::io::pread(src, &mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(SyscallError::new("pread", errno)),
        }
    }
    Ok(done)
}

/// Writes all of `buf` to `dst` at `offset`.
pub(crate) fn write_all_at(
    dst: BorrowedFd<'_>,
    mut buf: &[u8],
    mut offset: u64,
) -> Result<(), SyscallError> {
    while !buf.is_empty() {
        match rustix::io::pwrite(dst, buf, offset) {
            Ok(0) => return Err(SyscallError::new("pwrite", io::ErrorKind::WriteZero)),
            Ok(n) => {
                buf = &buf[n..];
                offset += n as u64;
            }
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(SyscallError::new("pwrite", errno)),
        }
    }
    Ok(())
}

/// fsyncs the directory at `path` (after a rename into it).
pub(crate) fn fsync_dir(path: &Path) -> Result<(), SyscallError> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .call("open")?;
    rustix::fs::fsync(&fd).call("fsync")
}

/// The names in the directory open as `dir`, without `.` and `..`, sorted bytewise.
pub(crate) fn sorted_names(dir: impl AsFd) -> Result<Vec<CString>, SyscallError> {
    Ok(sorted_names_at_most(dir, usize::MAX)?.unwrap_or_default())
}

/// [`sorted_names`], or `None` as soon as the directory turns out to hold more than `max`
/// names (the rest is not read: memory stays bounded for huge directories).
pub(crate) fn sorted_names_at_most(
    dir: impl AsFd,
    max: usize,
) -> Result<Option<Vec<CString>>, SyscallError> {
    let mut names = Vec::new();
    for entry in Dir::read_from(dir).call("openat(\".\")")? {
        let entry = entry.call("getdents64")?;
        let name = entry.file_name();
        if name != c"." && name != c".." {
            if names.len() == max {
                return Ok(None);
            }
            names.push(name.to_owned());
        }
    }
    names.sort_unstable();
    Ok(Some(names))
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Write;

    use super::*;

    #[test]
    fn copy_range_copies_and_reports_short_source() {
        let dir = tempfile::tempdir().unwrap();
        let mut src = File::create(dir.path().join("src")).unwrap();
        src.write_all(b"hello world").unwrap();
        let src = File::open(dir.path().join("src")).unwrap();
        let dst = File::create(dir.path().join("dst")).unwrap();
        let copied = copy_range(src.as_fd(), 6, dst.as_fd(), 3, 100).unwrap();
        assert_eq!(copied, 5);
        // Below the kernel threshold: read and written through the copier's one buffer,
        // which serves every later range.
        let mut copier = RangeCopier::new(1 << 20);
        let copied = copier.copy(src.as_fd(), 0, dst.as_fd(), 8, 5).unwrap();
        assert_eq!(copied, 5);
        assert_eq!(
            std::fs::read(dir.path().join("dst")).unwrap(),
            b"\0\0\0worldhello"
        );
        let copied = copier.copy(src.as_fd(), 0, dst.as_fd(), 0, 3).unwrap();
        assert_eq!(copied, 3);
        assert_eq!(
            std::fs::read(dir.path().join("dst")).unwrap(),
            b"helworldhello"
        );
    }

    #[test]
    fn sorted_names_are_bytewise_sorted() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["b", "a", "B", "a\u{e9}"] {
            File::create(dir.path().join(name)).unwrap();
        }
        let fd = File::open(dir.path()).unwrap();
        let names = sorted_names(&fd).unwrap();
        let names: Vec<&[u8]> = names.iter().map(|n| n.to_bytes()).collect();
        assert_eq!(names, [&b"B"[..], b"a", "a\u{e9}".as_bytes(), b"b"]);
    }

    #[test]
    fn xattrs_are_filtered_and_sorted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = File::create(&path).unwrap();
        set_xattr_fd(file.as_fd(), b"user.b", b"2").unwrap();
        set_xattr_path(&path, b"user.a", b"1").unwrap();
        let by_fd = xattrs_of_fd(file.as_fd()).unwrap();
        assert_eq!(
            by_fd,
            vec![
                (b"user.a".to_vec(), b"1".to_vec()),
                (b"user.b".to_vec(), b"2".to_vec())
            ]
        );
        let parent = File::open(dir.path()).unwrap();
        let by_path = xattrs_of_path(&proc_fd_path(parent.as_fd(), b"f")).unwrap();
        assert_eq!(by_fd, by_path);
    }
}
