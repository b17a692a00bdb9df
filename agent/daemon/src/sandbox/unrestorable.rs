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
//! - **`/dev/tty` open in a sandbox of the host's user namespace.** CRIU re-opens such a
//!   descriptor and `fchown`s it; there `/dev/tty` is the host's node bound read-only (its root
//!   would have `CAP_FOWNER` over it), so the restore would fail with `EROFS`. Found in the
//!   dump's `tty-info.img` by the path check.
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
    /// A process holds `/dev/tty` open in a sandbox of the host's user namespace, whose
    /// `/dev/tty` is a read-only bind of the host's node: CRIU's restore `fchown`s such a
    /// descriptor and fails with `EROFS` (with a private user namespace `/dev/tty` is writable
    /// and this restores).
    #[error(
        "{count} descriptor(s) of /dev/tty in a sandbox of the host's user namespace: CRIU's \
         restore fchowns them, and there /dev/tty is the host's node bound read-only"
    )]
    DevTtyInHostUserns {
        /// Descriptors found in the images.
        count: usize,
    },
    /// The dump's ghost files (files deleted while open, which CRIU copies into its images and
    /// writes back at restore, each up to `criu_ghost_limit_bytes`) would not fit in what the
    /// sandbox's disk limit leaves: the restore would fail writing them.
    #[error(
        "the dump holds {ghost_bytes} bytes of files deleted while open, more than the \
         {room} bytes the sandbox's disk limit leaves for writing them back at restore"
    )]
    GhostsOverDiskRoom {
        /// Bytes of the ghost-file images.
        ghost_bytes: u64,
        /// The limit minus the rest of the upper layer's charge.
        room: u64,
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

/// Checks that `ghost_bytes` of ghost files fit a restore of a sandbox with disk limit
/// `limit` whose upper layer is charged `charged` bytes, ghosts included (their extents stay
/// allocated while open): the restore writes them back on top of the rest.
pub fn check_ghost_room(
    ghost_bytes: u64,
    charged: u64,
    limit: u64,
) -> Result<(), UnsupportedState> {
    let room = limit.saturating_sub(charged.saturating_sub(ghost_bytes));
    if ghost_bytes > room {
        return Err(UnsupportedState::GhostsOverDiskRoom { ghost_bytes, room });
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

    #[test]
    fn ghosts_must_fit_what_the_limit_leaves() {
        // 10 MiB of ghosts in a 15 MiB layer under 32 MiB: 27 MiB left for them.
        assert_eq!(check_ghost_room(10 << 20, 15 << 20, 32 << 20), Ok(()));
        // Clones charged once (20 MiB) but dumped 7 times (140 MiB).
        assert_eq!(
            check_ghost_room(140 << 20, 20 << 20, 32 << 20),
            Err(UnsupportedState::GhostsOverDiskRoom {
                ghost_bytes: 140 << 20,
                room: 32 << 20
            })
        );
    }
}
