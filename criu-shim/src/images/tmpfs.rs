//! The content of a dumped tmpfs, as CRIU will extract it, and the check of its archive.
//!
//! CRIU dumps a tmpfs with `tar --create --gzip ... --directory /proc/self/fd/0 .` (GNU tar,
//! members `./`, `./shm/`, `./null`, ...) into `tmpfs-dev-<root_dev>.tar.gz.img` (or
//! `tmpfs-<mnt_id>.tar.gz.img`), and restores it with `tar --extract --gzip --directory <fresh
//! tmpfs>` running as host root (`criu/filesystems.c` `tmpfs_restore`). Extraction creates every
//! member by its name relative to that directory, creating missing parents, so a member below a
//! symbolic-link member would be written wherever the link points. An archive made from a real
//! tree never has one; [`TarTree::read`] refuses it anyway, with absolute names, `..`, hard
//! links to anything but an earlier non-directory member, block devices and character devices
//! outside [`ALLOWED_CHAR_DEVICES`]. The resulting tree is then the model of that mount for the
//! path checks of later restore steps (ghost files and sockets in `/dev/shm`).

use std::collections::HashMap;
use std::io::Read;

use super::error::UnsafeKind;
use super::path::{split, Comps, Entry};

/// Character devices (major, minor) a container `/dev` holds: null, zero, full, random,
/// urandom, tty, ptmx. Archive members and ghost files of other devices are refused: CRIU would
/// create them with `mknod` as host root inside the sandbox.
pub const ALLOWED_CHAR_DEVICES: [(u32, u32); 7] =
    [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2)];

/// Most members read from one archive.
const MAX_MEMBERS: usize = 1_000_000;

/// The tree an archive extracts to: fs-relative components → entry.
#[derive(Debug, Default)]
pub(crate) struct TarTree {
    nodes: HashMap<Comps, Entry>,
    /// Members read.
    pub members: usize,
}

/// Why an archive was refused: the member name (lossy) and what is wrong, or a read error.
#[derive(Debug)]
pub(crate) enum TarError {
    Member { name: String, kind: UnsafeKind },
    Read { offset: u64, what: &'static str },
}

fn member_err(name: &[u8], kind: UnsafeKind) -> TarError {
    TarError::Member {
        name: String::from_utf8_lossy(name).into_owned(),
        kind,
    }
}

impl TarTree {
    /// Reads a gzip-compressed archive and builds its tree, refusing unsafe members.
    pub(crate) fn read(reader: impl Read) -> Result<TarTree, TarError> {
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(reader));
        let read_err = |what| TarError::Read { offset: 0, what };
        let entries = archive
            .entries()
            .map_err(|_| read_err("not a tar archive"))?;
        let mut tree = TarTree::default();
        tree.nodes.insert(Vec::new(), Entry::Dir);
        for entry in entries {
            let entry = entry.map_err(|_| read_err("corrupt tar or gzip stream"))?;
            tree.members += 1;
            if tree.members > MAX_MEMBERS {
                return Err(member_err(b"", UnsafeKind::TooManyMembers));
            }
            let offset = entry.raw_header_position();
            let name = entry.path_bytes().into_owned();
            let header = entry.header();
            let kind = match header.entry_type() {
                tar::EntryType::Directory => Entry::Dir,
                tar::EntryType::Symlink => {
                    let target = entry.link_name_bytes().map(|c| c.into_owned());
                    Entry::Symlink(target.ok_or(TarError::Read {
                        offset,
                        what: "symlink member without a target",
                    })?)
                }
                tar::EntryType::Regular
                | tar::EntryType::Continuous
                | tar::EntryType::GNUSparse
                | tar::EntryType::Fifo => Entry::Other,
                tar::EntryType::Link => {
                    let target = entry.link_name_bytes().unwrap_or_default();
                    let comps = member_comps(&target).map_err(|k| member_err(&target, k))?;
                    match tree.nodes.get(&comps) {
                        Some(Entry::Other) => Entry::Other,
                        _ => return Err(member_err(&name, UnsafeKind::BadArchiveMember)),
                    }
                }
                tar::EntryType::Char => {
                    let dev = |r: std::io::Result<Option<u32>>| r.ok().flatten().unwrap_or(0);
                    let (major, minor) = (dev(header.device_major()), dev(header.device_minor()));
                    if !ALLOWED_CHAR_DEVICES.contains(&(major, minor)) {
                        return Err(member_err(&name, UnsafeKind::Device { major, minor }));
                    }
                    Entry::Other
                }
                tar::EntryType::Block => {
                    let dev = |r: std::io::Result<Option<u32>>| r.ok().flatten().unwrap_or(0);
                    let (major, minor) = (dev(header.device_major()), dev(header.device_minor()));
                    return Err(member_err(&name, UnsafeKind::Device { major, minor }));
                }
                _ => return Err(member_err(&name, UnsafeKind::BadArchiveMember)),
            };
            tree.insert(&name, kind)?;
        }
        Ok(tree)
    }

    /// Adds member `name` of `kind`: its parents must be directory members or absent
    /// (tar creates them); a name may repeat only as a directory over a directory.
    fn insert(&mut self, name: &[u8], kind: Entry) -> Result<(), TarError> {
        let comps = member_comps(name).map_err(|k| member_err(name, k))?;
        if comps.is_empty() {
            // `./`: the mount root itself.
            return match kind {
                Entry::Dir => Ok(()),
                _ => Err(member_err(name, UnsafeKind::BadArchiveMember)),
            };
        }
        for i in 1..comps.len() {
            let at = || display(&comps[..i]);
            match self.nodes.get(&comps[..i]) {
                None => {
                    self.nodes.insert(comps[..i].to_vec(), Entry::Dir);
                }
                Some(Entry::Dir) => {}
                Some(Entry::Symlink(_)) => {
                    return Err(member_err(name, UnsafeKind::Symlink { at: at() }))
                }
                Some(_) => return Err(member_err(name, UnsafeKind::NotDirectory { at: at() })),
            }
        }
        match (self.nodes.get(&comps), &kind) {
            (None, _) | (Some(Entry::Dir), Entry::Dir) => {
                self.nodes.insert(comps, kind);
                Ok(())
            }
            _ => Err(member_err(
                name,
                UnsafeKind::Exists {
                    at: display(&comps),
                },
            )),
        }
    }

    /// The entry at fs-relative `comps` (`Missing` when the archive does not hold it).
    pub(crate) fn get(&self, comps: &[Vec<u8>]) -> Entry {
        self.nodes.get(comps).cloned().unwrap_or(Entry::Missing)
    }
}

/// Splits a member name: `./` prefixes and empty components dropped, absolute names and `..`
/// refused.
fn member_comps(name: &[u8]) -> Result<Comps, UnsafeKind> {
    if name.first() == Some(&b'/') {
        return Err(UnsafeKind::Malformed);
    }
    split(name)
}

fn display(comps: &[Vec<u8>]) -> String {
    let mut s = String::new();
    for c in comps {
        s.push('/');
        s.push_str(&String::from_utf8_lossy(c));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::images::testutil::tar_gz as archive;

    use tar::EntryType as T;

    #[test]
    fn a_dev_tree_reads_back() {
        let a = archive(&[
            ("./", T::Directory, ""),
            ("./shm/", T::Directory, ""),
            ("./fd", T::Symlink, "/proc/self/fd"),
            ("./null", T::Char, "3"),
            ("./shm/sem.x", T::Regular, ""),
            ("./shm/hl", T::Link, "./shm/sem.x"),
        ]);
        let t = TarTree::read(&a[..]).unwrap();
        assert_eq!(t.members, 6);
        assert_eq!(t.get(&[b"shm".to_vec()]), Entry::Dir);
        assert_eq!(
            t.get(&[b"fd".to_vec()]),
            Entry::Symlink(b"/proc/self/fd".to_vec())
        );
        assert_eq!(t.get(&[b"null".to_vec()]), Entry::Other);
        assert_eq!(t.get(&[b"nope".to_vec()]), Entry::Missing);
    }

    #[test]
    fn hostile_members_are_refused() {
        let cases: Vec<Vec<(&str, T, &str)>> = vec![
            vec![("./d", T::Symlink, "/etc"), ("./d/passwd", T::Regular, "")],
            vec![("./f", T::Regular, ""), ("./f/x", T::Regular, "")],
            vec![("./../x", T::Regular, "")],
            vec![("/etc/x", T::Regular, "")],
            vec![("./h", T::Link, "../../etc/shadow")],
            vec![("./h", T::Link, "./missing")],
            vec![("./sda", T::Block, "")],
            vec![("./mem", T::Char, "1")],
            vec![("./d/", T::Directory, ""), ("./d", T::Symlink, "/etc")],
        ];
        for members in cases {
            let a = archive(&members);
            assert!(TarTree::read(&a[..]).is_err(), "{members:?} accepted");
        }
        assert!(TarTree::read(&b"not gzip"[..]).is_err());
    }
}
