//! Admission: who may hold a connection or an event stream right now.
//!
//! The [`Census`] counts what every peer uid holds against the [`Quota`]s of the server's
//! [`ConnectionLimits`](super::ConnectionLimits) and keeps a clone of every served stream (to
//! evict it, or to shut it down when the server stops). It is only ever touched under one
//! mutex, by the accept loop and by connection threads as they end; every operation is
//! O(connections served), which the quota bounds.
//!
//! When a newcomer's pool is full (all connections, or the non-root share of them), one
//! **idle** connection (waiting for its next request, no frame started, not an event stream)
//! is evicted to make room, if a fair victim exists: one of the newcomer's own uid, or of a uid
//! holding at least two connections more than the newcomer's (so two uids never take turns
//! evicting each other), never one of root's below its reserve, and the oldest idle one of the
//! uid holding the most. The evicted connection is told `Busy` (id 0) and closed by its own
//! thread; until that thread is gone it counts as *draining*, and at most [`MAX_DRAINING`]
//! may drain at once. Without a fair victim the newcomer is refused (`Busy`).

use std::collections::HashMap;
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use super::config::Quota;
use super::stats::ServerStats;

/// Most evicted connections whose threads may still be running; beyond that, a newcomer to a
/// full pool is refused instead. Connection threads never exceed the connection quota's total
/// plus this.
pub(crate) const MAX_DRAINING: usize = 16;

const ACTIVE: u8 = 0;
const IDLE: u8 = 1;
const EVICTED: u8 = 2;

/// What a connection is doing, shared by its thread and the accept loop: waiting for a request
/// (idle, evictable), reading or handling one (active), or evicted.
#[derive(Debug)]
pub(crate) struct Activity {
    state: AtomicU8,
    /// Server clock (milliseconds) when the connection last became idle.
    idle_since_ms: AtomicU64,
}

impl Activity {
    /// A freshly accepted connection: idle since `now_ms`.
    pub(crate) fn new(now_ms: u64) -> Activity {
        Activity {
            state: AtomicU8::new(IDLE),
            idle_since_ms: AtomicU64::new(now_ms),
        }
    }

    /// Marks the connection idle (waiting for a request) since `now_ms`; an evicted connection
    /// stays evicted.
    pub(crate) fn set_idle(&self, now_ms: u64) {
        self.idle_since_ms.store(now_ms, Ordering::SeqCst);
        let _ = self
            .state
            .compare_exchange(ACTIVE, IDLE, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Marks the connection active (a request is arriving, or it is an event stream); `false`
    /// when it was evicted first, in which case the connection must be closed.
    pub(crate) fn activate(&self) -> bool {
        match self
            .state
            .compare_exchange(IDLE, ACTIVE, Ordering::SeqCst, Ordering::SeqCst)
        {
            Ok(_) => true,
            Err(state) => state == ACTIVE,
        }
    }

    /// Whether the connection was evicted.
    #[cfg(test)]
    fn evicted(&self) -> bool {
        self.state.load(Ordering::SeqCst) == EVICTED
    }

    fn idle_since(&self) -> Option<u64> {
        (self.state.load(Ordering::SeqCst) == IDLE)
            .then(|| self.idle_since_ms.load(Ordering::SeqCst))
    }

    fn try_evict(&self) -> bool {
        self.state
            .compare_exchange(IDLE, EVICTED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

/// Why a connection or an event stream was refused; the text is the message of the `Busy`
/// reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// The peer's uid holds its quota.
    #[error("uid {uid} holds {limit} {what}, its limit")]
    PerUid {
        /// Peer uid.
        uid: u32,
        /// "connections" or "event streams".
        what: &'static str,
        /// The per-uid quota.
        limit: usize,
    },
    /// Non-root peers together hold their share and none of it can be freed.
    #[error("non-root peers hold {limit} {what}, their limit")]
    NonRoot {
        /// "connections" or "event streams".
        what: &'static str,
        /// The non-root share.
        limit: usize,
    },
    /// The server holds its total and none of it can be freed.
    #[error("the server holds {limit} {what}, its limit")]
    Total {
        /// "connections" or "event streams".
        what: &'static str,
        /// The total quota.
        limit: usize,
    },
}

const CONNECTIONS: &str = "connections";
const STREAMS: &str = "event streams";

/// What one uid (or a group of peers) holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Held {
    connections: usize,
    subscriptions: usize,
}

#[derive(Debug)]
struct Entry {
    uid: u32,
    stream: UnixStream,
    activity: Arc<Activity>,
    subscribed: bool,
    evicted: bool,
}

/// A connection evicted to make room for a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Eviction {
    /// The evicted connection's number.
    pub(crate) conn: u64,
    /// Its peer's uid.
    pub(crate) uid: u32,
}

/// The served connections and what each uid holds (see the module docs).
#[derive(Debug)]
pub(crate) struct Census {
    connections: Quota,
    subscriptions: Quota,
    entries: HashMap<u64, Entry>,
    uids: HashMap<u32, Held>,
    non_root: Held,
    all: Held,
    draining: usize,
    /// Where the totals are published for the metrics endpoint.
    stats: Arc<ServerStats>,
}

impl Census {
    /// An empty census for the given quotas.
    pub(crate) fn new(connections: Quota, subscriptions: Quota, stats: Arc<ServerStats>) -> Census {
        Census {
            stats,
            connections,
            subscriptions,
            entries: HashMap::new(),
            uids: HashMap::new(),
            non_root: Held::default(),
            all: Held::default(),
            draining: 0,
        }
    }

    /// Admits connection `conn` of peer `uid` (`stream`: a clone of its socket) or refuses it.
    /// When its pool is full, an idle connection is evicted first (marked, its read side shut
    /// down so its thread wakes, and returned).
    pub(crate) fn admit(
        &mut self,
        conn: u64,
        uid: u32,
        stream: UnixStream,
        activity: Arc<Activity>,
    ) -> Result<Option<Eviction>, Refusal> {
        let quota = self.connections;
        let held = self.held(uid);
        if uid != 0 && held.connections >= quota.per_uid {
            return Err(Refusal::PerUid {
                uid,
                what: CONNECTIONS,
                limit: quota.per_uid,
            });
        }
        let non_root_full = uid != 0 && self.non_root.connections >= quota.non_root_total();
        let total_full = self.all.connections >= quota.total;
        let mut eviction = None;
        if non_root_full || total_full {
            let refusal = if non_root_full {
                Refusal::NonRoot {
                    what: CONNECTIONS,
                    limit: quota.non_root_total(),
                }
            } else {
                Refusal::Total {
                    what: CONNECTIONS,
                    limit: quota.total,
                }
            };
            if self.draining >= MAX_DRAINING {
                return Err(refusal);
            }
            eviction = Some(self.evict_for(uid, non_root_full).ok_or(refusal)?);
        }
        self.entries.insert(
            conn,
            Entry {
                uid,
                stream,
                activity,
                subscribed: false,
                evicted: false,
            },
        );
        self.count(uid, |h| h.connections += 1);
        Ok(eviction)
    }

    /// Turns admitted connection `conn` into an event stream, or refuses it (the connection
    /// itself stays admitted).
    pub(crate) fn subscribe(&mut self, conn: u64) -> Result<(), Refusal> {
        let quota = self.subscriptions;
        let Some(entry) = self.entries.get(&conn) else {
            return Err(Refusal::Total {
                what: STREAMS,
                limit: quota.total,
            });
        };
        if entry.subscribed {
            return Ok(());
        }
        let uid = entry.uid;
        if uid != 0 && self.held(uid).subscriptions >= quota.per_uid {
            return Err(Refusal::PerUid {
                uid,
                what: STREAMS,
                limit: quota.per_uid,
            });
        }
        if uid != 0 && self.non_root.subscriptions >= quota.non_root_total() {
            return Err(Refusal::NonRoot {
                what: STREAMS,
                limit: quota.non_root_total(),
            });
        }
        if self.all.subscriptions >= quota.total {
            return Err(Refusal::Total {
                what: STREAMS,
                limit: quota.total,
            });
        }
        if let Some(entry) = self.entries.get_mut(&conn) {
            entry.subscribed = true;
        }
        self.count(uid, |h| h.subscriptions += 1);
        Ok(())
    }

    /// Gives back the event-stream slot of `conn` (the handler had no stream to offer).
    pub(crate) fn unsubscribe(&mut self, conn: u64) {
        let Some(entry) = self.entries.get_mut(&conn) else {
            return;
        };
        if !entry.subscribed || entry.evicted {
            return;
        }
        entry.subscribed = false;
        let uid = entry.uid;
        self.count(uid, |h| h.subscriptions -= 1);
    }

    /// Forgets connection `conn` (its thread ended).
    pub(crate) fn release(&mut self, conn: u64) {
        let Some(entry) = self.entries.remove(&conn) else {
            return;
        };
        if entry.evicted {
            self.draining -= 1;
            return;
        }
        self.count(entry.uid, |h| {
            h.connections -= 1;
            if entry.subscribed {
                h.subscriptions -= 1;
            }
        });
    }

    /// Removes every entry and returns the streams (to shut them down when the server stops).
    pub(crate) fn drain(&mut self) -> Vec<UnixStream> {
        self.uids.clear();
        self.non_root = Held::default();
        self.all = Held::default();
        self.draining = 0;
        self.stats.set_open(0, 0);
        self.entries.drain().map(|(_, e)| e.stream).collect()
    }

    /// Connections served (evicted ones not counted).
    #[cfg(test)]
    fn served(&self) -> usize {
        self.all.connections
    }

    fn held(&self, uid: u32) -> Held {
        self.uids.get(&uid).copied().unwrap_or_default()
    }

    /// Applies `change` to the counts of `uid`, of its group (non-root or not) and of all.
    fn count(&mut self, uid: u32, change: impl Fn(&mut Held)) {
        let held = self.uids.entry(uid).or_default();
        change(held);
        if *held == Held::default() {
            self.uids.remove(&uid);
        }
        if uid != 0 {
            change(&mut self.non_root);
        }
        change(&mut self.all);
        self.stats
            .set_open(self.all.connections, self.all.subscriptions);
    }

    /// Evicts the fairest idle victim for a newcomer of `uid` (see the module docs); `None`
    /// when there is none. `non_root_only`: the newcomer needs a non-root slot.
    fn evict_for(&mut self, uid: u32, non_root_only: bool) -> Option<Eviction> {
        let mine = self.held(uid).connections;
        let root_held = self.held(0).connections;
        let root_reserved = self.connections.root_reserved;
        // (victim uid's count, older first, conn)
        let mut candidates: Vec<(usize, u64, u64)> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.evicted && !e.subscribed)
            .filter_map(|(&conn, e)| {
                let theirs = self.held(e.uid).connections;
                let fair = e.uid == uid || theirs >= mine + 2;
                let allowed = match e.uid {
                    0 => !non_root_only && (uid == 0 || root_held > root_reserved),
                    _ => true,
                };
                let since = e.activity.idle_since()?;
                (fair && allowed).then_some((theirs, since, conn))
            })
            .collect();
        // Most held first, then the longest idle.
        candidates.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        for (_, _, conn) in candidates {
            let Some(entry) = self.entries.get_mut(&conn) else {
                continue;
            };
            if !entry.activity.try_evict() {
                continue; // a request started meanwhile
            }
            entry.evicted = true;
            // Wakes the connection's thread, which tells its peer and closes.
            let _ = entry.stream.shutdown(Shutdown::Read);
            let victim = entry.uid;
            self.count(victim, |h| h.connections -= 1);
            self.draining += 1;
            return Some(Eviction { conn, uid: victim });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(total: usize, per_uid: usize, root_reserved: usize) -> Quota {
        Quota {
            total,
            per_uid,
            root_reserved,
        }
    }

    struct Fixture {
        census: Census,
        next: u64,
        activities: HashMap<u64, Arc<Activity>>,
        _peers: Vec<UnixStream>,
    }

    impl Fixture {
        fn new(connections: Quota, subscriptions: Quota) -> Fixture {
            Fixture {
                census: Census::new(connections, subscriptions, Arc::default()),
                next: 0,
                activities: HashMap::new(),
                _peers: Vec::new(),
            }
        }

        /// Admits a connection of `uid` that became idle at `now`.
        fn admit(&mut self, uid: u32, now: u64) -> Result<(u64, Option<Eviction>), Refusal> {
            self.next += 1;
            let (ours, theirs) = UnixStream::pair().unwrap();
            self._peers.push(theirs);
            let activity = Arc::new(Activity::new(now));
            let evicted = self
                .census
                .admit(self.next, uid, ours, Arc::clone(&activity))?;
            self.activities.insert(self.next, activity);
            Ok((self.next, evicted))
        }
    }

    #[test]
    fn a_uid_at_its_cap_is_refused_while_others_and_root_get_in() {
        let mut f = Fixture::new(quota(8, 2, 2), quota(4, 1, 1));
        f.admit(1000, 0).unwrap();
        f.admit(1000, 0).unwrap();
        assert_eq!(
            f.admit(1000, 0),
            Err(Refusal::PerUid {
                uid: 1000,
                what: "connections",
                limit: 2
            })
        );
        assert!(f.admit(1001, 0).unwrap().1.is_none());
        // Root has no per-uid cap.
        for _ in 0..4 {
            assert!(f.admit(0, 0).unwrap().1.is_none());
        }
        assert_eq!(f.census.served(), 7);
    }

    #[test]
    fn the_root_reserve_keeps_non_root_peers_to_their_share() {
        // 6 slots, 2 kept for root: non-root peers hold at most 4.
        let mut f = Fixture::new(quota(6, 2, 2), quota(2, 1, 1));
        for uid in [1000, 1000, 1001, 1001] {
            f.admit(uid, 0).unwrap();
        }
        // The share is full; uid 1002 holds none, so it may take one of a uid holding 2.
        let (first, evicted) = f.admit(1002, 5).unwrap();
        assert!(matches!(
            evicted,
            Some(Eviction {
                uid: 1000 | 1001,
                ..
            })
        ));
        // Now 1002 holds 1 and nobody holds 3: it may only recycle its own idle connection.
        let (second, evicted) = f.admit(1002, 6).unwrap();
        assert_eq!(
            evicted,
            Some(Eviction {
                conn: first,
                uid: 1002
            })
        );
        // While that one handles a request, 1002 is refused.
        assert!(f.activities[&second].activate());
        assert_eq!(
            f.admit(1002, 7),
            Err(Refusal::NonRoot {
                what: "connections",
                limit: 4
            })
        );
        // Root still gets both reserved slots without touching anybody.
        assert!(f.admit(0, 7).unwrap().1.is_none());
        assert!(f.admit(0, 7).unwrap().1.is_none());
    }

    #[test]
    fn a_full_server_evicts_the_oldest_idle_connection_of_the_biggest_holder() {
        let mut f = Fixture::new(quota(4, 4, 1), quota(1, 1, 0));
        let (old, _) = f.admit(0, 10).unwrap();
        let (busy, _) = f.admit(0, 1).unwrap();
        f.admit(0, 20).unwrap();
        f.admit(0, 30).unwrap();
        // The oldest idle one is handling a request: not evictable.
        assert!(f.activities[&busy].activate());
        let (_, evicted) = f.admit(0, 40).unwrap();
        assert_eq!(evicted, Some(Eviction { conn: old, uid: 0 }));
        assert!(f.activities[&old].evicted());
        assert!(!f.activities[&old].activate());
        assert_eq!(f.census.served(), 4);
        // The evicted thread ends later; its slot was handed over already.
        f.census.release(old);
        assert_eq!(f.census.served(), 4);
        assert_eq!(f.census.draining, 0);
    }

    #[test]
    fn non_root_newcomers_never_evict_root_below_its_reserve_or_subscribers() {
        let mut f = Fixture::new(quota(3, 3, 1), quota(2, 2, 0));
        let (root, _) = f.admit(0, 0).unwrap();
        let (a, _) = f.admit(1000, 0).unwrap();
        let (b, _) = f.admit(1000, 0).unwrap();
        f.census.subscribe(a).unwrap();
        assert!(f.activities[&a].activate());
        f.census.subscribe(b).unwrap();
        assert!(f.activities[&b].activate());
        // 1000's own connections are event streams; root is at its reserve.
        assert!(f.admit(1000, 1).is_err());
        assert!(!f.activities[&root].evicted());
        assert!(f.admit(1001, 1).is_err());
        // Root itself may recycle its own idle connection.
        let (_, evicted) = f.admit(0, 2).unwrap();
        assert_eq!(evicted, Some(Eviction { conn: root, uid: 0 }));
    }

    #[test]
    fn draining_is_bounded() {
        let mut f = Fixture::new(quota(2, 2, 1), quota(1, 1, 0));
        f.admit(0, 0).unwrap();
        f.admit(0, 0).unwrap();
        // Every newcomer is idle at once, so each one can be evicted by the next.
        let mut evicted = Vec::new();
        while let Ok((_, Some(eviction))) = f.admit(0, 1) {
            evicted.push(eviction.conn);
            assert!(evicted.len() <= MAX_DRAINING);
        }
        assert_eq!(evicted.len(), MAX_DRAINING);
        assert_eq!(f.census.served(), 2);
        // Once an evicted thread ends, eviction works again.
        f.census.release(evicted[0]);
        assert!(matches!(f.admit(0, 2), Ok((_, Some(_)))));
    }

    #[test]
    fn subscriptions_have_their_own_quota_and_are_given_back() {
        let mut f = Fixture::new(quota(8, 4, 1), quota(3, 1, 1));
        let (a, _) = f.admit(1000, 0).unwrap();
        let (b, _) = f.admit(1000, 0).unwrap();
        let (c, _) = f.admit(1001, 0).unwrap();
        let (d, _) = f.admit(1002, 0).unwrap();
        let (r, _) = f.admit(0, 0).unwrap();
        f.census.subscribe(a).unwrap();
        assert_eq!(
            f.census.subscribe(b),
            Err(Refusal::PerUid {
                uid: 1000,
                what: "event streams",
                limit: 1
            })
        );
        f.census.subscribe(c).unwrap();
        assert!(matches!(
            f.census.subscribe(d),
            Err(Refusal::NonRoot { limit: 2, .. })
        ));
        f.census.subscribe(r).unwrap();
        f.census.unsubscribe(c);
        f.census.subscribe(d).unwrap();
        f.census.release(a);
        f.census.subscribe(b).unwrap();
        assert_eq!(f.census.all.subscriptions, 3);
    }
}
