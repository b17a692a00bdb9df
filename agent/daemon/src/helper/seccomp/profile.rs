//! The syscall table of the sandbox seccomp profile: what is allowed, on which condition, and
//! what is refused and why.
//!
//! Derived from Docker's default profile (moby/profiles `seccomp/default.json`, May 2026, which
//! knows the syscalls of Linux 6.13) as Docker applies it to a container without
//! `CAP_SYS_ADMIN` and with the sandbox's capabilities
//! ([`SANDBOX_CAPABILITIES`](crate::helper::SANDBOX_CAPABILITIES)):
//! - [`ALLOWED`] (and [`ALLOWED_ARCH`] for the legacy calls only x86_64 has): Docker's
//!   unconditional allow-list, plus what Docker gates on kernel ≥ 4.8 (`ptrace`,
//!   `process_vm_readv`, `process_vm_writev`) or on a capability the sandbox keeps (`chroot`,
//!   `CAP_SYS_CHROOT`), minus the four calls this profile refuses although Docker allows them
//!   (see [`REFUSED`], marked "stricter");
//! - allowed on a condition (built by the parent module from the constants below): `clone`
//!   without namespace flags, `personality` with Docker's five values, `socket` for
//!   [`SOCKET_FAMILIES`] only, `socketpair` for `AF_UNIX` only;
//! - `clone3` fails with `ENOSYS` (seccomp cannot read its flags from user memory; glibc ≥ 2.34
//!   and musl then fall back to `clone`);
//! - everything else fails with `EPERM`, Docker's default action: the calls in [`REFUSED`], the
//!   unimplemented ones (`afs_syscall`, `tuxcall`, `security`, `vserver`, `getpmsg`, `putpmsg`),
//!   32-bit x32 numbers (bit 30 set: no rule matches them), and every syscall newer than this
//!   table (`open_tree_attr`, `file_getattr`, ... from Linux 6.15 on) until it is reviewed here.
//!   A syscall of another ABI on the same machine (i386 `int 0x80`) kills the process: the
//!   filter's architecture check (seccompiler) refuses them wholesale, where Docker allows the
//!   i386 and x32 sub-architectures.

#![allow(non_upper_case_globals)] // libc's and the kernel's names: `SYS_openat`

// The table names syscalls as libc does (`SYS_openat`); the few that libc 0.2 lacks are defined
// below with their numbers from the kernel's syscall tables (identical on every architecture
// from 424 on).
#[allow(clippy::wildcard_imports)]
use libc::*;

/// A syscall of the profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syscall {
    /// libc's constant name, e.g. `SYS_openat`.
    pub ident: &'static str,
    /// Its number on the architecture this crate is built for.
    pub nr: i64,
}

impl Syscall {
    /// The kernel's name of the syscall, e.g. `openat`.
    pub fn name(&self) -> &'static str {
        self.ident.strip_prefix("SYS_").unwrap_or(self.ident)
    }
}

/// A syscall the profile refuses with `EPERM`, with Docker's stance and the reason.
#[derive(Debug, Clone, Copy)]
pub struct Refusal {
    /// The syscall.
    pub syscall: Syscall,
    /// What Docker's default profile does with it for a container without `CAP_SYS_ADMIN`:
    /// `"not listed"` (refused by default), the capability it requires (refused, as the sandbox
    /// does not keep that capability), or `"allows; stricter here"`.
    pub docker: &'static str,
    /// Why a sandbox must not have it.
    pub why: &'static str,
}

macro_rules! syscalls {
    ($($nr:ident),* $(,)?) => {
        &[$(Syscall { ident: stringify!($nr), nr: $nr as i64 }),*]
    };
}

macro_rules! refused {
    ($($nr:ident, $docker:literal, $why:literal;)*) => {
        &[$(Refusal {
            syscall: Syscall { ident: stringify!($nr), nr: $nr as i64 },
            docker: $docker,
            why: $why,
        }),*]
    };
}

// Syscalls that libc 0.2.191 does not name.
const SYS_cachestat: i64 = 451;
const SYS_map_shadow_stack: i64 = 453;
const SYS_futex_wake: i64 = 454;
const SYS_futex_wait: i64 = 455;
const SYS_futex_requeue: i64 = 456;
const SYS_statmount: i64 = 457;
const SYS_listmount: i64 = 458;
const SYS_lsm_get_self_attr: i64 = 459;
const SYS_lsm_set_self_attr: i64 = 460;
const SYS_lsm_list_modules: i64 = 461;
const SYS_setxattrat: i64 = 463;
const SYS_getxattrat: i64 = 464;
const SYS_listxattrat: i64 = 465;
const SYS_removexattrat: i64 = 466;
#[cfg(target_arch = "x86_64")]
const SYS_io_pgetevents: i64 = 333;
#[cfg(target_arch = "x86_64")]
const SYS_uretprobe: i64 = 335;
#[cfg(target_arch = "x86_64")]
const SYS_create_module: i64 = 174;
#[cfg(target_arch = "x86_64")]
const SYS_get_kernel_syms: i64 = 177;
#[cfg(target_arch = "x86_64")]
const SYS_query_module: i64 = 178;
#[cfg(target_arch = "aarch64")]
const SYS_io_pgetevents: i64 = 292;
#[cfg(target_arch = "aarch64")]
const SYS_fchmodat2: i64 = 452;
#[cfg(target_arch = "aarch64")]
const SYS_renameat: i64 = 38;
#[cfg(target_arch = "aarch64")]
const SYS_sync_file_range: i64 = 84;
#[cfg(target_arch = "aarch64")]
const SYS_getrlimit: i64 = 163;
#[cfg(target_arch = "aarch64")]
const SYS_setrlimit: i64 = 164;

/// Syscalls allowed unconditionally on every supported architecture (Docker's list, see the
/// module docs). Unconditional allows are what the kernel's seccomp action cache (Linux 5.11)
/// answers without running the filter.
#[rustfmt::skip]
pub const ALLOWED: &[Syscall] = syscalls![
    SYS_accept, SYS_accept4, SYS_bind, SYS_brk, SYS_cachestat, SYS_capget, SYS_capset, SYS_chdir,
    SYS_chroot, SYS_clock_getres, SYS_clock_gettime, SYS_clock_nanosleep, SYS_close,
    SYS_close_range, SYS_connect, SYS_copy_file_range, SYS_dup, SYS_dup3, SYS_epoll_create1,
    SYS_epoll_ctl, SYS_epoll_pwait, SYS_epoll_pwait2, SYS_eventfd2, SYS_execve, SYS_execveat,
    SYS_exit, SYS_exit_group, SYS_faccessat, SYS_faccessat2, SYS_fadvise64, SYS_fallocate,
    SYS_fanotify_mark, SYS_fchdir, SYS_fchmod, SYS_fchmodat, SYS_fchmodat2, SYS_fchown,
    SYS_fchownat, SYS_fcntl, SYS_fdatasync, SYS_fgetxattr, SYS_flistxattr, SYS_flock,
    SYS_fremovexattr, SYS_fsetxattr, SYS_fstat, SYS_fstatfs, SYS_fsync, SYS_ftruncate, SYS_futex,
    SYS_futex_requeue, SYS_futex_wait, SYS_futex_waitv, SYS_futex_wake, SYS_get_robust_list,
    SYS_getcpu, SYS_getcwd, SYS_getdents64, SYS_getegid, SYS_geteuid, SYS_getgid, SYS_getgroups,
    SYS_getitimer, SYS_getpeername, SYS_getpgid, SYS_getpid, SYS_getppid, SYS_getpriority,
    SYS_getrandom, SYS_getresgid, SYS_getresuid, SYS_getrlimit, SYS_getrusage, SYS_getsid,
    SYS_getsockname, SYS_getsockopt, SYS_gettid, SYS_gettimeofday, SYS_getuid, SYS_getxattr,
    SYS_getxattrat, SYS_inotify_add_watch, SYS_inotify_init1, SYS_inotify_rm_watch, SYS_io_cancel,
    SYS_io_destroy, SYS_io_getevents, SYS_io_pgetevents, SYS_io_setup, SYS_io_submit, SYS_ioctl,
    SYS_ioprio_get, SYS_ioprio_set, SYS_kill, SYS_landlock_add_rule, SYS_landlock_create_ruleset,
    SYS_landlock_restrict_self, SYS_lgetxattr, SYS_linkat, SYS_listen, SYS_listmount, SYS_listxattr,
    SYS_listxattrat, SYS_llistxattr, SYS_lremovexattr, SYS_lseek, SYS_lsetxattr, SYS_madvise,
    SYS_map_shadow_stack, SYS_membarrier, SYS_memfd_create, SYS_mincore, SYS_mkdirat, SYS_mknodat,
    SYS_mlock, SYS_mlock2, SYS_mlockall, SYS_mmap, SYS_mprotect, SYS_mq_getsetattr, SYS_mq_notify,
    SYS_mq_open, SYS_mq_timedreceive, SYS_mq_timedsend, SYS_mq_unlink, SYS_mremap, SYS_mseal,
    SYS_msgctl, SYS_msgget, SYS_msgrcv, SYS_msgsnd, SYS_msync, SYS_munlock, SYS_munlockall,
    SYS_munmap, SYS_nanosleep, SYS_newfstatat, SYS_openat, SYS_openat2, SYS_pidfd_open,
    SYS_pidfd_send_signal, SYS_pipe2, SYS_pkey_alloc, SYS_pkey_free, SYS_pkey_mprotect, SYS_ppoll,
    SYS_prctl, SYS_pread64, SYS_preadv, SYS_preadv2, SYS_prlimit64, SYS_process_mrelease,
    SYS_process_vm_readv, SYS_process_vm_writev, SYS_pselect6, SYS_ptrace, SYS_pwrite64,
    SYS_pwritev, SYS_pwritev2, SYS_read, SYS_readahead, SYS_readlinkat, SYS_readv, SYS_recvfrom,
    SYS_recvmmsg, SYS_recvmsg, SYS_remap_file_pages, SYS_removexattr, SYS_removexattrat,
    SYS_renameat, SYS_renameat2, SYS_restart_syscall, SYS_rseq, SYS_rt_sigaction, SYS_rt_sigpending,
    SYS_rt_sigprocmask, SYS_rt_sigqueueinfo, SYS_rt_sigreturn, SYS_rt_sigsuspend,
    SYS_rt_sigtimedwait, SYS_rt_tgsigqueueinfo, SYS_sched_get_priority_max,
    SYS_sched_get_priority_min, SYS_sched_getaffinity, SYS_sched_getattr, SYS_sched_getparam,
    SYS_sched_getscheduler, SYS_sched_rr_get_interval, SYS_sched_setaffinity, SYS_sched_setattr,
    SYS_sched_setparam, SYS_sched_setscheduler, SYS_sched_yield, SYS_seccomp, SYS_semctl,
    SYS_semget, SYS_semop, SYS_semtimedop, SYS_sendfile, SYS_sendmmsg, SYS_sendmsg, SYS_sendto,
    SYS_set_robust_list, SYS_set_tid_address, SYS_setfsgid, SYS_setfsuid, SYS_setgid, SYS_setgroups,
    SYS_setitimer, SYS_setpgid, SYS_setpriority, SYS_setregid, SYS_setresgid, SYS_setresuid,
    SYS_setreuid, SYS_setrlimit, SYS_setsid, SYS_setsockopt, SYS_setuid, SYS_setxattr,
    SYS_setxattrat, SYS_shmat, SYS_shmctl, SYS_shmdt, SYS_shmget, SYS_shutdown, SYS_sigaltstack,
    SYS_signalfd4, SYS_splice, SYS_statfs, SYS_statmount, SYS_statx, SYS_symlinkat, SYS_sync,
    SYS_sync_file_range, SYS_syncfs, SYS_sysinfo, SYS_tee, SYS_tgkill, SYS_timer_create,
    SYS_timer_delete, SYS_timer_getoverrun, SYS_timer_gettime, SYS_timer_settime,
    SYS_timerfd_create, SYS_timerfd_gettime, SYS_timerfd_settime, SYS_times, SYS_tkill,
    SYS_truncate, SYS_umask, SYS_uname, SYS_unlinkat, SYS_utimensat, SYS_vmsplice, SYS_wait4,
    SYS_waitid, SYS_write, SYS_writev,
];

/// Legacy syscalls only x86_64 has (the generic table of aarch64 dropped them), plus x86's
/// `arch_prctl` and `modify_ldt` (Docker allows both on amd64) and `uretprobe` (the return
/// trampoline of user-space probes, Linux 6.11).
#[cfg(target_arch = "x86_64")]
#[rustfmt::skip]
pub const ALLOWED_ARCH: &[Syscall] = syscalls![
    SYS_access, SYS_alarm, SYS_arch_prctl, SYS_chmod, SYS_chown, SYS_creat, SYS_dup2,
    SYS_epoll_create, SYS_epoll_ctl_old, SYS_epoll_wait, SYS_epoll_wait_old, SYS_eventfd, SYS_fork,
    SYS_futimesat, SYS_get_thread_area, SYS_getdents, SYS_getpgrp, SYS_inotify_init, SYS_lchown,
    SYS_link, SYS_lstat, SYS_mkdir, SYS_mknod, SYS_modify_ldt, SYS_open, SYS_pause, SYS_pipe,
    SYS_poll, SYS_readlink, SYS_rename, SYS_rmdir, SYS_select, SYS_set_thread_area, SYS_signalfd,
    SYS_stat, SYS_symlink, SYS_time, SYS_unlink, SYS_uretprobe, SYS_utime, SYS_utimes, SYS_vfork,
];

/// aarch64 has no legacy calls beyond the generic table.
#[cfg(target_arch = "aarch64")]
pub const ALLOWED_ARCH: &[Syscall] = syscalls![];

/// Namespace flags `clone` may not carry: Docker's mask `0x7E020000` (`CLONE_NEWNS`,
/// `CLONE_NEWCGROUP`, `CLONE_NEWUTS`, `CLONE_NEWIPC`, `CLONE_NEWUSER`, `CLONE_NEWPID`,
/// `CLONE_NEWNET`) plus `CLONE_NEWTIME` (`0x80`). `clone` itself reads bits 0..8 as the exit
/// signal, so a time namespace can only be asked of `clone3` (`ENOSYS` here) or `unshare`
/// (refused); the bit is in the mask so that no namespace flag is ever let through, at the cost
/// of exit signals ≥ 128, which the kernel rejects anyway.
pub const CLONE_NAMESPACE_FLAGS: u64 = (CLONE_NEWNS
    | CLONE_NEWCGROUP
    | CLONE_NEWUTS
    | CLONE_NEWIPC
    | CLONE_NEWUSER
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWTIME) as u64;

/// `personality(2)` values allowed, as in Docker: `PER_LINUX`, `PER_LINUX32`, `UNAME26`,
/// `PER_LINUX32 | UNAME26` and `0xffffffff` (query). `ADDR_NO_RANDOMIZE` (gdb's and `setarch
/// -R`'s way to turn off ASLR) is refused: gdb warns and debugs with ASLR on.
pub const PERSONALITIES: &[u32] = &[0, 0x0008, 0x0002_0000, 0x0002_0008, 0xffff_ffff];

/// Address families `socket(2)` may create. Docker refuses `AF_ALG` and `AF_VSOCK` only; this
/// profile allows what a sandbox with only `lo` can use — Unix, IPv4, IPv6, netlink (iproute2,
/// `getifaddrs`, glibc's `AI_ADDRCONFIG`) — and refuses every other family (stricter): that
/// closes `AF_PACKET` (raw frames, a long CVE history, reachable with the `CAP_NET_RAW` a
/// sandbox keeps for `ping`), `AF_VSOCK`, `AF_ALG`, and the kernel's module autoload of rare
/// protocol families (`net-pf-N`: RDS, TIPC, CAN, Bluetooth, XDP, ...), which any `socket()`
/// call triggers. `io_uring` (which could create sockets without this check) is refused.
pub const SOCKET_FAMILIES: &[i32] = &[AF_UNIX, AF_INET, AF_INET6, AF_NETLINK];

/// Netlink protocols an `AF_NETLINK` socket may speak: routing (`getifaddrs`, `ip`), socket
/// diagnostics (`ss`) and audit (which PAM and login tools open; the kernel refuses audit
/// messages from a user namespace). Refused: `NETLINK_KOBJECT_UEVENT`, whose broadcast of the
/// host's device events reaches the sandbox's network namespace (it belongs to the host's
/// user namespace), generic netlink and the rest.
pub const NETLINK_PROTOCOLS: &[i32] = &[
    libc::NETLINK_ROUTE,
    libc::NETLINK_SOCK_DIAG,
    libc::NETLINK_AUDIT,
];

/// Address family `socketpair(2)` may use (Docker: any; only `AF_UNIX` pairs are useful, and a
/// family check here keeps `socketpair` from autoloading protocol modules too).
pub const SOCKETPAIR_FAMILY: i32 = AF_UNIX;

/// Syscalls refused with `EPERM` on every supported architecture. This is the review table of
/// the profile: none of them is in [`ALLOWED`]; the tests probe each one.
pub const REFUSED: &[Refusal] = refused![
    SYS_keyctl, "not listed", "kernel keyrings are not namespaced: keys and quotas are host-wide";
    SYS_add_key, "not listed", "kernel keyrings are not namespaced";
    SYS_request_key, "not listed", "kernel keyrings are not namespaced; may upcall to host helpers";
    SYS_unshare, "CAP_SYS_ADMIN", "new namespaces (a user namespace grants every capability in it)";
    SYS_setns, "CAP_SYS_ADMIN", "joining namespaces";
    SYS_mount, "CAP_SYS_ADMIN", "mounts (escape from /proc/sys read-only, masked paths)";
    SYS_umount2, "CAP_SYS_ADMIN", "unmounting masks and read-only binds";
    SYS_pivot_root, "not listed", "changing the root mount";
    SYS_move_mount, "CAP_SYS_ADMIN", "new mount API";
    SYS_open_tree, "CAP_SYS_ADMIN", "new mount API (detached bind mounts)";
    SYS_fsopen, "CAP_SYS_ADMIN", "new mount API";
    SYS_fsconfig, "CAP_SYS_ADMIN", "new mount API";
    SYS_fsmount, "CAP_SYS_ADMIN", "new mount API";
    SYS_fspick, "CAP_SYS_ADMIN", "new mount API (reconfiguring superblocks)";
    SYS_mount_setattr, "CAP_SYS_ADMIN", "changing mount flags (read-only, idmap)";
    SYS_io_uring_setup, "not listed", "io_uring runs operations no seccomp filter sees";
    SYS_io_uring_enter, "not listed", "io_uring";
    SYS_io_uring_register, "not listed", "io_uring";
    SYS_bpf, "CAP_SYS_ADMIN or CAP_BPF", "loading BPF programs and maps into the kernel";
    SYS_perf_event_open, "CAP_SYS_ADMIN or CAP_PERFMON", "perf events: host-wide data, CVEs";
    SYS_userfaultfd, "not listed", "stalls kernel page faults: a race widener for exploits";
    SYS_kexec_load, "not listed", "replacing the running kernel";
    SYS_kexec_file_load, "not listed", "replacing the running kernel";
    SYS_open_by_handle_at, "CAP_DAC_READ_SEARCH",
        "opens any inode of a mounted filesystem (shocker)";
    SYS_name_to_handle_at, "allows; stricter here", "file handles serve only open_by_handle_at";
    SYS_init_module, "CAP_SYS_MODULE", "loading kernel modules";
    SYS_finit_module, "CAP_SYS_MODULE", "loading kernel modules";
    SYS_delete_module, "CAP_SYS_MODULE", "unloading kernel modules";
    SYS_reboot, "CAP_SYS_BOOT", "rebooting the host (or a pid namespace's init)";
    SYS_swapon, "not listed", "host swap configuration";
    SYS_swapoff, "not listed", "host swap configuration";
    SYS_acct, "CAP_SYS_PACCT", "host-wide process accounting";
    SYS_quotactl, "CAP_SYS_ADMIN", "disk quotas of host filesystems";
    SYS_quotactl_fd, "CAP_SYS_ADMIN", "disk quotas of host filesystems";
    SYS_syslog, "CAP_SYS_ADMIN or CAP_SYSLOG", "the kernel log (addresses, other tenants)";
    SYS_settimeofday, "CAP_SYS_TIME", "the host clock is not namespaced";
    SYS_clock_settime, "CAP_SYS_TIME", "the host clock is not namespaced";
    SYS_clock_adjtime, "allows; stricter here", "host clock discipline (reads need no syscall)";
    SYS_adjtimex, "allows; stricter here", "host clock discipline (reads need no syscall)";
    SYS_lookup_dcookie, "CAP_SYS_ADMIN", "oprofile; removed in Linux 6.7";
    SYS_vhangup, "CAP_SYS_TTY_CONFIG", "hanging up terminals";
    SYS_fanotify_init, "CAP_SYS_ADMIN", "filesystem-wide access monitoring";
    SYS_pidfd_getfd, "CAP_SYS_PTRACE", "stealing descriptors of other processes";
    SYS_process_madvise, "CAP_SYS_PTRACE", "changing the memory of other processes";
    SYS_kcmp, "CAP_SYS_PTRACE", "comparing kernel objects of other processes (KASLR oracle)";
    SYS_memfd_secret, "allows; stricter here", "CRIU cannot checkpoint it; blocks host hibernation";
    SYS_get_mempolicy, "CAP_SYS_NICE", "NUMA policy (Docker gates it on CAP_SYS_NICE)";
    SYS_set_mempolicy, "CAP_SYS_NICE", "NUMA policy";
    SYS_set_mempolicy_home_node, "CAP_SYS_NICE", "NUMA policy";
    SYS_mbind, "CAP_SYS_NICE", "NUMA policy";
    SYS_migrate_pages, "not listed", "moving memory of other processes between NUMA nodes";
    SYS_move_pages, "not listed", "moving memory of other processes between NUMA nodes";
    SYS_sethostname, "CAP_SYS_ADMIN", "the hostname is set by Belayer before the filter";
    SYS_setdomainname, "CAP_SYS_ADMIN", "the domain name";
    SYS_lsm_get_self_attr, "CAP_SYS_ADMIN", "LSM attributes";
    SYS_lsm_set_self_attr, "CAP_SYS_ADMIN", "LSM attributes";
    SYS_lsm_list_modules, "CAP_SYS_ADMIN", "LSM attributes";
];

/// Refused syscalls only x86_64 has: port I/O and calls that are gone from the kernel (refused
/// rather than left to `ENOSYS`, so a kernel that still has one does not expose it).
#[cfg(target_arch = "x86_64")]
pub const REFUSED_ARCH: &[Refusal] = refused![
    SYS_iopl, "CAP_SYS_RAWIO", "raw port I/O";
    SYS_ioperm, "CAP_SYS_RAWIO", "raw port I/O";
    SYS_uselib, "not listed", "a.out shared libraries; removed";
    SYS_ustat, "not listed", "obsolete filesystem statistics of any device";
    SYS_sysfs, "not listed", "obsolete filesystem type queries";
    SYS__sysctl, "not listed", "binary sysctl; removed in Linux 5.5";
    SYS_nfsservctl, "not listed", "removed in Linux 3.1";
    SYS_create_module, "not listed", "removed in Linux 2.6";
    SYS_get_kernel_syms, "not listed", "removed in Linux 2.6";
    SYS_query_module, "not listed", "removed in Linux 2.6";
];

/// aarch64 has none of the x86-only calls.
#[cfg(target_arch = "aarch64")]
pub const REFUSED_ARCH: &[Refusal] = refused![];
