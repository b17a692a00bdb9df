//! Per-action dirtiness when a sandbox changes files without write(2), with BPF and with the
//! fallback (`belayerd --no-bpf`): stores through a shared file mapping (python3's `mmap`
//! module), a background process writing through a mapping made in an earlier step, io_uring
//! and Linux AIO writes, the 32-bit syscall entry, a core dump; and that reads (`cat`, `grep`,
//! a read-only mapping), checkpoints and restores stay clean. Where the sandbox's seccomp
//! filter refuses io_uring or 32-bit syscalls those cases are skipped (printed); the BPF
//! side of them is tested in `ebpf/tests/tracer.rs`.
//!
//! The io_uring/AIO/int 0x80 probe (`ebpf/tests/probes/dirty.c`) is built at test time with the
//! host's `cc -static -no-pie` and placed into a copy of the busybox image.

use std::path::Path;
use std::process::Command;

use belayer_tests::{busybox_rootfs, python_rootfs, Daemon};

fn daemon(bpf: bool) -> Daemon {
    if bpf {
        Daemon::start()
    } else {
        Daemon::start_no_bpf()
    }
}

/// Runs `cmd`, asserts it succeeded without an infrastructure fault, returns its dirtiness.
fn dirty(d: &Daemon, id: &str, cmd: &str) -> bool {
    let r = d.exec(id, cmd);
    assert_eq!(
        r.exit_code,
        0,
        "{cmd}: {r:?}\n{}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(r.infra_fault, None, "{cmd}");
    r.dirty
        .unwrap_or_else(|| panic!("{cmd}: dirtiness unknown"))
}

/// Runs `true` until a step is clean again (a stopped writer may still hold its mapping at
/// the end of the step that stopped it, which makes the next one dirty too).
fn settles(d: &Daemon, id: &str) {
    for _ in 0..4 {
        if !dirty(d, id, "true") {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!(
        "steps stay dirty after the writer stopped\n{}",
        d.log_text()
    );
}

const PY_WRITE: &str = "python3 -B -c 'import mmap\nf = open(\"/data\", \"r+b\")\n\
     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)\nm[0:5] = b\"hello\"\nm.close()'";
const PY_READ: &str = "python3 -B -c 'import mmap\nf = open(\"/data\", \"rb\")\n\
     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)\n\
     print(m[0:5])'";
/// A background process that maps /data shared and stores a growing count into its last 16
/// bytes every 20 ms, forever.
const PY_HOLDER: &str = "python3 -B -c 'import mmap, time\nf = open(\"/data\", \"r+b\")\n\
     m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED)\ni = 0\n\
     while True:\n    i += 1\n    m[4080:4096] = b\"%16d\" % i\n    time.sleep(0.02)' \
     > /dev/null 2>&1 & echo $! > /holder.pid";

fn mappings(bpf: bool) {
    let d = daemon(bpf);
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    assert!(!dirty(&d, &id, "cat /etc/passwd > /dev/null"), "first read");
    assert!(dirty(
        &d,
        &id,
        "head -c 4096 /dev/zero | tr '\\0' x > /data"
    ));
    for clean in ["cat /data > /dev/null", "grep -c x /data", PY_READ] {
        assert!(!dirty(&d, &id, clean), "{clean} should be clean");
    }
    assert!(dirty(&d, &id, PY_WRITE), "a MAP_SHARED store is dirty");
    assert_eq!(d.sh(&id, "head -c 5 /data"), "hello");
    assert!(!dirty(&d, &id, PY_READ));

    // A writer started in one step changes /data in the next ones through its mapping only.
    assert!(dirty(&d, &id, PY_HOLDER));
    let count = || -> u64 {
        let text = d.sh(&id, "tail -c 16 /data");
        text.trim().parse().unwrap_or(0)
    };
    let first = count();
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert!(
        dirty(&d, &id, "sleep 0.1"),
        "a step in which only a mapping is written is dirty"
    );
    assert!(dirty(&d, &id, "cat /data > /dev/null"));
    assert!(count() > first, "the holder writes");
    assert!(dirty(&d, &id, "kill $(cat /holder.pid)"));
    settles(&d, &id);
    assert!(!dirty(&d, &id, "cat /data > /dev/null"));
}

#[test]
fn shared_mappings_are_dirty_bpf() {
    mappings(true);
}

#[test]
fn shared_mappings_are_dirty_fallback() {
    mappings(false);
}

/// A copy of the busybox image with the probe at `/probe`; imported as `bbx`.
fn probe_image(d: &Daemon) {
    let dir = tempfile::tempdir().unwrap();
    let rootfs = dir.path().join("rootfs");
    let status = Command::new("cp")
        .arg("-a")
        .arg(busybox_rootfs())
        .arg(&rootfs)
        .status()
        .unwrap();
    assert!(status.success(), "copying the busybox rootfs");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ebpf/tests/probes/dirty.c");
    let status = Command::new("cc")
        .args(["-static", "-no-pie", "-O1", "-o"])
        .arg(rootfs.join("probe"))
        .arg(&src)
        .status()
        .expect("cc (build-essential, installed by scripts/setup.sh)");
    assert!(status.success(), "cc {} failed", src.display());
    d.image("bbx", &rootfs);
}

/// Runs a probe step that the kernel or the sandbox's seccomp filter may refuse (exit code 2:
/// the call failed with EPERM/ENOSYS; 128 + SIGSYS: the filter killed the probe, as it does
/// for 32-bit syscalls); its dirtiness, `None` when refused.
fn probe_step(d: &Daemon, id: &str, cmd: &str) -> Option<bool> {
    let r = d.exec(id, cmd);
    if r.exit_code == 2 || r.exit_code == 128 + libc::SIGSYS {
        eprintln!(
            "{cmd}: refused here ({}): skipped",
            String::from_utf8_lossy(&r.stderr).trim()
        );
        return None;
    }
    assert_eq!(
        r.exit_code,
        0,
        "{cmd}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(r.infra_fault, None, "{cmd}");
    Some(r.dirty.expect("dirtiness known"))
}

fn other_paths(bpf: bool) {
    let d = daemon(bpf);
    probe_image(&d);
    let id = d.create("bbx").id;
    assert!(dirty(
        &d,
        &id,
        "head -c 4096 /dev/zero > /data && mkdir /cores"
    ));
    for clean in [
        "/probe mmap-read /data > /dev/null",
        "/probe mprotect-anon",
        "cat /data > /dev/null",
    ] {
        assert!(!dirty(&d, &id, clean), "{clean} should be clean");
    }
    for changing in [
        "/probe mmap-write /data",
        "/probe mprotect-write /data",
        "/probe uring-write /data",
        "/probe aio-write /data",
        "/probe int80-write /data",
        "/probe bind-unix /sock",
    ] {
        if let Some(dirty) = probe_step(&d, &id, changing) {
            assert!(dirty, "{changing} should be dirty");
        }
        assert!(!dirty(&d, &id, "cat /data > /dev/null"));
    }

    // A process holding an io_uring may write without syscalls: every step is dirty while it
    // lives.
    let hold = "/probe uring-hold > /dev/null 2>&1 & p=$!; sleep 0.2; \
                kill -0 $p 2>/dev/null || exit 2; echo $p > /uring.pid";
    if probe_step(&d, &id, hold).is_some() {
        assert!(dirty(&d, &id, "true"), "an io_uring is held");
        assert!(dirty(&d, &id, "kill $(cat /uring.pid)"));
        settles(&d, &id);
    }

    // A core dump is written by the kernel into the working directory.
    let r = d.exec(
        &id,
        "cd /cores && ulimit -c unlimited && sh -c 'kill -SEGV $$'; ls /cores",
    );
    if String::from_utf8_lossy(&r.stdout).contains("core") {
        assert_eq!(r.dirty, Some(true), "a core dump is dirty: {r:?}");
    } else {
        eprintln!("no core file written here (core_pattern or limits): core dump case skipped");
    }
}

#[test]
fn other_write_paths_are_dirty_bpf() {
    other_paths(true);
}

#[test]
fn other_write_paths_are_dirty_fallback() {
    other_paths(false);
}

/// A checkpoint (CRIU's parasite runs inside the sandbox's tasks and logs to a host file)
/// does not make the next read-only step dirty; with `restore`, neither does a restore.
fn checkpoint_restore(bpf: bool, restore: bool) {
    let d = daemon(bpf);
    d.image("bb", &busybox_rootfs());
    let id = d.create("bb").id;
    assert!(dirty(&d, &id, "echo a > /a; sleep 300 > /dev/null 2>&1 &"));
    // Until it sleeps, the background process runs: a step meanwhile would be dirty.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!dirty(&d, &id, "cat /a"));
    d.checkpoint(&id, 2, b"k2");
    assert!(!dirty(&d, &id, "cat /a"), "after a checkpoint");
    if restore {
        d.restore(&id);
        assert!(!dirty(&d, &id, "cat /a"), "after a restore");
    }
    assert!(dirty(&d, &id, "echo b >> /a"));
}

#[test]
fn checkpoints_leave_steps_clean_bpf() {
    checkpoint_restore(true, false);
}

#[test]
fn checkpoints_leave_steps_clean_fallback() {
    checkpoint_restore(false, false);
}

#[test]
fn restores_leave_steps_clean_bpf() {
    checkpoint_restore(true, true);
}

#[test]
fn restores_leave_steps_clean_fallback() {
    checkpoint_restore(false, true);
}

/// Changes held by another process that need not run while the action runs: a line into a
/// FIFO whose holder sleeps on something else, a connection queued with a listener that
/// sleeps, a SysV message (BPF only: the fallback has no syscall counter); and a process whose
/// main thread exited while a thread of it lives on (both kinds).
fn held_elsewhere(bpf: bool) {
    let d = daemon(bpf);
    d.image("py", &python_rootfs());
    let id = d.create("py").id;
    let holder = "mkfifo /q; (exec 3<>/q; exec sleep 100000) </dev/null >/dev/null 2>&1 &";
    assert!(dirty(&d, &id, holder));
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!dirty(&d, &id, "true"), "the holder sleeps");
    let listener = "python3 -B -c 'import socket, time\ns = socket.socket()\n\
                    s.bind((\"127.0.0.1\", 7000))\ns.listen()\ntime.sleep(100000)' \
                    </dev/null >/dev/null 2>&1 &";
    assert!(dirty(&d, &id, listener));
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!dirty(&d, &id, "true"), "the listener sleeps");
    if bpf {
        assert!(dirty(&d, &id, "echo put > /q"), "a line into the held FIFO");
        let connect = "python3 -B -c 'import socket\n\
                       socket.create_connection((\"127.0.0.1\", 7000)).sendall(b\"x\")'";
        assert!(
            dirty(&d, &id, connect),
            "a connection to the sleeping listener"
        );
        let msg = "python3 -B -c 'import ctypes\nlibc = ctypes.CDLL(None)\n\
                   print(libc.msgget(0, 0o1600))'";
        assert!(dirty(&d, &id, msg), "a SysV message queue");
        assert!(dirty(&d, &id, "echo again > /q"));
        assert!(
            dirty(&d, &id, "head -c 6 /q > /dev/null"),
            "a line taken out of the held FIFO"
        );
        let nonblocking = "python3 -B -c 'import socket\ns = socket.socket()\n\
                           s.setblocking(False)\ns.connect_ex((\"127.0.0.1\", 7000))'";
        assert!(dirty(&d, &id, nonblocking), "a non-blocking connection");
    }
    // Sockets only the action's own processes or the kernel hold stay clean: asyncio's
    // self-pipe (a socketpair), a netlink query.
    for clean in [
        "python3 -B -c 'import asyncio\nasyncio.run(asyncio.to_thread(print, 1))' > /dev/null",
        "python3 -B -c 'import socket\nsocket.if_nameindex()'",
    ] {
        assert!(!dirty(&d, &id, clean), "{clean} should be clean");
    }
    // The main thread exits (the process shows as a zombie), a thread serves on.
    let half = "python3 -B -c 'import threading, time, ctypes\n\
                threading.Thread(target=time.sleep, args=(100000,)).start()\n\
                ctypes.CDLL(None).syscall(60, 0)' </dev/null >/dev/null 2>&1 & \
                echo $! > /half.pid";
    assert!(dirty(&d, &id, half), "a process whose main thread exited");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(!dirty(&d, &id, "true"));
    assert!(
        dirty(&d, &id, "kill -9 $(cat /half.pid)"),
        "its end, once its last thread is killed"
    );
}

#[test]
fn state_held_by_other_processes_is_dirty_bpf() {
    held_elsewhere(true);
}

#[test]
fn state_held_by_other_processes_is_dirty_fallback() {
    held_elsewhere(false);
}
