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
//! 1. [`SandboxFilter::build`] once, before forking (it allocates: libseccomp compiles the
//!    rules to one classic-BPF program, a binary tree over syscall numbers); `belayerd` does
//!    it once at start and hands the program to each helper in a sealed memfd ([`sealed`]);
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
pub mod sealed;

use std::io::{Read, Seek};

use libseccomp::{ScmpAction, ScmpArch, ScmpArgCompare, ScmpCompareOp, ScmpFilterContext};
use seccompiler::{sock_filter, BpfProgram};

#[cfg(target_arch = "x86_64")]
const TARGET_ARCH: ScmpArch = ScmpArch::X8664;
#[cfg(target_arch = "aarch64")]
const TARGET_ARCH: ScmpArch = ScmpArch::Aarch64;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!("the sandbox seccomp profile has syscall tables for x86_64 and aarch64 only");

/// libseccomp's optimization level 2: the syscall numbers are tested as a binary tree, so a
/// syscall's path through the filter is about 2·log2(n) instructions instead of a linear scan.
/// The kernel runs the filter once per syscall number when it is installed (to build its
/// per-syscall action cache), at every exec and every restored process, so the path length is
/// the install cost: ~0.05 ms instead of ~0.8 ms for the linear program.
const OPTIMIZE_BINARY_TREE: u32 = 2;

/// Errors of building or installing the sandbox filter; each names the failed step.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// libseccomp refused a rule or the export of the program (a bug in [`profile`], caught
    /// by the tests), or the exported program is not whole BPF instructions.
    #[error("cannot compile the sandbox seccomp filter: {step}")]
    Compile {
        /// The step: `rule <nr>`, `attribute`, `export`.
        step: String,
        /// Cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `prctl(PR_SET_NO_NEW_PRIVS, 1)` failed.
    #[error("prctl(PR_SET_NO_NEW_PRIVS) failed")]
    NoNewPrivs {
        /// Cause (the errno).
        #[source]
        source: std::io::Error,
    },
    /// The program compiled by the daemon could not be sealed in its memfd, or an exec helper
    /// could not read it back from there ([`sealed`]).
    #[error("cannot pass the sandbox seccomp filter to the helper: {step}")]
    Load {
        /// The step that failed.
        step: &'static str,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `seccomp(SECCOMP_SET_MODE_FILTER)` refused the filter (`EINVAL`: a kernel without
    /// `CONFIG_SECCOMP_FILTER`; `ENOMEM`: the 32 768-instruction budget of a task's filters is
    /// spent, e.g. the filter installed many times over a deep chain).
    #[error("seccomp(SECCOMP_SET_MODE_FILTER) refused the sandbox filter")]
    Install {
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
            Self::Compile { .. } | Self::Load { .. } => None,
            Self::NoNewPrivs { source } | Self::Install { source } => source.raw_os_error(),
        }
    }
}

/// The compiled sandbox filter: one classic-BPF program, built by libseccomp as a binary tree
/// over syscall numbers. [`profile::ALLOWED`] and the conditional rules are allowed, `clone3`
/// answers `ENOSYS` (so libc falls back to `clone`, whose flags the filter can see), every
/// other syscall `EPERM`; a syscall of another architecture (32-bit `int 0x80`, x32) kills
/// the process.
///
/// Cheap to clone (about 8 bytes per instruction, a few KiB).
#[derive(Clone)]
pub struct SandboxFilter {
    program: BpfProgram,
}

impl std::fmt::Debug for SandboxFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxFilter")
            .field("instructions", &self.program.len())
            .finish()
    }
}

impl SandboxFilter {
    /// Compiles the profile for the architecture this crate is built for with libseccomp and
    /// exports the program (through a memfd). Allocates; call it before forking. Takes about
    /// 1 ms. Errors: [`SeccompError::Compile`] (a rule or attribute libseccomp refuses, a
    /// failed export).
    pub fn build() -> Result<Self, SeccompError> {
        let compile = |step: &str| {
            let step = step.to_string();
            move |e: libseccomp::error::SeccompError| SeccompError::Compile {
                step,
                source: Box::new(e),
            }
        };
        let mut ctx =
            ScmpFilterContext::new(ScmpAction::Errno(libc::EPERM)).map_err(compile("context"))?;
        // The native architecture only; another architecture's syscall numbers (and, on
        // x86_64, x32's) take the bad-architecture action.
        ctx.set_act_badarch(ScmpAction::KillProcess)
            .and_then(|c| c.set_ctl_nnp(false))
            .and_then(|c| c.set_ctl_optimize(OPTIMIZE_BINARY_TREE))
            .map_err(compile("attribute"))?;
        if ScmpArch::native() != TARGET_ARCH {
            return Err(SeccompError::Compile {
                step: "architecture".into(),
                source: "libseccomp's native architecture is not the build's".into(),
            });
        }
        for (nr, action, conditions) in rules() {
            let step = format!("rule for syscall {nr}");
            let syscall = libseccomp::ScmpSyscall::from(nr as i32);
            if conditions.is_empty() {
                ctx.add_rule_exact(action, syscall)
            } else {
                ctx.add_rule_conditional_exact(action, syscall, &conditions)
            }
            .map_err(compile(&step))?;
        }
        let program = export(&ctx)?;
        Ok(Self { program })
    }

    /// The program as bytes: each instruction (`struct sock_filter`) in native byte order.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.program
            .iter()
            .flat_map(|i| {
                let mut b = [0u8; 8];
                b[..2].copy_from_slice(&i.code.to_ne_bytes());
                b[2] = i.jt;
                b[3] = i.jf;
                b[4..].copy_from_slice(&i.k.to_ne_bytes());
                b
            })
            .collect()
    }

    /// The program of [`Self::to_bytes`]; `None` unless `bytes` are 1 to 4096 whole
    /// instructions (`BPF_MAXINSNS`).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(8) || bytes.len() / 8 > 4096 {
            return None;
        }
        Some(Self {
            program: instructions(bytes),
        })
    }

    /// Number of BPF instructions of the program. The kernel refuses a program over 4096
    /// instructions (`BPF_MAXINSNS`) and a task whose filters total more than 32 768
    /// (counting 4 extra per filter).
    pub fn instructions(&self) -> usize {
        self.program.len()
    }

    /// Installs the filter on the calling thread: `prctl(PR_SET_NO_NEW_PRIVS, 1)`, then
    /// `seccomp(SECCOMP_SET_MODE_FILTER)` with no flags (the helpers are single-threaded, so
    /// no `TSYNC`). Irreversible: the filter holds for the thread, everything it execs and
    /// every child it makes.
    ///
    /// Allocates nothing and takes no lock: safe between `fork` and `execve`, also in the child
    /// of a multi-threaded process. Call it after dropping capabilities, immediately before
    /// `execve`. Costs about 0.1 ms of kernel time (checking and JIT-compiling the program,
    /// precomputing the per-syscall action cache). Errors: [`SeccompError::NoNewPrivs`],
    /// [`SeccompError::Install`]; after an error the caller must not exec the sandbox program.
    pub fn install(&self) -> Result<(), SeccompError> {
        seccompiler::apply_filter(&self.program).map_err(|e| match e {
            seccompiler::Error::Prctl(source) => SeccompError::NoNewPrivs { source },
            seccompiler::Error::Seccomp(source) => SeccompError::Install { source },
            // The other variants (empty program, TSYNC, backend) cannot come from a built,
            // non-empty filter installed without TSYNC; an error kind allocates nothing.
            _ => SeccompError::Install {
                source: std::io::ErrorKind::InvalidInput.into(),
            },
        })
    }
}

/// The program of `ctx`, exported by libseccomp into a memfd and read back as instructions
/// (`struct sock_filter`, 8 bytes each, native byte order).
fn export(ctx: &ScmpFilterContext) -> Result<BpfProgram, SeccompError> {
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| SeccompError::Compile {
        step: "export".into(),
        source,
    };
    let fd = rustix::fs::memfd_create("belayer-seccomp", rustix::fs::MemfdFlags::CLOEXEC)
        .map_err(|e| failed(Box::new(std::io::Error::from(e))))?;
    let mut file = std::fs::File::from(fd);
    ctx.export_bpf(&file).map_err(|e| failed(Box::new(e)))?;
    let mut bytes = Vec::new();
    file.rewind()
        .and_then(|()| file.read_to_end(&mut bytes))
        .map_err(|e| failed(Box::new(e)))?;
    if bytes.is_empty() || bytes.len() % 8 != 0 {
        return Err(failed(
            format!("{} bytes are not whole instructions", bytes.len()).into(),
        ));
    }
    Ok(instructions(&bytes))
}

/// The instructions of `bytes` (whole 8-byte `struct sock_filter`s, native byte order).
fn instructions(bytes: &[u8]) -> BpfProgram {
    bytes
        .chunks_exact(8)
        .map(|i| sock_filter {
            code: u16::from_ne_bytes([i[0], i[1]]),
            jt: i[2],
            jf: i[3],
            k: u32::from_ne_bytes([i[4], i[5], i[6], i[7]]),
        })
        .collect()
}

/// One rule: syscall number, action, conditions (all must hold; several rules of one syscall
/// are alternatives).
type Rule = (i64, ScmpAction, Vec<ScmpArgCompare>);

/// Rules of the filter: every [`profile::ALLOWED`] syscall unconditionally, `clone3` `ENOSYS`,
/// plus `clone`, `personality`, `socket` and `socketpair` on their conditions. Comparisons are
/// on the whole 64-bit argument (for an `int` argument, a caller passing garbage in the upper
/// half is refused, never allowed).
fn rules() -> Vec<Rule> {
    let allow = ScmpAction::Allow;
    let mut rules: Vec<Rule> = profile::ALLOWED
        .iter()
        .chain(profile::ALLOWED_ARCH)
        .map(|s| (s.nr, allow, Vec::new()))
        .collect();
    rules.push((
        libc::SYS_clone3,
        ScmpAction::Errno(libc::ENOSYS),
        Vec::new(),
    ));
    let arg = |n, op, value: u64| ScmpArgCompare::new(n, op, value);
    // The kernel reads only the low 32 bits of clone's flags (`lower_32_bits(clone_flags)`);
    // the mask covers only those.
    rules.push((
        libc::SYS_clone,
        allow,
        vec![arg(
            0,
            ScmpCompareOp::MaskedEqual(profile::CLONE_NAMESPACE_FLAGS),
            0,
        )],
    ));
    for &p in profile::PERSONALITIES {
        rules.push((
            libc::SYS_personality,
            allow,
            vec![arg(0, ScmpCompareOp::Equal, u64::from(p))],
        ));
    }
    for &family in profile::SOCKET_FAMILIES {
        if family != libc::AF_NETLINK {
            rules.push((
                libc::SYS_socket,
                allow,
                vec![arg(0, ScmpCompareOp::Equal, family as u64)],
            ));
        }
    }
    for &protocol in profile::NETLINK_PROTOCOLS {
        rules.push((
            libc::SYS_socket,
            allow,
            vec![
                arg(0, ScmpCompareOp::Equal, libc::AF_NETLINK as u64),
                arg(2, ScmpCompareOp::Equal, protocol as u64),
            ],
        ));
    }
    rules.push((
        libc::SYS_socketpair,
        allow,
        vec![arg(
            0,
            ScmpCompareOp::Equal,
            profile::SOCKETPAIR_FAMILY as u64,
        )],
    ));
    rules
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn filter_fits_the_kernel_limit() {
        let filter = SandboxFilter::build().expect("build");
        let n = filter.instructions();
        // BPF_MAXINSNS per program; MAX_INSNS_PER_PATH (32768, 4 extra per filter) per task.
        assert!(n < 4096, "the filter has {n} instructions");
        assert!(n + 4 < 32768 / 4);
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
