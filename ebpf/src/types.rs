//! The tracer's shared vocabulary: the [`Target`]s it watches, the [`Fault`]s and
//! [`TraceEvent`]s it reports, the [`Counters`] the BPF programs keep, which detector runs
//! ([`TracerKind`]), its errors, and the handles both detectors share (the event sink, the
//! target table, the OOM counter reader). Used by the facade (`tracer`) and by both
//! detectors (`bpf`, `fallback`), which never depend on each other or on the facade.

use std::collections::HashMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Errors of the tracer.
#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    /// Reading the kernel's BTF failed.
    #[error("cannot read kernel BTF")]
    Btf(#[source] aya::BtfError),
    /// Loading the BPF object (maps, relocations) failed.
    #[error("cannot load the BPF object")]
    Load(#[source] aya::EbpfError),
    /// The object lacks a program or map the loader expects.
    #[error("BPF object has no {0}")]
    Missing(String),
    /// Loading or attaching one program failed.
    #[error("cannot load or attach BPF program {name}")]
    Program {
        /// Program (C function) name.
        name: &'static str,
        /// Cause.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// A map operation failed.
    #[error("BPF map {name}: {op} failed")]
    Map {
        /// Map name.
        name: &'static str,
        /// Operation.
        op: &'static str,
        /// Cause.
        #[source]
        source: aya::maps::MapError,
    },
    /// Starting the event thread failed.
    #[error("cannot start the tracer thread")]
    Thread(#[source] std::io::Error),
    /// Opening a pidfd of a sandbox init failed.
    #[error("pidfd_open({pid}) failed")]
    Pidfd {
        /// Host pid.
        pid: i32,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Opening a cgroup file failed.
    #[error("cannot open {path}")]
    Open {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Which detector runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TracerKind {
    /// The BPF programs are loaded: exact attribution, per-cgroup counters.
    Bpf,
    /// pidfd/waitid and cgroup polling: init death, OOM counter; no activity counters.
    Fallback,
}

impl fmt::Display for TracerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TracerKind::Bpf => "bpf",
            TracerKind::Fallback => "fallback",
        })
    }
}

/// A sandbox to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Cgroup v2 id of the sandbox cgroup (see [`cgroup_id`]).
    pub cgroup_id: u64,
    /// The sandbox's cgroup v2 directory (its `cgroup.events` is polled by the fallback).
    pub cgroup_dir: PathBuf,
    /// Host pid of the sandbox init.
    pub init_pid: i32,
    /// A file with an `oom_kill <n>` line counting OOM kills in the sandbox (v2
    /// `memory.events`, v1 `memory.oom_control`); read by the fallback.
    pub oom_events: Option<PathBuf>,
}

/// What went wrong in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The sandbox init exited.
    InitExited {
        /// Host pid of the init.
        pid: i32,
        /// Exit status when it exited normally (when known).
        exit_code: Option<i32>,
        /// Terminating signal (when known).
        signal: Option<i32>,
    },
    /// A fatal signal sent from outside the sandbox's cgroup reached one of its processes.
    ExternalKill {
        /// Host pid of the target process.
        pid: i32,
        /// The signal.
        signal: i32,
        /// Host pid of the sender (BPF only).
        sender_pid: Option<i32>,
    },
    /// The OOM killer chose a process of the sandbox.
    Oom {
        /// Host pid of the victim (BPF only).
        pid: Option<i32>,
    },
    /// The sandbox cgroup has no process left (fallback only; BPF reports the init's exit).
    CgroupEmpty,
}

impl Fault {
    /// A short name of the kind of fault, for metrics and logs: `init_exited`,
    /// `external_kill`, `oom` or `cgroup_empty`.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::InitExited { .. } => "init_exited",
            Fault::ExternalKill { .. } => "external_kill",
            Fault::Oom { .. } => "oom",
            Fault::CgroupEmpty => "cgroup_empty",
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::InitExited {
                pid,
                exit_code,
                signal,
            } => {
                write!(f, "sandbox init {pid} exited")?;
                if let Some(s) = signal {
                    write!(f, " (signal {s})")?;
                } else if let Some(c) = exit_code {
                    write!(f, " (code {c})")?;
                }
                Ok(())
            }
            Fault::ExternalKill {
                pid,
                signal,
                sender_pid,
            } => {
                write!(
                    f,
                    "process {pid} got signal {signal} from outside the sandbox"
                )?;
                if let Some(s) = sender_pid {
                    write!(f, " (sender pid {s})")?;
                }
                Ok(())
            }
            Fault::Oom { pid: Some(p) } => write!(f, "process {p} was killed by the OOM killer"),
            Fault::Oom { pid: None } => f.write_str("a process was killed by the OOM killer"),
            Fault::CgroupEmpty => f.write_str("the sandbox cgroup has no process left"),
        }
    }
}

/// A fault seen in a tracked sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    /// Cgroup v2 id of the sandbox.
    pub cgroup_id: u64,
    /// What happened.
    pub fault: Fault,
    /// When the tracer's thread handled it.
    pub observed: Instant,
}

/// Per-sandbox activity counters kept by the BPF programs since the cgroup was tracked.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Changes: writes to named regular files (not anonymous pipes, devices, memfds, pseudo
    /// files), creates, unlinks, renames, mkdir/rmdir, mknod, links, attribute changes
    /// (chmod, chown, utimes, truncate), xattr changes, Unix sockets bound to a path,
    /// modifying ioctls, shared writable file mappings made by `mmap` or `mprotect`, every
    /// io_uring and Linux AIO syscall, every 32-bit or x32 syscall, core dumps; and data
    /// sent to sockets or named FIFOs, connections made, `process_vm_writev` and `ptrace`,
    /// SysV and POSIX IPC syscalls (state another process or the IPC namespace holds). The
    /// table in `bpf/file_activity.h` lists each path and its rule.
    pub fs_writes: u64,
    /// Processes created (threads not counted).
    pub forks: u64,
    /// Processes exited.
    pub exits: u64,
    /// Fatal signals from outside the cgroup.
    pub external_kills: u64,
    /// OOM victims.
    pub oom_kills: u64,
    /// Target of the last external kill (host pid).
    pub last_kill_pid: u32,
    /// Signal of the last external kill.
    pub last_kill_signal: u32,
    /// Last OOM victim (host pid).
    pub last_oom_pid: u32,
    /// Padding (layout of the BPF side).
    pub pad: u32,
    /// Live processes of the cgroup that used io_uring or Linux AIO since it was tracked
    /// (each counted once, uncounted when its last thread exits; never uncounted when the
    /// BPF map of such processes was full). While it is above 0, files may change without
    /// any syscall (SQPOLL rings, deferred requests, AIO in flight).
    pub async_procs: u64,
}

// SAFETY: `Counters` is `repr(C)`, made only of integers (any bit pattern is valid) and has the
// exact layout of `struct counters` in bpf/tracer.bpf.c (5 u64, 4 u32, 1 u64: no implicit
// padding, the u32s fill 16 bytes).
unsafe impl aya::Pod for Counters {}

/// The cgroup v2 id of the cgroup directory `dir`: its inode number.
///
/// Errors: the directory cannot be stat'ed.
pub fn cgroup_id(dir: &Path) -> std::io::Result<u64> {
    Ok(std::fs::metadata(dir)?.ino())
}

/// Callback receiving faults, called from the tracer's thread.
pub(crate) type Sink = Arc<dyn Fn(TraceEvent) + Send + Sync>;

/// Targets by cgroup id, shared with the tracer threads.
pub(crate) type Targets = Arc<Mutex<HashMap<u64, Target>>>;

/// The `oom_kill <n>` value of a `memory.events` / `memory.oom_control` file.
pub(crate) fn read_oom_kills(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_match_the_bpf_layout() {
        assert_eq!(std::mem::size_of::<Counters>(), 6 * 8 + 4 * 4);
    }

    #[test]
    fn oom_counter_parses() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("memory.oom_control");
        std::fs::write(&p, "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n").unwrap();
        assert_eq!(read_oom_kills(&p), Some(3));
        std::fs::write(&p, "low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\n").unwrap();
        assert_eq!(read_oom_kills(&p), Some(1));
    }

    #[test]
    fn faults_read_well() {
        let f = Fault::ExternalKill {
            pid: 10,
            signal: 9,
            sender_pid: Some(3),
        };
        assert_eq!(
            f.to_string(),
            "process 10 got signal 9 from outside the sandbox (sender pid 3)"
        );
        assert_eq!(TracerKind::Fallback.to_string(), "fallback");
    }
}
