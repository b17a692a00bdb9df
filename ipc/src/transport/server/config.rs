//! Where and how the server listens ([`ServerConfig`]) and what one client may hold of it
//! ([`ConnectionLimits`]: connection and subscription quotas, frame, idle and send timeouts).

use std::path::PathBuf;
use std::time::Duration;

use crate::frame::DEFAULT_MAX_FRAME;
use crate::transport::creds::AccessPolicy;

/// Default permission bits of the socket file: owner and group may connect.
pub const DEFAULT_SOCKET_MODE: u32 = 0o660;

/// How many of something (connections, event subscriptions) the server serves at once, in
/// total and per peer uid.
///
/// Root (uid 0) is counted in `total` but has no per-uid cap, and `root_reserved` of the
/// `total` slots are kept for it: all non-root peers together hold at most
/// `total - root_reserved`. So no peer uid at its cap, nor all of them together, can keep root
/// or another uid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Most held at once by all peers together (at least 1).
    pub total: usize,
    /// Most held at once by one non-root uid (at least 1).
    pub per_uid: usize,
    /// Slots of `total` only root may take (below `total`).
    pub root_reserved: usize,
}

impl Quota {
    /// Most held at once by all non-root peers together.
    pub fn non_root_total(&self) -> usize {
        self.total.saturating_sub(self.root_reserved)
    }
}

/// What clients may hold of the server: see [`ConnectionLimits::default`] for the values.
///
/// A connection over the connection quota is answered with an
/// [`ErrorCode::Busy`](crate::ErrorCode::Busy) reply (request id 0) and closed by the accept
/// loop itself, without a thread of its own; a `Subscribe` over the subscription quota is
/// answered `Busy` with the request's id and the connection goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections served at once (each holds one thread while open, idle or not).
    pub connections: Quota,
    /// Of those, connections turned into event streams (`Request::Subscribe`).
    pub subscriptions: Quota,
    /// Time from the first byte of a request frame until its last byte; a frame not complete
    /// by then is answered `BadRequest` (id 0) and the connection closed.
    pub frame_timeout: Duration,
    /// Longest wait for the next request on a connection (from its accept or from the end of
    /// the previous response); then the connection is closed. Event streams are exempt, and a
    /// request being handled is never cut.
    pub idle_timeout: Duration,
    /// Longest time to write one response or one event frame; a peer that does not read it
    /// in time is disconnected (a subscriber too).
    pub send_timeout: Duration,
}

impl Default for ConnectionLimits {
    /// 256 connections (32 per non-root uid, 32 kept for root), 64 event streams (8 per
    /// non-root uid, 8 kept for root), frame timeout 10 s, idle timeout 3600 s, send timeout
    /// 10 s.
    fn default() -> Self {
        ConnectionLimits {
            connections: Quota {
                total: 256,
                per_uid: 32,
                root_reserved: 32,
            },
            subscriptions: Quota {
                total: 64,
                per_uid: 8,
                root_reserved: 8,
            },
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(3600),
            send_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a [`ConnectionLimits`] is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// A count or a duration is zero.
    #[error("{field} must be greater than zero")]
    Zero {
        /// The offending field.
        field: &'static str,
    },
    /// The root reserve leaves nothing for the other peers.
    #[error("{field} ({reserved}) must be below the total ({total})")]
    ReserveTooLarge {
        /// The offending field.
        field: &'static str,
        /// Its value.
        reserved: usize,
        /// The total it is part of.
        total: usize,
    },
}

impl ConnectionLimits {
    /// Checks that every count and duration is non-zero and each root reserve is below its
    /// total. (Event streams beyond the connection quota are allowed but never reached: every
    /// stream is a connection.)
    ///
    /// Errors: [`LimitsError`] naming the field by its `belayerd` config key.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let quotas = [
            (
                &self.connections,
                "max_connections",
                "max_connections_per_uid",
                "root_reserved_connections",
            ),
            (
                &self.subscriptions,
                "max_subscriptions",
                "max_subscriptions_per_uid",
                "root_reserved_subscriptions",
            ),
        ];
        for (quota, total, per_uid, reserved) in quotas {
            if quota.total == 0 {
                return Err(LimitsError::Zero { field: total });
            }
            if quota.per_uid == 0 {
                return Err(LimitsError::Zero { field: per_uid });
            }
            if quota.root_reserved >= quota.total {
                return Err(LimitsError::ReserveTooLarge {
                    field: reserved,
                    reserved: quota.root_reserved,
                    total: quota.total,
                });
            }
        }
        let durations = [
            (self.frame_timeout, "frame_timeout_ms"),
            (self.idle_timeout, "idle_timeout_s"),
            (self.send_timeout, "send_timeout_ms"),
        ];
        for (duration, field) in durations {
            if duration.is_zero() {
                return Err(LimitsError::Zero { field });
            }
        }
        Ok(())
    }

    /// Sets the connection quota.
    pub fn connections(mut self, total: usize, per_uid: usize, root_reserved: usize) -> Self {
        self.connections = Quota {
            total,
            per_uid,
            root_reserved,
        };
        self
    }

    /// Sets the event-stream quota.
    pub fn subscriptions(mut self, total: usize, per_uid: usize, root_reserved: usize) -> Self {
        self.subscriptions = Quota {
            total,
            per_uid,
            root_reserved,
        };
        self
    }

    /// Sets the frame timeout.
    pub fn frame_timeout(mut self, timeout: Duration) -> Self {
        self.frame_timeout = timeout;
        self
    }

    /// Sets the idle timeout.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Sets the send timeout.
    pub fn send_timeout(mut self, timeout: Duration) -> Self {
        self.send_timeout = timeout;
        self
    }
}

/// Where and how the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Socket path; its parent directory is created when missing.
    pub path: PathBuf,
    /// Permission bits of the socket file (default [`DEFAULT_SOCKET_MODE`]).
    pub mode: u32,
    /// Group that owns the socket file, when set (the owner stays the server's uid).
    pub group: Option<u32>,
    /// Who may talk to the server once connected (default: root only).
    pub policy: AccessPolicy,
    /// Largest accepted request payload and largest sent response payload, bytes.
    pub max_frame: u32,
    /// Connection quotas and timeouts (default [`ConnectionLimits::default`]).
    pub limits: ConnectionLimits,
}

impl ServerConfig {
    /// A configuration for `path` with mode 0660, no group change, root-only access, the
    /// default 16 MiB frame limit and the default [`ConnectionLimits`].
    pub fn new(path: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            path: path.into(),
            mode: DEFAULT_SOCKET_MODE,
            group: None,
            policy: AccessPolicy::root_only(),
            max_frame: DEFAULT_MAX_FRAME,
            limits: ConnectionLimits::default(),
        }
    }

    /// Sets the permission bits of the socket file.
    pub fn mode(mut self, mode: u32) -> ServerConfig {
        self.mode = mode;
        self
    }

    /// Sets the group owning the socket file (does not change the access policy).
    pub fn group(mut self, gid: u32) -> ServerConfig {
        self.group = Some(gid);
        self
    }

    /// Sets the access policy.
    pub fn policy(mut self, policy: AccessPolicy) -> ServerConfig {
        self.policy = policy;
        self
    }

    /// Sets the maximum payload size in bytes.
    pub fn max_frame(mut self, max_frame: u32) -> ServerConfig {
        self.max_frame = max_frame;
        self
    }

    /// Sets the connection quotas and timeouts.
    pub fn limits(mut self, limits: ConnectionLimits) -> ServerConfig {
        self.limits = limits;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_name_their_key() {
        let limits = ConnectionLimits::default();
        assert_eq!(limits.validate(), Ok(()));
        assert_eq!(limits.connections.non_root_total(), 224);
        assert_eq!(
            limits.connections(0, 1, 0).validate(),
            Err(LimitsError::Zero {
                field: "max_connections"
            })
        );
        assert_eq!(
            limits.connections(8, 0, 0).validate(),
            Err(LimitsError::Zero {
                field: "max_connections_per_uid"
            })
        );
        assert_eq!(
            limits.connections(8, 4, 8).validate(),
            Err(LimitsError::ReserveTooLarge {
                field: "root_reserved_connections",
                reserved: 8,
                total: 8
            })
        );
        assert_eq!(
            limits.idle_timeout(Duration::ZERO).validate(),
            Err(LimitsError::Zero {
                field: "idle_timeout_s"
            })
        );
        assert_eq!(
            limits
                .subscriptions(4, 4, 4)
                .validate()
                .unwrap_err()
                .to_string(),
            "root_reserved_subscriptions (4) must be below the total (4)"
        );
    }
}
