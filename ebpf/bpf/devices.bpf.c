// SPDX-License-Identifier: GPL-2.0
// Belayer device allow-list for cgroup v2 (BPF_PROG_TYPE_CGROUP_DEVICE): attached to a
// sandbox's cgroup, it runs on every open and mknod of a device node by a task of that cgroup
// (or of a cgroup below it) and answers 1 (allow) or 0 (deny: the syscall fails with EPERM).
//
// Policy: read and write of the character devices listed in `devices` (filled by the loader,
// ebpf/src/devices.rs, from the agent's tables `ALLOWED_DEVICES` and `PTY_DEVICES`; an entry
// whose minor is ANY_MINOR stands for every minor of its major); nothing else. Every mknod is
// denied, every block device is denied, and so is any access bit the kernel may add later.
//
// The list lives in .rodata: the loader writes it before the program is loaded and the map is
// frozen then, so neither user space nor the program can change it afterwards, and the verifier
// sees the entries as constants. Keep `struct char_device` and MAX_DEVICES in sync with
// ebpf/src/devices.rs.

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

// include/uapi/linux/bpf.h (not in vmlinux.h, which has only the types of the kernel's BTF):
// the low 16 bits of `access_type` are the device type, the high 16 bits the access.
#define DEVCG_DEV_BLOCK 1
#define DEVCG_DEV_CHAR 2
#define DEVCG_ACC_MKNOD 1
#define DEVCG_ACC_READ 2
#define DEVCG_ACC_WRITE 4

#define MAX_DEVICES 16

// A minor no device has (minors have 20 bits): the entry matches every minor of its major.
#define ANY_MINOR 0xffffffffu

struct char_device {
	__u32 major;
	__u32 minor;
};

const volatile __u32 n_devices = 0;
const volatile struct char_device devices[MAX_DEVICES] = {};

SEC("cgroup/dev")
int belayer_devices(struct bpf_cgroup_dev_ctx *ctx)
{
	__u32 type = ctx->access_type & 0xffff;
	__u32 access = ctx->access_type >> 16;

	if (type != DEVCG_DEV_CHAR)
		return 0;
	if (access == 0 || (access & ~(__u32)(DEVCG_ACC_READ | DEVCG_ACC_WRITE)))
		return 0;
	for (__u32 i = 0; i < MAX_DEVICES; i++) {
		if (i >= n_devices)
			break;
		if (devices[i].major != ctx->major)
			continue;
		if (devices[i].minor == ANY_MINOR || devices[i].minor == ctx->minor)
			return 1;
	}
	return 0;
}
