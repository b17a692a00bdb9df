//! The lease table of a memory server: who holds which region, in which mode.
//!
//! Leases are taken per attachment, on every region of the attachment at once (all or
//! nothing), and follow [`LeaseMode::conflicts_with`]: any number of readers, at most one
//! writer, and an exclusive holder alone. Every attachment belongs to one connection; when the
//! connection closes, all its attachments go (a dead worker never keeps a lease).

use belayer_ipc::memory::LeaseMode;

/// One attachment's hold on its regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Attachment id.
    pub attachment: u64,
    /// Connection the attachment belongs to.
    pub conn: u64,
    /// Worker id given at attach.
    pub worker: String,
    /// Lease mode.
    pub mode: LeaseMode,
}

/// A lease refused because another attachment holds a conflicting one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("region {region} is held {mode:?} by worker {worker:?} (attachment {attachment})")]
pub struct Conflict {
    /// Index of the region (layout order).
    pub region: usize,
    /// Mode of the lease in the way.
    pub mode: LeaseMode,
    /// Worker holding it.
    pub worker: String,
    /// Its attachment id.
    pub attachment: u64,
}

/// Leases per region, indexed by region position in the layout.
#[derive(Debug, Default)]
pub struct LeaseTable {
    regions: Vec<Vec<Holder>>,
}

impl LeaseTable {
    /// A table for `regions` regions, none held.
    pub fn new(regions: usize) -> LeaseTable {
        LeaseTable {
            regions: vec![Vec::new(); regions],
        }
    }

    /// Takes `holder`'s lease on every region in `regions`, or on none of them.
    ///
    /// Errors: the first [`Conflict`] found (regions are checked in the order given). Panics
    /// never: an index outside the table counts as a region nobody holds and is ignored.
    pub fn acquire(&mut self, regions: &[usize], holder: &Holder) -> Result<(), Conflict> {
        for &region in regions {
            let Some(held) = self.regions.get(region) else {
                continue;
            };
            if let Some(other) = held.iter().find(|h| holder.mode.conflicts_with(h.mode)) {
                return Err(Conflict {
                    region,
                    mode: other.mode,
                    worker: other.worker.clone(),
                    attachment: other.attachment,
                });
            }
        }
        for &region in regions {
            if let Some(held) = self.regions.get_mut(region) {
                held.push(holder.clone());
            }
        }
        Ok(())
    }

    /// Releases attachment `attachment` if it belongs to connection `conn`; returns whether it
    /// did.
    pub fn release(&mut self, conn: u64, attachment: u64) -> bool {
        let mut found = false;
        for held in &mut self.regions {
            held.retain(|h| {
                let hit = h.attachment == attachment && h.conn == conn;
                found |= hit;
                !hit
            });
        }
        found
    }

    /// Releases every attachment of connection `conn`; returns their ids.
    pub fn release_connection(&mut self, conn: u64) -> Vec<u64> {
        let mut ids = Vec::new();
        for held in &mut self.regions {
            held.retain(|h| {
                if h.conn == conn {
                    if !ids.contains(&h.attachment) {
                        ids.push(h.attachment);
                    }
                    false
                } else {
                    true
                }
            });
        }
        ids.sort_unstable();
        ids
    }

    /// A writing lease (`Write` or `Exclusive`) on `region` held by a connection other than
    /// `conn`, if any.
    pub fn writer_besides(&self, conn: u64, region: usize) -> Option<&Holder> {
        self.regions
            .get(region)?
            .iter()
            .find(|h| h.conn != conn && h.mode.writes())
    }

    /// Whether connection `conn` holds a writing lease on any region.
    pub fn writes_anything(&self, conn: u64) -> bool {
        self.regions
            .iter()
            .flatten()
            .any(|h| h.conn == conn && h.mode.writes())
    }

    /// Number of distinct attachments alive.
    pub fn attachments(&self) -> usize {
        let mut ids: Vec<u64> = self
            .regions
            .iter()
            .flatten()
            .map(|h| h.attachment)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(attachment: u64, conn: u64, mode: LeaseMode) -> Holder {
        Holder {
            attachment,
            conn,
            worker: format!("w{attachment}"),
            mode,
        }
    }

    #[test]
    fn readers_share_writers_exclude_writers_and_exclusive_excludes_all() {
        let mut table = LeaseTable::new(3);
        table
            .acquire(&[0, 1], &holder(1, 1, LeaseMode::Read))
            .unwrap();
        table
            .acquire(&[0, 1], &holder(2, 2, LeaseMode::Read))
            .unwrap();
        table
            .acquire(&[1, 2], &holder(3, 3, LeaseMode::Write))
            .unwrap();
        let conflict = table
            .acquire(&[2], &holder(4, 4, LeaseMode::Write))
            .unwrap_err();
        assert_eq!(
            conflict,
            Conflict {
                region: 2,
                mode: LeaseMode::Write,
                worker: "w3".to_owned(),
                attachment: 3
            }
        );
        assert!(table
            .acquire(&[0], &holder(5, 5, LeaseMode::Exclusive))
            .is_err());
        // All or nothing: region 0 is free of writers, region 1 is not.
        assert!(table
            .acquire(&[0, 1], &holder(6, 6, LeaseMode::Write))
            .is_err());
        assert!(table.writer_besides(6, 0).is_none());
        assert_eq!(table.writer_besides(6, 1).unwrap().attachment, 3);
        assert!(table.writer_besides(3, 1).is_none());
        assert_eq!(table.attachments(), 3);
        assert!(table.writes_anything(3) && !table.writes_anything(1));
        // Another connection cannot release attachment 3; its own can.
        assert!(!table.release(9, 3));
        assert!(table.release(3, 3));
        table
            .acquire(&[2], &holder(4, 4, LeaseMode::Write))
            .unwrap();
    }

    #[test]
    fn closing_a_connection_releases_all_its_attachments() {
        let mut table = LeaseTable::new(2);
        table
            .acquire(&[0], &holder(1, 7, LeaseMode::Write))
            .unwrap();
        table
            .acquire(&[1], &holder(2, 7, LeaseMode::Exclusive))
            .unwrap();
        table.acquire(&[0], &holder(3, 8, LeaseMode::Read)).unwrap();
        assert_eq!(table.release_connection(7), vec![1, 2]);
        table
            .acquire(&[1], &holder(4, 9, LeaseMode::Exclusive))
            .unwrap();
        assert_eq!(table.attachments(), 2);
        assert!(table.release_connection(7).is_empty());
    }
}
