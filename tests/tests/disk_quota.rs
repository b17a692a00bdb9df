//! The daemon's disk-quota policy at start: a non-zero default disk limit on a state dir that
//! cannot enforce it is refused with a typed error saying what to do; 0 runs with a warning;
//! on the btrfs state file system of scripts/setup.sh quotas are on.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::{Client, Request, Response};
use belayer_tests::{bin, Daemon};

/// A scratch dir on ext4 (/var/tmp), removed on drop.
struct Ext4Dir(PathBuf);

impl Ext4Dir {
    fn new(name: &str) -> Ext4Dir {
        let p = PathBuf::from(format!("/var/tmp/belayer-dq-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        assert!(
            !belayer_tests::is_btrfs(&p),
            "/var/tmp is expected to be ext4 here"
        );
        Ext4Dir(p)
    }
}

impl Drop for Ext4Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn belayerd(dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(bin("belayerd"));
    cmd.arg("--socket")
        .arg(dir.join("b.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--config")
        .arg("/dev/null")
        .arg("--no-bpf")
        .args(extra)
        .env_remove("BELAYER_DEFAULT_DISK_MAX")
        .stdin(Stdio::null());
    cmd
}

#[test]
fn refuses_to_start_without_quota_support() {
    let dir = Ext4Dir::new("refuse");
    let out = belayerd(&dir.0, &[]).output().unwrap();
    assert!(!out.status.success(), "belayerd started on ext4: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "cannot enforce default_disk_max_bytes = 10737418240",
        "scripts/setup.sh",
        "default_disk_max_bytes = 0",
        "is not on btrfs",
    ] {
        assert!(stderr.contains(needle), "missing {needle:?} in:\n{stderr}");
    }
    assert!(!dir.0.join("b.sock").exists());
}

#[test]
fn zero_default_runs_without_limit_and_warns() {
    let dir = Ext4Dir::new("zero");
    let log = dir.0.join("log");
    let mut child = belayerd(&dir.0, &["--default-disk-max", "0"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let answered = loop {
        if let Ok(mut c) = Client::connect(dir.0.join("b.sock")) {
            if matches!(c.call(Request::Ping), Ok(Response::Pong { .. })) {
                break true;
            }
        }
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = child.kill();
    let _ = child.wait();
    let text = strip_ansi(&std::fs::read_to_string(&log).unwrap());
    assert!(answered, "belayerd did not start:\n{text}");
    assert!(text.contains("WARN"), "{text}");
    assert!(
        text.contains("default_disk_max_bytes = 0: sandboxes without disk_max have no disk limit"),
        "{text}"
    );
}

#[test]
fn test_daemons_run_with_quotas_on() {
    let d = Daemon::start_no_bpf();
    assert!(belayer_tests::is_btrfs(&d.state_dir));
    let log = strip_ansi(&d.log_text());
    assert!(log.contains("disk quotas enforced"), "{log}");
    assert!(log.contains("mode=Simple"), "{log}");
}

/// The log without terminal colour sequences (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
