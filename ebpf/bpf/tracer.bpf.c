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

#include "fds.h"

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

#include "file_activity.h"

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
