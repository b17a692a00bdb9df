//! Process states CRIU 4.2.1 cannot bring back into a Belayer sandbox, found before a
//! checkpoint that holds them is published (docs/process-states.md).
//!
//! - **TCP connections of a sandbox with a private user namespace.** CRIU rebuilds a
//!   connection in repair mode (`TCP_REPAIR`), which needs `CAP_NET_ADMIN` over the user
//!   namespace owning the socket's network namespace. The restored tasks live in the user
//!   namespace CRIU recreates from the images, while the network namespace, made by the
//!   daemon so that CRIU does not have to dump it, belongs to the host's: every restore of
//!   such a checkpoint would fail ("Can't turn TCP repair mode ON: Operation not permitted"),
//!   so the checkpoint is refused instead. Listening sockets need no repair mode and are fine.
//! - **A non-default personality.** CRIU reads `/proc/<pid>/personality` at dump and never
//!   sets it at restore: the process would silently come back as `PER_LINUX`.
//! - **POSIX message queues.** CRIU cannot dump an fd of the `mqueue` filesystem (it looks for
//!   the fd's mount in the sandbox's mount namespace and fails); found when a dump failed,
//!   to say why.
//!
//! Everything here reads the host's procfs for pids the daemon found in the sandbox's cgroup
//! (while the sandbox is frozen, they cannot change); no path inside the sandbox is used.

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
        /// One of them, `local -> remote (state)`.
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

/// Checks the frozen sandbox whose init is `init_pid` and whose processes are `pids` for
/// states a restore could not bring back. `private_userns`: the sandbox has a user namespace
/// of its own. Costs one read of `/proc/<pid>/personality` per process and of the namespace's
/// TCP tables (tens of microseconds for a small sandbox).
pub fn check_frozen(
    init_pid: i32,
    pids: &[i32],
    private_userns: bool,
) -> Result<(), UnsupportedState> {
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
    if private_userns {
        let mut count = 0;
        let mut example = None;
        for table in ["tcp", "tcp6"] {
            let Ok(text) = std::fs::read_to_string(format!("/proc/{init_pid}/net/{table}")) else {
                continue;
            };
            for conn in text.lines().skip(1).filter_map(parse_tcp_line) {
                count += 1;
                example.get_or_insert(conn);
            }
        }
        if let Some(example) = example {
            return Err(UnsupportedState::TcpInPrivateUserns { count, example });
        }
    }
    Ok(())
}

/// A line of `/proc/net/tcp{,6}` that is a connection CRIU restores in repair mode: owned by a
/// socket (inode not 0) and neither `LISTEN` (0A) nor `CLOSE` (07). Returns
/// `local -> remote (state)` in the table's hex notation.
fn parse_tcp_line(line: &str) -> Option<String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let (local, remote, state, inode) = (f.get(1)?, f.get(2)?, f.get(3)?, f.get(9)?);
    if *inode == "0" || *state == "0A" || *state == "07" {
        return None;
    }
    Some(format!("{local} -> {remote} (state {state})"))
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
    fn only_owned_connections_count() {
        let est = "   1: 0100007F:A1B2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 20 4 30 10 -1";
        let listen = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12344 1 0000000000000000 100 0 0 10 0";
        let unaccepted = "   2: 0100007F:1F90 0100007F:A1B3 01 00000000:00000000 00:00000000 00000000     0        0 0 1 0000000000000000 20 4 30 10 -1";
        assert_eq!(
            parse_tcp_line(est).as_deref(),
            Some("0100007F:A1B2 -> 0100007F:1F90 (state 01)")
        );
        assert_eq!(parse_tcp_line(listen), None);
        assert_eq!(parse_tcp_line(unaccepted), None);
        assert_eq!(parse_tcp_line("garbage"), None);
    }

    #[test]
    fn this_process_has_nothing_unsupported() {
        let me = std::process::id() as i32;
        assert_eq!(check_frozen(me, &[me], false), Ok(()));
        assert_eq!(diagnose_dump_failure(&[me]), None);
    }
}
