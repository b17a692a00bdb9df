//! Hostile probes from inside a sandbox against its confinement: a user namespace of its own,
//! runc's masked and read-only paths, a private cgroup namespace in every hierarchy, limits it
//! cannot raise, no host executable reachable, timeouts it cannot stop. Each test asserts the
//! safe outcome on the host side (values unchanged, canaries intact, daemon serving).

use std::time::{Duration, Instant};

use belayer_ipc::{ErrorCode, Request, Response, SandboxSpec, UsernsMode};
use belayer_tests::{bin, busybox_rootfs, python_rootfs, Daemon};

/// blake3 of a file's bytes.
fn digest(path: &std::path::Path) -> String {
    blake3::hash(&std::fs::read(path).unwrap())
        .to_hex()
        .to_string()
}

/// The first line of `uid_map` of a default sandbox: `[inside, outside, count]`.
fn uid_map(d: &Daemon, id: &str) -> [u32; 3] {
    d.inspect(id).userns.expect("userns info").uid_map[0]
}

#[test]
fn default_sandboxes_get_private_user_namespaces_of_their_own() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let a = d.create("busybox").id;
    let b = d.create("busybox").id;
    let (ma, mb) = (uid_map(&d, &a), uid_map(&d, &b));
    println!("uid maps: {a} {ma:?}, {b} {mb:?}");
    assert_eq!(d.inspect(&a).userns.unwrap().mode, "private");
    assert_eq!(ma[0], 0);
    assert!(ma[1] >= 65536 && ma[2] >= 65536, "identity-like map {ma:?}");
    let disjoint = ma[1] + ma[2] <= mb[1] || mb[1] + mb[2] <= ma[1];
    assert!(disjoint, "ranges overlap: {ma:?} {mb:?}");
    // Inside: root with the same map; files it makes belong to its range on the host.
    assert_eq!(d.sh(&a, "id -u; id -g"), "0\n0");
    let inside = d.sh(&a, "cat /proc/self/uid_map");
    let fields: Vec<u32> = inside
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(fields, ma.to_vec());
    d.sh(
        &a,
        "echo x > /root/made-inside; chown 7:7 /root/x 2>/dev/null; true",
    );
    let host_path = d.root(&a).join("root/made-inside");
    let meta = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&host_path).unwrap());
    assert_eq!(
        meta, ma[1],
        "a file of sandbox root is not owned by its host range"
    );
    // No new privileges: a setuid binary cannot raise anything.
    assert_eq!(d.sh(&a, "grep NoNewPrivs /proc/self/status | cut -f2"), "1");
    // The map survives a checkpoint, a fail-stop and a restore.
    d.checkpoint(&a, 1, b"k1");
    d.fail_stop(&a);
    d.restore(&a);
    assert_eq!(uid_map(&d, &a), ma);
    assert_eq!(d.sh(&a, "cat /root/made-inside; id -u"), "x\n0");
    // A removed sandbox's range goes back to the pool.
    d.call(Request::RemoveSandbox { id: a.clone() });
    let c = d.create("busybox").id;
    assert_eq!(uid_map(&d, &c), ma);
}

#[test]
fn host_user_namespace_is_an_explicit_opt_in() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            userns: Some(UsernsMode::Host),
            ..Default::default()
        })
        .id;
    let info = d.inspect(&id).userns.unwrap();
    assert_eq!(info.mode, "host");
    assert_eq!(info.uid_map, vec![[0, 0, u32::MAX]]);
    // Everything else still holds: capabilities, no_new_privs, masks.
    assert_eq!(
        d.sh(&id, "grep NoNewPrivs /proc/self/status | cut -f2"),
        "1"
    );
    assert_eq!(d.sh(&id, "wc -c < /proc/keys"), "0");
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    assert_eq!(d.inspect(&id).userns.unwrap().mode, "host");
}

#[test]
fn no_host_executable_is_reachable() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let binaries: Vec<_> = ["belayerd", "belayer", "belayer-helper"]
        .iter()
        .map(|b| (bin(b), digest(&bin(b))))
        .collect();
    // A watcher reads /proc/<pid>/exe of every process it can see while actions run: all it
    // may ever get are the sandbox's own binaries, never the helper (non-dumpable, and a
    // sealed memfd anyway) nor a host file.
    d.sh(
        &id,
        "(while :; do for p in /proc/[0-9]*; do l=$(readlink $p/exe 2>/dev/null) && echo \"$l\"; \
         cat $p/exe >/dev/null 2>&1 && echo \"read $l\"; done; done | sort -u > /tmp/seen) \
         </dev/null >/dev/null 2>&1 &",
    );
    for i in 0..30 {
        d.sh(&id, &format!("echo {i} > /tmp/n"));
    }
    let seen = d.sh(&id, "sleep 0.2; sort -u /tmp/seen");
    println!("exe links seen from inside:\n{seen}");
    assert!(
        !seen.contains("belayer"),
        "a helper's exe was visible: {seen}"
    );
    assert!(
        !seen.contains("memfd"),
        "a helper's memfd was readable: {seen}"
    );
    // The CVE-2019-5736 move: make /bin/sh a link to /proc/self/exe. The next action must not
    // run anything through it.
    d.sh(
        &id,
        "ln -sf /proc/self/exe /bin/sh.new && mv -f /bin/sh.new /bin/sh",
    );
    match d.call(Request::Exec(belayer_ipc::ExecRequest {
        id: id.clone(),
        argv: vec!["true".into()],
        ..Default::default()
    })) {
        Response::Error(e) => {
            println!("exec through a magic-link shell: {}", e.message);
            assert_eq!(e.code, ErrorCode::ExecFailed);
        }
        r => panic!("an action ran through /proc/self/exe: {r:?}"),
    }
    for (path, before) in &binaries {
        assert_eq!(&digest(path), before, "{} changed", path.display());
    }
    assert!(matches!(d.call(Request::Ping), Response::Pong { .. }));
}

/// `(path, contents)` of every file directly under each cgroup hierarchy root that a sandbox
/// could want to change, plus the list of each root's child cgroups.
fn host_cgroup_snapshot() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for h in [
        "cpu", "cpuset", "blkio", "devices", "pids", "memory", "systemd", "unified",
    ] {
        let root = std::path::Path::new("/sys/fs/cgroup").join(h);
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for n in &names {
            if [
                "cpu.shares",
                "cpu.cfs_quota_us",
                "cpuset.cpus",
                "cpuset.mems",
                "blkio.weight",
                "pids.max",
                "memory.limit_in_bytes",
            ]
            .contains(&n.as_str())
            {
                let v = std::fs::read_to_string(root.join(n)).unwrap_or_default();
                out.push((format!("{h}/{n}"), v));
            }
        }
        let dirs: Vec<&String> = names.iter().filter(|n| root.join(n).is_dir()).collect();
        out.push((format!("{h}/<dirs>"), format!("{dirs:?}")));
    }
    out
}

#[test]
fn nested_namespaces_cannot_reach_host_cgroups() {
    let d = Daemon::start();
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    let before = host_cgroup_snapshot();
    let init = d.inspect(&id).init_pid.unwrap();
    // The sandbox sits in a cgroup of its own in every hierarchy, seen from inside as "/".
    let membership = std::fs::read_to_string(format!("/proc/{init}/cgroup")).unwrap();
    for line in membership.lines() {
        assert!(
            line.ends_with(&format!("/{id}")),
            "sandbox init in a host cgroup: {line}"
        );
    }
    let inside = d.sh(&id, "cat /proc/self/cgroup");
    assert!(inside.lines().all(|l| l.ends_with(":/")), "{inside}");
    // The attack: a nested user + cgroup + mount namespace, mount the v1 hierarchies, raise
    // the limits, write the roots.
    let attack = "unshare -U -r -C -m sh -c '\
        for c in pids memory cpu,cpuacct cpuset blkio; do mkdir -p /tmp/$c; \
          mount -t cgroup -o $c none /tmp/$c && echo mounted $c; \
          echo max > /tmp/$c/pids.max; echo -1 > /tmp/$c/memory.limit_in_bytes; \
          echo 2 > /tmp/$c/cpu.shares; echo 0 > /tmp/$c/cpuset.cpus; mkdir /tmp/$c/evil; done' 2>&1; \
        mkdir -p /tmp/cg2 && mount -t cgroup2 none /tmp/cg2 2>&1; echo done";
    let out = d.exec(&id, attack);
    println!(
        "nested-namespace attack:\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(host_cgroup_snapshot(), before, "a host cgroup changed");
    let pids_max =
        std::fs::read_to_string(format!("/sys/fs/cgroup/pids/belayer/{id}/pids.max")).unwrap();
    assert_eq!(pids_max.trim(), "4096");
    assert!(matches!(d.call(Request::Ping), Response::Pong { .. }));
}

#[test]
fn kernel_interfaces_of_the_host_are_masked_or_read_only() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    for file in [
        "/proc/keys",
        "/proc/timer_list",
        "/proc/slabinfo",
        "/proc/vmallocinfo",
        "/proc/iomem",
        "/proc/config.gz",
        "/proc/kcore",
        "/proc/kallsyms",
    ] {
        let n = d.sh(&id, &format!("cat {file} 2>/dev/null | wc -c"));
        assert_eq!(n, "0", "{file} readable inside ({n} bytes)");
    }
    let irq = std::fs::read_to_string("/proc/irq/default_smp_affinity").unwrap();
    let r = d.exec(&id, "echo 1 > /proc/irq/default_smp_affinity");
    assert_ne!(r.exit_code, 0, "/proc/irq writable");
    assert_eq!(
        std::fs::read_to_string("/proc/irq/default_smp_affinity").unwrap(),
        irq
    );
    for write in [
        "echo 1 > /proc/sys/kernel/sysrq",
        "echo 1 > /proc/sys/vm/drop_caches",
        "umount /proc/keys",
        "umount -l /proc/sys",
    ] {
        assert_ne!(d.exec(&id, write).exit_code, 0, "{write} succeeded");
    }
    // The masks are the host's /dev/null bound read-only: the sandbox cannot touch its times.
    let host_null = std::fs::metadata("/dev/null").unwrap().modified().unwrap();
    let r = d.exec(&id, "touch /proc/kcore /proc/keys");
    assert_ne!(r.exit_code, 0, "touch of a mask succeeded");
    assert_eq!(
        std::fs::metadata("/dev/null").unwrap().modified().unwrap(),
        host_null
    );
    // The masks are part of what a checkpoint captures and a restore rebuilds.
    let mounts = d.sh(&id, "wc -l < /proc/self/mounts");
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    assert_eq!(d.sh(&id, "wc -l < /proc/self/mounts"), mounts);
    assert_eq!(d.sh(&id, "cat /proc/keys | wc -c"), "0");
    assert_ne!(d.exec(&id, "touch /proc/kcore /dev/null").exit_code, 0);
}

#[test]
fn devices_are_an_allow_list() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let list = std::fs::read_to_string(format!("/sys/fs/cgroup/devices/belayer/{id}/devices.list"));
    if let Ok(list) = list {
        println!("devices.list:\n{list}");
        assert!(!list.contains("a *:* rwm"), "every device allowed");
        assert!(list.contains("c 1:3 rw"));
        assert!(
            !list.lines().any(|l| l.starts_with('b')),
            "a block device allowed"
        );
    }
    assert_ne!(d.exec(&id, "mknod /tmp/sda b 8 0").exit_code, 0);
    assert_ne!(d.exec(&id, "mknod /tmp/mem c 1 1").exit_code, 0);
    assert_eq!(
        d.sh(&id, "echo ok > /dev/null && head -c 4 /dev/zero | wc -c"),
        "4"
    );
    // The device nodes are the host's inodes, bound read-only: usable, but their times,
    // modes and owners are not the sandbox's to change.
    for probe in [
        "touch /dev/null",
        "chmod 666 /dev/zero",
        "chown 5 /dev/urandom",
    ] {
        let r = d.exec(&id, probe);
        assert_ne!(r.exit_code, 0, "{probe} succeeded");
        assert!(
            String::from_utf8_lossy(&r.stderr).contains("Read-only file system"),
            "{probe}: {:?}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
    // The rest of /dev is the sandbox's own.
    assert_eq!(
        d.sh(
            &id,
            "mkdir -p /dev/shm/x && echo y > /dev/shm/x/f && cat /dev/shm/x/f"
        ),
        "y"
    );
}

#[test]
fn default_limits_apply_and_can_be_set() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let cg = |ctl: &str, file: &str| {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{ctl}/belayer/{id}/{file}"))
            .unwrap()
            .trim()
            .to_string()
    };
    assert_eq!(
        cg("memory", "memory.limit_in_bytes"),
        (8u64 << 30).to_string()
    );
    assert_eq!(cg("cpu", "cpu.cfs_quota_us"), "400000");
    assert_eq!(cg("pids", "pids.max"), "4096");
    let small = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            cpus: Some(0.5),
            memory_max: Some(64 << 20),
            ..Default::default()
        })
        .id;
    let quota = std::fs::read_to_string(format!(
        "/sys/fs/cgroup/cpu/belayer/{small}/cpu.cfs_quota_us"
    ))
    .unwrap();
    assert_eq!(quota.trim(), "50000");
    match d.call(Request::CreateSandbox(SandboxSpec {
        image: "busybox".into(),
        cpus: Some(f64::NAN),
        ..Default::default()
    })) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
        r => panic!("NaN cpus accepted: {r:?}"),
    }
}

#[test]
fn a_sandbox_that_stops_itself_cannot_stop_the_timeout() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    for cmd in [
        "kill -STOP $$; sleep 100",
        "sleep 100 & kill -STOP $! ; kill -STOP $$",
        // No cgroup file system is reachable from inside to freeze itself with.
        "for f in /sys/fs/cgroup/cgroup.freeze /sys/fs/cgroup/freezer.state; do echo 1 > $f; done; sleep 100",
    ] {
        let started = Instant::now();
        let r = d.call(Request::Exec(belayer_ipc::ExecRequest {
            id: id.clone(),
            argv: vec![cmd.into()],
            timeout_ms: Some(1500),
            ..Default::default()
        }));
        let took = started.elapsed();
        println!("{cmd:?}: {took:?}");
        match r {
            Response::Exec(r) => assert!(r.timed_out, "{cmd}: not timed out: {r:?}"),
            r => panic!("{cmd}: {r:?}"),
        }
        assert!(took < Duration::from_secs(6), "{cmd}: took {took:?}");
    }
    assert_eq!(d.sh(&id, "echo alive"), "alive");
}

/// Python run inside the sandbox: each refused call by name, with its errno, one per line.
const SYSCALL_PROBES: &str = r#"
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
def probe(name, nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    print(name, errno.errorcode.get(ctypes.get_errno(), 'ok') if r == -1 else 'ok')
buf = ctypes.create_string_buffer(256)
probe('keyctl', 250, 0, -3, 0)
probe('add_key', 248, 0, 0, 0, 0, -3)
probe('unshare', 272, 0x10000000)
probe('io_uring_setup', 425, 1, ctypes.addressof(buf))
probe('bpf', 321, 0, ctypes.addressof(buf), 64)
probe('perf_event_open', 298, ctypes.addressof(buf), 0, -1, -1, 0)
probe('userfaultfd', 323, 0)
probe('kexec_load', 246, 0, 0, 0, 0)
probe('open_by_handle_at', 304, -100, ctypes.addressof(buf), 0)
probe('mount', 165, 0, 0, 0, 0, 0)
try:
    socket.socket(17, socket.SOCK_RAW, 0)
    print('af_packet ok')
except OSError as e:
    print('af_packet', errno.errorcode[e.errno])
"#;

#[test]
fn seccomp_refuses_host_reaching_calls_before_and_after_a_restore() {
    let d = Daemon::start();
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    let check = |when: &str| {
        let status = d.sh(
            &id,
            "grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status /proc/1/status",
        );
        println!("{when}:\n{status}");
        assert_eq!(status.matches("Seccomp:\t2").count(), 2, "{status}");
        assert_eq!(status.matches("NoNewPrivs:\t1").count(), 2, "{status}");
        let out = d.sh(
            &id,
            &format!("python3 -c '{}'", SYSCALL_PROBES.replace('\'', "\"")),
        );
        println!("{out}");
        for line in out.lines() {
            assert!(line.ends_with(" EPERM"), "{when}: {line}");
        }
        assert_eq!(out.lines().count(), 11);
    };
    check("fresh sandbox");
    d.sh(&id, "sleep 1000 >/dev/null 2>&1 &");
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    check("after restore");
    // The restored background process keeps its filter too.
    let pid = d.sh(&id, "pidof sleep | cut -d' ' -f1");
    assert_eq!(
        d.sh(&id, &format!("grep Seccomp: /proc/{pid}/status")),
        "Seccomp:\t2"
    );
}

/// Runs `cmd` with a timeout of `timeout_ms` and returns the result and how long it took.
fn timed_exec(d: &Daemon, id: &str, cmd: &str, timeout_ms: u64) -> (Response, Duration) {
    let started = Instant::now();
    let r = d.call(Request::Exec(belayer_ipc::ExecRequest {
        id: id.into(),
        argv: vec![cmd.into()],
        timeout_ms: Some(timeout_ms),
        ..Default::default()
    }));
    (r, started.elapsed())
}

#[test]
fn a_fifo_planted_as_dev_null_wedges_no_action() {
    // The exec child opens the sandbox's /dev/null as the sandbox's root, before the timeout
    // ran: a fifo there used to block it (and the sandbox's verb lock) forever.
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "mv /dev /dev.old && mkdir /dev && mkfifo /dev/null && ls -l /dev/null",
    );
    for _ in 0..2 {
        let (r, took) = timed_exec(&d, &id, "cat; echo stdin-closed", 2000);
        println!("{took:?}: {r:?}");
        match r {
            Response::Exec(r) => {
                assert_eq!(String::from_utf8_lossy(&r.stdout), "stdin-closed\n");
                assert!(!r.timed_out);
            }
            r => panic!("action after a planted fifo: {r:?}"),
        }
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
    // A regular file or a link there is not the null device either; the sandbox can repair
    // its /dev and its checkpoints and restores still work.
    d.sh(&id, "rm /dev/null; ln -s /etc/passwd /dev/null");
    assert_eq!(d.sh(&id, "wc -c < /proc/self/fd/0"), "0");
    d.sh(&id, "rm -r /dev; mv /dev.old /dev");
    assert_eq!(d.sh(&id, "readlink /proc/self/fd/0"), "/dev/null");
    d.checkpoint(&id, 1, b"k1");
    d.restore(&id);
    assert_eq!(d.sh(&id, "echo alive"), "alive");
}

#[test]
fn stopping_the_action_before_it_executes_cannot_stop_the_timeout() {
    // Once the exec child is the sandbox's root it can be stopped by the sandbox before it
    // executes the action; the clock must run from the fork. A watcher stops every helper it
    // sees (a race it may or may not win): every action must still answer in time.
    let d = Daemon::start();
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    let watcher = r#"
import os, signal
while True:
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                if b"__belayer-helper" in open("/proc/%s/cmdline" % p, "rb").read():
                    os.kill(int(p), signal.SIGSTOP)
            except OSError:
                pass
"#;
    d.sh(
        &id,
        &format!(
            "echo '{}' > /w.py; nohup python3 /w.py >/dev/null 2>&1 &",
            watcher.replace('\'', "\"")
        ),
    );
    for i in 0..10 {
        let (r, took) = timed_exec(&d, &id, "true", 1500);
        println!("{i}: {took:?}: {r:?}");
        assert!(
            took < Duration::from_millis(1500) + Duration::from_secs(4),
            "took {took:?}"
        );
        match r {
            // Killed from inside the sandbox's cgroup, as any timed-out action: not an
            // infrastructure fault, the sandbox keeps running.
            Response::Exec(r) => assert!(
                r.infra_fault.is_none(),
                "{r:?}\n{}",
                d.log_text()
                    .lines()
                    .filter(|l| l.contains("fault") || l.contains("WARN"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ),
            r => panic!("{r:?}"),
        }
    }
    d.assert_alive("after stopped helpers");
}
