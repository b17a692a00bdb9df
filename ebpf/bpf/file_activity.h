// SPDX-License-Identifier: GPL-2.0
// Belayer sandbox tracer: the file-activity counter (sys_enter/sys_exit programs and the table
// of what counts). Included once, by tracer.bpf.c, after the maps, count_write, remember and
// the async-user helpers it uses.

/* File activity: one raw (BTF) tracepoint on every syscall entry and exit instead of the
 * per-syscall perf tracepoints, which cost an untar twice its time here; tasks outside
 * tracked cgroups leave after one map lookup. Syscall numbers are per architecture: x86_64
 * only for now (elsewhere the loader reports no file counters and the agent falls back to
 * comparing the upper layer).
 *
 * Every way a sandbox task can change a file, and how it is counted ("enter": at sys_enter,
 * whether or not the call then succeeds, which is cheaper than a pending entry per write and
 * errs only towards dirty; "ok": at sys_exit when it returned >= 0; "held": by the agent at
 * the end of each step, from /proc, see agent/daemon/src/trace/held.rs):
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

