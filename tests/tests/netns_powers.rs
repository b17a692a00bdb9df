//! Hostile checks on the network namespace of a default sandbox (private user namespace),
//! which that user namespace owns (so CRIU can repair TCP sockets at restore): no sandbox
//! process can use the owner's powers, neither one that lived through a restore nor a new
//! action after it. Each check asserts the refusal and that nothing changed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::Daemon;

/// `NS_GET_USERNS` (`linux/nsfs.h`).
const NS_GET_USERNS: libc::c_ulong = 0xb701;

/// Whether the network namespace of host pid `pid` is owned by `pid`'s user namespace.
fn netns_owned_by_own_userns(pid: i32) -> bool {
    let net = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    // SAFETY: NS_GET_USERNS takes no argument and returns a new fd that we own.
    let fd = unsafe { libc::ioctl(net.as_raw_fd(), NS_GET_USERNS as _) };
    assert!(
        fd >= 0,
        "NS_GET_USERNS: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd from the kernel.
    let owner = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let owner = owner.metadata().unwrap();
    let user = std::fs::metadata(format!("/proc/{pid}/ns/user")).unwrap();
    (owner.dev(), owner.ino()) == (user.dev(), user.ino())
}

fn init_pid(d: &Daemon, id: &str) -> i32 {
    d.inspect(id)
        .init_pid
        .expect("a running sandbox has an init")
}

/// What no sandbox process may do in its network namespace, checked by `run_checks(when)`:
/// add a link over rtnetlink, take `lo` down, set an iptables table
/// (`setsockopt(IPT_SO_SET_REPLACE)`), put a TCP socket in repair mode, open a raw IP or a
/// packet socket, write the namespace's sysctls, create a network or a user namespace; and it
/// holds neither `CAP_NET_ADMIN` nor `CAP_NET_RAW`, bounding set included. What the sandbox
/// keeps is checked too: `lo` up, low ports and ICMP echo sockets for root.
const CHECKS: &str = r#"
import ctypes, errno, fcntl, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
REFUSED = (errno.EPERM, errno.EACCES, errno.EROFS)

def refused(what, when, f, allowed=REFUSED):
    try:
        f()
    except OSError as e:
        print(f"{when}: {what}: refused, errno {e.errno}", flush=True)
        check(e.errno in allowed, f"{when}: {what}: errno {e.errno}")
        return
    check(False, f"{when}: {what}: allowed")

def pad(b):
    return b + b"\0" * ((4 - len(b) % 4) % 4)

def rtattr(kind, payload):
    return pad(struct.pack("HH", 4 + len(payload), kind) + payload)

def link_add():
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
    body = struct.pack("BBHiII", 0, 0, 0, 0, 0, 0)
    body += rtattr(3, b"evil0\0")                      # IFLA_IFNAME
    body += rtattr(18, rtattr(1, b"dummy\0"))          # IFLA_LINKINFO { IFLA_INFO_KIND }
    flags = 0x1 | 0x4 | 0x400 | 0x200                  # REQUEST | ACK | CREATE | EXCL
    s.send(struct.pack("IHHII", 16 + len(body), 16, flags, 1, 0) + body)  # RTM_NEWLINK
    resp = s.recv(4096)
    err = struct.unpack("i", resp[16:20])[0]
    if err != 0:
        raise OSError(-err, "RTM_NEWLINK")

def lo_down():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0))  # SIOCSIFFLAGS

def ipt_replace():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, 64, b"filter" + b"\0" * 1018)  # IPT_SO_SET_REPLACE

def tcp_repair():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_TCP, 19, 1)  # TCP_REPAIR

def write_sysctl(name, value):
    def f():
        with open(f"/proc/sys/net/ipv4/{name}", "w") as fh:
            fh.write(value)
    return f

def sysctl(name):
    with open(f"/proc/sys/net/ipv4/{name}") as fh:
        return fh.read().split()

def unshare(flag):
    def f():
        if libc.unshare(flag) != 0:
            e = ctypes.get_errno()
            raise OSError(e, "unshare")
    return f

def run_checks(when):
    port_start, ping = sysctl("ip_unprivileged_port_start"), sysctl("ping_group_range")
    refused("ip link add", when, link_add)
    check("evil0" not in [n for _, n in socket.if_nameindex()], f"{when}: evil0 exists")
    refused("lo down", when, lo_down)
    # ENOPROTOOPT: no ip_tables in the kernel to take the request at all.
    refused("IPT_SO_SET_REPLACE", when, ipt_replace, REFUSED + (errno.ENOPROTOOPT,))
    refused("TCP_REPAIR", when, tcp_repair)
    refused("raw IP socket", when, lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
    refused("packet socket", when, lambda: socket.socket(17, socket.SOCK_RAW, 0),
            REFUSED + (errno.EAFNOSUPPORT,))
    refused("write ip_unprivileged_port_start", when, write_sysctl("ip_unprivileged_port_start", "1024"))
    refused("write ping_group_range", when, write_sysctl("ping_group_range", "1 0"))
    check(sysctl("ip_unprivileged_port_start") == port_start == ["0"], f"{when}: port start {port_start}")
    check(sysctl("ping_group_range") == ping and ping[0] == "0", f"{when}: ping range {ping}")
    refused("unshare(CLONE_NEWNET)", when, unshare(0x40000000))
    refused("unshare(CLONE_NEWUSER)", when, unshare(0x10000000))
    caps = {l.split(":")[0]: int(l.split()[1], 16) for l in open("/proc/self/status") if l.startswith("Cap")}
    for name in ("CapBnd", "CapEff", "CapPrm"):
        check(caps[name] & (1 << 12 | 1 << 13) == 0, f"{when}: {name} {caps[name]:x} has NET_ADMIN or NET_RAW")
    # What the sandbox keeps: lo up, a low port, ICMP echo sockets.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 80))
    srv.listen(1)
    c = socket.create_connection(("127.0.0.1", 80), timeout=5)
    c.close()
    srv.close()
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close()
"#;

/// State: a process that runs the checks, is checkpointed, killed and restored (its tree
/// rebuilt by CRIU in a network namespace CRIU made) and runs them again; then a new action
/// in the restored sandbox runs them too. The namespace is owned by the sandbox's user
/// namespace before and after the restore.
#[test]
fn network_namespace_powers_stay_refused_before_and_after_a_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    assert!(netns_owned_by_own_userns(init_pid(&d, &id)));
    let body = format!(
        "{CHECKS}\nrun_checks('before')\nready()\nwait_term()\nrun_checks('restored')\nfinish()\n"
    );
    let p = Probe::python(&d, &id, "netpowers", &body);
    p.checkpoint_kill_restore();
    assert!(netns_owned_by_own_userns(init_pid(&d, &id)));
    p.assert_pass();
    eprintln!("{}", p.log());
    let after = format!("{CHECKS}\nrun_checks('new action')\nready()\nwait_term()\nfinish()\n");
    let q = Probe::python(&d, &id, "netpowers-after", &after);
    q.assert_pass();
    eprintln!("{}", q.log());
}

/// The kernel's half of "cannot write the namespace's sysctls" (the sandbox's `/proc/sys` is
/// read-only besides): root of a user namespace that owns a network namespace, without
/// `CAP_NET_ADMIN`, is refused a write to that namespace's `net.ipv4` sysctls even through a
/// writable `/proc` (the host's). Run by a host `python3` (a test thread cannot `unshare` a
/// user namespace: the harness is multi-threaded); with capabilities the same write works.
#[test]
fn a_network_namespace_root_without_net_admin_cannot_write_its_sysctls() {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(SYSCTL_PERMISSION)
        .output()
        .expect("python3 on the host");
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(text.contains("with caps: wrote 7"), "{text}");
    assert_eq!(
        text.matches("without caps: refused, errno 13").count(),
        2,
        "{text}"
    );
}

const SYSCTL_PERMISSION: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
r, w = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(CLONE_NEWUSER) == 0
    os.write(w2, b"x"); os.read(r, 1)
    assert libc.setresgid(0, 0, 0) == 0 and libc.setresuid(0, 0, 0) == 0
    assert libc.unshare(CLONE_NEWNET) == 0
    port = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
    with open(port, "w") as f:
        f.write("7")
    print("with caps: wrote", open(port).read().strip(), flush=True)
    class H(ctypes.Structure): _fields_ = [("v", ctypes.c_uint32), ("p", ctypes.c_int)]
    class D(ctypes.Structure): _fields_ = [("e", ctypes.c_uint32), ("pm", ctypes.c_uint32), ("i", ctypes.c_uint32)]
    assert libc.capset(ctypes.byref(H(0x20080522, 0)), (D * 2)()) == 0
    for path, value in ((port, "9"), ("/proc/sys/net/ipv4/ping_group_range", "1 0")):
        try:
            with open(path, "w") as f:
                f.write(value)
            print("without caps: WROTE", path, flush=True)
        except OSError as e:
            print("without caps: refused, errno", e.errno, path, flush=True)
    os._exit(0)
os.read(r2, 1)
with open(f"/proc/{pid}/uid_map", "w") as f: f.write("0 1000000 65536")
with open(f"/proc/{pid}/setgroups", "w") as f: f.write("deny")
with open(f"/proc/{pid}/gid_map", "w") as f: f.write("0 1000000 65536")
os.write(w, b"x")
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"#;
