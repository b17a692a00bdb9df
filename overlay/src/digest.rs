//! Integrity digests: blake3 of a file, and a canonical digest of a directory tree (an
//! overlay's merged view, or an upper directory) that two restores of the same checkpoint
//! must agree on.
//!
//! The tree digest is the blake3 of a canonical listing, one line per entry in sorted
//! pre-order (see [`tree_listing`]). Each line holds, for the entry: its relative path
//! (`.` for the root), type, permission and special mode bits, uid:gid, mtime in
//! nanoseconds (not for directories: creating a child changes them), size and blake3 of
//! the content (regular files), target (symlinks), device numbers (device nodes), the
//! hardlink group (for a non-directory whose inode was already listed: the line number of
//! its first occurrence), and the extended attributes `user.*`, `security.*`, `trusted.*`
//! except `trusted.overlay.*` (overlay bookkeeping that differs between equal trees), and
//! the POSIX ACLs, sorted. Link counts, inode numbers, atimes and ctimes are left out.
//! Bytes outside printable ASCII, space, `\` and `=` are written `\xNN`, so each line is an
//! unambiguous encoding of its entry.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};

use crate::format::hex;
use crate::sys::{self, Call, SyscallError, Xattr};
use crate::walk::{file_type, normalize_excludes, walk, WalkEntry, WalkErrorSink, WalkFailure};

/// Why a digest could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    /// Opening the file to hash failed.
    #[error("opening {path} failed")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Reading the file to hash failed.
    #[error("reading {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// Walking the tree (open, list, stat, readlink, xattrs) failed.
    #[error("reading {path} in the tree failed")]
    Walk {
        /// The entry (root joined with its relative path).
        path: PathBuf,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// An entry lies deeper than [`MAX_WALK_DEPTH`](crate::MAX_WALK_DEPTH) levels below the
    /// root.
    #[error("{path} is more than {max} directory levels deep")]
    TooDeep {
        /// The first entry below the limit (root joined with its relative path).
        path: PathBuf,
        /// The limit.
        max: usize,
    },
    /// A directory holds more names than the walk may hold at once.
    #[error("{path}: more than {max} entries held at once")]
    TooManyEntries {
        /// The directory being listed (root joined with its relative path).
        path: PathBuf,
        /// The limit.
        max: u64,
    },
    /// A directory re-opened through `..` was not the one the walk had left: the tree was
    /// moved during the walk.
    #[error("directory {path} moved during the walk")]
    DirectoryMoved {
        /// The directory whose parent changed (root joined with its relative path).
        path: PathBuf,
    },
}

impl WalkErrorSink for DigestError {
    fn walk_error(path: PathBuf, failure: WalkFailure) -> Self {
        match failure {
            WalkFailure::Syscall(source) => DigestError::Walk { path, source },
            WalkFailure::TooDeep { max } => DigestError::TooDeep { path, max },
            WalkFailure::TooManyEntries { max } => DigestError::TooManyEntries { path, max },
            WalkFailure::Moved => DigestError::DirectoryMoved { path },
        }
    }
}

/// Most directory entries a digest walk holds in memory at once (the names of the
/// directories on the current path): about 4 million, a few hundred MiB at worst.
pub const DIGEST_MAX_NAMES: u64 = 1 << 22;

/// blake3 of the bytes of the file at `path` (following symlinks: the path is the
/// caller's own), as 64 lowercase hex digits. Errors: [`DigestError::Open`],
/// [`DigestError::Read`].
pub fn file_digest(path: &Path) -> Result<String, DigestError> {
    let file = File::open(path).map_err(|source| DigestError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    hash_reader(file)
        .map(|hash| hash.to_hex().to_string())
        .map_err(|source| DigestError::Read {
            path: path.to_path_buf(),
            source,
        })
}

fn hash_reader(mut reader: impl Read) -> io::Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match reader.read(&mut buf) {
            Ok(0) => return Ok(hasher.finalize()),
            Ok(n) => {
                hasher.update(&buf[..n]);
            }
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        }
    }
}

/// Canonical digest of the tree at `root` (64 lowercase hex digits): blake3 of the lines
/// of [`tree_listing`], each ended by `\n`. Never follows a symlink (`root` itself must
/// not be one). `exclude` holds relative paths (e.g. `["proc", "dev"]`) skipped together
/// with everything below them. Errors: [`DigestError`].
pub fn tree_digest(root: &Path, exclude: &[&str]) -> Result<String, DigestError> {
    let mut hasher = blake3::Hasher::new();
    visit_tree(root, exclude, |line| {
        hasher.update(line.as_bytes());
        hasher.update(b"\n");
    })?;
    Ok(hasher.finalize().to_hex().to_string())
}

/// The canonical listing [`tree_digest`] hashes: one line per entry, in sorted pre-order.
/// Compare two listings with [`first_difference`] to see why two digests differ.
pub fn tree_listing(root: &Path, exclude: &[&str]) -> Result<Vec<String>, DigestError> {
    let mut lines = Vec::new();
    visit_tree(root, exclude, |line| lines.push(line.to_owned()))?;
    Ok(lines)
}

/// The first line where two listings differ, as `(line number, left, right)`; a missing
/// line (one listing is longer) is `None`. `None` overall when they are equal.
pub fn first_difference<'a>(
    left: &'a [String],
    right: &'a [String],
) -> Option<(usize, Option<&'a str>, Option<&'a str>)> {
    let len = left.len().max(right.len());
    (0..len).find_map(|i| {
        let (l, r) = (left.get(i), right.get(i));
        (l != r).then(|| (i, l.map(String::as_str), r.map(String::as_str)))
    })
}

fn visit_tree(
    root: &Path,
    exclude: &[&str],
    mut emit: impl FnMut(&str),
) -> Result<(), DigestError> {
    let exclude = normalize_excludes(exclude);
    let mut first_seen: HashMap<(u32, u32, u64), usize> = HashMap::new();
    let mut index = 0usize;
    let mut line = String::new();
    walk(root, &exclude, DIGEST_MAX_NAMES, |entry: &WalkEntry<'_>| {
        line.clear();
        describe(entry, index, &mut first_seen, &mut line)?;
        emit(&line);
        index += 1;
        Ok(())
    })
}

/// blake3 over the metadata of every entry of the tree at `root`, in sorted pre-order:
/// relative path, inode, mode, size, mtime and ctime (nanoseconds); file contents are not
/// read. Any change to the tree (a write moves mtime and ctime, a chmod the ctime) changes
/// it; reading does not. Cheap enough to compare a sandbox's upper layer before and after
/// an action. Never follows a symlink; bounded like every walk of this crate (depth
/// [`MAX_WALK_DEPTH`](crate::MAX_WALK_DEPTH), fds, at most `max_names` names held).
///
/// Errors: [`DigestError::Walk`], [`DigestError::TooDeep`],
/// [`DigestError::TooManyEntries`], [`DigestError::DirectoryMoved`].
pub fn metadata_fingerprint(root: &Path, max_names: u64) -> Result<[u8; 32], DigestError> {
    let mut hasher = blake3::Hasher::new();
    walk(root, &[], max_names, |entry: &WalkEntry<'_>| {
        let stat = entry.stat;
        hasher.update(&(entry.rel.len() as u64).to_le_bytes());
        hasher.update(entry.rel);
        for v in [
            stat.stx_ino,
            u64::from(stat.stx_mode),
            stat.stx_size,
            stat.stx_mtime.tv_sec as u64,
            u64::from(stat.stx_mtime.tv_nsec),
            stat.stx_ctime.tv_sec as u64,
            u64::from(stat.stx_ctime.tv_nsec),
        ] {
            hasher.update(&v.to_le_bytes());
        }
        Ok::<(), DigestError>(())
    })?;
    Ok(*hasher.finalize().as_bytes())
}

/// Sum of the apparent sizes (bytes) of the regular files in the tree at `root`, a file
/// with several links counted once per link. Never follows a symlink; bounded like
/// [`metadata_fingerprint`].
///
/// Errors: as [`metadata_fingerprint`].
pub fn tree_bytes(root: &Path, max_names: u64) -> Result<u64, DigestError> {
    let mut total = 0u64;
    walk(root, &[], max_names, |entry: &WalkEntry<'_>| {
        if file_type(entry.stat) == FileType::RegularFile {
            total = total.saturating_add(entry.stat.stx_size);
        }
        Ok::<(), DigestError>(())
    })?;
    Ok(total)
}

/// Appends `bytes` escaped: printable ASCII other than space, `\` and `=` as is, the rest
/// as `\xNN`.
fn escape_into(out: &mut String, bytes: &[u8]) {
    for &b in bytes {
        if b.is_ascii_graphic() && b != b'\\' && b != b'=' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
}

fn describe(
    entry: &WalkEntry<'_>,
    index: usize,
    first_seen: &mut HashMap<(u32, u32, u64), usize>,
    out: &mut String,
) -> Result<(), DigestError> {
    let fail = |source| DigestError::Walk {
        path: PathBuf::from(std::ffi::OsStr::from_bytes(entry.rel)),
        source,
    };
    let stat = entry.stat;
    let kind = file_type(stat);
    if entry.is_root() {
        out.push('.');
    } else {
        escape_into(out, entry.rel);
    }
    let tag = match kind {
        FileType::Directory => 'd',
        FileType::RegularFile => 'f',
        FileType::Symlink => 'l',
        FileType::CharacterDevice => 'c',
        FileType::BlockDevice => 'b',
        FileType::Fifo => 'p',
        FileType::Socket => 's',
        _ => '?',
    };
    let _ = write!(
        out,
        " {tag} mode={:04o} owner={}:{}",
        u32::from(stat.stx_mode) & 0o7777,
        stat.stx_uid,
        stat.stx_gid
    );
    if kind != FileType::Directory {
        let _ = write!(
            out,
            " mtime={}.{:09}",
            stat.stx_mtime.tv_sec, stat.stx_mtime.tv_nsec
        );
        if stat.stx_nlink > 1 {
            let key = (stat.stx_dev_major, stat.stx_dev_minor, stat.stx_ino);
            let first = *first_seen.entry(key).or_insert(index);
            if first != index {
                let _ = write!(out, " link=#{first}");
            }
        }
    }
    let name = entry.name.to_bytes();
    let xattrs: Vec<Xattr> = match kind {
        FileType::Directory => {
            sys::xattrs_of_fd(entry.dir.expect("the walk opens every directory")).map_err(fail)?
        }
        FileType::RegularFile => {
            let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let fd: OwnedFd = rustix::fs::openat(entry.parent, entry.name, flags, Mode::empty())
                .call("openat")
                .map_err(fail)?;
            let xattrs = sys::xattrs_of_fd(fd.as_fd()).map_err(fail)?;
            let hash =
                hash_reader(File::from(fd)).map_err(|e| fail(SyscallError::new("read", e)))?;
            let _ = write!(out, " size={} blake3={}", stat.stx_size, hash.to_hex());
            xattrs
        }
        _ => {
            if kind == FileType::Symlink {
                let target = rustix::fs::readlinkat(entry.parent, entry.name, Vec::new())
                    .call("readlinkat")
                    .map_err(fail)?;
                out.push_str(" target=");
                escape_into(out, target.as_bytes());
            }
            if matches!(kind, FileType::CharacterDevice | FileType::BlockDevice) {
                let _ = write!(out, " rdev={}:{}", stat.stx_rdev_major, stat.stx_rdev_minor);
            }
            sys::xattrs_of_path(&sys::proc_fd_path(entry.parent, name)).map_err(fail)?
        }
    };
    for (xname, value) in xattrs
        .iter()
        .filter(|(n, _)| !n.starts_with(b"trusted.overlay."))
    {
        out.push_str(" xattr:");
        escape_into(out, xname);
        let _ = write!(out, "={}", hex(value));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_digest_is_blake3_hex() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(
            file_digest(&path).unwrap(),
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
        assert!(matches!(
            file_digest(&dir.path().join("missing")),
            Err(DigestError::Open { .. })
        ));
    }

    #[test]
    fn escaping_is_unambiguous() {
        let mut out = String::new();
        escape_into(&mut out, b"a b\\=\n\xffz");
        assert_eq!(out, "a\\x20b\\x5c\\x3d\\x0a\\xffz");
    }

    #[test]
    fn first_difference_finds_the_line() {
        let a = vec!["x".to_string(), "y".to_string()];
        let b = vec!["x".to_string(), "z".to_string(), "w".to_string()];
        assert_eq!(first_difference(&a, &a), None);
        assert_eq!(first_difference(&a, &b), Some((1, Some("y"), Some("z"))));
        assert_eq!(first_difference(&a[..1], &a), Some((1, None, Some("y"))));
    }
}
