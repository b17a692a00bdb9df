//! Moving a layer manifest from one host id range to another (a fork restores a checkpoint
//! into a sandbox whose user namespace maps to other host ids).
//!
//! An upper layer holds host ids: each entry's owner and group, the `ACL_USER`/`ACL_GROUP`
//! entries of its POSIX ACLs (`system.posix_acl_access`, `system.posix_acl_default`, stored
//! by the kernel in the host's ids) and the root id of a namespaced file capability
//! (`security.capability` version 3). [`LayerManifest::shift_ids`] rewrites all of them from
//! `from..from + count` to `to..to + count` and refuses any id outside the source range: a
//! sandbox can only create files owned by ids its namespace maps, so such an id means the
//! manifest is not what the caller believes it to be.

use super::manifest::LayerManifest;

/// A move of `count` host ids starting at `from` to the ids starting at `to` (uids and gids
/// alike: a sandbox's user namespace maps both to the same range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdShift {
    /// First host id of the source range.
    pub from: u32,
    /// First host id of the target range.
    pub to: u32,
    /// Ids in each range (≥ 1; both ranges must fit below `u32::MAX`).
    pub count: u32,
}

/// Why [`LayerManifest::shift_ids`] refused a manifest (it is left unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdShiftError {
    /// A range is empty or runs past `u32::MAX`.
    #[error("invalid id shift {from}..+{count} -> {to}..+{count}")]
    BadRange {
        /// Source start.
        from: u32,
        /// Target start.
        to: u32,
        /// Ids.
        count: u32,
    },
    /// An id of the manifest lies outside the source range.
    #[error("{what} of {path:?} is host id {id}, outside the source range {from}..{end}")]
    OutOfRange {
        /// The entry's path.
        path: String,
        /// `uid`, `gid`, `acl`, `capability root`.
        what: &'static str,
        /// The id.
        id: u32,
        /// Source range start.
        from: u32,
        /// Source range end (exclusive).
        end: u64,
    },
    /// An ACL or capability attribute does not have its kernel layout.
    #[error("{name} of {path:?} is malformed ({len} bytes)")]
    BadXattr {
        /// The entry's path.
        path: String,
        /// Attribute name.
        name: String,
        /// Its length.
        len: usize,
    },
}

/// `POSIX_ACL_XATTR_VERSION`, the header of an ACL attribute.
const ACL_VERSION: u32 = 2;
/// ACL tags that carry an id (`ACL_USER`, `ACL_GROUP`).
const ACL_USER: u16 = 0x02;
const ACL_GROUP: u16 = 0x08;
/// `VFS_CAP_REVISION_3` in the top byte of `magic_etc`, and the size of that layout.
const CAP_REVISION_MASK: u32 = 0xFF00_0000;
const CAP_REVISION_3: u32 = 0x0300_0000;
const CAP_V3_BYTES: usize = 24;

impl IdShift {
    fn check(&self) -> Result<(), IdShiftError> {
        let fits = |start: u32| u64::from(start) + u64::from(self.count) <= u64::from(u32::MAX);
        if self.count == 0 || !fits(self.from) || !fits(self.to) {
            return Err(IdShiftError::BadRange {
                from: self.from,
                to: self.to,
                count: self.count,
            });
        }
        Ok(())
    }

    /// The id `id` moves to: its place in the target range, itself for host root (0), or
    /// `None` for any other id outside the source range.
    pub fn map(&self, id: u32) -> Option<u32> {
        if id == 0 {
            return Some(0);
        }
        id.checked_sub(self.from)
            .filter(|off| *off < self.count)
            .map(|off| self.to + off)
    }

    fn map_at(&self, id: u32, path: &[u8], what: &'static str) -> Result<u32, IdShiftError> {
        self.map(id).ok_or_else(|| IdShiftError::OutOfRange {
            path: String::from_utf8_lossy(path).into_owned(),
            what,
            id,
            from: self.from,
            end: u64::from(self.from) + u64::from(self.count),
        })
    }

    /// The attribute `value` of `name` with its ids moved (ACLs, v3 capabilities); other
    /// attributes unchanged.
    fn xattr(&self, path: &[u8], name: &[u8], value: &[u8]) -> Result<Vec<u8>, IdShiftError> {
        let bad = || IdShiftError::BadXattr {
            path: String::from_utf8_lossy(path).into_owned(),
            name: String::from_utf8_lossy(name).into_owned(),
            len: value.len(),
        };
        let u32_at = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut out = value.to_vec();
        match name {
            b"system.posix_acl_access" | b"system.posix_acl_default" => {
                if value.len() < 4
                    || !(value.len() - 4).is_multiple_of(8)
                    || u32_at(value, 0) != ACL_VERSION
                {
                    return Err(bad());
                }
                for at in (4..value.len()).step_by(8) {
                    let tag = u16::from_le_bytes([value[at], value[at + 1]]);
                    if tag == ACL_USER || tag == ACL_GROUP {
                        let id = self.map_at(u32_at(value, at + 4), path, "acl")?;
                        out[at + 4..at + 8].copy_from_slice(&id.to_le_bytes());
                    }
                }
            }
            b"security.capability" => {
                if value.len() < 4 {
                    return Err(bad());
                }
                if u32_at(value, 0) & CAP_REVISION_MASK == CAP_REVISION_3 {
                    if value.len() != CAP_V3_BYTES {
                        return Err(bad());
                    }
                    let id = self.map_at(u32_at(value, 20), path, "capability root")?;
                    out[20..24].copy_from_slice(&id.to_le_bytes());
                }
            }
            _ => {}
        }
        Ok(out)
    }
}

impl LayerManifest {
    /// Moves every host id of the layer by `shift` (see the module docs): owners, groups,
    /// ACL entries and v3 capability root ids. All or nothing: on an error the manifest is
    /// unchanged.
    ///
    /// Errors: [`IdShiftError::BadRange`], [`IdShiftError::OutOfRange`] (an id outside the
    /// source range), [`IdShiftError::BadXattr`] (an ACL or capability of the wrong layout).
    pub fn shift_ids(&mut self, shift: &IdShift) -> Result<(), IdShiftError> {
        shift.check()?;
        let mut shifted = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let mut e2 = e.clone();
            e2.uid = shift.map_at(e.uid, &e.path, "uid")?;
            e2.gid = shift.map_at(e.gid, &e.path, "gid")?;
            for (name, value) in e2.xattrs.iter_mut() {
                *value = shift.xattr(&e.path, name, value)?;
            }
            shifted.push(e2);
        }
        self.entries = shifted;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::{EntryKind, LayerEntry, StatKey};

    fn entry(path: &str, uid: u32, xattrs: Vec<(Vec<u8>, Vec<u8>)>) -> LayerEntry {
        LayerEntry {
            path: path.as_bytes().to_vec(),
            kind: EntryKind::Directory,
            mode: 0o755,
            uid,
            gid: uid,
            mtime: (0, 0),
            xattrs,
            key: StatKey::default(),
        }
    }

    fn acl(entries: &[(u16, u32)]) -> Vec<u8> {
        let mut v = ACL_VERSION.to_le_bytes().to_vec();
        for (tag, id) in entries {
            v.extend_from_slice(&tag.to_le_bytes());
            v.extend_from_slice(&7u16.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    const SHIFT: IdShift = IdShift {
        from: 1000,
        to: 5000,
        count: 100,
    };

    #[test]
    fn owners_acls_and_v3_capabilities_move() {
        let mut cap = (CAP_REVISION_3 | 1).to_le_bytes().to_vec();
        cap.extend_from_slice(&[0; 16]);
        cap.extend_from_slice(&1000u32.to_le_bytes());
        let mut m = LayerManifest {
            entries: vec![
                entry("", 1000, vec![]),
                entry(
                    "a",
                    1042,
                    vec![
                        (
                            b"system.posix_acl_access".to_vec(),
                            acl(&[(0x01, u32::MAX), (ACL_USER, 1001), (ACL_GROUP, 1099)]),
                        ),
                        (b"security.capability".to_vec(), cap),
                        (b"user.x".to_vec(), b"1000".to_vec()),
                    ],
                ),
            ],
            ..Default::default()
        };
        m.shift_ids(&SHIFT).unwrap();
        assert_eq!((m.entries[0].uid, m.entries[0].gid), (5000, 5000));
        assert_eq!(m.entries[1].uid, 5042);
        let x = &m.entries[1].xattrs;
        assert_eq!(
            x[0].1,
            acl(&[(0x01, u32::MAX), (ACL_USER, 5001), (ACL_GROUP, 5099)])
        );
        assert_eq!(&x[1].1[20..24], &5000u32.to_le_bytes());
        assert_eq!(x[2].1, b"1000");
    }

    #[test]
    fn an_id_outside_the_range_or_a_bad_attribute_changes_nothing() {
        for xattrs in [
            vec![(b"system.posix_acl_default".to_vec(), acl(&[(ACL_USER, 7)]))],
            vec![(b"system.posix_acl_access".to_vec(), vec![2, 0, 0, 0, 1])],
            vec![(
                b"security.capability".to_vec(),
                CAP_REVISION_3.to_le_bytes().to_vec(),
            )],
        ] {
            let mut m = LayerManifest {
                entries: vec![entry("", 1000, vec![]), entry("b", 1001, xattrs)],
                ..Default::default()
            };
            let before = m.clone();
            assert!(m.shift_ids(&SHIFT).is_err());
            assert_eq!(m, before);
        }
        let mut m = LayerManifest {
            entries: vec![entry("", 0, vec![])],
            ..Default::default()
        };
        m.shift_ids(&SHIFT).unwrap();
        assert_eq!(m.entries[0].uid, 0, "host root (overlayfs whiteouts) stays");
        let mut m = LayerManifest {
            entries: vec![entry("", 1100, vec![])],
            ..Default::default()
        };
        assert!(matches!(
            m.shift_ids(&SHIFT),
            Err(IdShiftError::OutOfRange { id: 1100, .. })
        ));
        let bad = IdShift {
            from: u32::MAX - 1,
            to: 0,
            count: 10,
        };
        assert!(matches!(
            m.shift_ids(&bad),
            Err(IdShiftError::BadRange { .. })
        ));
    }
}
