//! Process states CRIU 4.2.1 cannot bring back into a Belayer sandbox, found before a
//! checkpoint that holds them is published (docs/process-states.md).
//!
//! - **TCP connections of a sandbox with a private user namespace.** CRIU rebuilds a
//!   connection in repair mode (`TCP_REPAIR`), which needs `CAP_NET_ADMIN` over the user
//!   namespace owning the socket's network namespace. The restored tasks live in the user
//!   namespace CRIU recreates from the images, while the network namespace, made by the
//!   daemon so that CRIU does not have to dump it, belongs to the host's: every restore of
//!   such a checkpoint would fail ("Can't turn TCP repair mode ON: Operation not permitted"),
//!   so the checkpoint is refused instead (found in the dump's `files.img`). Listening
//!   sockets need no repair mode and are fine.
//! - **A non-default personality.** CRIU reads `/proc/<pid>/personality` at dump and never
//!   sets it at restore: the process would silently come back as `PER_LINUX`.
//! - **POSIX message queues.** CRIU cannot dump an fd of the `mqueue` filesystem (it looks for
//!   the fd's mount in the sandbox's mount namespace and fails); found when a dump failed,
//!   to say why.
//!
//! Everything here reads the host's procfs for pids the daemon found in the sandbox's cgroup
//! (while the sandbox is frozen, they cannot change), or CRIU's images; no path inside the
//! sandbox is used.

/// `statfs` magic of the mqueue filesystem.
const MQUEUE_MAGIC: u64 = 0x1980_0202;

/// Most file descriptors looked at per process when a failed dump is diagnosed.
const MAX_FDS_SCANNED: usize = 65_536;

/// A state the checkpoint cannot carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnsupportedState {
    /// A TCP connection (not a listening socket) in a sandbox with a private user namespace.
    #[error(
        "{count} TCP connection(s) (e.g. {example}) in a sandbox with a private user namespace: \
         CRIU cannot put them in repair mode at restore (the network namespace is the host's)"
    )]
    TcpInPrivateUserns {
        /// Connections found (sockets with an owner, neither listening nor closed).
        count: usize,
        /// One of them: ports, kernel TCP state, family.
        example: String,
    },
    /// A process runs with a personality other than `PER_LINUX`.
    #[error("process {pid} has personality {value:#x}: CRIU does not restore personalities")]
    Personality {
        /// Host pid.
        pid: i32,
        /// Its personality.
        value: u32,
    },
    /// A process holds a POSIX message queue.
    #[error("process {pid} holds a POSIX message queue (fd {fd}): CRIU cannot dump mqueue files")]
    PosixMqueue {
        /// Host pid.
        pid: i32,
        /// The fd.
        fd: i32,
    },
}

/// Checks the frozen sandbox's processes `pids` for states a restore could not bring back
/// (one read of `/proc/<pid>/personality` each: a few microseconds per process).
pub fn check_frozen(pids: &[i32]) -> Result<(), UnsupportedState> {
    for &pid in pids {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/personality")) else {
            continue;
        };
        if let Ok(value) = u32::from_str_radix(text.trim(), 16) {
            if value != 0 {
                return Err(UnsupportedState::Personality { pid, value });
            }
        }
    }
    Ok(())
}

/// Checks a finished dump in `images` of a sandbox with a private user namespace for TCP
/// connections (from CRIU's `files.img`, after the thaw: reading the namespace's
/// `/proc/net/tcp{,6}` walks the host's whole TCP hash, ≈4 ms each, too long for the frozen
/// window). An unreadable `files.img` is left to the path check, which reads it too.
pub fn check_tcp_images(images: &std::path::Path) -> Result<(), UnsupportedState> {
    match belayer_criu::tcp_connections(images) {
        Ok(conns) => match conns.first() {
            None => Ok(()),
            Some(c) => Err(UnsupportedState::TcpInPrivateUserns {
                count: conns.len(),
                example: format!(
                    "port {} -> {} (state {}{})",
                    c.src_port,
                    c.dst_port,
                    c.state,
                    if c.family == 10 { ", IPv6" } else { "" }
                ),
            }),
        },
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the dump's TCP connections");
            Ok(())
        }
    }
}

/// After a failed dump: a state of `pids` that explains it, if one is known.
pub fn diagnose_dump_failure(pids: &[i32]) -> Option<UnsupportedState> {
    for &pid in pids {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for entry in dir.flatten().take(MAX_FDS_SCANNED) {
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<i32>().ok())
            else {
                continue;
            };
            // The magic link opens the fd's own file, wherever it lives.
            let Ok(st) = rustix::fs::statfs(entry.path()) else {
                continue;
            };
            if st.f_type as u64 == MQUEUE_MAGIC {
                return Some(UnsupportedState::PosixMqueue { pid, fd });
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_nothing_unsupported() {
        let me = std::process::id() as i32;
        assert_eq!(check_frozen(&[me]), Ok(()));
        assert_eq!(diagnose_dump_failure(&[me]), None);
    }
}
