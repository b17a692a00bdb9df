//! Sandbox cgroups: one cgroup per sandbox, spread over whatever hierarchies the node mounts.
//!
//! Nodes come in two shapes, both handled here:
//! - **pure cgroup v2** (typical GPU nodes): one hierarchy, usually at `/sys/fs/cgroup`, with the
//!   `memory` and `pids` controllers enabled through `cgroup.subtree_control`;
//! - **hybrid**: cgroup v2 mounted (e.g. at `/sys/fs/cgroup/unified`) with no controllers, which still
//!   gives `cgroup.freeze` (Linux 5.2+), `cgroup.kill` (Linux 5.14+) and `cgroup.events`, while
//!   `memory`, `pids` and `freezer` are v1 hierarchies under `/sys/fs/cgroup/<controller>`.
//!
//! [`CgroupLayout`] finds the hierarchies once from `/proc/self/mountinfo`. A [`SandboxCgroup`] lives at
//! the same relative path (e.g. `belayer/<sandbox id>`) in the v2 hierarchy and in each v1 hierarchy
//! it needs. v2 is preferred for everything; v1 is used for the limits v2 cannot enforce on this node
//! and, when asked for (or when v2 is absent), for freezing.
//!
//! The device allow-list ([`ALLOWED_DEVICES`]) is the v1 `devices` controller where mounted, else
//! a BPF device program on the v2 cgroup that outlives the daemon ([`DeviceFilter`],
//! `devices.rs`).
//!
//! Freezing is what makes a checkpoint consistent (the state-agreement invariant of the design):
//! [`SandboxCgroup::freeze`] returns only once every task is frozen and hands back a
//! [`FrozenGuard`] that thaws on drop, so an error path never leaves a sandbox frozen.

mod devices;
mod freeze;
mod kill;
mod layout;
mod limits;
mod sandbox;
mod sys;
mod tree;

#[cfg(test)]
mod test_support;

use std::io;
use std::path::PathBuf;
use std::time::Duration;

pub use devices::{device_rules, DeviceFilter, ALLOWED_DEVICES, PTY_DEVICES, PTY_SLAVE_MAJOR};
pub use freeze::FrozenGuard;
pub use layout::{CgroupLayout, V1Hierarchy};
pub use limits::{CpuMax, Limits};
pub use sandbox::{FreezerKind, KillMethod, SandboxCgroup};

/// Errors of cgroup operations. Paths name the exact file or directory involved.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// `/proc/self/mountinfo` could not be read.
    #[error("reading mount table {}", path.display())]
    ReadMountinfo {
        /// The mount table file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Neither a cgroup2 hierarchy nor a v1 `memory`, `pids` or `freezer` hierarchy is mounted.
    #[error("no cgroup hierarchy usable for sandboxes is mounted")]
    NoHierarchy,
    /// The relative cgroup path is absolute, empty, or has an empty, `.` or `..` component.
    #[error("invalid relative cgroup path {rel:?}")]
    InvalidPath {
        /// The rejected path.
        rel: String,
    },
    /// [`SandboxCgroup::create`] found the cgroup already there.
    #[error("cgroup {} already exists", path.display())]
    AlreadyExists {
        /// The existing cgroup directory.
        path: PathBuf,
    },
    /// [`SandboxCgroup::open`] found no such cgroup.
    #[error("cgroup {} does not exist", path.display())]
    NotFound {
        /// The missing cgroup directory.
        path: PathBuf,
    },
    /// `mkdir` of a cgroup directory failed.
    #[error("creating cgroup directory {}", path.display())]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Writing a control file failed.
    #[error("writing {value:?} to {}", path.display())]
    Write {
        /// The control file.
        path: PathBuf,
        /// What was written.
        value: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Reading a control file (or listing a cgroup directory) failed.
    #[error("reading {}", path.display())]
    Read {
        /// The control file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A control file held something unexpected.
    #[error("parsing {}: unexpected contents {contents:?}", path.display())]
    Parse {
        /// The control file.
        path: PathBuf,
        /// What it held.
        contents: String,
    },
    /// A limit was asked for but no hierarchy offers its controller.
    #[error("no {controller} controller available to enforce the limit")]
    LimitUnsupported {
        /// `"memory"` or `"pids"`.
        controller: &'static str,
    },
    /// The device allow-list asked for has no mechanism on this node (no v1 `devices`
    /// hierarchy for [`DeviceFilter::V1`], no cgroup2 for [`DeviceFilter::Bpf`]).
    #[error("no hierarchy for the {filter:?} device allow-list is mounted")]
    DeviceFilterUnavailable {
        /// The filter asked for.
        filter: DeviceFilter,
    },
    /// Loading, attaching or querying the BPF device allow-list of a v2 cgroup failed.
    #[error("BPF device allow-list of cgroup {}", path.display())]
    DeviceProgram {
        /// The v2 cgroup directory.
        path: PathBuf,
        /// What failed.
        #[source]
        source: belayer_ebpf::DeviceProgramError,
    },
    /// The chosen freezer does not exist for this cgroup.
    #[error("{kind:?} freezer not available for cgroup {rel}")]
    FreezerUnavailable {
        /// The relative cgroup path.
        rel: String,
        /// The freezer asked for.
        kind: FreezerKind,
    },
    /// Not every task froze in time; the cgroup has been thawed again.
    #[error("cgroup {} did not freeze within {timeout:?} (last state {state:?})", path.display())]
    FreezeTimeout {
        /// The freezer directory.
        path: PathBuf,
        /// The time allowed.
        timeout: Duration,
        /// The last state read (`cgroup.events` or `freezer.state`).
        state: String,
    },
    /// Processes were still in the cgroup when the kill timed out.
    #[error("cgroup {} still holds pids {remaining:?} {timeout:?} after being killed", path.display())]
    KillTimeout {
        /// The cgroup directory.
        path: PathBuf,
        /// The time allowed.
        timeout: Duration,
        /// Pids still present (host pid namespace).
        remaining: Vec<i32>,
    },
    /// `kill(pid, SIGKILL)` failed with something other than `ESRCH`.
    #[error("kill(SIGKILL) of pid {pid}")]
    Kill {
        /// The target pid.
        pid: i32,
        /// The errno.
        #[source]
        source: nix::errno::Errno,
    },
    /// `poll` on a `cgroup.events` file failed.
    #[error("poll on {}", path.display())]
    Poll {
        /// The events file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// `rmdir` of a cgroup directory failed (typically `EBUSY`: still populated).
    #[error("removing cgroup directory {}", path.display())]
    RemoveDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}
