//! The tracer against the real kernel (root): a scratch cgroup v2 with shell processes in it.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use belayer_ebpf::{cgroup_id, Fault, Target, TraceEvent, Tracer, TracerKind};

/// The cgroup v2 mount: `/sys/fs/cgroup/unified` on hybrid hosts, else `/sys/fs/cgroup`.
fn v2_root() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (pre, post) = l.split_once(" - ")?;
        post.starts_with("cgroup2 ")
            .then(|| PathBuf::from(pre.split_whitespace().nth(4).unwrap_or("")))
    })
}

struct Scratch {
    dir: PathBuf,
    children: Vec<Child>,
}

impl Scratch {
    fn new(name: &str) -> Option<Scratch> {
        if !nix_root() {
            eprintln!("skipping: not root");
            return None;
        }
        let dir = v2_root()?.join(format!("belayer-ebpf-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        Some(Scratch {
            dir,
            children: Vec::new(),
        })
    }

    /// Starts `sh -c script` inside the cgroup.
    fn spawn(&mut self, script: &str) -> u32 {
        let child = self.command(script).spawn().expect("spawn");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Runs `sh -c script` inside the cgroup to its end; its exit code.
    fn run(&mut self, script: &str) -> i32 {
        let status = self.command(script).status().expect("run");
        status.code().unwrap_or(-1)
    }

    /// Runs `sh -c script` inside the cgroup under ptrace (as CRIU's parasite runs: in a
    /// seized task), resuming it at every stop; its exit code.
    fn run_traced(&mut self, script: &str) -> i32 {
        let mut cmd = self.command(script);
        // SAFETY: runs between fork and exec; ptrace(PTRACE_TRACEME) takes no pointers and is
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn traced");
        let pid = child.id() as libc::pid_t;
        let code = loop {
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid out-pointer.
            if unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
                break -1;
            }
            if libc::WIFEXITED(status) {
                break libc::WEXITSTATUS(status);
            }
            if libc::WIFSIGNALED(status) {
                break -1;
            }
            // A stop: exec traps (SIGTRAP) are swallowed, other signals passed on.
            let sig = libc::WSTOPSIG(status);
            let pass = if sig == libc::SIGTRAP { 0 } else { sig };
            // SAFETY: PTRACE_CONT of our stopped tracee; no memory involved.
            unsafe { libc::ptrace(libc::PTRACE_CONT, pid, 0, pass) };
        };
        // Already reaped by waitpid above (this returns ECHILD); keeps `child` accounted for.
        let _ = child.wait();
        code
    }

    fn command(&self, script: &str) -> Command {
        let procs = std::ffi::CString::new(
            self.dir
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .unwrap();
        let mut cmd = Command::new("/bin/sh");
        // Output to /dev/null: the test harness's stdout may be a regular file (a CI log), and
        // writes to it would count as file activity.
        cmd.arg("-c")
            .arg(script)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: the closure runs between fork and exec and only calls open, write and close
        // (async-signal-safe, no allocation) on a path prepared before the fork; "0" moves the
        // writing process itself.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
                Ok(())
            });
        }
        cmd
    }

    fn wait_all(&mut self) {
        for c in &mut self.children {
            let _ = c.wait();
        }
        self.children.clear();
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        self.wait_all();
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn nix_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn next(rx: &mpsc::Receiver<TraceEvent>, want: impl Fn(&Fault) -> bool) -> Option<TraceEvent> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(ev) if want(&ev.fault) => return Some(ev),
            Ok(_) => continue,
            Err(_) => return None,
        }
    }
    None
}

#[test]
fn bpf_counts_writes_and_sees_external_kills() {
    let Some(mut sc) = Scratch::new("bpf") else {
        return;
    };
    let (tx, rx) = mpsc::channel();
    let tracer = Tracer::builder()
        .on_event(move |ev| {
            let _ = tx.send(ev);
        })
        .start()
        .expect("tracer");
    assert_eq!(
        tracer.kind(),
        TracerKind::Bpf,
        "BPF should load here: {:?}",
        tracer.fallback_reason()
    );
    let id = cgroup_id(&sc.dir).unwrap();
    let init = sc.spawn("exec sleep 30");
    tracer
        .track(Target {
            cgroup_id: id,
            cgroup_dir: sc.dir.clone(),
            init_pid: init as i32,
            oom_events: None,
        })
        .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let file = scratch.path().join("f");

    // Read-only work and output to a pipe/null: no file activity.
    sc.spawn("cat /proc/self/status > /dev/null; ls / | grep -c bin; echo hi");
    std::thread::sleep(Duration::from_millis(300));
    let c0 = tracer.counters(id).unwrap();
    assert_eq!(c0.fs_writes, 0, "{c0:?}");
    assert!(c0.forks >= 2 && c0.exits >= 1, "{c0:?}");

    sc.spawn(&format!(
        "echo x > {f}; mkdir {f}.d; rm -r {f}.d",
        f = file.display()
    ));
    std::thread::sleep(Duration::from_millis(300));
    let c1 = tracer.counters(id).unwrap();
    assert!(c1.fs_writes >= 3, "{c1:?}");

    // A kill inside the cgroup is not external.
    sc.spawn("sleep 30 & kill -9 $!; wait");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(tracer.counters(id).unwrap().external_kills, 0);

    // A kill from here is, and the init's exit follows.
    let sent = Instant::now();
    // SAFETY: kill with a pid we started; no memory involved.
    unsafe { libc::kill(init as i32, libc::SIGKILL) };
    let ev = next(&rx, |f| matches!(f, Fault::ExternalKill { .. })).expect("external kill");
    assert_eq!(
        ev.fault,
        Fault::ExternalKill {
            pid: init as i32,
            signal: 9,
            sender_pid: Some(std::process::id() as i32)
        }
    );
    let exited = next(&rx, |f| matches!(f, Fault::InitExited { .. })).expect("init exit");
    assert_eq!(
        exited.fault,
        Fault::InitExited {
            pid: init as i32,
            exit_code: None,
            signal: Some(9)
        }
    );
    eprintln!(
        "kill -> event: {:.3} ms",
        ev.observed.duration_since(sent).as_secs_f64() * 1000.0
    );
    let c2 = tracer.counters(id).unwrap();
    assert_eq!((c2.external_kills, c2.last_kill_pid), (1, init));
    tracer.untrack(id);
    assert!(tracer.counters(id).is_none());
}

#[test]
fn fallback_sees_the_init_exit() {
    let Some(mut sc) = Scratch::new("fallback") else {
        return;
    };
    let (tx, rx) = mpsc::channel();
    let tracer = Tracer::builder()
        .force_fallback(true)
        .on_event(move |ev| {
            let _ = tx.send(ev);
        })
        .start()
        .unwrap();
    assert_eq!(tracer.kind(), TracerKind::Fallback);
    let id = cgroup_id(&sc.dir).unwrap();
    let init = sc.spawn("exec sleep 30");
    tracer
        .track(Target {
            cgroup_id: id,
            cgroup_dir: sc.dir.clone(),
            init_pid: init as i32,
            oom_events: None,
        })
        .unwrap();
    assert!(tracer.counters(id).is_none());
    let sent = Instant::now();
    // SAFETY: kill with a pid we started; no memory involved.
    unsafe { libc::kill(init as i32, libc::SIGKILL) };
    let ev = next(&rx, |f| matches!(f, Fault::InitExited { .. })).expect("init exit");
    // Our own child: waitid(WNOWAIT) gives the signal.
    assert_eq!(
        ev.fault,
        Fault::InitExited {
            pid: init as i32,
            exit_code: None,
            signal: Some(9)
        }
    );
    eprintln!(
        "kill -> event (fallback): {:.3} ms",
        ev.observed.duration_since(sent).as_secs_f64() * 1000.0
    );
}

/// The test probe `tests/probes/dirty.c`, built with the host's C compiler into `dir`.
fn dirty_probe(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/probes/dirty.c");
    let out = dir.join("dirty");
    let status = Command::new("cc")
        .args(["-static", "-no-pie", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("cc (build-essential, installed by scripts/setup.sh)");
    assert!(status.success(), "cc {} failed", src.display());
    out
}

/// Files changed without write(2): shared writable mappings (mmap, mprotect), io_uring, AIO,
/// the 32-bit syscall entry, a Unix socket bound to a path, a core dump, all counted; reads
/// and private memory are not. Live io_uring users are counted while they live.
#[test]
fn bpf_counts_changes_without_write_syscalls() {
    let Some(mut sc) = Scratch::new("paths") else {
        return;
    };
    let tracer = Tracer::builder().start().expect("tracer");
    assert_eq!(
        tracer.kind(),
        TracerKind::Bpf,
        "{:?}",
        tracer.fallback_reason()
    );
    let id = cgroup_id(&sc.dir).unwrap();
    let init = sc.spawn("exec sleep 60");
    tracer
        .track(Target {
            cgroup_id: id,
            cgroup_dir: sc.dir.clone(),
            init_pid: init as i32,
            oom_events: None,
        })
        .unwrap();
    let scratch = tempfile::tempdir().unwrap();
    let probe = dirty_probe(scratch.path());
    let file = scratch.path().join("f");
    std::fs::write(&file, vec![b'.'; 4096]).unwrap();
    let (p, f) = (probe.display(), file.display());
    let step = |sc: &mut Scratch, script: &str| -> (i32, bool) {
        let before = tracer.counters(id).unwrap();
        let code = sc.run(script);
        let after = tracer.counters(id).unwrap();
        (code, after.fs_writes > before.fs_writes)
    };
    for clean in [
        format!("cat {f} > /dev/null"),
        format!("{p} mmap-read {f}"),
        format!("{p} mprotect-anon"),
    ] {
        let (code, dirty) = step(&mut sc, &clean);
        assert_eq!(code, 0, "{clean}");
        assert!(!dirty, "{clean} should be clean");
    }
    let sock = scratch.path().join("sock");
    for (changing, may_be_refused) in [
        (format!("{p} mmap-write {f}"), false),
        (format!("{p} mprotect-write {f}"), false),
        (format!("{p} uring-write {f}"), true),
        (format!("{p} aio-write {f}"), true),
        (format!("{p} int80-write {f}"), true),
        (format!("{p} bind-unix {}", sock.display()), false),
    ] {
        let (code, dirty) = step(&mut sc, &changing);
        if code == 2 && may_be_refused {
            eprintln!("{changing}: refused by this kernel (a refused attempt counts anyway)");
        } else {
            assert_eq!(code, 0, "{changing}");
        }
        assert!(dirty, "{changing} should be dirty");
    }
    assert_eq!(tracer.counters(id).unwrap().async_procs, 0, "users exited");

    // A live io_uring user is counted until it exits.
    let holder = sc.spawn(&format!("exec {p} uring-hold"));
    let deadline = Instant::now() + Duration::from_secs(5);
    while tracer.counters(id).unwrap().async_procs == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    if tracer.counters(id).unwrap().async_procs == 1 {
        // SAFETY: kill with a pid we started; no memory involved.
        unsafe { libc::kill(holder as i32, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while tracer.counters(id).unwrap().async_procs != 0 {
            assert!(Instant::now() < deadline, "io_uring user not uncounted");
            std::thread::sleep(Duration::from_millis(10));
        }
    } else {
        eprintln!("io_uring refused here: no live user to count");
    }

    // A core dump is written by the kernel, not by a syscall of the task.
    let cores = scratch.path().join("cores");
    std::fs::create_dir(&cores).unwrap();
    let (_, dirty) = step(
        &mut sc,
        &format!(
            "ulimit -c unlimited && cd {} && sh -c 'kill -SEGV $$'",
            cores.display()
        ),
    );
    let dumped = std::fs::read_dir(&cores).unwrap().next().is_some();
    if dumped {
        assert!(dirty, "a core dump into the cgroup's cwd should be dirty");
    } else {
        eprintln!("no core file written here (core_pattern or limits): core dump case skipped");
    }
}

/// Starts `builder`'s tracer (BPF, or the test fails), spawns an idle init in the scratch
/// cgroup and tracks it; the tracer and the cgroup id.
fn track_scratch(sc: &mut Scratch, builder: belayer_ebpf::TracerBuilder) -> (Tracer, u64) {
    let tracer = builder.start().expect("tracer");
    assert_eq!(
        tracer.kind(),
        TracerKind::Bpf,
        "{:?}",
        tracer.fallback_reason()
    );
    let id = cgroup_id(&sc.dir).unwrap();
    let init = sc.spawn("exec sleep 60");
    tracer
        .track(Target {
            cgroup_id: id,
            cgroup_dir: sc.dir.clone(),
            init_pid: init as i32,
            oom_events: None,
        })
        .unwrap();
    (tracer, id)
}

/// With the agent's own mount namespace given, a ptraced task's writes to files of the
/// agent's mounts do not count (CRIU's parasite logging to its host file during a
/// checkpoint); the same file reached through a mount of another namespace does, and so does
/// any write of a task that is not ptraced (the check is skipped there: errs towards dirty).
#[test]
fn bpf_ignores_files_of_the_agents_own_mounts_under_ptrace() {
    let Some(mut sc) = Scratch::new("own-ns") else {
        return;
    };
    let own = std::fs::metadata("/proc/self/ns/mnt").unwrap().ino();
    let (tracer, id) = track_scratch(&mut sc, Tracer::builder().own_mount_ns(own));
    let scratch = tempfile::tempdir().unwrap();
    let f = scratch.path().join("f");
    std::fs::write(&f, "seed\n").unwrap();
    let writes = || tracer.counters(id).unwrap().fs_writes;
    let c0 = writes();
    assert_eq!(sc.run_traced(&format!("echo x >> {}", f.display())), 0);
    assert_eq!(
        writes(),
        c0,
        "a ptraced write to a file of the agent's own mounts"
    );
    assert_eq!(
        sc.run_traced(&format!("unshare -m sh -c 'echo y >> {}'", f.display())),
        0
    );
    let c1 = writes();
    assert!(c1 > c0, "the same file through another namespace's mount");
    assert_eq!(sc.run(&format!("echo z >> {}", f.display())), 0);
    assert!(writes() > c1, "a task that is not ptraced");
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "seed\nx\ny\nz\n");
}

/// With the sandboxes' pid-namespace depth given, the tasks of a tracked cgroup in a
/// shallower pid namespace (the agent's own, as CRIU is while it restores a tree into the
/// cgroup) count no file change; a task in a pid namespace of that depth does.
#[test]
fn bpf_ignores_the_agents_own_pid_namespace() {
    let Some(mut sc) = Scratch::new("own-pidns") else {
        return;
    };
    let (tracer, id) = track_scratch(&mut sc, Tracer::builder().sandbox_pid_level(1));
    let scratch = tempfile::tempdir().unwrap();
    let f = scratch.path().join("f");
    let writes = || tracer.counters(id).unwrap().fs_writes;
    let c0 = writes();
    assert_eq!(sc.run(&format!("echo x >> {}", f.display())), 0);
    assert_eq!(writes(), c0, "a write from the agent's pid namespace");
    assert_eq!(
        sc.run(&format!("unshare -p -f sh -c 'echo y >> {}'", f.display())),
        0
    );
    assert!(writes() > c0, "a write from a pid namespace one level down");
    assert_eq!(std::fs::read_to_string(&f).unwrap(), "x\ny\n");
}
