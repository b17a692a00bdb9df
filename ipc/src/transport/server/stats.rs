//! Counters of the socket server, read by the daemon's metrics endpoint.
//!
//! Every field is an atomic updated where the event happens (the accept loop, the census,
//! a connection thread ending); reading them never takes the census lock.

use std::sync::atomic::{AtomicU64, Ordering};

/// What the socket server has accepted, served and refused since it was bound. Shared
/// through [`Server::stats`](super::Server::stats); all counts are since the bind.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections served now (admitted, thread running; evicted ones not counted).
    open: AtomicU64,
    /// Event streams held now.
    subscriptions: AtomicU64,
    /// Connections admitted.
    admitted: AtomicU64,
    /// Connections refused at accept (access policy or quota), answered and closed.
    refused: AtomicU64,
    /// Idle connections evicted to make room for a newcomer.
    evicted: AtomicU64,
}

/// A consistent-enough copy of [`ServerStats`] (each field read once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerCounts {
    /// Connections served now.
    pub open: u64,
    /// Event streams held now.
    pub subscriptions: u64,
    /// Connections admitted since the bind.
    pub admitted: u64,
    /// Connections refused since the bind.
    pub refused: u64,
    /// Idle connections evicted since the bind.
    pub evicted: u64,
}

impl ServerStats {
    /// The current counts.
    pub fn counts(&self) -> ServerCounts {
        ServerCounts {
            open: self.open.load(Ordering::Relaxed),
            subscriptions: self.subscriptions.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn set_open(&self, connections: usize, subscriptions: usize) {
        self.open.store(connections as u64, Ordering::Relaxed);
        self.subscriptions
            .store(subscriptions as u64, Ordering::Relaxed);
    }

    pub(crate) fn admitted(&self) {
        self.admitted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn evicted(&self) {
        self.evicted.fetch_add(1, Ordering::Relaxed);
    }
}
