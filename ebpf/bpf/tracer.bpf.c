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

static __always_inline struct counters *current_counters(void)
{
	__u64 id = bpf_get_current_cgroup_id();
	return bpf_map_lookup_elem(&sandboxes, &id);
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

/* Whether fd of the current task is a regular file with a name (not a pipe, socket, device,
 * memfd, unlinked file or pseudo-fs file): only writes to those change the sandbox's files. */
static __always_inline int fd_is_named_regular(long fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	unsigned int max = BPF_CORE_READ(fdt, max_fds);
	struct file **fda;
	struct file *f = 0;
	struct inode *inode;
	umode_t mode;

	if (fd < 0 || fd >= max)
		return 0;
	fda = BPF_CORE_READ(fdt, fd);
	if (bpf_probe_read_kernel(&f, sizeof(f), &fda[fd]) || !f)
		return 0;
	inode = BPF_CORE_READ(f, f_inode);
	mode = BPF_CORE_READ(inode, i_mode);
	if ((mode & S_IFMT) != S_IFREG || BPF_CORE_READ(inode, __i_nlink) == 0)
		return 0;
	return !pseudo_fs(BPF_CORE_READ(inode, i_sb, s_magic));
}

#define O_CREAT 00000100
#define O_TRUNC 00001000

/* What sys_exit does for a syscall remembered at sys_enter. */
#define PENDING_IF_OK 1	  /* count when it succeeded */
#define PENDING_OPEN_FD 2 /* count when the new descriptor is a named regular file */

/* Thread id -> PENDING_* between sys_enter and sys_exit of a tracked task. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} pending SEC(".maps");

static __always_inline void remember(__u32 what)
{
	__u64 tid = bpf_get_current_pid_tgid();

	bpf_map_update_elem(&pending, &tid, &what, BPF_ANY);
}

/* File activity: one raw (BTF) tracepoint on every syscall entry and exit instead of the
 * per-syscall perf tracepoints, which cost an untar twice its time here; tasks outside
 * tracked cgroups leave after one map lookup. Syscall numbers are per architecture: x86_64
 * only for now (elsewhere the loader reports no file counters and the agent falls back to
 * comparing the upper layer). */
#if defined(__TARGET_ARCH_x86)
SEC("tp_btf/sys_enter")
int BPF_PROG(on_sys_enter, struct pt_regs *regs, long id)
{
	struct counters *c = current_counters();
	long flags;

	if (!c)
		return 0;
	switch (id) {
	case 1:	  /* write */
	case 18:  /* pwrite64 */
	case 20:  /* writev */
	case 296: /* pwritev */
	case 328: /* pwritev2 */
	case 77:  /* ftruncate */
	case 285: /* fallocate */
	case 91:  /* fchmod */
	case 93:  /* fchown */
	case 190: /* fsetxattr */
	case 199: /* fremovexattr */
	case 40:  /* sendfile */
		if (fd_is_named_regular(BPF_CORE_READ(regs, di)))
			__sync_fetch_and_add(&c->fs_writes, 1);
		break;
	case 326: /* copy_file_range */
	case 275: /* splice */
		if (fd_is_named_regular(BPF_CORE_READ(regs, dx)))
			__sync_fetch_and_add(&c->fs_writes, 1);
		break;
	case 2: /* open */
		flags = BPF_CORE_READ(regs, si);
		if (flags & (O_CREAT | O_TRUNC))
			remember(PENDING_OPEN_FD);
		break;
	case 257: /* openat */
		flags = BPF_CORE_READ(regs, dx);
		if (flags & (O_CREAT | O_TRUNC))
			remember(PENDING_OPEN_FD);
		break;
	case 437: { /* openat2 */
		__u64 how_flags = 0;

		bpf_probe_read_user(&how_flags, sizeof(how_flags), (void *)BPF_CORE_READ(regs, dx));
		if (how_flags & (O_CREAT | O_TRUNC))
			remember(PENDING_OPEN_FD);
		break;
	}
	case 85: /* creat */
		remember(PENDING_OPEN_FD);
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
		remember(PENDING_IF_OK);
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
	if (ret >= 0 && (*what == PENDING_IF_OK || fd_is_named_regular(ret)))
		__sync_fetch_and_add(&c->fs_writes, 1);
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
	struct counters *c = bpf_map_lookup_elem(&sandboxes, &cg);
	struct event e = {};
	int code;

	if (!c)
		return 0;
	e.pid = BPF_CORE_READ(p, tgid);
	e.tid = BPF_CORE_READ(p, pid);
	if (e.pid != e.tid)
		return 0;
	__sync_fetch_and_add(&c->exits, 1);
	code = BPF_CORE_READ(p, exit_code);
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
