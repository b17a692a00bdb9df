// Test probe for the tracer's dirtiness rules: each subcommand changes (or only reads) a file
// through one path that needs no ordinary write syscall. Built by the tests at test time with
// the host's `cc -static -no-pie` (static: it runs inside busybox sandboxes; non-PIE: the
// int $0x80 path passes 32-bit pointers). Exit codes: 0 done, 1 failed, 2 the kernel refuses
// the facility (e.g. io_uring disabled or filtered by seccomp).
//
//   mmap-write FILE      open O_RDWR, mmap MAP_SHARED PROT_WRITE, store, munmap
//   mmap-read FILE       open O_RDONLY, mmap MAP_SHARED PROT_READ, load
//   mprotect-write FILE  mmap MAP_SHARED PROT_READ of an O_RDWR fd, mprotect to RW, store
//   mprotect-anon        mprotect of private anonymous memory to RW (not a file)
//   uring-write FILE     one IORING_OP_WRITE through a raw io_uring
//   uring-hold           set up an io_uring and sleep holding it
//   aio-write FILE       one IOCB_CMD_PWRITE through Linux AIO (io_setup/io_submit)
//   int80-write FILE     write(2) through the 32-bit int $0x80 entry
//   bind-unix PATH       bind an AF_UNIX socket to PATH
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

static char msg[] = "through another path\n";

static int open_or_die(const char *path, int flags)
{
	int fd = open(path, flags);

	if (fd < 0) {
		perror(path);
		exit(1);
	}
	return fd;
}

static int mmap_write(const char *path)
{
	int fd = open_or_die(path, O_RDWR);
	char *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

	if (p == MAP_FAILED)
		return perror("mmap"), 1;
	p[0] = 'M';
	return munmap(p, 4096) != 0;
}

static int mmap_read(const char *path)
{
	int fd = open_or_die(path, O_RDONLY);
	volatile char *p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);

	if (p == MAP_FAILED)
		return perror("mmap"), 1;
	printf("%c\n", p[0]);
	return 0;
}

static int mprotect_write(const char *path)
{
	int fd = open_or_die(path, O_RDWR);
	char *p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);

	if (p == MAP_FAILED)
		return perror("mmap"), 1;
	if (mprotect(p, 4096, PROT_READ | PROT_WRITE))
		return perror("mprotect"), 1;
	p[0] = 'P';
	return munmap(p, 4096) != 0;
}

static int mprotect_anon(void)
{
	char *p = mmap(NULL, 3 * 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	int i;

	if (p == MAP_FAILED)
		return perror("mmap"), 1;
	for (i = 0; i < 100; i++) {
		if (mprotect(p, 3 * 4096, PROT_READ | PROT_WRITE) || mprotect(p, 3 * 4096, PROT_READ))
			return perror("mprotect"), 1;
	}
	return 0;
}

struct ring {
	int fd;
	unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
	struct io_uring_sqe *sqes;
	struct io_uring_cqe *cqes;
};

static int ring_setup(struct ring *r)
{
	struct io_uring_params p;
	size_t sq_size, cq_size;
	char *sq, *cq;

	memset(&p, 0, sizeof(p));
	r->fd = syscall(__NR_io_uring_setup, 4, &p);
	if (r->fd < 0) {
		perror("io_uring_setup");
		exit(errno == EPERM || errno == ENOSYS || errno == EACCES ? 2 : 1);
	}
	sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
	cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
	if (p.features & IORING_FEAT_SINGLE_MMAP)
		sq_size = cq_size = sq_size > cq_size ? sq_size : cq_size;
	sq = mmap(NULL, sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
		  IORING_OFF_SQ_RING);
	if (sq == MAP_FAILED)
		return perror("mmap sq"), 1;
	cq = sq;
	if (!(p.features & IORING_FEAT_SINGLE_MMAP)) {
		cq = mmap(NULL, cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
			  IORING_OFF_CQ_RING);
		if (cq == MAP_FAILED)
			return perror("mmap cq"), 1;
	}
	r->sqes = mmap(NULL, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
	if (r->sqes == MAP_FAILED)
		return perror("mmap sqes"), 1;
	r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
	r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
	r->sq_array = (unsigned *)(sq + p.sq_off.array);
	r->cq_head = (unsigned *)(cq + p.cq_off.head);
	r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
	r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
	r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
	return 0;
}

static int uring_write(const char *path)
{
	int fd = open_or_die(path, O_WRONLY);
	struct ring r;
	struct io_uring_sqe *e;
	unsigned tail, idx;
	int res;

	if (ring_setup(&r))
		return 1;
	tail = *r.sq_tail;
	idx = tail & *r.sq_mask;
	e = &r.sqes[idx];
	memset(e, 0, sizeof(*e));
	e->opcode = IORING_OP_WRITE;
	e->fd = fd;
	e->addr = (unsigned long)msg;
	e->len = sizeof(msg) - 1;
	e->off = 0;
	r.sq_array[idx] = idx;
	__atomic_store_n(r.sq_tail, tail + 1, __ATOMIC_RELEASE);
	if (syscall(__NR_io_uring_enter, r.fd, 1, 1, IORING_ENTER_GETEVENTS, NULL, 0) < 0)
		return perror("io_uring_enter"), 1;
	if (__atomic_load_n(r.cq_tail, __ATOMIC_ACQUIRE) == *r.cq_head)
		return fprintf(stderr, "no completion\n"), 1;
	res = r.cqes[*r.cq_head & *r.cq_mask].res;
	if (res != (int)sizeof(msg) - 1)
		return fprintf(stderr, "write through io_uring: %d\n", res), 1;
	return 0;
}

static int uring_hold(void)
{
	struct ring r;

	if (ring_setup(&r))
		return 1;
	for (;;)
		pause();
}

static int aio_write(const char *path)
{
	int fd = open_or_die(path, O_WRONLY);
	aio_context_t ctx = 0;
	struct iocb cb, *cbs[1] = { &cb };
	struct io_event ev;

	if (syscall(__NR_io_setup, 8, &ctx) < 0) {
		perror("io_setup");
		return errno == EPERM || errno == ENOSYS ? 2 : 1;
	}
	memset(&cb, 0, sizeof(cb));
	cb.aio_fildes = fd;
	cb.aio_lio_opcode = IOCB_CMD_PWRITE;
	cb.aio_buf = (unsigned long)msg;
	cb.aio_nbytes = sizeof(msg) - 1;
	cb.aio_offset = 0;
	if (syscall(__NR_io_submit, ctx, 1, cbs) != 1)
		return perror("io_submit"), 1;
	if (syscall(__NR_io_getevents, ctx, 1, 1, &ev, NULL) != 1)
		return perror("io_getevents"), 1;
	syscall(__NR_io_destroy, ctx);
	return ev.res == sizeof(msg) - 1 ? 0 : 1;
}

static int int80_write(const char *path)
{
	int fd = open_or_die(path, O_WRONLY);
	long r;

	/* i386 write = 4; 64-bit registers are truncated to 32 bits: msg lies below 4 GiB in a
	 * non-PIE static binary. */
	__asm__ volatile("int $0x80"
			 : "=a"(r)
			 : "a"(4L), "b"((long)fd), "c"(msg), "d"(sizeof(msg) - 1)
			 : "memory", "r8", "r9", "r10", "r11");
	if (r == -ENOSYS)
		return fprintf(stderr, "no ia32 emulation\n"), 2;
	return r == sizeof(msg) - 1 ? 0 : (fprintf(stderr, "int80 write: %ld\n", r), 1);
}

static int bind_unix(const char *path)
{
	struct sockaddr_un a;
	int s = socket(AF_UNIX, SOCK_STREAM, 0);

	memset(&a, 0, sizeof(a));
	a.sun_family = AF_UNIX;
	strncpy(a.sun_path, path, sizeof(a.sun_path) - 1);
	if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof(a)))
		return perror("bind"), 1;
	return 0;
}

int main(int argc, char **argv)
{
	const char *cmd = argc > 1 ? argv[1] : "";
	const char *arg = argc > 2 ? argv[2] : "";

	if (!strcmp(cmd, "mmap-write"))
		return mmap_write(arg);
	if (!strcmp(cmd, "mmap-read"))
		return mmap_read(arg);
	if (!strcmp(cmd, "mprotect-write"))
		return mprotect_write(arg);
	if (!strcmp(cmd, "mprotect-anon"))
		return mprotect_anon();
	if (!strcmp(cmd, "uring-write"))
		return uring_write(arg);
	if (!strcmp(cmd, "uring-hold"))
		return uring_hold();
	if (!strcmp(cmd, "aio-write"))
		return aio_write(arg);
	if (!strcmp(cmd, "int80-write"))
		return int80_write(arg);
	if (!strcmp(cmd, "bind-unix"))
		return bind_unix(arg);
	fprintf(stderr, "usage: %s mmap-write|mmap-read|mprotect-write|mprotect-anon|"
			"uring-write|uring-hold|aio-write|int80-write|bind-unix [FILE]\n",
		argv[0]);
	return 1;
}
