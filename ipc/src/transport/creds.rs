//! Peer credentials of a Unix socket connection and the access policy applied to them.
//!
//! The kernel records the peer's pid, uid and gid (`SO_PEERCRED`) and its supplementary groups
//! (`SO_PEERGROUPS`) when it calls `connect(2)`; neither can be forged by the peer. Where
//! `SO_PEERGROUPS` is unavailable the groups are read from `/proc/<pid>/status` instead (racy
//! against pid reuse, so only a fallback).

use std::fmt;
use std::io;
use std::os::fd::AsFd;

use nix::errno::Errno;
use nix::sys::socket::{getsockopt, sockopt};

use super::sys;

/// Why the credentials of a peer could not be read, or why the peer is refused.
#[derive(Debug, thiserror::Error)]
pub enum CredsError {
    /// `getsockopt(SO_PEERCRED)` failed.
    #[error("getsockopt(SO_PEERCRED) failed")]
    PeerCred {
        /// The errno.
        #[source]
        source: Errno,
    },
    /// `getsockopt(SO_PEERGROUPS)` failed with something other than "unsupported".
    #[error("getsockopt(SO_PEERGROUPS) failed for peer pid {pid}")]
    PeerGroups {
        /// Peer pid.
        pid: i32,
        /// The errno.
        #[source]
        source: Errno,
    },
    /// `/proc/<pid>/status` could not be read (the peer may have exited).
    #[error("reading /proc/{pid}/status failed")]
    ReadStatus {
        /// Peer pid.
        pid: i32,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// `/proc/<pid>/status` has no parsable `Groups:` line.
    #[error("/proc/{pid}/status has no parsable Groups: line")]
    ParseStatus {
        /// Peer pid.
        pid: i32,
    },
    /// The peer is neither root nor a member of the allowed group.
    #[error("peer pid {pid} uid {uid} gid {gid} is not allowed: {}", refusal(.allowed_gid))]
    Denied {
        /// Peer pid.
        pid: i32,
        /// Peer uid.
        uid: u32,
        /// Peer primary gid.
        gid: u32,
        /// The group the policy admits, if any.
        allowed_gid: Option<u32>,
    },
}

fn refusal(allowed_gid: &Option<u32>) -> String {
    match allowed_gid {
        Some(gid) => format!("neither root nor a member of group {gid}"),
        None => "only root may connect".to_owned(),
    }
}

/// Credentials of the process at the other end of a Unix socket, as of its `connect(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCred {
    /// Process id (in the server's pid namespace).
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective primary group id.
    pub gid: u32,
}

impl PeerCred {
    /// Reads the peer credentials of a connected Unix socket (`SO_PEERCRED`).
    ///
    /// Errors: [`CredsError::PeerCred`].
    pub fn of<F: AsFd>(socket: &F) -> Result<PeerCred, CredsError> {
        let creds = getsockopt(socket, sockopt::PeerCredentials)
            .map_err(|source| CredsError::PeerCred { source })?;
        Ok(PeerCred {
            pid: creds.pid(),
            uid: creds.uid(),
            gid: creds.gid(),
        })
    }
}

impl fmt::Display for PeerCred {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} uid {} gid {}", self.pid, self.uid, self.gid)
    }
}

/// Who sent a request: the peer's credentials and, where the kernel reports them, its
/// supplementary groups, all as of its `connect(2)`.
///
/// A handler that acts *on behalf of* the peer (opens or reads something with its rights)
/// needs the groups as well as uid and gid; they come from `SO_PEERGROUPS` only (never from
/// `/proc/<pid>/status`, which is racy against pid reuse), so `groups` is `None` where that
/// option is unsupported and such work must be refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// pid, uid and gid (`SO_PEERCRED`).
    pub cred: PeerCred,
    /// Supplementary groups (`SO_PEERGROUPS`), `None` when unavailable.
    pub groups: Option<Vec<u32>>,
}

impl Caller {
    /// Reads the credentials and supplementary groups of the peer of `socket`.
    ///
    /// Errors: [`CredsError::PeerCred`] (a missing `SO_PEERGROUPS` only leaves `groups` unset).
    pub fn of<F: AsFd>(socket: &F) -> Result<Caller, CredsError> {
        let cred = PeerCred::of(socket)?;
        let groups = sys::peer_groups(socket.as_fd()).ok();
        Ok(Caller { cred, groups })
    }

    /// The calling process itself as root: for in-process callers of a handler (embedded
    /// agents, benchmarks) that act with the daemon's own rights.
    pub fn root() -> Caller {
        Caller {
            cred: PeerCred {
                pid: std::process::id() as i32,
                uid: 0,
                gid: 0,
            },
            groups: Some(Vec::new()),
        }
    }

    /// A caller with credentials `cred` and unknown supplementary groups.
    pub fn without_groups(cred: PeerCred) -> Caller {
        Caller { cred, groups: None }
    }

    /// Whether the caller is root (uid 0), which may see and act on everything.
    pub fn is_root(&self) -> bool {
        self.cred.uid == 0
    }
}

/// Supplementary groups of the peer of `socket`: `SO_PEERGROUPS` (Linux 4.13+), or
/// `/proc/<peer.pid>/status` where that option is unsupported.
///
/// Errors: [`CredsError::PeerGroups`], or those of [`proc_groups`] on the fallback path.
pub fn peer_groups<F: AsFd>(socket: &F, peer: &PeerCred) -> Result<Vec<u32>, CredsError> {
    match sys::peer_groups(socket.as_fd()) {
        Ok(groups) => Ok(groups),
        Err(Errno::ENOPROTOOPT) => proc_groups(peer.pid),
        Err(source) => Err(CredsError::PeerGroups {
            pid: peer.pid,
            source,
        }),
    }
}

/// Supplementary groups of process `pid`, from the `Groups:` line of `/proc/<pid>/status`.
///
/// Errors: [`CredsError::ReadStatus`], [`CredsError::ParseStatus`].
pub fn proc_groups(pid: i32) -> Result<Vec<u32>, CredsError> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|source| CredsError::ReadStatus { pid, source })?;
    parse_status_groups(&status).ok_or(CredsError::ParseStatus { pid })
}

fn parse_status_groups(status: &str) -> Option<Vec<u32>> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("Groups:"))?;
    line.split_whitespace()
        .map(|gid| gid.parse().ok())
        .collect()
}

/// Who may talk to the server.
///
/// Root (uid 0) is always admitted. When `allowed_gid` is set, a peer whose primary gid or one
/// of whose supplementary groups equals it is admitted too. Everyone else is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AccessPolicy {
    /// The group whose members may connect besides root; `None` = root only.
    pub allowed_gid: Option<u32>,
}

impl AccessPolicy {
    /// Root only.
    pub fn root_only() -> AccessPolicy {
        AccessPolicy { allowed_gid: None }
    }

    /// Root and the members of group `gid`.
    pub fn group(gid: u32) -> AccessPolicy {
        AccessPolicy {
            allowed_gid: Some(gid),
        }
    }

    /// Whether a peer with credentials `peer` and supplementary groups `supplementary` is
    /// admitted.
    pub fn allows(&self, peer: &PeerCred, supplementary: &[u32]) -> bool {
        if peer.uid == 0 {
            return true;
        }
        match self.allowed_gid {
            Some(gid) => peer.gid == gid || supplementary.contains(&gid),
            None => false,
        }
    }

    /// Decides about the peer `peer` of `socket`, reading its supplementary groups only when
    /// uid and primary gid do not settle the question.
    ///
    /// Errors: [`CredsError::Denied`] for a refused peer; the errors of [`peer_groups`] when the
    /// groups cannot be read (callers must treat those as a refusal too).
    pub fn authorize<F: AsFd>(&self, socket: &F, peer: &PeerCred) -> Result<(), CredsError> {
        if self.allows(peer, &[]) {
            return Ok(());
        }
        if self.allowed_gid.is_some() && self.allows(peer, &peer_groups(socket, peer)?) {
            return Ok(());
        }
        Err(CredsError::Denied {
            pid: peer.pid,
            uid: peer.uid,
            gid: peer.gid,
            allowed_gid: self.allowed_gid,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    use super::*;

    fn peer(uid: u32, gid: u32) -> PeerCred {
        PeerCred { pid: 1, uid, gid }
    }

    #[test]
    fn policy_admits_root_and_group_members_only() {
        let root_only = AccessPolicy::root_only();
        assert!(root_only.allows(&peer(0, 0), &[]));
        assert!(root_only.allows(&peer(0, 1000), &[]));
        assert!(!root_only.allows(&peer(1000, 0), &[0]));

        let group = AccessPolicy::group(4242);
        assert!(group.allows(&peer(0, 0), &[]));
        assert!(group.allows(&peer(1000, 4242), &[]));
        assert!(group.allows(&peer(1000, 1000), &[7, 4242]));
        assert!(!group.allows(&peer(1000, 1000), &[7, 4243]));
        assert!(!group.allows(&peer(65534, 65534), &[]));
    }

    #[test]
    fn status_groups_line_is_parsed() {
        let status = "Name:\tcat\nUid:\t0\t0\t0\t0\nGroups:\t4 24 27 4242 \nNSpid:\t1\n";
        assert_eq!(parse_status_groups(status), Some(vec![4, 24, 27, 4242]));
        assert_eq!(parse_status_groups("Groups:\t\n"), Some(vec![]));
        assert_eq!(parse_status_groups("Name:\tx\n"), None);
        assert_eq!(parse_status_groups("Groups:\tx\n"), None);
    }

    #[test]
    fn own_credentials_and_groups_are_read() {
        let (a, _b) = UnixStream::pair().unwrap();
        let cred = PeerCred::of(&a).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        assert_eq!(cred.uid, nix::unistd::geteuid().as_raw());
        assert_eq!(cred.gid, nix::unistd::getegid().as_raw());
        let mut from_proc = proc_groups(cred.pid).unwrap();
        let mut from_socket = peer_groups(&a, &cred).unwrap();
        from_proc.sort_unstable();
        from_socket.sort_unstable();
        assert_eq!(from_proc, from_socket);
        assert!(AccessPolicy::root_only().authorize(&a, &cred).is_ok() || cred.uid != 0);
    }

    #[test]
    fn denial_message_names_the_peer_and_the_rule() {
        let err = CredsError::Denied {
            pid: 9,
            uid: 65534,
            gid: 65534,
            allowed_gid: Some(4242),
        };
        assert_eq!(
            err.to_string(),
            "peer pid 9 uid 65534 gid 65534 is not allowed: neither root nor a member of group 4242"
        );
    }
}
