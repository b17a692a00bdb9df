//! The tracer against the real kernel (root): a scratch cgroup v2 with shell processes in it.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
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
        let child = cmd.spawn().expect("spawn");
        let pid = child.id();
        self.children.push(child);
        pid
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
