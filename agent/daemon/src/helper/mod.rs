//! Helper processes: short-lived, single-threaded re-executions of the agent's own binary that
//! enter or create sandbox namespaces.
//!
//! `belayerd` is multi-threaded, and namespace work (unshare + fork into a new pid namespace,
//! `setns` into a sandbox) must run in a process with a single thread. The helpers are their
//! own small binary, `belayer-helper` ([`image::HELPER_BINARY`]), whose `main` calls
//! [`dispatch`]; the daemon runs it only from a sealed memfd copy ([`image::HelperImage`]),
//! so no host executable is ever reachable from inside a sandbox. A helper makes itself
//! non-dumpable first (`PR_SET_DUMPABLE` 0): while it sits in a sandbox's namespaces before
//! its final `execve`, sandbox processes can neither ptrace it nor open its
//! `/proc/<pid>/{exe,fd,root,mem}`.
//!
//! - `init` ([`init`]): creates a sandbox's namespaces and its long-lived init (paper:
//!   "Environment-state recovery": each trajectory runs in its own sandbox).
//! - `exec` ([`exec`]): runs one action inside an existing sandbox;
//! - `tree` ([`tree`]): streams a tar of a directory a client passed, read with that
//!   client's uid, gid and groups (image import for non-root peers);
//! - `exec --builtin unpack|pack` ([`transfer`]): file transfer into and out of a sandbox, run
//!   in process by a confined child of the sandbox instead of a shell.
//!
//! [`spawn`]: how the daemon starts a helper (`posix_spawn`, descriptors at fixed numbers).
//!
//! [`seccomp`]: the seccomp filter sandbox processes must run under ("Confinement"), for the
//! helpers to install right before they exec sandbox code.

pub mod exec;
pub mod finish;
pub mod image;
pub mod init;
pub mod mount;
pub mod seccomp;
pub mod spawn;
pub mod transfer;
pub mod tree;

pub use exec::KILL_GRACE;

/// First argument that selects helper mode.
pub const HELPER_ARG: &str = "__belayer-helper";

/// Runs a helper and exits if this process was started as one; returns otherwise.
pub fn dispatch() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some(HELPER_ARG) {
        return;
    }
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes integers only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        eprintln!("belayer helper: cannot make itself non-dumpable");
        std::process::exit(125);
    }
    // `belayerd` blocks SIGTERM/SIGINT for its signal thread and the mask survives exec: clear
    // it, or no process of a sandbox could be stopped by those signals.
    let _ = nix::sys::signal::SigSet::empty().thread_set_mask();
    let code = match args.get(2).map(String::as_str) {
        Some("init") => init::main(&args[3..]),
        Some("exec") => exec::main(&args[3..]),
        Some("tree") => tree::main(&args[3..]),
        other => {
            eprintln!("belayer helper: unknown helper {other:?}");
            125
        }
    };
    std::process::exit(code);
}

/// Moves the calling process into the sandbox cgroup: writes its pid to every `cgroup.procs`
/// file in `procs` (one per hierarchy). Errors name the file.
pub(crate) fn join_cgroup(procs: &[&str]) -> Result<(), JoinCgroupError> {
    let me = std::process::id().to_string();
    for path in procs {
        std::fs::write(path, &me).map_err(|source| JoinCgroupError {
            path: path.to_string(),
            source,
        })?;
    }
    Ok(())
}

/// Joining the sandbox cgroup failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot join cgroup via {path}")]
pub struct JoinCgroupError {
    /// The `cgroup.procs` file.
    pub path: String,
    /// Cause.
    #[source]
    pub source: std::io::Error,
}

/// Capabilities a sandbox keeps (the usual container default set, without `CAP_MKNOD`, as
/// sandboxes have no device cgroup). Everything else — `CAP_SYS_ADMIN` (mounts, cgroup escape),
/// `CAP_SYS_TIME`, `CAP_SYSLOG`, `CAP_SYS_MODULE`, `CAP_SYS_RAWIO`, `CAP_BPF`, ... — is dropped
/// from every set, the bounding set included, before the sandbox runs anything.
pub const SANDBOX_CAPABILITIES: &[caps::Capability] = &[
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_FSETID,
    caps::Capability::CAP_FOWNER,
    caps::Capability::CAP_NET_RAW,
    caps::Capability::CAP_SETGID,
    caps::Capability::CAP_SETUID,
    caps::Capability::CAP_SETFCAP,
    caps::Capability::CAP_SETPCAP,
    caps::Capability::CAP_NET_BIND_SERVICE,
    caps::Capability::CAP_SYS_CHROOT,
    caps::Capability::CAP_KILL,
    caps::Capability::CAP_AUDIT_WRITE,
];

/// Dropping capabilities failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot drop capabilities ({set})")]
pub struct CapabilityError {
    /// Which set.
    pub set: &'static str,
    /// Cause.
    #[source]
    pub source: caps::errors::CapsError,
}

/// Capabilities a sandbox with its own user namespace drops as well: that namespace owns the
/// sandbox's network namespace, where `CAP_NET_RAW` would open raw IP sockets (and
/// `SO_MARK`, `IP_TRANSPARENT`, `SO_BINDTODEVICE`), which a host-owned network namespace
/// refuses it. ICMP echo goes through `ping_group_range` instead.
pub const PRIVATE_USERNS_DROPPED: &[caps::Capability] = &[caps::Capability::CAP_NET_RAW];

/// Restricts the calling process to [`SANDBOX_CAPABILITIES`] (less [`PRIVATE_USERNS_DROPPED`]
/// when `private_userns`): bounding set first (needs `CAP_SETPCAP`, kept), then permitted and
/// effective; inheritable and ambient cleared.
pub(crate) fn drop_capabilities(private_userns: bool) -> Result<(), CapabilityError> {
    use caps::CapSet;
    let keep: caps::CapsHashSet = SANDBOX_CAPABILITIES
        .iter()
        .copied()
        .filter(|cap| !(private_userns && PRIVATE_USERNS_DROPPED.contains(cap)))
        .collect();
    for cap in caps::all() {
        if !keep.contains(&cap) {
            caps::drop(None, CapSet::Bounding, cap).map_err(|source| CapabilityError {
                set: "bounding",
                source,
            })?;
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(|source| CapabilityError {
        set: "ambient",
        source,
    })?;
    // Inheritable stays empty (runc since CVE-2022-24769): nothing the sandbox execs can
    // gain a capability through file capabilities' inheritable bits.
    caps::set(None, CapSet::Inheritable, &caps::CapsHashSet::new()).map_err(|source| {
        CapabilityError {
            set: "inheritable",
            source,
        }
    })?;
    for (set, name) in [
        (CapSet::Effective, "effective"),
        (CapSet::Permitted, "permitted"),
    ] {
        caps::set(None, set, &keep).map_err(|source| CapabilityError { set: name, source })?;
    }
    Ok(())
}

/// Returns the value after `--name` in `args`, and every value for repeated flags.
pub(crate) struct Args<'a> {
    args: &'a [String],
}

impl<'a> Args<'a> {
    pub(crate) fn new(args: &'a [String]) -> Self {
        Self { args }
    }

    /// The arguments before a `--` separator.
    fn flags(&self) -> &'a [String] {
        let end = self
            .args
            .iter()
            .position(|a| a == "--")
            .unwrap_or(self.args.len());
        &self.args[..end]
    }

    pub(crate) fn one(&self, name: &str) -> Option<&'a str> {
        let flags = self.flags();
        flags
            .iter()
            .position(|a| a == name)
            .and_then(|i| flags.get(i + 1))
            .map(String::as_str)
    }

    pub(crate) fn all(&self, name: &str) -> Vec<&'a str> {
        let flags = self.flags();
        flags
            .iter()
            .enumerate()
            .filter(|(_, a)| *a == name)
            .filter_map(|(i, _)| flags.get(i + 1).map(String::as_str))
            .collect()
    }

    /// Everything after `--`.
    pub(crate) fn rest(&self) -> &'a [String] {
        match self.args.iter().position(|a| a == "--") {
            Some(i) => &self.args[i + 1..],
            None => &[],
        }
    }
}
