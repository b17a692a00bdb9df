// SPDX-License-Identifier: GPL-2.0
// Belayer sandbox tracer: process exits, signals and OOM victims of tracked sandbox cgroups,
// streamed through a ring buffer, plus per-cgroup activity counters (file-modifying syscalls,
// process creation/exit, external and OOM kills) read synchronously by the agent.
//
// Only tracepoints are used (the target kernels have no kprobes): BTF-typed ones (tp_btf) where
// the task pointer is needed, the classic syscall tracepoints for file activity. Kernel structures
// are read with CO-RE (BPF_CORE_READ), so the object loads on other kernels with BTF.
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
#define O_CREAT 00000100
#define O_TRUNC 00001000

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

/* Thread id -> 1 between sys_enter_open* with O_CREAT|O_TRUNC and its sys_exit. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, __u32);
} pending_open SEC(".maps");

static __always_inline struct counters *current_counters(void)
{
	__u64 id = bpf_get_current_cgroup_id();
	return bpf_map_lookup_elem(&sandboxes, &id);
}

static __always_inline __u64 task_cgroup_id(struct task_struct *t)
{
	return BPF_CORE_READ(t, cgroups, dfl_cgrp, kn, id);
}

/* Whether fd of the current task is a regular file with a name (not a pipe, socket, device,
 * memfd or unlinked file): only writes to those change the sandbox's file system state. */
static __always_inline int fd_is_named_regular(long fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	unsigned int max = BPF_CORE_READ(fdt, max_fds);
	struct file **fda;
	struct file *f = 0;
	struct inode *inode;
	umode_t mode;
	unsigned int nlink;

	if (fd < 0 || fd >= max)
		return 0;
	fda = BPF_CORE_READ(fdt, fd);
	if (bpf_probe_read_kernel(&f, sizeof(f), &fda[fd]) || !f)
		return 0;
	inode = BPF_CORE_READ(f, f_inode);
	mode = BPF_CORE_READ(inode, i_mode);
	if ((mode & S_IFMT) != S_IFREG)
		return 0;
	nlink = BPF_CORE_READ(inode, __i_nlink);
	return nlink > 0;
}

static __always_inline int count_fd_write(long fd)
{
	struct counters *c = current_counters();

	if (c && fd_is_named_regular(fd))
		__sync_fetch_and_add(&c->fs_writes, 1);
	return 0;
}

static __always_inline int count_if_ok(long ret)
{
	struct counters *c;

	if (ret < 0)
		return 0;
	c = current_counters();
	if (c)
		__sync_fetch_and_add(&c->fs_writes, 1);
	return 0;
}

/* Writes through a descriptor: counted when the descriptor is a named regular file. */
#define FD_WRITE(name, argi)                                                   \
	SEC("tracepoint/syscalls/sys_enter_" #name)                            \
	int enter_##name(struct trace_event_raw_sys_enter *ctx)                \
	{                                                                      \
		return count_fd_write((long)ctx->args[argi]);                  \
	}

FD_WRITE(write, 0)
FD_WRITE(pwrite64, 0)
FD_WRITE(writev, 0)
FD_WRITE(pwritev, 0)
FD_WRITE(pwritev2, 0)
FD_WRITE(ftruncate, 0)
FD_WRITE(fallocate, 0)
FD_WRITE(fchmod, 0)
FD_WRITE(fchown, 0)
FD_WRITE(fsetxattr, 0)
FD_WRITE(fremovexattr, 0)
FD_WRITE(copy_file_range, 2)
FD_WRITE(splice, 2)
FD_WRITE(sendfile64, 0)

/* Path operations that change the tree or metadata: counted when they succeed. */
#define PATH_OP(name)                                                          \
	SEC("tracepoint/syscalls/sys_exit_" #name)                             \
	int exit_##name(struct trace_event_raw_sys_exit *ctx)                  \
	{                                                                      \
		return count_if_ok(ctx->ret);                                  \
	}

PATH_OP(unlink)
PATH_OP(unlinkat)
PATH_OP(rmdir)
PATH_OP(rename)
PATH_OP(renameat)
PATH_OP(renameat2)
PATH_OP(mkdir)
PATH_OP(mkdirat)
PATH_OP(mknod)
PATH_OP(mknodat)
PATH_OP(symlink)
PATH_OP(symlinkat)
PATH_OP(link)
PATH_OP(linkat)
PATH_OP(chmod)
PATH_OP(fchmodat)
PATH_OP(fchmodat2)
PATH_OP(chown)
PATH_OP(lchown)
PATH_OP(fchownat)
PATH_OP(truncate)
PATH_OP(utimensat)
PATH_OP(utimes)
PATH_OP(utime)
PATH_OP(futimesat)
PATH_OP(setxattr)
PATH_OP(lsetxattr)
PATH_OP(removexattr)
PATH_OP(lremovexattr)

/* Opens that create or truncate: remembered at entry, counted at exit when the new descriptor
 * is a named regular file (so `> /dev/null` does not count). */
static __always_inline int open_enter(long flags)
{
	__u64 tid;
	__u32 one = 1;

	if (!(flags & (O_CREAT | O_TRUNC)) || !current_counters())
		return 0;
	tid = bpf_get_current_pid_tgid();
	bpf_map_update_elem(&pending_open, &tid, &one, BPF_ANY);
	return 0;
}

static __always_inline int open_exit(long ret)
{
	__u64 tid = bpf_get_current_pid_tgid();

	if (!bpf_map_lookup_elem(&pending_open, &tid))
		return 0;
	bpf_map_delete_elem(&pending_open, &tid);
	if (ret >= 0)
		count_fd_write(ret);
	return 0;
}

SEC("tracepoint/syscalls/sys_enter_openat")
int enter_openat(struct trace_event_raw_sys_enter *ctx)
{
	return open_enter((long)ctx->args[2]);
}

SEC("tracepoint/syscalls/sys_enter_open")
int enter_open(struct trace_event_raw_sys_enter *ctx)
{
	return open_enter((long)ctx->args[1]);
}

SEC("tracepoint/syscalls/sys_enter_creat")
int enter_creat(struct trace_event_raw_sys_enter *ctx)
{
	return open_enter(O_CREAT | O_TRUNC);
}

SEC("tracepoint/syscalls/sys_enter_openat2")
int enter_openat2(struct trace_event_raw_sys_enter *ctx)
{
	__u64 flags = 0;

	bpf_probe_read_user(&flags, sizeof(flags), (void *)ctx->args[2]);
	return open_enter((long)flags);
}

#define OPEN_EXIT(name)                                                        \
	SEC("tracepoint/syscalls/sys_exit_" #name)                             \
	int exit_##name(struct trace_event_raw_sys_exit *ctx)                  \
	{                                                                      \
		return open_exit(ctx->ret);                                    \
	}

OPEN_EXIT(openat)
OPEN_EXIT(open)
OPEN_EXIT(creat)
OPEN_EXIT(openat2)

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
