//! Network namespaces owned by a sandbox's user namespace (see docs/design.md "Namespaces").
//!
//! A private-userns sandbox's init creates its network namespace after entering the sandbox's
//! user namespace, so that namespace owns it: CRIU's restored tasks (in the user namespace CRIU
//! recreates, which owns the network namespace CRIU creates with it) may then put their TCP
//! sockets in repair mode. Sandbox processes still hold no `CAP_NET_ADMIN` or `CAP_NET_RAW`
//! (bounding set) and cannot create namespaces (seccomp), so the owner's powers stay unused.
//!
//! - [`owned_by_own_userns`]: is the namespace of a live init owned by that init's user
//!   namespace (a sandbox created with this layout) or by the host's (an older one)?
//! - [`ready_restored`]: at CRIU's `post-setup-namespaces` stage, checks the fresh namespace
//!   and readies it as the init helper does, then locks it ([`super::net_lock`]).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use super::net_lock::NetLock;
use crate::sys;

/// `NS_GET_USERNS` (`_IO(0xb7, 0x1)`, `linux/nsfs.h`): the owning user namespace of an nsfs fd.
const NS_GET_USERNS: libc::c_ulong = 0xb701;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// A namespace file of the process could not be opened or examined.
    #[error("cannot examine {what} of process {pid}")]
    Examine {
        /// Host pid.
        pid: i32,
        /// The namespace file or the ioctl.
        what: &'static str,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The restored tree's network namespace is the daemon's own, or is not owned by the
    /// tree's user namespace: CRIU did not make the namespace the images asked for.
    #[error("the restored root {pid}'s network namespace is {why}")]
    Foreign {
        /// Host pid of the restored root.
        pid: i32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Readying the namespace (`lo` up, sysctls) failed.
    #[error(transparent)]
    Prepare(#[from] sys::SyscallError),
}

fn examine(pid: i32, what: &'static str) -> impl FnOnce(std::io::Error) -> NetnsError {
    move |source| NetnsError::Examine { pid, what, source }
}

/// (dev, ino) of the user namespace owning the namespace `ns` (an nsfs fd).
fn owner_of(ns: BorrowedFd<'_>, pid: i32) -> Result<(u64, u64), NetnsError> {
    // SAFETY: NS_GET_USERNS takes no argument and returns a new fd (or -1) that we own.
    let fd = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_USERNS as _) };
    if fd < 0 {
        return Err(examine(pid, "NS_GET_USERNS")(
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `fd` is a fresh fd returned by the kernel above, owned by nobody else.
    let owner = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let meta = owner.metadata().map_err(examine(pid, "owner"))?;
    Ok((meta.dev(), meta.ino()))
}

fn ns_id(path: &str, pid: i32, what: &'static str) -> Result<(u64, u64), NetnsError> {
    let meta = std::fs::metadata(path).map_err(examine(pid, what))?;
    Ok((meta.dev(), meta.ino()))
}

/// Whether the network namespace of process `pid` is owned by `pid`'s own user namespace
/// (and that is not the daemon's). Three `/proc` lookups and an ioctl.
pub fn owned_by_own_userns(pid: i32) -> Result<bool, NetnsError> {
    let net = File::open(format!("/proc/{pid}/ns/net")).map_err(examine(pid, "ns/net"))?;
    let owner = owner_of(net.as_fd(), pid)?;
    let user = ns_id(&format!("/proc/{pid}/ns/user"), pid, "ns/user")?;
    let host_user = ns_id("/proc/self/ns/user", pid, "the daemon's ns/user")?;
    Ok(owner == user && user != host_user)
}

/// Readies the network namespace CRIU made for the restored root `pid` (at its
/// `post-setup-namespaces` stage, before any socket exists): checks that it is neither the
/// daemon's nor owned by another user namespace than the root's (refused with
/// [`NetnsError::Foreign`]), brings `lo` up, sets the sysctls the init helper sets and locks it
/// until the caller unlocks it. A lock that cannot be taken is logged and the restore goes on
/// without it (as for a host-owned namespace).
pub fn ready_restored(id: &str, pid: i32) -> Result<Option<NetLock>, NetnsError> {
    let net = File::open(format!("/proc/{pid}/ns/net")).map_err(examine(pid, "ns/net"))?;
    let meta = net.metadata().map_err(examine(pid, "ns/net"))?;
    if (meta.dev(), meta.ino()) == ns_id("/proc/self/ns/net", pid, "the daemon's ns/net")? {
        return Err(NetnsError::Foreign {
            pid,
            why: "the daemon's",
        });
    }
    if owner_of(net.as_fd(), pid)? != ns_id(&format!("/proc/{pid}/ns/user"), pid, "ns/user")? {
        return Err(NetnsError::Foreign {
            pid,
            why: "not owned by its user namespace",
        });
    }
    let (first, last) = sys::gid_map_span(&format!("/proc/{pid}/gid_map"), true)?;
    sys::prepare_netns_of(net.as_fd(), (first, last.min(sys::PING_GID_MAX)))?;
    let t = std::time::Instant::now();
    Ok(match NetLock::lock(net.as_fd()) {
        Ok(lock) => {
            tracing::debug!(sandbox = %id, ms = t.elapsed().as_secs_f64() * 1e3, "restored network namespace locked");
            Some(lock)
        }
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "restored network namespace not locked");
            None
        }
    })
}
