//! The default seccomp filter of sandbox processes.
//!
//! DESIGN.md invariant "Confinement": root in a sandbox is not root on the host, and runs under
//! a seccomp filter at least as strict as Docker's default profile. Every sandbox process — the
//! sandbox init and every action — must run with `no_new_privs` and under [`SandboxFilter`],
//! which refuses with `EPERM` everything [`profile`] does not allow: keyrings, namespaces, the
//! mount families, io_uring, BPF, perf, userfaultfd, kexec, modules, file handles, clocks, swap,
//! quotas, raw port I/O, every socket family but Unix/IPv4/IPv6/netlink. The table, with the
//! reason and Docker's stance for each refused call, is [`profile`].
//!
//! # Use
//!
//! 1. [`SandboxFilter::build`] once, before forking (it allocates: seccompiler compiles the
//!    rules to classic BPF);
//! 2. in the forked child, after every privileged set-up step (namespaces, mounts, `setsid`,
//!    `close_range`, dropping capabilities), immediately before `execve`:
//!    [`SandboxFilter::install`]. It allocates nothing and takes no lock, so it is safe in the
//!    child of a multi-threaded process; the filter then holds for the exec'd program and
//!    everything it starts. Nothing between `install` and `execve` may need a refused call.
//!
//! # What a filtered process keeps
//!
//! Everything glibc, musl, python, pip, git, gcc, node, tar and apt use (tested against the
//! host's programs): threads (`clone` with `CLONE_THREAD`; `clone3` answers `ENOSYS` and libc
//! falls back to `clone`), `fork`/`vfork`, `rseq`, `statx`, `faccessat2`, `close_range`,
//! `openat2`, pidfds, `epoll_pwait2`, `futex_waitv`, SysV and POSIX IPC, `ptrace` and
//! `process_vm_readv`/`writev` (gdb, strace: Docker allows them on Linux ≥ 4.8, where seccomp
//! is re-checked after a tracer changes a syscall), the `setuid`/`setgid`/`setgroups` family,
//! `chroot`, `mknod` (the capability check still applies), landlock.
//!
//! `no_new_privs` also means that set-user-ID bits and file capabilities give nothing on
//! `execve` (`sudo`/`su` run by a non-root user inside a sandbox cannot raise privileges; actions
//! run as root keep exactly the sandbox capabilities, as the bounding set already limits them).
//!
//! # CRIU (checked in CRIU 4.2.1's sources)
//!
//! Dump: compel reads `Seccomp:` from `/proc/<pid>/status` when it seizes a task and, for a
//! filtered one, sets `PTRACE_O_SUSPEND_SECCOMP` (compel `ptrace_suspend_seccomp`), so the
//! parasite's syscalls are not filtered; `criu/seccomp.c` reads every filter of every thread
//! with `PTRACE_SECCOMP_GET_FILTER` and its flags with `PTRACE_SECCOMP_GET_METADATA` into
//! `seccomp.img` (threads with identical chains are stored once, restored with `TSYNC`; each
//! process stores its own copy, about 8 bytes per BPF instruction). Restore: the restored tasks
//! are seized with `PTRACE_O_SUSPEND_SECCOMP` while CRIU works in them (`cr-restore.c`); the
//! restorer blob installs the filters with `seccomp(SECCOMP_SET_MODE_FILTER)` at its very end
//! (`restore_seccomp`, before `restore_creds`, while it still has `CAP_SYS_ADMIN`), then
//! `restore_creds` sets `no_new_privs` again from the creds image. Both suspending and reading
//! filters need `CAP_SYS_ADMIN` in the initial user namespace *and a tracer that is not itself
//! under seccomp*: `belayerd` and the CRIU it runs must never install this filter.
//!
//! # Kernel requirements
//!
//! Linux ≥ 3.17 for `seccomp(2)` and `no_new_privs`, ≥ 4.8 for `ptrace` being safe under
//! seccomp, ≥ 5.11 for the per-syscall action cache (unconditionally allowed syscalls then skip
//! the filter), `CONFIG_SECCOMP_FILTER`; CRIU needs `CONFIG_CHECKPOINT_RESTORE` for
//! `PTRACE_O_SUSPEND_SECCOMP` and `PTRACE_SECCOMP_GET_FILTER` (`criu check --feature
//! seccomp_suspend` and `seccomp_filters` say yes on this kernel). Builds for x86_64 and
//! aarch64 (syscall tables from libc and the kernel); tested on x86_64.

pub mod profile;

use std::collections::BTreeMap;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

#[cfg(target_arch = "x86_64")]
const TARGET_ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const TARGET_ARCH: TargetArch = TargetArch::aarch64;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the sandbox seccomp profile has syscall tables for x86_64 and aarch64 only");

/// Name of the main filter in errors.
const ALLOW_LIST: &str = "allow-list";
/// Name of the `clone3` filter in errors.
const CLONE3: &str = "clone3";

/// Errors of building or installing the sandbox filter; each names the failed step.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// seccompiler refused the rules of a filter (a bug in [`profile`], caught by the tests).
    #[error("cannot compile the {filter} seccomp filter")]
    Compile {
        /// Which filter: `allow-list` or `clone3`.
        filter: &'static str,
        /// Cause.
        #[source]
        source: BackendError,
    },
    /// `prctl(PR_SET_NO_NEW_PRIVS, 1)` failed.
    #[error("prctl(PR_SET_NO_NEW_PRIVS) failed")]
    NoNewPrivs {
        /// Cause (the errno).
        #[source]
        source: std::io::Error,
    },
    /// `seccomp(SECCOMP_SET_MODE_FILTER)` refused a filter (`EINVAL`: a kernel without
    /// `CONFIG_SECCOMP_FILTER`; `ENOMEM`: the 32 768-instruction budget of a task's filters is
    /// spent, e.g. the filter installed twice over a deep chain).
    #[error("seccomp(SECCOMP_SET_MODE_FILTER) refused the {filter} filter")]
    Install {
        /// Which filter: `allow-list` or `clone3`.
        filter: &'static str,
        /// Cause (the errno).
        #[source]
        source: std::io::Error,
    },
}

impl SeccompError {
    /// The errno of a failed install step (`None` for [`SeccompError::Compile`]). For callers
    /// between `fork` and `execve` that report an errno without allocating.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Self::Compile { .. } => None,
            Self::NoNewPrivs { source } | Self::Install { source, .. } => source.raw_os_error(),
        }
    }
}

/// The compiled sandbox filter: two classic-BPF programs, installed in this order.
///
/// - the allow-list: [`profile::ALLOWED`] and the conditional rules allowed, everything else
///   (`clone3` included) `EPERM`;
/// - a two-rule filter that turns `clone3` into `ENOSYS` and allows everything else. The kernel
///   runs every filter of a task and keeps the most restrictive action; between two `ERRNO`
///   results the newest filter's wins, so `clone3` gets `ENOSYS` (seccompiler gives one
///   filter a single match action, hence the second filter).
///
/// Cheap to clone (about 13 KiB of instructions).
#[derive(Clone)]
pub struct SandboxFilter {
    allow_list: BpfProgram,
    clone3: BpfProgram,
}

impl std::fmt::Debug for SandboxFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxFilter")
            .field("allow_list_instructions", &self.allow_list.len())
            .field("clone3_instructions", &self.clone3.len())
            .finish()
    }
}

impl SandboxFilter {
    /// Compiles the profile for the architecture this crate is built for. Allocates; call it
    /// before forking. Takes about 1 ms (debug build, this 2-core VM). Errors:
    /// [`SeccompError::Compile`] (rules seccompiler refuses, or a program over the kernel's 4096
    /// instructions).
    pub fn build() -> Result<Self, SeccompError> {
        let compile = |filter: &'static str, f: Result<SeccompFilter, BackendError>| {
            f.and_then(BpfProgram::try_from)
                .map_err(|source| SeccompError::Compile { filter, source })
        };
        let allow_list = compile(
            ALLOW_LIST,
            allow_list_rules().and_then(|rules| {
                SeccompFilter::new(
                    rules,
                    SeccompAction::Errno(libc::EPERM as u32),
                    SeccompAction::Allow,
                    TARGET_ARCH,
                )
            }),
        )?;
        let clone3 = compile(
            CLONE3,
            SeccompFilter::new(
                BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
                SeccompAction::Allow,
                SeccompAction::Errno(libc::ENOSYS as u32),
                TARGET_ARCH,
            ),
        )?;
        Ok(Self { allow_list, clone3 })
    }

    /// Number of BPF instructions of the allow-list and of the `clone3` filter. The kernel
    /// refuses a program over 4096 instructions (`BPF_MAXINSNS`) and a task whose filters
    /// total more than 32 768 (counting 4 extra per filter).
    pub fn instructions(&self) -> (usize, usize) {
        (self.allow_list.len(), self.clone3.len())
    }

    /// Installs the filter on the calling thread: `prctl(PR_SET_NO_NEW_PRIVS, 1)`, then the
    /// allow-list, then the `clone3` filter (`seccomp(SECCOMP_SET_MODE_FILTER)`, no flags: the
    /// helpers are single-threaded, so no `TSYNC`). Irreversible: the filters hold for the
    /// thread, everything it execs and every child it makes.
    ///
    /// Allocates nothing and takes no lock: safe between `fork` and `execve`, also in the child
    /// of a multi-threaded process. Call it after dropping capabilities, immediately before
    /// `execve`. Costs about 1 ms of kernel time (checking and JIT-compiling the programs,
    /// precomputing the per-syscall action cache). Errors: [`SeccompError::NoNewPrivs`],
    /// [`SeccompError::Install`]; after an error the caller must not exec the sandbox program
    /// (the allow-list may already be on without the `clone3` filter).
    pub fn install(&self) -> Result<(), SeccompError> {
        apply(ALLOW_LIST, &self.allow_list)?;
        apply(CLONE3, &self.clone3)
    }
}

/// `seccompiler::apply_filter` (prctl(NO_NEW_PRIVS), then seccomp(2)) with the step in the error.
fn apply(filter: &'static str, program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(|e| match e {
        seccompiler::Error::Prctl(source) => SeccompError::NoNewPrivs { source },
        seccompiler::Error::Seccomp(source) => SeccompError::Install { filter, source },
        // The other variants (empty program, TSYNC, backend) cannot come from a built,
        // non-empty filter installed without TSYNC; an error kind allocates nothing.
        _ => SeccompError::Install {
            filter,
            source: std::io::ErrorKind::InvalidInput.into(),
        },
    })
}

/// Rules of the allow-list: every [`profile::ALLOWED`] syscall unconditionally, plus `clone`,
/// `personality`, `socket` and `socketpair` on their conditions.
fn allow_list_rules() -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = profile::ALLOWED
        .iter()
        .chain(profile::ALLOWED_ARCH)
        .map(|s| (s.nr, Vec::new()))
        .collect();
    // Flags are `unsigned long`, but the kernel reads only their low 32 bits
    // (`lower_32_bits(clone_flags)`), so a 32-bit comparison is exact.
    let arg0 = |op, value: u64| SeccompCondition::new(0, SeccompCmpArgLen::Dword, op, value);
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![arg0(
            SeccompCmpOp::MaskedEq(profile::CLONE_NAMESPACE_FLAGS),
            0,
        )?])?],
    );
    let one_of = |values: &mut dyn Iterator<Item = u64>| {
        values
            .map(|v| SeccompRule::new(vec![arg0(SeccompCmpOp::Eq, v)?]))
            .collect::<Result<Vec<_>, _>>()
    };
    rules.insert(
        libc::SYS_personality,
        one_of(&mut profile::PERSONALITIES.iter().map(|&p| u64::from(p)))?,
    );
    let mut socket = one_of(
        &mut profile::SOCKET_FAMILIES
            .iter()
            .filter(|&&f| f != libc::AF_NETLINK)
            .map(|&f| f as u64),
    )?;
    for &protocol in profile::NETLINK_PROTOCOLS {
        socket.push(SeccompRule::new(vec![
            arg0(SeccompCmpOp::Eq, libc::AF_NETLINK as u64)?,
            SeccompCondition::new(
                2,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                protocol as u64,
            )?,
        ])?);
    }
    rules.insert(libc::SYS_socket, socket);
    rules.insert(
        libc::SYS_socketpair,
        one_of(&mut std::iter::once(profile::SOCKETPAIR_FAMILY as u64))?,
    );
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn filter_fits_the_kernel_limit() {
        let filter = SandboxFilter::build().expect("build");
        let (allow_list, clone3) = filter.instructions();
        // BPF_MAXINSNS per program; MAX_INSNS_PER_PATH (32768, 4 extra per filter) per task.
        assert!(
            allow_list < 4096,
            "allow-list has {allow_list} instructions"
        );
        assert!(clone3 < 16, "clone3 filter has {clone3} instructions");
        assert!(allow_list + clone3 + 8 < 32768 / 4);
    }

    #[test]
    fn allowed_and_refused_are_disjoint_and_unique() {
        let mut allowed = BTreeSet::new();
        for s in profile::ALLOWED.iter().chain(profile::ALLOWED_ARCH) {
            assert!(allowed.insert(s.nr), "{} listed twice", s.name());
        }
        let conditional = [
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_personality,
            libc::SYS_socket,
            libc::SYS_socketpair,
        ];
        for nr in conditional {
            assert!(
                !allowed.contains(&nr),
                "conditional syscall {nr} allowed outright"
            );
        }
        let mut refused = BTreeSet::new();
        for r in profile::REFUSED.iter().chain(profile::REFUSED_ARCH) {
            assert!(
                refused.insert(r.syscall.nr),
                "{} refused twice",
                r.syscall.name()
            );
            assert!(
                !allowed.contains(&r.syscall.nr),
                "{} is both allowed and refused",
                r.syscall.name()
            );
            assert!(!r.why.is_empty() && !r.docker.is_empty());
        }
    }

    #[test]
    fn every_call_the_threat_model_names_is_refused() {
        let refused: BTreeSet<&str> = profile::REFUSED
            .iter()
            .chain(profile::REFUSED_ARCH)
            .map(|r| r.syscall.name())
            .collect();
        let mut must = vec![
            "keyctl",
            "add_key",
            "request_key",
            "unshare",
            "setns",
            "mount",
            "umount2",
            "pivot_root",
            "move_mount",
            "open_tree",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "kexec_load",
            "kexec_file_load",
            "open_by_handle_at",
            "name_to_handle_at",
            "init_module",
            "finit_module",
            "delete_module",
            "reboot",
            "swapon",
            "swapoff",
            "acct",
            "quotactl",
            "quotactl_fd",
            "syslog",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "adjtimex",
            "lookup_dcookie",
            "vhangup",
            "fanotify_init",
            "pidfd_getfd",
            "process_madvise",
            "memfd_secret",
        ];
        if cfg!(target_arch = "x86_64") {
            must.extend([
                "iopl",
                "ioperm",
                "uselib",
                "ustat",
                "sysfs",
                "_sysctl",
                "nfsservctl",
                "create_module",
                "get_kernel_syms",
                "query_module",
            ]);
        }
        for name in must {
            assert!(refused.contains(name), "{name} is not in the refused table");
        }
    }

    #[test]
    fn clone_mask_is_dockers_plus_newtime() {
        assert_eq!(profile::CLONE_NAMESPACE_FLAGS, 0x7E02_0000 | 0x80);
    }

    #[test]
    fn names_strip_the_libc_prefix() {
        let openat = profile::ALLOWED
            .iter()
            .find(|s| s.nr == libc::SYS_openat)
            .expect("openat allowed");
        assert_eq!(openat.name(), "openat");
    }
}
