//! The sandbox seccomp filter against the real kernel and the host's real programs (as root, with
//! every capability, so a refusal can only come from the filter).
//!
//! Probes fork: the child leaves the test's session, installs the filter, makes one raw syscall
//! and reports its return value and errno through a pipe. Between `fork` and `_exit` the child
//! only makes syscalls (the test binary is multi-threaded; `SandboxFilter::install` allocates
//! nothing), and every probe runs in its own child, so a call that got through changes nothing
//! for the next one. Probe arguments are all-ones (`-1`): pointers fault, descriptors are bad,
//! flags are invalid, so even an unfiltered call does nothing. Programs run under the filter
//! through `Command::pre_exec`, i.e. between fork and exec, as the helpers will.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use belayer_daemon::helper::seccomp::{profile, SandboxFilter};

/// Arguments that make every refused syscall harmless should the filter let it through.
const HARMLESS: [u64; 6] = [u64::MAX; 6];

fn filter() -> SandboxFilter {
    SandboxFilter::build().expect("build the sandbox filter")
}

/// The return value and errno of one raw syscall in a probe child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    ret: i64,
    errno: i32,
}

impl Outcome {
    fn refused_with(&self, errno: i32) -> bool {
        self.ret == -1 && self.errno == errno
    }
}

/// Runs `syscall(nr, args...)` in a forked child, under `filter` when given.
fn probe(filter: Option<&SandboxFilter>, nr: i64, args: [u64; 6]) -> Outcome {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array it is given.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let [rd, wr] = fds;
    // SAFETY: the child only makes syscalls (setsid, the two install syscalls, the probe, write,
    // _exit) and touches no lock or allocator, which is what POSIX allows after fork in a
    // multi-threaded process.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: see above; `report` lives on this stack, `wr` is the pipe's write end.
        unsafe {
            libc::setsid();
            let mut report = [0u8; 12];
            let installed = filter.map_or(Ok(()), |f| f.install());
            match installed {
                Ok(()) => {
                    let ret =
                        libc::syscall(nr, args[0], args[1], args[2], args[3], args[4], args[5]);
                    let errno = *libc::__errno_location();
                    report[..8].copy_from_slice(&ret.to_ne_bytes());
                    report[8..].copy_from_slice(&errno.to_ne_bytes());
                }
                Err(e) => {
                    // ret -2 marks a failed install; errno says why.
                    report[..8].copy_from_slice(&(-2i64).to_ne_bytes());
                    report[8..].copy_from_slice(&e.raw_os_error().unwrap_or(0).to_ne_bytes());
                }
            }
            libc::write(wr, report.as_ptr().cast(), report.len());
            libc::_exit(0);
        }
    }
    // SAFETY: `wr` is ours and closed once; `rd` is wrapped once and owned by the File.
    let mut reader = unsafe {
        libc::close(wr);
        <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(rd)
    };
    let mut report = [0u8; 12];
    reader.read_exact(&mut report).expect("probe report");
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let ret = i64::from_ne_bytes(report[..8].try_into().unwrap());
    let errno = i32::from_ne_bytes(report[8..].try_into().unwrap());
    assert_ne!(
        ret, -2,
        "installing the filter failed in the probe child: errno {errno}"
    );
    Outcome { ret, errno }
}

fn args(first: &[u64]) -> [u64; 6] {
    let mut a = [0; 6];
    a[..first.len()].copy_from_slice(first);
    a
}

#[test]
fn refused_syscalls_fail_with_eperm() {
    let f = filter();
    let mut wrong = Vec::new();
    for r in profile::REFUSED.iter().chain(profile::REFUSED_ARCH) {
        let got = probe(Some(&f), r.syscall.nr, HARMLESS);
        if !got.refused_with(libc::EPERM) {
            wrong.push(format!("{}: {got:?}", r.syscall.name()));
        }
    }
    assert!(wrong.is_empty(), "not refused with EPERM: {wrong:?}");
}

#[test]
fn refusals_come_from_the_filter_not_the_kernel() {
    // Unfiltered, the same probes fail differently (or succeed): EPERM above is the filter's.
    for nr in [
        libc::SYS_keyctl,
        libc::SYS_unshare,
        libc::SYS_mount,
        libc::SYS_bpf,
        libc::SYS_io_uring_setup,
        libc::SYS_userfaultfd,
        libc::SYS_open_tree,
    ] {
        let got = probe(None, nr, HARMLESS);
        assert!(
            !got.refused_with(libc::EPERM),
            "syscall {nr} unfiltered: {got:?}"
        );
    }
    let got = probe(None, libc::SYS_clone3, args(&[0, 0]));
    assert!(got.refused_with(libc::EINVAL), "clone3 unfiltered: {got:?}");
}

#[test]
fn clone3_fails_with_enosys() {
    let got = probe(Some(&filter()), libc::SYS_clone3, args(&[0, 0]));
    assert!(got.refused_with(libc::ENOSYS), "{got:?}");
}

#[test]
fn clone_is_refused_with_any_namespace_flag() {
    let f = filter();
    // CLONE_THREAD without CLONE_SIGHAND: the kernel itself rejects it (EINVAL) before creating
    // anything, so the probe can never fork; EPERM can only be the filter's answer.
    let thread = libc::CLONE_THREAD as u64;
    for flag in [
        libc::CLONE_NEWNS,
        libc::CLONE_NEWCGROUP,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        libc::CLONE_NEWTIME,
    ] {
        let flags = flag as u64 | thread;
        let got = probe(Some(&f), libc::SYS_clone, args(&[flags]));
        assert!(got.refused_with(libc::EPERM), "clone({flags:#x}): {got:?}");
        let control = probe(None, libc::SYS_clone, args(&[flags]));
        assert!(
            control.refused_with(libc::EINVAL),
            "unfiltered {flags:#x}: {control:?}"
        );
    }
    // Without namespace flags the call gets through to the kernel (and its EINVAL).
    let got = probe(Some(&f), libc::SYS_clone, args(&[thread]));
    assert!(
        got.refused_with(libc::EINVAL),
        "clone(CLONE_THREAD): {got:?}"
    );
}

#[test]
fn personality_takes_only_dockers_values() {
    let f = filter();
    for &p in profile::PERSONALITIES {
        let got = probe(Some(&f), libc::SYS_personality, args(&[u64::from(p)]));
        assert!(got.ret >= 0, "personality({p:#x}): {got:?}");
    }
    for p in [
        0x0040000u64, /* ADDR_NO_RANDOMIZE */
        0x0400000,    /* READ_IMPLIES_EXEC */
    ] {
        let got = probe(Some(&f), libc::SYS_personality, args(&[p]));
        assert!(
            got.refused_with(libc::EPERM),
            "personality({p:#x}): {got:?}"
        );
    }
}

#[test]
fn socket_families_other_than_unix_inet_netlink_are_refused() {
    let f = filter();
    for family in 0..64 {
        let got = probe(
            Some(&f),
            libc::SYS_socket,
            args(&[family, libc::SOCK_DGRAM as u64, 0]),
        );
        if profile::SOCKET_FAMILIES.contains(&(family as i32)) {
            assert!(!got.refused_with(libc::EPERM), "family {family}: {got:?}");
        } else {
            assert!(got.refused_with(libc::EPERM), "family {family}: {got:?}");
        }
    }
    // The families the threat model names, with the socket types they use.
    for (family, ty) in [
        (libc::AF_PACKET, libc::SOCK_RAW),
        (libc::AF_VSOCK, libc::SOCK_STREAM),
        (libc::AF_ALG, libc::SOCK_SEQPACKET),
    ] {
        let got = probe(
            Some(&f),
            libc::SYS_socket,
            args(&[family as u64, ty as u64]),
        );
        assert!(got.refused_with(libc::EPERM), "family {family}: {got:?}");
    }
    let got = probe(
        Some(&f),
        libc::SYS_socket,
        args(&[libc::AF_INET as u64, libc::SOCK_STREAM as u64]),
    );
    assert!(got.ret >= 0, "AF_INET stream: {got:?}");
    // Netlink: routing, socket diagnostics and audit only; never the host's device events.
    for (protocol, allowed) in [
        (libc::NETLINK_ROUTE, true),
        (libc::NETLINK_SOCK_DIAG, true),
        (libc::NETLINK_AUDIT, true),
        (libc::NETLINK_KOBJECT_UEVENT, false),
        (libc::NETLINK_GENERIC, false),
        (libc::NETLINK_NETFILTER, false),
    ] {
        let got = probe(
            Some(&f),
            libc::SYS_socket,
            args(&[
                libc::AF_NETLINK as u64,
                libc::SOCK_RAW as u64,
                protocol as u64,
            ]),
        );
        assert_eq!(
            !got.refused_with(libc::EPERM),
            allowed,
            "netlink protocol {protocol}: {got:?}"
        );
    }
}

#[test]
fn socketpair_is_unix_only() {
    let f = filter();
    let pair: &'static mut [i32; 2] = Box::leak(Box::new([0; 2]));
    let sv = pair.as_mut_ptr() as u64;
    let stream = libc::SOCK_STREAM as u64;
    let unix = probe(Some(&f), libc::SYS_socketpair, args(&[1, stream, 0, sv]));
    assert_eq!(unix.ret, 0, "socketpair(AF_UNIX): {unix:?}");
    let inet = libc::AF_INET as u64;
    let got = probe(Some(&f), libc::SYS_socketpair, args(&[inet, stream, 0, sv]));
    assert!(
        got.refused_with(libc::EPERM),
        "socketpair(AF_INET): {got:?}"
    );
    let control = probe(None, libc::SYS_socketpair, args(&[inet, stream, 0, sv]));
    assert!(
        control.refused_with(libc::EOPNOTSUPP),
        "unfiltered: {control:?}"
    );
}

/// Runs `program args` with the filter installed between fork and exec; `private_mounts` first
/// moves the child into a private mount namespace, so that a mount the filter failed to stop
/// could not reach the host.
fn run_filtered(program: &str, args: &[&str], private_mounts: bool) -> Output {
    let f = filter();
    let mut cmd = Command::new(program);
    cmd.args(args).stdin(Stdio::null());
    // SAFETY: the hook only makes syscalls (unshare, mount, close_range and the two install
    // calls) and allocates nothing, so it is sound between fork and exec of this
    // multi-threaded test process.
    unsafe {
        cmd.pre_exec(move || {
            if private_mounts {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let flags = libc::MS_REC | libc::MS_PRIVATE;
                let root = c"/".as_ptr();
                if libc::mount(
                    std::ptr::null(),
                    root,
                    std::ptr::null(),
                    flags,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
            }
            f.install()
                .map_err(|e| std::io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)))
        })
    };
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {program} under the filter: {e}"))
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_ok(what: &str, out: &Output) {
    assert!(
        out.status.success(),
        "{what} failed under the filter: {:?}\nstdout: {}\nstderr: {}",
        out.status,
        stdout(out),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The first of `candidates` that exists, or a printed skip.
fn tool(candidates: &[&str]) -> Option<String> {
    let found = candidates.iter().find(|p| Path::new(p).exists());
    if found.is_none() {
        eprintln!("skipped: none of {candidates:?} on this host");
    }
    found.map(|p| p.to_string())
}

#[test]
fn proc_status_shows_filter_and_no_new_privs() {
    let out = run_filtered("/bin/cat", &["/proc/self/status"], false);
    assert_ok("cat /proc/self/status", &out);
    let status = stdout(&out);
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_default()
    };
    assert_eq!(field("Seccomp:"), "2", "{status}");
    assert_eq!(field("NoNewPrivs:"), "1", "{status}");
    // One program: the allow-list with `clone3`'s ENOSYS rule in it.
    assert_eq!(field("Seccomp_filters:"), "1", "{status}");
}

#[test]
fn shell_pipes_and_background_jobs_work() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
        set -e
        a=$(echo abc | tr a-c x-z | cat)
        [ "$a" = xyz ]
        (sleep 0.05; echo background > "$1/bg") &
        wait
        read line < "$1/bg"
        echo "$a $line $((6 * 7))" | sort | cat
    "#;
    let dir_arg = dir.path().to_str().unwrap();
    let out = run_filtered("/bin/sh", &["-c", script, "sh", dir_arg], false);
    assert_ok("sh", &out);
    assert_eq!(stdout(&out), "xyz background 42\n");
}

const PYTHON_WORKLOAD: &str = r#"
import mmap, multiprocessing, os, socket, subprocess, tempfile, threading
out = []
lock = threading.Lock()
def work(i):
    with lock:
        out.append(i * i)
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert sorted(out) == [i * i for i in range(8)], out
sub = subprocess.run(["/bin/sh", "-c", "echo sub"], capture_output=True, text=True, check=True)
assert sub.stdout == "sub\n", sub
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind(("127.0.0.1", 0)); srv.listen(1)
cli = socket.create_connection(srv.getsockname()); conn, _ = srv.accept()
cli.sendall(b"ping"); assert conn.recv(4) == b"ping"
a, b = socket.socketpair(socket.AF_UNIX); a.sendall(b"x"); assert b.recv(1) == b"x"
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); server.bind(path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); client.sendto(b"dgram", path)
    assert server.recv(5) == b"dgram"
    name = os.path.join(d, "mapped")
    with open(name, "wb") as fh: fh.write(b"\0" * 4096)
    with open(name, "r+b") as fh:
        m = mmap.mmap(fh.fileno(), 4096); m[:5] = b"hello"; m.flush(); m.close()
    with open(name, "rb") as fh: assert fh.read(5) == b"hello"
anon = mmap.mmap(-1, 1 << 20); anon[:3] = b"abc"; assert anon[:3] == b"abc"
with multiprocessing.get_context("fork").Pool(2) as pool:
    assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    raise SystemExit("AF_PACKET socket allowed")
except PermissionError:
    pass
print("ok")
"#;

#[test]
fn python_threads_subprocess_sockets_mmap_work() {
    let Some(python) = tool(&["/usr/bin/python3"]) else {
        return;
    };
    let out = run_filtered(&python, &["-c", PYTHON_WORKLOAD], false);
    assert_ok("python3", &out);
    assert_eq!(stdout(&out), "ok\n");
}

#[test]
fn tar_with_gzip_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
        set -e
        cd "$1"
        mkdir -p src/sub dst
        echo hello > src/sub/file; ln -s sub/file src/link; mkfifo src/fifo
        chmod 0640 src/sub/file
        tar -C src -czf a.tar.gz .
        tar -C dst -xzpf a.tar.gz
        cmp src/sub/file dst/sub/file
        [ "$(readlink dst/link)" = sub/file ] && [ -p dst/fifo ]
        stat -c %a dst/sub/file
    "#;
    let dir_arg = dir.path().to_str().unwrap();
    let out = run_filtered("/bin/sh", &["-c", script, "sh", dir_arg], false);
    assert_ok("tar", &out);
    assert_eq!(stdout(&out), "640\n");
}

#[test]
fn git_runs() {
    let dir = tempfile::tempdir().unwrap();
    let script = r#"
        set -e
        command -v git >/dev/null || { echo skipped; exit 0; }
        git --version >/dev/null
        cd "$1" && git init -q repo && cd repo
        echo x > f && git add f
        git -c user.name=t -c user.email=t@e commit -qm first
        git log --format=%s
    "#;
    let dir_arg = dir.path().to_str().unwrap();
    let out = run_filtered("/bin/sh", &["-c", script, "sh", dir_arg], false);
    assert_ok("git", &out);
    let text = stdout(&out);
    if text == "skipped\n" {
        eprintln!("skipped: no git on this host");
        return;
    }
    assert_eq!(text, "first\n");
}

#[test]
fn pip_gcc_node_strace_apt_run() {
    if let Some(pip) = tool(&["/usr/bin/pip3"]) {
        let out = run_filtered(&pip, &["--version"], false);
        assert_ok("pip3 --version", &out);
        assert!(stdout(&out).starts_with("pip "), "{}", stdout(&out));
    }
    if let Some(gcc) = tool(&["/usr/bin/gcc"]) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("hello.c");
        std::fs::write(
            &src,
            "#include <stdio.h>\nint main(void){puts(\"hi\");return 0;}\n",
        )
        .unwrap();
        let exe = dir.path().join("hello");
        let (src, exe) = (src.to_str().unwrap(), exe.to_str().unwrap());
        let out = run_filtered(&gcc, &["-O1", "-o", exe, src], false);
        assert_ok("gcc", &out);
        let out = run_filtered(exe, &[], false);
        assert_eq!(stdout(&out), "hi\n");
    }
    if let Some(node) = tool(&["/usr/bin/node"]) {
        let js = "const c=require('child_process');\
                  process.stdout.write(c.execSync('echo sub').toString());\
                  require('fs').readdirSync('/');";
        let out = run_filtered(&node, &["-e", js], false);
        assert_ok("node", &out);
        assert_eq!(stdout(&out), "sub\n");
    }
    if let Some(strace) = tool(&["/usr/bin/strace"]) {
        // ptrace, as Docker allows it: strace follows a fork and an exec.
        let out = run_filtered(
            &strace,
            &["-f", "-qq", "-e", "trace=execve", "/bin/true"],
            false,
        );
        assert_ok("strace", &out);
    }
    if let Some(apt) = tool(&["/usr/bin/apt-config"]) {
        let out = run_filtered(&apt, &["dump"], false);
        assert_ok("apt-config dump", &out);
    }
}

#[test]
fn unshare_and_mount_commands_fail() {
    let unshare = run_filtered("/usr/bin/unshare", &["-U", "/bin/true"], false);
    assert!(!unshare.status.success(), "unshare -U succeeded");
    let err = String::from_utf8_lossy(&unshare.stderr);
    assert!(err.contains("Operation not permitted"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().to_str().unwrap();
    let mount = run_filtered(
        "/bin/mount",
        &["-t", "tmpfs", "none", target],
        true, // private mount namespace: nothing could leak to the host
    );
    assert!(!mount.status.success(), "mount -t tmpfs succeeded");
    let err = String::from_utf8_lossy(&mount.stderr).to_lowercase();
    assert!(
        err.contains("permission denied") || err.contains("not permitted"),
        "{err}"
    );
}

#[test]
fn raw_calls_from_python_ctypes_fail() {
    let Some(python) = tool(&["/usr/bin/python3"]) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // name, syscall number, arguments (ints, or bytes passed as C strings)
    let calls = [
        ("keyctl", libc::SYS_keyctl, "0, -3, 1"), // KEYCTL_GET_KEYRING_ID(session, create)
        ("add_key", libc::SYS_add_key, "b'user', b'k', b'v', 1, -2"),
        ("request_key", libc::SYS_request_key, "b'user', b'k', 0, -2"),
        ("unshare", libc::SYS_unshare, "0x10000000"), // CLONE_NEWUSER
        ("mount", libc::SYS_mount, "b'none', TARGET, b'tmpfs', 0, 0"),
        ("bpf", libc::SYS_bpf, "0, 0, 0"),
        ("io_uring_setup", libc::SYS_io_uring_setup, "8, 0"),
        ("userfaultfd", libc::SYS_userfaultfd, "0"),
    ];
    let mut script = String::from(
        "import ctypes, sys\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         libc.syscall.restype = ctypes.c_long\n\
         TARGET = sys.argv[1].encode()\n\
         def call(nr, *args):\n\
         \x20   conv = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a)\n\
         \x20           for a in args]\n\
         \x20   ret = libc.syscall(ctypes.c_long(nr), *conv)\n\
         \x20   return ret, ctypes.get_errno()\n",
    );
    for (name, nr, args) in calls {
        script.push_str(&format!("print('{name}', *call({nr}, {args}))\n"));
    }
    let target = dir.path().to_str().unwrap();
    let out = run_filtered(&python, &["-c", &script, target], true);
    assert_ok("python3 ctypes", &out);
    let text = stdout(&out);
    for (name, _, _) in calls {
        assert!(
            text.lines()
                .any(|l| l == format!("{name} -1 {}", libc::EPERM)),
            "{name} not refused with EPERM:\n{text}"
        );
    }
}

/// How a forked child that installs the filter and runs `call` ended: `Some(signal)` when a
/// signal killed it, `None` when it returned from `call` and exited.
fn ends_by_signal(call: fn()) -> Option<i32> {
    let f = filter();
    // SAFETY: the child only makes syscalls (setsid, the install syscalls, `call`'s, _exit).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            libc::setsid();
            if f.install().is_err() {
                libc::_exit(2);
            }
            call();
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(
        libc::WIFSIGNALED(status) || libc::WEXITSTATUS(status) == 0,
        "probe child exited with {}",
        libc::WEXITSTATUS(status)
    );
    libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status))
}

#[cfg(target_arch = "x86_64")]
#[test]
fn syscalls_of_other_abis_kill_the_process() {
    // The i386 ABI through `int 0x80` (getpid is 20 there) and the x32 ABI (getpid with bit 30
    // set): the filter's bad-architecture action kills the process, so no call of a table the
    // profile was not written for gets through.
    fn int80_getpid() {
        // SAFETY: getpid through the i386 entry point takes no arguments and touches no memory.
        unsafe {
            std::arch::asm!("int 0x80", inlateout("eax") 20 => _, options(nostack));
        }
    }
    fn x32_getpid() {
        // SAFETY: a raw getpid.
        unsafe {
            libc::syscall(libc::SYS_getpid | 0x4000_0000);
        }
    }
    fn native_getpid() {
        // SAFETY: a raw getpid.
        unsafe {
            libc::syscall(libc::SYS_getpid);
        }
    }
    assert_eq!(ends_by_signal(int80_getpid), Some(libc::SIGSYS));
    assert_eq!(ends_by_signal(x32_getpid), Some(libc::SIGSYS));
    assert_eq!(ends_by_signal(native_getpid), None);
    // A number past the table is simply refused.
    assert!(probe(Some(&filter()), 4000, HARMLESS).refused_with(libc::EPERM));
}
