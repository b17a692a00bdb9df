//! The restored mount tree as the path checks see it, and the two ways CRIU resolves paths.
//!
//! Each file system of the images is modelled by what it will hold when CRIU touches it:
//! the restore root by the freshly materialized tree itself (looked up with `openat2`
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`, and `RESOLVE_NO_XDEV` for a
//! sandbox root, so a lookup never leaves it), a tmpfs by its archive ([`TarTree`]), procfs by a
//! rule (every name is a directory except the magic links, see [`proc_entry`]), devpts by
//! another (`ptmx` and the numbered pty nodes, see [`devpts_entry`]). Entries CRIU
//! creates during the restore (ghost files, sockets, directories) are layered on top, in the
//! order CRIU creates them.
//!
//! [`World::walk_fs`] resolves within one mount, never crossing into another and refusing
//! every symbolic link: that is what CRIU's host-context operations see (ghost files under
//! `<yard>/mnt-<id>/`, where each mount is its own plain mount, looked up from the host root).
//! [`World::walk_ns`] resolves in the restored namespace, crossing mounts at their mount
//! points: strictly for paths the kernel wrote at dump time (file descriptors), or following
//! symbolic links with chroot semantics (absolute targets restart at the root, `..` stops
//! there) for unix-socket names, which CRIU binds inside `chroot(<restored root>)`.
//!
//! A walk that stops is a [`WalkError`]; [`walk_error`] turns it into the validator's
//! [`UnsafeImagePath`] for the image being checked. Path components and [`Entry`] are in
//! `path`.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstat, Mode, SFlag};

use super::error::{PathOp, UnsafeImagePath, UnsafeKind};
use super::path::{show, Comps, Entry};
use super::tmpfs::TarTree;
use crate::sys::SyscallError;

/// Most symbolic links followed in one resolution (the kernel's limit).
const MAX_SYMLINKS: usize = 40;

/// One file system of the restored tree.
#[derive(Debug)]
pub(crate) enum Fs {
    /// The restore root, open as an `O_PATH` directory.
    Root { fd: OwnedFd, no_xdev: bool },
    /// A tmpfs, by its archive.
    Tar(TarTree),
    /// A procfs.
    Proc,
    /// A devpts instance (CRIU mounts a fresh one and opens its ptys by index).
    Devpts,
    /// A bind of an allow-listed host file or empty directory (an external mount CRIU binds
    /// from the same host path at restore): its root is `Other` (a file) or `Dir`, and nothing
    /// exists or may be created below it.
    External {
        /// The mount's root inside its file system.
        root: Comps,
        /// Whether it is a directory.
        dir: bool,
    },
}

impl Fs {
    /// Whether the restore must not create anything here (procfs, devpts, host binds).
    pub(crate) fn refuses_creation(&self) -> bool {
        matches!(self, Fs::Proc | Fs::Devpts | Fs::External { .. })
    }
}

/// One mount: which file system, from which directory of it, where in the namespace.
#[derive(Debug, Clone)]
pub(crate) struct Mount {
    pub mnt_id: u32,
    pub fs: usize,
    /// The mount's root inside its file system.
    pub root: Comps,
    /// Where it is mounted, from the namespace root.
    pub mountpoint: Comps,
}

/// How a resolution ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Walk {
    /// File system of the final location.
    pub fs: usize,
    /// Path of the parent inside that file system, as far as it exists.
    pub parent: Comps,
    /// Missing components below `parent` (empty when the parent exists), the last one
    /// being the leaf's name.
    pub missing: Comps,
    /// The leaf's entry (`Missing` when it or a parent is missing).
    pub leaf: Entry,
    /// `parent` as a path from the namespace root (for messages).
    pub shown: Comps,
}

impl Walk {
    /// The leaf's full path inside its file system (existing part plus missing part).
    pub(crate) fn path(&self) -> Comps {
        self.parent.iter().chain(&self.missing).cloned().collect()
    }
}

/// The modelled tree: file systems, mounts, entries the restore creates, a lookup cache.
#[derive(Debug, Default)]
pub(crate) struct World {
    pub fss: Vec<Fs>,
    /// Mounts, the namespace root first.
    pub mounts: Vec<Mount>,
    created: HashMap<(usize, Comps), Entry>,
    cache: HashMap<(usize, Comps), Entry>,
    /// `openat2` calls made.
    pub lookups: usize,
}

/// The procfs entry at `comps` (relative to the procfs root): magic links are `self`,
/// `thread-self`, and below `<pid>/` or `<pid>/task/<tid>/`: `cwd`, `root`, `exe` and every
/// child of `fd`, `map_files` and `ns`.
pub(crate) fn proc_entry(comps: &[Vec<u8>]) -> Entry {
    let is_num = |c: &[u8]| !c.is_empty() && c.iter().all(u8::is_ascii_digit);
    if comps.iter().any(|c| c == b"self" || c == b"thread-self") {
        return Entry::MagicLink;
    }
    let base = match comps {
        [p, t, n, ..] if is_num(p) && t == b"task" && is_num(n) => 3,
        [p, ..] if is_num(p) => 1,
        _ => return Entry::Proc,
    };
    match &comps[base..] {
        [x, ..] if x == b"cwd" || x == b"root" || x == b"exe" => Entry::MagicLink,
        [x, _, ..] if x == b"fd" || x == b"map_files" || x == b"ns" => Entry::MagicLink,
        _ => Entry::Proc,
    }
}

/// The devpts entry at `comps` (relative to its root): the root directory, `ptmx` and the
/// numbered pty slaves (character devices, `Other`); nothing else exists there.
pub(crate) fn devpts_entry(comps: &[Vec<u8>]) -> Entry {
    let is_num = |c: &[u8]| !c.is_empty() && c.len() <= 10 && c.iter().all(u8::is_ascii_digit);
    match comps {
        [] => Entry::Dir,
        [name] if name == b"ptmx" || is_num(name) => Entry::Other,
        _ => Entry::Missing,
    }
}

impl World {
    /// Records that the restore creates `kind` at `comps` of file system `fs`.
    pub(crate) fn create(&mut self, fs: usize, comps: Comps, kind: Entry) {
        self.created.insert((fs, comps), kind);
    }

    /// The entry at `comps` of file system `fs`, whose every proper prefix is a directory.
    pub(crate) fn lookup(&mut self, fs: usize, comps: &[Vec<u8>]) -> Result<Entry, LookupError> {
        let key = (fs, comps.to_vec());
        if let Some(e) = self.created.get(&key).or_else(|| self.cache.get(&key)) {
            return Ok(e.clone());
        }
        let entry = match &self.fss[fs] {
            Fs::Tar(t) => t.get(comps),
            Fs::Proc => proc_entry(comps),
            Fs::Devpts => devpts_entry(comps),
            Fs::External { root, dir } => match comps.strip_prefix(root.as_slice()) {
                Some([]) if *dir => Entry::Dir,
                Some([]) => Entry::Other,
                _ => Entry::Missing,
            },
            Fs::Root { fd, no_xdev } => {
                self.lookups += 1;
                root_lookup(fd, comps, *no_xdev)?
            }
        };
        self.cache.insert(key, entry.clone());
        Ok(entry)
    }

    /// The mount covering namespace path `ns`: the one with the longest mount point that is a
    /// prefix of it, and the path inside its file system.
    pub(crate) fn mount_at(&self, ns: &[Vec<u8>]) -> (usize, Comps) {
        let mut best = 0;
        for (i, m) in self.mounts.iter().enumerate() {
            if ns.starts_with(&m.mountpoint)
                && m.mountpoint.len() >= self.mounts[best].mountpoint.len()
            {
                best = i;
            }
        }
        let m = &self.mounts[best];
        let inner = m
            .root
            .iter()
            .chain(&ns[m.mountpoint.len()..])
            .cloned()
            .collect();
        (m.fs, inner)
    }

    /// Resolves `rel` below `start` inside file system `fs` only, refusing every symbolic
    /// link and magic link. Missing components end the walk (reported in [`Walk::missing`]).
    /// Errors name components as `shown` (the mount point of `start`) followed by `rel`.
    pub(crate) fn walk_fs(
        &mut self,
        fs: usize,
        start: &[Vec<u8>],
        rel: &[Vec<u8>],
        shown: &[Vec<u8>],
    ) -> Result<Walk, WalkError> {
        let mut cur: Comps = start.to_vec();
        for (i, c) in rel.iter().enumerate() {
            cur.push(c.clone());
            let last = i + 1 == rel.len();
            let e = self.lookup(fs, &cur)?;
            match e {
                Entry::Dir | Entry::Proc if !last => {}
                Entry::Missing => {
                    cur.pop();
                    return Ok(Walk {
                        fs,
                        parent: cur,
                        missing: rel[i..].to_vec(),
                        leaf: Entry::Missing,
                        shown: shown.iter().chain(&rel[..i]).cloned().collect(),
                    });
                }
                _ if last => {
                    cur.pop();
                    return Ok(Walk {
                        fs,
                        parent: cur,
                        missing: vec![c.clone()],
                        leaf: e,
                        shown: shown.iter().chain(&rel[..i]).cloned().collect(),
                    });
                }
                e => {
                    let at: Comps = shown.iter().chain(&rel[..=i]).cloned().collect();
                    return Err(component_error(&e, &at).into());
                }
            }
        }
        // `rel` empty: the start itself.
        let leaf = self.lookup(fs, &cur)?;
        Ok(Walk {
            fs,
            parent: cur,
            missing: Vec::new(),
            leaf,
            shown: shown.to_vec(),
        })
    }

    /// Resolves namespace path `path` across mounts. Without `follow`, every symbolic link
    /// before the leaf is refused; with it, links are followed with chroot semantics (a leaf
    /// link is never followed: binds and unlinks do not follow it).
    pub(crate) fn walk_ns(&mut self, path: &[Vec<u8>], follow: bool) -> Result<Walk, WalkError> {
        let mut stack: Comps = Vec::new();
        let mut queue: std::collections::VecDeque<Vec<u8>> = path.iter().cloned().collect();
        let mut hops = 0;
        while let Some(c) = queue.pop_front() {
            if c == b".." {
                // Only from a followed link's target; chroot semantics.
                stack.pop();
                continue;
            }
            let last = queue.is_empty();
            stack.push(c);
            let (fs, inner) = self.mount_at(&stack);
            let e = self.lookup(fs, &inner)?;
            match e {
                Entry::Dir | Entry::Proc if !last => {}
                Entry::Symlink(target) if follow && !last => {
                    hops += 1;
                    if hops > MAX_SYMLINKS {
                        return Err(WalkError::Unsafe(UnsafeKind::TooManySymlinks));
                    }
                    stack.pop();
                    if target.first() == Some(&b'/') {
                        stack.clear();
                    }
                    if target.contains(&0) {
                        return Err(WalkError::Unsafe(UnsafeKind::Nul));
                    }
                    for t in target.split(|b| *b == b'/').rev() {
                        match t {
                            b"" | b"." => {}
                            t => queue.push_front(t.to_vec()),
                        }
                    }
                }
                Entry::Missing => {
                    let leaf = stack.pop().unwrap_or_default();
                    let (fs, parent) = self.mount_at(&stack);
                    if queue.iter().any(|c| c == b"..") {
                        return Err(WalkError::Unsafe(UnsafeKind::DotDot));
                    }
                    let missing = std::iter::once(leaf).chain(queue).collect();
                    return Ok(Walk {
                        fs,
                        parent,
                        missing,
                        leaf: Entry::Missing,
                        shown: stack,
                    });
                }
                _ if last => {
                    let leaf = stack.pop().unwrap_or_default();
                    let (fs, parent) = self.mount_at(&stack);
                    return Ok(Walk {
                        fs,
                        parent,
                        missing: vec![leaf],
                        leaf: e,
                        shown: stack,
                    });
                }
                e => return Err(component_error(&e, &stack).into()),
            }
        }
        let (fs, inner) = self.mount_at(&stack);
        let leaf = self.lookup(fs, &inner)?;
        Ok(Walk {
            fs,
            parent: inner,
            missing: Vec::new(),
            leaf,
            shown: stack,
        })
    }
}

fn component_error(e: &Entry, at: &[Vec<u8>]) -> UnsafeKind {
    let at = show(at);
    match e {
        Entry::Symlink(_) => UnsafeKind::Symlink { at },
        Entry::MagicLink => UnsafeKind::Procfs { at },
        _ => UnsafeKind::NotDirectory { at },
    }
}

/// Why a walk stopped.
#[derive(Debug)]
pub(crate) enum WalkError {
    Unsafe(UnsafeKind),
    Lookup(LookupError),
}

impl From<LookupError> for WalkError {
    fn from(e: LookupError) -> Self {
        match e {
            LookupError::Unsafe(k) => WalkError::Unsafe(k),
            e => WalkError::Lookup(e),
        }
    }
}

impl From<UnsafeKind> for WalkError {
    fn from(k: UnsafeKind) -> Self {
        WalkError::Unsafe(k)
    }
}

/// A lookup in the restore root that failed.
#[derive(Debug)]
pub(crate) enum LookupError {
    /// Something the check refuses (a mount inside the root, an over-long name).
    Unsafe(UnsafeKind),
    /// Any other errno.
    Syscall { path: String, source: SyscallError },
}

/// The validator's error for a refused path of `image`.
pub(super) fn refuse(image: &str, op: PathOp, path: &[u8], kind: UnsafeKind) -> UnsafeImagePath {
    UnsafeImagePath::Unsafe {
        image: image.to_string(),
        op,
        path: String::from_utf8_lossy(path).into_owned(),
        kind,
    }
}

/// Maps a failed walk to the validator's error.
pub(super) fn walk_error(image: &str, op: PathOp, path: &[u8], e: WalkError) -> UnsafeImagePath {
    match e {
        WalkError::Unsafe(kind) => refuse(image, op, path, kind),
        WalkError::Lookup(LookupError::Syscall { path, source }) => {
            UnsafeImagePath::Lookup { path, source }
        }
        WalkError::Lookup(LookupError::Unsafe(kind)) => refuse(image, op, path, kind),
    }
}

/// Looks `comps` up beneath the root fd: `O_PATH | O_NOFOLLOW` with `RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` (and `RESOLVE_NO_XDEV`), then `fstat`, and
/// `readlinkat` for a symbolic link (only the leaf can be one: the prefixes are directories).
fn root_lookup(root: &OwnedFd, comps: &[Vec<u8>], no_xdev: bool) -> Result<Entry, LookupError> {
    let mut path = Vec::new();
    for (i, c) in comps.iter().enumerate() {
        if i > 0 {
            path.push(b'/');
        }
        path.extend_from_slice(c);
    }
    if path.is_empty() {
        path.push(b'.');
    }
    let path = std::ffi::OsStr::from_bytes(&path);
    let mut resolve = ResolveFlag::RESOLVE_BENEATH
        | ResolveFlag::RESOLVE_NO_SYMLINKS
        | ResolveFlag::RESOLVE_NO_MAGICLINKS;
    if no_xdev {
        resolve |= ResolveFlag::RESOLVE_NO_XDEV;
    }
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .mode(Mode::empty())
        .resolve(resolve);
    let syscall = |call, e: Errno| LookupError::Syscall {
        path: show(comps),
        source: SyscallError::new(call, e),
    };
    // RESOLVE_BENEATH answers EAGAIN when a rename raced the lookup; nothing of the sandbox
    // runs during a restore, but retry a few times rather than fail on a host process.
    let mut tries = 0;
    let fd = loop {
        match nix::fcntl::openat2(root.as_fd(), path, how) {
            Ok(fd) => break fd,
            Err(Errno::EAGAIN) if tries < 8 => tries += 1,
            Err(Errno::ENOENT) => return Ok(Entry::Missing),
            Err(Errno::ENOTDIR) => return Ok(Entry::Other),
            Err(Errno::ELOOP) => return Ok(Entry::Symlink(Vec::new())),
            Err(Errno::EXDEV) => {
                return Err(LookupError::Unsafe(UnsafeKind::CrossesMount {
                    at: show(comps),
                }))
            }
            Err(Errno::ENAMETOOLONG) => {
                return Err(LookupError::Unsafe(UnsafeKind::TooLong { len: path.len() }))
            }
            Err(e) => return Err(syscall("openat2", e)),
        }
    };
    let st = fstat(&fd).map_err(|e| syscall("fstat", e))?;
    let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
    Ok(match kind {
        SFlag::S_IFDIR => Entry::Dir,
        SFlag::S_IFLNK => {
            let target = nix::fcntl::readlinkat(&fd, "").map_err(|e| syscall("readlinkat", e))?;
            Entry::Symlink(target.into_encoded_bytes())
        }
        _ => Entry::Other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::path::split;

    fn c(p: &str) -> Comps {
        split(p.as_bytes()).unwrap()
    }

    #[test]
    fn proc_magic_links() {
        for p in [
            "self/fd",
            "1/cwd",
            "12/root/etc",
            "3/fd/4",
            "3/task/3/exe",
            "9/ns/net",
            "thread-self",
        ] {
            assert_eq!(proc_entry(&c(p)), Entry::MagicLink, "{p}");
        }
        for p in [
            "",
            "sys",
            "sysrq-trigger",
            "1/status",
            "3/fd",
            "3/task/3/stat",
            "cpuinfo",
        ] {
            assert_eq!(proc_entry(&c(p)), Entry::Proc, "{p}");
        }
    }

    fn world(root: &std::path::Path) -> World {
        let fd = nix::fcntl::open(root, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty()).unwrap();
        let mut w = World::default();
        w.fss.push(Fs::Root { fd, no_xdev: true });
        w.mounts.push(Mount {
            mnt_id: 1,
            fs: 0,
            root: Vec::new(),
            mountpoint: Vec::new(),
        });
        w
    }

    #[test]
    fn walks_refuse_symlinks_and_follow_them_in_root() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("a/b")).unwrap();
        std::fs::create_dir_all(t.path().join("run/pg")).unwrap();
        std::os::unix::fs::symlink("/run", t.path().join("a/run")).unwrap();
        std::os::unix::fs::symlink("../../a/b", t.path().join("run/pg/up")).unwrap();
        std::os::unix::fs::symlink("/etc", t.path().join("a/etc")).unwrap();
        let mut w = world(t.path());

        let walk = w.walk_fs(0, &[], &c("a/b/x.ghost"), &[]).unwrap();
        assert_eq!((walk.parent, walk.leaf), (c("a/b"), Entry::Missing));
        let walk = w.walk_fs(0, &[], &c("a/q/r/f"), &[]).unwrap();
        assert_eq!((walk.parent, walk.missing), (c("a"), c("q/r/f")));
        match w.walk_fs(0, &[], &c("a/etc/passwd"), &c("mnt")) {
            Err(WalkError::Unsafe(UnsafeKind::Symlink { at })) => assert_eq!(at, "/mnt/a/etc"),
            r => panic!("{r:?}"),
        }
        assert!(w.walk_ns(&c("a/run/pg/s.sock"), false).is_err());

        // chroot semantics: /a/run -> /run; /run/pg/up -> ../../a/b; /etc stays inside.
        let walk = w.walk_ns(&c("a/run/pg/s.sock"), true).unwrap();
        assert_eq!((walk.parent, walk.missing), (c("run/pg"), c("s.sock")));
        let walk = w.walk_ns(&c("run/pg/up/s.sock"), true).unwrap();
        assert_eq!(walk.parent, c("a/b"));
        let walk = w.walk_ns(&c("a/etc/passwd"), true).unwrap();
        assert_eq!(walk.missing, c("etc/passwd"));
        assert!(walk.parent.is_empty());

        std::os::unix::fs::symlink("loop", t.path().join("loop")).unwrap();
        assert!(matches!(
            world(t.path()).walk_ns(&c("loop/x"), true),
            Err(WalkError::Unsafe(UnsafeKind::TooManySymlinks))
        ));
    }

    #[test]
    fn created_entries_shadow_the_tree() {
        let t = tempfile::tempdir().unwrap();
        let mut w = world(t.path());
        w.create(0, c("g.cr.1.ghost"), Entry::Symlink(b"/etc".to_vec()));
        assert!(matches!(
            w.walk_fs(0, &[], &c("g.cr.1.ghost/f"), &[]),
            Err(WalkError::Unsafe(UnsafeKind::Symlink { .. }))
        ));
    }
}
