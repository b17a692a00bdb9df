// SPDX-License-Identifier: GPL-2.0
// Belayer sandbox tracer: what a descriptor or inode of a sandbox task is (a named regular
// file, a named FIFO, a socket whose peer may be a sandbox process), for the file-activity
// rules of file_activity.h. Included once, by tracer.bpf.c, after vmlinux.h, the S_IF* modes
// and sandbox_pid_level.

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

