//! A process under the sandbox seccomp filter survives a real CRIU dump and restore with its
//! filters and `no_new_privs`, and the restored filters still refuse what they refused before.
//!
//! CRIU (the one `belayer_criu::Criu::locate` finds: `$BELAYER_CRIU` or
//! `/usr/local/sbin/criu`) suspends the filters while it works in the tasks
//! (`PTRACE_O_SUSPEND_SECCOMP`), stores them (`PTRACE_SECCOMP_GET_FILTER`) and re-installs them
//! at the end of the restore; this test proves that chain on this kernel.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_criu::Criu;
use belayer_daemon::helper::seccomp::SandboxFilter;

/// Polls `path` until it exists and is non-empty, for at most `limit`.
fn wait_for_file(path: &Path, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn gone(pid: i32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn criu_dump_and_restore_keep_the_filter() {
    let criu = Criu::locate(None).expect("CRIU 4.x (set BELAYER_CRIU)");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let images = d.join("images");
    std::fs::create_dir(&images).unwrap();
    // On SIGUSR1 (sent after the restore) the shell tries a user namespace and records its
    // seccomp state; until then it waits on a long sleep, as a sandbox init does.
    let script = r#"
        d="$1"
        on_usr1() {
            kill "$sleeper" 2>/dev/null
            grep -E '^(Seccomp|Seccomp_filters|NoNewPrivs):' /proc/self/status > "$d/status"
            unshare -U /bin/true 2> "$d/err"
            echo $? > "$d/rc"
            exit 0
        }
        trap on_usr1 USR1
        while :; do sleep 3600 & sleeper=$!; echo "$sleeper" > "$d/ready"; wait $sleeper; done
    "#;
    let filter = SandboxFilter::build().unwrap();
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", script, "sh", d.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid, close_range and the two install syscalls; no allocation between fork
    // and exec. CRIU needs the tree to lead its own session and hold no host descriptors
    // beyond stdio.
    unsafe {
        cmd.pre_exec(move || {
            libc::setsid();
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            filter
                .install()
                .map_err(|e| std::io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)))
        })
    };
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as i32;
    assert!(wait_for_file(&d.join("ready"), Duration::from_secs(10)));
    let sleeper: i32 = std::fs::read_to_string(d.join("ready"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let dump = Command::new(criu.path())
        .args(["dump", "-t", &pid.to_string(), "-D"])
        .arg(&images)
        .args(["-o", "dump.log", "-v4", "--manage-cgroups=ignore"])
        .output()
        .unwrap();
    let log = |name: &str| std::fs::read_to_string(images.join(name)).unwrap_or_default();
    assert!(
        dump.status.success(),
        "criu dump failed:\n{}",
        log("dump.log")
    );
    // The dump killed the tree. Reap the shell; its orphaned `sleep` is reaped by the host's
    // init. Both pids must be free again for the restore.
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(gone(pid) && gone(sleeper)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let seccomp_img = std::fs::metadata(images.join("seccomp.img")).map(|m| m.len());
    eprintln!("seccomp.img: {seccomp_img:?} bytes");
    assert!(seccomp_img.is_ok_and(|n| n > 0), "no seccomp image");

    let pidfile = d.join("restored.pid");
    let restore = Command::new(criu.path())
        .args(["restore", "-D"])
        .arg(&images)
        .args(["-o", "restore.log", "-v4", "--manage-cgroups=ignore"])
        .arg("--restore-detached")
        .arg("--pidfile")
        .arg(&pidfile)
        .output()
        .unwrap();
    assert!(
        restore.status.success(),
        "criu restore failed:\n{}",
        log("restore.log")
    );
    let restored: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(restored, pid);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    // SAFETY: signals the restored shell, which the pidfile names.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGUSR1) }, 0);
    let rc_written = wait_for_file(&d.join("rc"), Duration::from_secs(10));
    if !rc_written {
        // SAFETY: best-effort cleanup of the restored tree (it is no child of ours).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(rc_written, "restored shell did not answer SIGUSR1");

    for line in ["Seccomp:\t2", "Seccomp_filters:\t1", "NoNewPrivs:\t1"] {
        assert!(
            status.contains(line),
            "restored /proc status lacks {line:?}:\n{status}"
        );
    }
    let inner = std::fs::read_to_string(d.join("status")).unwrap();
    assert!(
        inner.contains("Seccomp:\t2") && inner.contains("NoNewPrivs:\t1"),
        "{inner}"
    );
    let rc = std::fs::read_to_string(d.join("rc")).unwrap();
    assert_ne!(rc.trim(), "0", "unshare -U succeeded after the restore");
    let err = std::fs::read_to_string(d.join("err")).unwrap();
    assert!(err.contains("Operation not permitted"), "{err}");
}
