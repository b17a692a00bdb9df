// SPDX-License-Identifier: GPL-2.0
// Belayer sandbox tracer: process exits, signals and OOM victims of tracked sandbox cgroups,
// streamed through a ring buffer, plus per-cgroup activity counters (file-modifying syscalls,
// process creation/exit, external and OOM kills) read synchronously by the agent.
//
// Only tracepoints (the target kernels have no kprobes, and refuse fentry/LSM programs): BTF
// tracepoints (tp_btf) for processes, signals, OOM victims and, through the raw sys_enter and
// sys_exit tracepoints, file activity. Kernel structures are read with CO-RE (BPF_CORE_READ),
// so the object loads on other kernels with BTF.
// Keep `struct counters` and `struct event` in sync with ebpf/src/bpf.rs.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "GPL";

#define EV_EXIT 1
#define EV_SIGNAL 2
#define EV_OOM 3

#define S_IFMT 00170000
#define S_IFREG 0100000
#define S_IFDIR 0040000

#define SIGHUP 1
#define SIGINT 2
#define SIGQUIT 3
#define SIGABRT 6
#define SIGKILL 9
#define SIGTERM 15

/* Per sandbox cgroup (key: cgroup v2 id). Present = tracked. */
struct counters {
	__u64 fs_writes;
	__u64 forks;
	__u64 exits;
	__u64 external_kills;
	__u64 oom_kills;
	__u32 last_kill_pid;
	__u32 last_kill_signal;
	__u32 last_oom_pid;
	__u32 pad;
	__u64 async_procs; /* live processes that used io_uring or Linux AIO (see async_users) */
};

struct event {
	__u32 kind;
	__u32 pid;
	__u32 tid;
	__s32 signal;
	__s32 exit_code;
	__u32 sender_pid;
	__u64 cgroup_id;
	__u64 sender_cgroup_id;
	__u64 ktime_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct counters);
} sandboxes SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} events SEC(".maps");

/* Depth of the sandboxes' pid namespaces (the agent's own depth + 1), set by the loader; 0:
 * unset. A task of a tracked cgroup in a shallower pid namespace is the agent's, not the
 * sandbox's: CRIU joins a sandbox's cgroup from the agent's pid namespace while it restores
 * the tree (its syscalls, its action script's), and a sandbox can make no such task. */
const volatile __u32 sandbox_pid_level = 0;

/* The counters of the current task's cgroup when it is tracked and the task is the
 * sandbox's (see sandbox_pid_level); NULL otherwise. */
static __always_inline struct counters *current_counters(void)
{
	__u64 id = bpf_get_current_cgroup_id();
	struct counters *c = bpf_map_lookup_elem(&sandboxes, &id);

	if (c && sandbox_pid_level &&
	    BPF_CORE_READ(bpf_get_current_task_btf(), thread_pid, level) < sandbox_pid_level)
		return 0;
	return c;
}

static __always_inline __u64 task_cgroup_id(struct task_struct *t)
{
	return BPF_CORE_READ(t, cgroups, dfl_cgrp, kn, id);
}

/* Pseudo file systems: writes there (cgroup.procs, /proc/self/...) are not sandbox state. */
static __always_inline int pseudo_fs(unsigned long magic)
{
	return magic == 0x9fa0 /* proc */ || magic == 0x62656572 /* sysfs */ ||
	       magic == 0x27e0eb /* cgroup */ || magic == 0x63677270 /* cgroup2 */ ||
	       magic == 0x64626720 /* debugfs */ || magic == 0x74726163 /* tracefs */ ||
	       magic == 0xcafe4a11 /* bpf */ || magic == 0x73636673 /* securityfs */;
}

/* Whether inode is a regular file (or, with dirs, a directory) with a name, on a real file
 * system: not a pipe, socket, device, anon inode, memfd or shared-memory file (their link
 * count is 0), unlinked file or pseudo-fs file. Only changes to those change the sandbox's
 * files. */
static __always_inline int inode_is_named(struct inode *inode, int dirs)
{
	umode_t mode;

	if (!inode)
		return 0;
	mode = BPF_CORE_READ(inode, i_mode) & S_IFMT;
	if (mode != S_IFREG && !(dirs && mode == S_IFDIR))
		return 0;
	if (BPF_CORE_READ(inode, __i_nlink) == 0)
		return 0;
	return !pseudo_fs(BPF_CORE_READ(inode, i_sb, s_magic));
}

/* Mount namespace (inode number) of the agent, set by the loader; 0: unset. Files on its
 * mounts were handed in from outside the sandbox and are not sandbox state: CRIU's parasite,
 * which runs in the sandbox's tasks during a checkpoint, writes its log to one. */
const volatile __u64 host_mnt_ns = 0;

static __always_inline int on_host_mount(struct file *f)
{
	struct vfsmount *vm = BPF_CORE_READ(f, f_path.mnt);
	struct mount *m = (void *)vm - bpf_core_field_offset(struct mount, mnt);

	return host_mnt_ns && BPF_CORE_READ(m, mnt_ns, ns.inum) == host_mnt_ns;
}

/* The open file behind descriptor fd of task (the current one, a trusted BTF pointer: the
 * walk to the descriptor array is plain loads), or NULL. */
static __always_inline struct file *fd_file(struct task_struct *task, long arg)
{
	struct fdtable *fdt = task->files->fdt;
	struct file **fda;
	struct file *f = 0;
	/* The kernel reads descriptor arguments as unsigned int: high bits are ignored. */
	__u32 fd = (__u32)arg;

	if (fd >= fdt->max_fds)
		return 0;
	fda = fdt->fd;
	if (bpf_probe_read_kernel(&f, sizeof(f), &fda[fd]))
		return 0;
	return f;
}

/* Whether descriptor fd of the current task refers to a sandbox file: a named regular file
 * (or, with dirs, a directory), not on one of the agent's own mounts. Only a ptraced task
 * (CRIU seizes the tasks it dumps) pays for the mount check; elsewhere such a descriptor
 * counts, which errs towards dirty. */
static __always_inline int fd_is_sandbox_file(long fd, int dirs)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct file *f = fd_file(task, fd);

	if (!f || !inode_is_named(BPF_CORE_READ(f, f_inode), dirs))
		return 0;
	return !(task->ptrace && on_host_mount(f));
}

static __always_inline int fd_is_named_regular(long fd)
{
	return fd_is_sandbox_file(fd, 0);
}

#define S_IFIFO 0010000
#define S_IFSOCK 0140000
#define PIPEFS_MAGIC 0x50495045
#define AF_UNIX_FAMILY 1
#define AF_INET 2
#define AF_NETLINK 16
#define AF_INET6 10
#define AF_ALG 38

/* Whether the current task is traced by a task outside the sandboxes' pid namespaces: CRIU,
 * whose parasite talks to it over a socket from inside the tasks it dumps. (Unset level: any
 * tracer.) A tracer inside the sandbox (strace) does not hide the tracee's sends. */
static __always_inline int traced_by_agent(struct task_struct *task)
{
	if (!task->ptrace)
		return 0;
	return !sandbox_pid_level ||
	       BPF_CORE_READ(task, parent, thread_pid, level) < sandbox_pid_level;
}

/* Whether a socket's data may reach a process of the sandbox that need not run while the
 * action runs. Not: netlink and AF_ALG (the kernel is the peer: route and address queries of
 * getaddrinfo); an AF_UNIX socket whose peer has no address (a socketpair: both ends are the
 * action's own, since handing one to an older process takes a send over a named socket or
 * pidfd_getfd, both counted); a connected IPv4/IPv6 socket whose peer is not on loopback (a
 * host outside the sandbox). Unconnected sockets (sendto with an address) count. */
static __always_inline int socket_reaches_sandbox(struct file *f)
{
	struct socket *sock = BPF_CORE_READ(f, private_data);
	struct sock *sk;
	__u16 family;

	if (!sock)
		return 1;
	sk = BPF_CORE_READ(sock, sk);
	if (!sk)
		return 1;
	family = BPF_CORE_READ(sk, __sk_common.skc_family);
	if (family == AF_NETLINK || family == AF_ALG)
		return 0;
	if (family == AF_UNIX_FAMILY) {
		struct unix_sock *peer = (struct unix_sock *)BPF_CORE_READ((struct unix_sock *)sk, peer);

		return !peer || BPF_CORE_READ(peer, addr) != 0;
	}
	if (family == AF_INET) {
		__u32 daddr = BPF_CORE_READ(sk, __sk_common.skc_daddr);

		/* 0: not connected; 127.0.0.0/8 in network order: first byte 127. */
		return daddr == 0 || (daddr & 0xff) == 127;
	}
	if (family == AF_INET6) {
		__u32 a[4];

		BPF_CORE_READ_INTO(&a, sk, __sk_common.skc_v6_daddr.in6_u.u6_addr32);
		if (!(a[0] | a[1] | a[2] | a[3]))
			return 1; /* not connected */
		if (!a[0] && !a[1] && !a[2] && a[3] == __builtin_bswap32(1))
			return 1; /* ::1 */
		/* ::ffff:127.x.y.z */
		return !a[0] && !a[1] && a[2] == __builtin_bswap32(0xffff) && (a[3] & 0xff) == 127;
	}
	return 1;
}

/* Whether descriptor fd of the current task is a named FIFO (not an anonymous pipe: the
 * action's own pipelines). */
static __always_inline int fd_is_named_fifo(long fd)
{
	struct file *f = fd_file(bpf_get_current_task_btf(), fd);
	struct inode *inode;

	if (!f)
		return 0;
	inode = BPF_CORE_READ(f, f_inode);
	return inode && (BPF_CORE_READ(inode, i_mode) & S_IFMT) == S_IFIFO &&
	       BPF_CORE_READ(inode, i_sb, s_magic) != PIPEFS_MAGIC;
}

/* Whether data written to descriptor fd of the current task may wait in the queue of a
 * process that existed before the action and does not run while it runs (asleep on something
 * else), a change no file and no CPU use shows: a named FIFO, or a socket that may reach such
 * a process (socket_reaches_sandbox). A task traced by CRIU is skipped. */
static __always_inline int fd_is_channel(long fd)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct file *f;
	struct inode *inode;
	umode_t mode;

	if (traced_by_agent(task))
		return 0;
	f = fd_file(task, fd);
	if (!f)
		return 0;
	inode = BPF_CORE_READ(f, f_inode);
	if (!inode)
		return 0;
	mode = BPF_CORE_READ(inode, i_mode) & S_IFMT;
	if (mode == S_IFSOCK)
		return socket_reaches_sandbox(f);
	return mode == S_IFIFO && BPF_CORE_READ(inode, i_sb, s_magic) != PIPEFS_MAGIC;
}

/* Whether descriptor fd of the current task is a datagram socket (its connect only sets a
 * default destination). */
static __always_inline int fd_is_datagram(long fd)
{
	struct file *f = fd_file(bpf_get_current_task_btf(), fd);
	struct socket *sock;

	if (!f)
		return 0;
	sock = BPF_CORE_READ(f, private_data);
	if (!sock || (BPF_CORE_READ(f, f_inode, i_mode) & S_IFMT) != S_IFSOCK)
		return 0;
	return BPF_CORE_READ(sock, type) == 2; /* SOCK_DGRAM */
}

#define O_CREAT 00000100
#define O_TRUNC 00001000

#define PROT_WRITE 0x2
#define MAP_TYPE 0x0f
#define MAP_PRIVATE 0x02
#define MAP_ANONYMOUS 0x20
#define VM_MAYSHARE 0x00000080
#define IOC_WRITE_BIT (1u << 30) /* _IOC_WRITE << _IOC_DIRSHIFT */
#define AF_UNIX 1
#define ENOENT 2
#define EEXIST 17

/* What sys_exit does for a syscall remembered at sys_enter. */
#define PENDING_IF_OK 1	  /* count when it succeeded */
#define PENDING_OPEN_FD 2 /* count when the new descriptor is a named regular file */
#define PENDING_CONNECT 3 /* count when it succeeded or is in progress (queued) */
#define PENDING_IF_DATA 4 /* count when it moved data (returned > 0) */
#define EINPROGRESS 115

/* Thread id -> PENDING_* between sys_enter and sys_exit of a tracked task. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} pending SEC(".maps");

/* Processes (tgid) of tracked cgroups that used io_uring or Linux AIO -> their cgroup id,
 * until the process exits. Such a process may change files later without any syscall (an
 * SQPOLL ring, linked or deferred requests, AIO still in flight); `counters.async_procs`
 * counts the live ones and the agent reports every step of the cgroup dirty while it is > 0. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, __u64);
} async_users SEC(".maps");

static __always_inline void count_write(struct counters *c)
{
	__sync_fetch_and_add(&c->fs_writes, 1);
}

/* Defers the decision to sys_exit; counts at once when the map is full (threads blocked in
 * remembered calls can fill it), so a full map never hides a change. */
static __always_inline void remember(struct counters *c, __u32 what)
{
	__u64 tid = bpf_get_current_pid_tgid();

	if (bpf_map_update_elem(&pending, &tid, &what, BPF_ANY))
		count_write(c);
}

static __always_inline void note_async_user(struct counters *c)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;
	__u64 cg;
	long r;

	if (bpf_map_lookup_elem(&async_users, &tgid))
		return;
	cg = bpf_get_current_cgroup_id();
	r = bpf_map_update_elem(&async_users, &tgid, &cg, BPF_NOEXIST);
	/* -EEXIST: another thread was first. A full map still counts: never uncounted, so the
	 * cgroup stays dirty for good rather than clean too early. */
	if (r != -EEXIST)
		__sync_fetch_and_add(&c->async_procs, 1);
}

static __always_inline void forget_async_user(__u32 tgid)
{
	__u64 *cg = bpf_map_lookup_elem(&async_users, &tgid);
	struct counters *c;

	if (!cg)
		return;
	c = bpf_map_lookup_elem(&sandboxes, cg);
	if (c && c->async_procs > 0)
		__sync_fetch_and_sub(&c->async_procs, 1);
	bpf_map_delete_elem(&async_users, &tgid);
}

/* File activity: one raw (BTF) tracepoint on every syscall entry and exit instead of the
 * per-syscall perf tracepoints, which cost an untar twice its time here; tasks outside
 * tracked cgroups leave after one map lookup. Syscall numbers are per architecture: x86_64
 * only for now (elsewhere the loader reports no file counters and the agent falls back to
 * comparing the upper layer).
 *
 * Every way a sandbox task can change a file, and how it is counted ("enter": at sys_enter,
 * whether or not the call then succeeds, which is cheaper than a pending entry per write and
 * errs only towards dirty; "ok": at sys_exit when it returned >= 0; "held": by the agent at
 * the end of each step, from /proc, see agent/src/trace/held.rs):
 *
 * "Named regular": a regular file with a link count > 0, not on a pseudo fs, and for
 * descriptors of a ptraced task not on a mount of the agent's own mount namespace
 * (host_mnt_ns: CRIU's parasite logging to its host file).
 *
 *   path                                        rule
 *   write pwrite64 writev pwritev pwritev2      enter, fd is a named regular file
 *   ftruncate fallocate fchmod fchown
 *   fsetxattr fremovexattr
 *   sendfile (out_fd)                           enter, out_fd named regular
 *   splice copy_file_range (fd_out)             enter, fd_out named regular
 *   open openat (O_CREAT|O_TRUNC) creat         exit, the new fd is a named regular file
 *   openat2 open_by_handle_at                   same (openat2: unreadable how -> as O_CREAT)
 *   unlink* rmdir rename* mkdir* mknod* link*   ok
 *   symlink* chmod fchmodat* chown lchown
 *   fchownat truncate utime* futimesat
 *   setxattr lsetxattr removexattr lremovexattr
 *   setxattrat removexattrat file_setattr acct
 *   bind of an AF_UNIX socket to a path         ok (creates the socket inode); unreadable
 *                                               address -> ok as well
 *   ioctl with _IOC_WRITE on a named regular    enter (FICLONE, FICLONERANGE, FS_IOC_SETFLAGS,
 *   file or directory                           FS_IOC_FSSETXATTR, FS_IOC_RESVSP/ZERO_RANGE,
 *                                               verity, ...; FIEMAP errs towards dirty)
 *   mmap MAP_SHARED(_VALIDATE) + PROT_WRITE     enter, fd named regular, not MAP_ANONYMOUS:
 *                                               stores through the mapping need no syscall
 *   mprotect pkey_mprotect adding PROT_WRITE    enter, a vma of the range (bpf_find_vma, up
 *                                               to 16 vmas; more, or a busy mmap lock, counts)
 *                                               is a shared mapping of a named regular file
 *   a shared writable file mapping made in an   held: any task of the sandbox with an rw-s
 *   earlier step (its own stores, a background  mapping of a regular file with a link count
 *   process's, process_vm_writev, ptrace,       > 0 (map_files) at the end of the previous
 *   /proc/pid/mem, read() into it, futex ops,   step or of this one makes the step dirty
 *   madvise MADV_REMOVE, mremap, msync, uffd)
 *   io_uring_setup io_uring_enter               enter, always; the process joins async_users
 *   io_uring_register                           (dirty while it lives); held: an io_uring fd,
 *   (SQPOLL rings submit without syscalls,      ring mapping or iou-sqp/iou-wrk thread
 *   linked timeouts run requests later)
 *   io_setup io_submit (Linux AIO)              enter, always; async_users; held: an [aio]
 *                                               ring mapping
 *   32-bit (int 0x80, ia32) and x32 syscalls    enter, every one: the numbers above are the
 *                                               x86_64 table's
 *   a core dump (core_pattern writes into the   at sched_process_exit: exit code has 0x80
 *   sandbox's cwd, no syscall of the task)
 *   write writev sendto sendmsg sendmmsg to a   exit, data moved; fd a named FIFO or a socket
 *   named FIFO or a socket that may reach a     whose peer may be a sandbox process (not
 *   sandbox process                             netlink/AF_ALG, not a socketpair, not a
 *                                               connected IPv4/6 socket off loopback); not
 *                                               while CRIU traces the task (its parasite)
 *   sendfile splice into such a descriptor      enter
 *   read readv from a named FIFO                exit, data moved (taken from its holder)
 *   connect (stream sockets)                    exit, ok or EINPROGRESS (a queued connection)
 *   process_vm_writev, ptrace but TRACEME and   enter: another process's state
 *   the peeks, pidfd_getfd
 *   SysV shm/sem/msg and POSIX mq syscalls      enter; the blocking ones (semop, semtimedop,
 *                                               msgsnd, msgrcv, mq_timedsend/receive) at exit
 *                                               when ok, as they restart after a thaw
 *   memfd_create + write, O_TMPFILE, anonymous  not counted: link count 0, not in the upper
 *   shared memory, anonymous pipes, devices,    layer; linking one in (linkat AT_EMPTY_PATH)
 *   /proc and other pseudo files                is linkat: ok
 *   tee vmsplice                                memory and pipes only (a shared file mapping
 *                                               written through them is held)
 *
 * Known limits: the fd checks at enter race with another thread of the task replacing the
 * descriptor (dup2) between the check and the call's own lookup; a daemon restart loses
 * async_users (the held checks remain). */
#if defined(__TARGET_ARCH_x86)
#define TS_COMPAT 0x0002		/* thread_info.status: a 32-bit syscall is running */
#define X32_SYSCALL_BIT 0x40000000
#define MPROTECT_VMAS 16

struct vma_walk {
	__u64 next; /* end of the last vma seen */
	int hit;    /* one was a shared mapping of a named regular file */
};

/* vma is a BTF pointer: plain loads (faults read as 0), no probe-read helper calls. */
static long vma_visit(struct task_struct *task, struct vm_area_struct *vma, void *data)
{
	struct vma_walk *w = data;
	struct inode *inode;
	struct file *f;

	w->next = vma->vm_end;
	if (!(vma->vm_flags & VM_MAYSHARE))
		return 0;
	f = vma->vm_file;
	if (!f)
		return 0;
	inode = f->f_inode;
	if ((inode->i_mode & S_IFMT) == S_IFREG && inode->__i_nlink &&
	    !pseudo_fs(inode->i_sb->s_magic))
		w->hit = 1;
	return 0;
}

/* Whether mprotect(start, len, ...) covers a shared mapping of a named regular file. vm_end
 * is page aligned, so comparing with start + len equals comparing with the kernel's
 * page-aligned end. */
static __always_inline int range_has_shared_file(__u64 start, __u64 len)
{
	struct task_struct *task = bpf_get_current_task_btf();
	struct vma_walk w = { .next = start };
	__u64 end = start + len;
	int i;

	for (i = 0; i < MPROTECT_VMAS; i++) {
		long r;

		if (w.next >= end)
			return 0;
		r = bpf_find_vma(task, w.next, vma_visit, &w, 0);
		if (r == -ENOENT)
			return 0; /* a hole: mprotect stops there with ENOMEM */
		if (r || w.hit)
			return 1; /* -EBUSY (mmap lock contended): cannot tell */
	}
	return w.next < end;
}

/* bind(fd, addr, len) names a path (not an abstract or unnamed AF_UNIX address); an
 * unreadable address counts (sys_exit then checks success). */
static __always_inline int binds_path(__u64 addr, __u64 len)
{
	__u8 b[3] = {};

	if (len <= 2)
		return 0;
	if (bpf_probe_read_user(b, sizeof(b), (void *)addr))
		return 1;
	return b[0] == AF_UNIX && b[1] == 0 && b[2] != 0; /* sa_family_t, little endian */
}

SEC("tp_btf/sys_enter")
int BPF_PROG(on_sys_enter, struct pt_regs *regs, long id)
{
	struct counters *c = current_counters();
	struct task_struct *task;
	long flags;

	if (!c)
		return 0;
	/* A trusted BTF pointer: a plain load, no probe-read helper call. */
	task = bpf_get_current_task_btf();
	if ((id & X32_SYSCALL_BIT) || (task->thread_info.status & TS_COMPAT)) {
		count_write(c);
		return 0;
	}
	switch (id) {
	case 1:	 /* write */
	case 20: /* writev */
		flags = BPF_CORE_READ(regs, di);
		if (fd_is_named_regular(flags))
			count_write(c);
		else if (fd_is_channel(flags))
			/* At exit: a send blocked on a full queue and restarted after a thaw is
			 * not a new one. */
			remember(c, PENDING_IF_DATA);
		break;
	case 0:	 /* read: taking data out of a named FIFO another process holds */
	case 19: /* readv */
		if (fd_is_named_fifo(BPF_CORE_READ(regs, di)) &&
		    !traced_by_agent(bpf_get_current_task_btf()))
			remember(c, PENDING_IF_DATA);
		break;
	case 91:  /* fchmod */
	case 93:  /* fchown */
	case 190: /* fsetxattr */
	case 199: /* fremovexattr */
		if (fd_is_sandbox_file(BPF_CORE_READ(regs, di), 1))
			count_write(c);
		break;
	case 438: /* pidfd_getfd: a descriptor taken from another process */
		count_write(c);
		break;
	case 18:  /* pwrite64 */
	case 296: /* pwritev */
	case 328: /* pwritev2 */
	case 77:  /* ftruncate */
	case 285: /* fallocate */
	case 40:  /* sendfile */
		flags = BPF_CORE_READ(regs, di);
		if (fd_is_named_regular(flags) || fd_is_channel(flags))
			count_write(c);
		break;
	case 326: /* copy_file_range */
	case 275: /* splice */
		flags = BPF_CORE_READ(regs, dx);
		if (fd_is_named_regular(flags) || fd_is_channel(flags))
			count_write(c);
		break;
	case 44:  /* sendto */
	case 46:  /* sendmsg */
	case 307: /* sendmmsg */
		if (fd_is_channel(BPF_CORE_READ(regs, di)))
			remember(c, PENDING_IF_DATA);
		break;
	case 42: /* connect: queues a connection with a listener that need not run */
		flags = BPF_CORE_READ(regs, di);
		if (fd_is_channel(flags) && !fd_is_datagram(flags))
			remember(c, PENDING_CONNECT);
		break;
	case 65:  /* semop */
	case 220: /* semtimedop */
	case 69:  /* msgsnd */
	case 70:  /* msgrcv */
	case 242: /* mq_timedsend */
	case 243: /* mq_timedreceive */
		/* At exit: blocked ones restart after a thaw or a restore. */
		remember(c, PENDING_IF_OK);
		break;
	case 101: /* ptrace: pokes, register and signal changes, stops and resumes */
		flags = BPF_CORE_READ(regs, di);
		/* PTRACE_TRACEME (0) and the peeks (1-3) change no other process. */
		if (flags > 3)
			count_write(c);
		break;
	case 311: /* process_vm_writev: another process's memory, that process not running */
	case 29:  /* shmget */
	case 30:  /* shmat */
	case 31:  /* shmctl */
	case 64:  /* semget */
	case 66:  /* semctl */
	case 68:  /* msgget */
	case 71:  /* msgctl */
	case 240: /* mq_open */
	case 241: /* mq_unlink */
	case 244: /* mq_notify */
	case 245: /* mq_getsetattr */
		/* SysV and POSIX IPC objects live in the sandbox's IPC namespace, which CRIU dumps. */
		count_write(c);
		break;
	case 9: /* mmap(addr, len, prot, flags, fd, off) */
		flags = BPF_CORE_READ(regs, r10);
		if ((BPF_CORE_READ(regs, dx) & PROT_WRITE) && (flags & MAP_TYPE) != MAP_PRIVATE &&
		    !(flags & MAP_ANONYMOUS) && fd_is_named_regular(BPF_CORE_READ(regs, r8)))
			count_write(c);
		break;
	case 10:  /* mprotect(start, len, prot) */
	case 329: /* pkey_mprotect(start, len, prot, pkey) */
		if ((BPF_CORE_READ(regs, dx) & PROT_WRITE) &&
		    range_has_shared_file(BPF_CORE_READ(regs, di), BPF_CORE_READ(regs, si)))
			count_write(c);
		break;
	case 16: /* ioctl(fd, cmd, arg) */
		if ((BPF_CORE_READ(regs, si) & IOC_WRITE_BIT) &&
		    fd_is_sandbox_file(BPF_CORE_READ(regs, di), 1))
			count_write(c);
		break;
	case 206: /* io_setup */
	case 209: /* io_submit */
	case 425: /* io_uring_setup */
	case 426: /* io_uring_enter */
	case 427: /* io_uring_register */
		count_write(c);
		note_async_user(c);
		break;
	case 49: /* bind(fd, addr, len) */
		if (binds_path(BPF_CORE_READ(regs, si), BPF_CORE_READ(regs, dx)))
			remember(c, PENDING_IF_OK);
		break;
	case 2: /* open */
		flags = BPF_CORE_READ(regs, si);
		if (flags & (O_CREAT | O_TRUNC))
			remember(c, PENDING_OPEN_FD);
		break;
	case 257: /* openat */
	case 304: /* open_by_handle_at(mount_fd, handle, flags) */
		flags = BPF_CORE_READ(regs, dx);
		if (flags & (O_CREAT | O_TRUNC))
			remember(c, PENDING_OPEN_FD);
		break;
	case 437: { /* openat2 */
		__u64 how_flags = 0;

		if (bpf_probe_read_user(&how_flags, sizeof(how_flags),
					(void *)BPF_CORE_READ(regs, dx)) ||
		    (how_flags & (O_CREAT | O_TRUNC)))
			remember(c, PENDING_OPEN_FD);
		break;
	}
	case 85: /* creat */
		remember(c, PENDING_OPEN_FD);
		break;
	case 87:  /* unlink */
	case 263: /* unlinkat */
	case 84:  /* rmdir */
	case 82:  /* rename */
	case 264: /* renameat */
	case 316: /* renameat2 */
	case 83:  /* mkdir */
	case 258: /* mkdirat */
	case 133: /* mknod */
	case 259: /* mknodat */
	case 88:  /* symlink */
	case 266: /* symlinkat */
	case 86:  /* link */
	case 265: /* linkat */
	case 90:  /* chmod */
	case 268: /* fchmodat */
	case 452: /* fchmodat2 */
	case 92:  /* chown */
	case 94:  /* lchown */
	case 260: /* fchownat */
	case 76:  /* truncate */
	case 280: /* utimensat */
	case 235: /* utimes */
	case 132: /* utime */
	case 261: /* futimesat */
	case 188: /* setxattr */
	case 189: /* lsetxattr */
	case 197: /* removexattr */
	case 198: /* lremovexattr */
	case 463: /* setxattrat */
	case 466: /* removexattrat */
	case 469: /* file_setattr */
	case 163: /* acct: the kernel then writes a record at every exit */
		remember(c, PENDING_IF_OK);
		break;
	default:
		break;
	}
	return 0;
}

SEC("tp_btf/sys_exit")
int BPF_PROG(on_sys_exit, struct pt_regs *regs, long ret)
{
	struct counters *c = current_counters();
	__u64 tid;
	__u32 *what;

	if (!c)
		return 0;
	tid = bpf_get_current_pid_tgid();
	what = bpf_map_lookup_elem(&pending, &tid);
	if (!what)
		return 0;
	switch (*what) {
	case PENDING_IF_OK:
		if (ret >= 0)
			count_write(c);
		break;
	case PENDING_OPEN_FD:
		if (ret >= 0 && fd_is_named_regular(ret))
			count_write(c);
		break;
	case PENDING_CONNECT:
		if (ret >= 0 || ret == -EINPROGRESS)
			count_write(c);
		break;
	case PENDING_IF_DATA:
		if (ret > 0)
			count_write(c);
		break;
	default:
		count_write(c);
		break;
	}
	bpf_map_delete_elem(&pending, &tid);
	return 0;
}
#endif

static __always_inline void submit(struct event *src)
{
	struct event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);

	if (!e)
		return;
	__builtin_memcpy(e, src, sizeof(*e));
	bpf_ringbuf_submit(e, 0);
}

SEC("tp_btf/sched_process_fork")
int BPF_PROG(on_fork, struct task_struct *parent, struct task_struct *child)
{
	struct counters *c = current_counters();

	if (c && BPF_CORE_READ(child, pid) == BPF_CORE_READ(child, tgid))
		__sync_fetch_and_add(&c->forks, 1);
	return 0;
}

SEC("tp_btf/sched_process_exit")
int BPF_PROG(on_exit, struct task_struct *p)
{
	__u64 cg = bpf_get_current_cgroup_id();
	struct counters *c;
	struct event e = {};
	int code;

	e.pid = BPF_CORE_READ(p, tgid);
	e.tid = BPF_CORE_READ(p, pid);
	/* The last task of the process (signal->live is decremented before this tracepoint):
	 * its rings and AIO contexts go with it. */
	if (BPF_CORE_READ(p, signal, live.counter) == 0)
		forget_async_user(e.pid);
	c = bpf_map_lookup_elem(&sandboxes, &cg);
	if (!c)
		return 0;
	code = BPF_CORE_READ(p, exit_code);
	/* 0x80: the task dumped core; the kernel wrote the file (core_pattern "core": into the
	 * task's working directory, in the sandbox) without a syscall of the task. */
	if (code & 0x80)
		__sync_fetch_and_add(&c->fs_writes, 1);
	if (e.pid != e.tid)
		return 0;
	__sync_fetch_and_add(&c->exits, 1);
	e.kind = EV_EXIT;
	e.signal = code & 0x7f;
	e.exit_code = (code >> 8) & 0xff;
	e.cgroup_id = cg;
	e.ktime_ns = bpf_ktime_get_ns();
	submit(&e);
	return 0;
}

SEC("tp_btf/signal_generate")
int BPF_PROG(on_signal, int sig, struct kernel_siginfo *info, struct task_struct *task, int group,
	     int result)
{
	struct counters *c;
	struct event e = {};
	__u64 target, sender;

	if (result != 0) /* TRACE_SIGNAL_DELIVERED */
		return 0;
	if (sig != SIGKILL && sig != SIGTERM && sig != SIGINT && sig != SIGHUP &&
	    sig != SIGQUIT && sig != SIGABRT)
		return 0;
	/* SEND_SIG_PRIV: sent by the kernel itself (OOM killer, pid namespace teardown); OOM
	 * kills are reported by mark_victim. */
	if ((unsigned long)info == 1)
		return 0;
	target = task_cgroup_id(task);
	c = bpf_map_lookup_elem(&sandboxes, &target);
	if (!c)
		return 0;
	sender = bpf_get_current_cgroup_id();
	if (sender == target)
		return 0;
	e.kind = EV_SIGNAL;
	e.pid = BPF_CORE_READ(task, tgid);
	e.tid = BPF_CORE_READ(task, pid);
	e.signal = sig;
	e.sender_pid = bpf_get_current_pid_tgid() >> 32;
	e.cgroup_id = target;
	e.sender_cgroup_id = sender;
	e.ktime_ns = bpf_ktime_get_ns();
	c->last_kill_pid = e.pid;
	c->last_kill_signal = sig;
	__sync_fetch_and_add(&c->external_kills, 1);
	submit(&e);
	return 0;
}

/* Runs in the context of the task that triggered the OOM kill: the victim is the argument. */
SEC("tp_btf/mark_victim")
int BPF_PROG(on_oom_victim, struct task_struct *task)
{
	struct counters *c;
	struct event e = {};
	__u64 target = task_cgroup_id(task);

	c = bpf_map_lookup_elem(&sandboxes, &target);
	if (!c)
		return 0;
	e.kind = EV_OOM;
	e.pid = BPF_CORE_READ(task, tgid);
	e.tid = BPF_CORE_READ(task, pid);
	e.signal = SIGKILL;
	e.sender_pid = bpf_get_current_pid_tgid() >> 32;
	e.cgroup_id = target;
	e.sender_cgroup_id = bpf_get_current_cgroup_id();
	e.ktime_ns = bpf_ktime_get_ns();
	c->last_oom_pid = e.pid;
	__sync_fetch_and_add(&c->oom_kills, 1);
	submit(&e);
	return 0;
}
