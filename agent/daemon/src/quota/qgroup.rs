//! Level-0 qgroups of a btrfs file system: their usage and limits, read from the quota tree.

use std::os::fd::{AsFd, OwnedFd};

use super::sys::{self, le_u64};

/// Usage and limit of one level-0 qgroup, as of the last committed transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Qgroup {
    /// Subvolume id (the qgroup is `0/<id>`).
    pub id: u64,
    /// Referenced bytes.
    pub referenced: u64,
    /// Exclusive bytes.
    pub exclusive: u64,
    /// Limit on referenced bytes, if one is set.
    pub max_referenced: Option<u64>,
}

/// `BTRFS_QGROUP_LIMIT_MAX_RFER` in a limit item.
const LIMIT_MAX_RFER: u64 = 1 << 0;

/// Level-0 qgroups (all, or only `only`), merged from their info and limit items.
pub(super) fn qgroups(
    fd: &OwnedFd,
    only: Option<u64>,
) -> Result<Vec<Qgroup>, crate::sys::SyscallError> {
    let (lo, hi) = only.map_or((0, (1u64 << 48) - 1), |id| (id, id));
    let info = sys::tree_search(
        fd.as_fd(),
        sys::QUOTA_TREE,
        (0, sys::QGROUP_INFO_KEY, lo),
        (0, sys::QGROUP_INFO_KEY, hi),
    )?;
    let limits = sys::tree_search(
        fd.as_fd(),
        sys::QUOTA_TREE,
        (0, sys::QGROUP_LIMIT_KEY, lo),
        (0, sys::QGROUP_LIMIT_KEY, hi),
    )?;
    let mut out: Vec<Qgroup> = info
        .iter()
        .filter(|i| i.kind == sys::QGROUP_INFO_KEY && (lo..=hi).contains(&i.offset))
        .map(|i| Qgroup {
            id: i.offset,
            referenced: le_u64(&i.data, 8),
            exclusive: le_u64(&i.data, 24),
            max_referenced: None,
        })
        .collect();
    // By id, not by a scan per limit item: stale qgroups keep theirs, and there may be many.
    let at: std::collections::HashMap<u64, usize> =
        out.iter().enumerate().map(|(i, g)| (g.id, i)).collect();
    for l in limits
        .iter()
        .filter(|i| i.kind == sys::QGROUP_LIMIT_KEY && (lo..=hi).contains(&i.offset))
    {
        if let Some(&i) = at.get(&l.offset) {
            if le_u64(&l.data, 0) & LIMIT_MAX_RFER != 0 {
                out[i].max_referenced = Some(le_u64(&l.data, 8));
            }
        }
    }
    Ok(out)
}
