//! The sandbox tracer end to end, with BPF and with the fallback (`belayerd --no-bpf`):
//! infrastructure faults of actions (external kill, OOM kill) against task-level failures,
//! per-action dirtiness, the failure seen without waiting for a timeout, `belayer status` and
//! `belayer exec --json`.

use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use belayer_ipc::{InfraFaultKind, Request, Response, SandboxSpec};
use belayer_tests::cli::belayer_json;
use belayer_tests::{bin, busybox_rootfs, Daemon};
use serde_json::Value;

fn daemon(bpf: bool) -> Daemon {
    let d = if bpf {
        Daemon::start()
    } else {
        Daemon::start_no_bpf()
    };
    d.image("bb", &busybox_rootfs());
    d
}

fn tracer_of(d: &Daemon) -> String {
    match d.call(Request::Status) {
        Response::Status(s) => s.tracer,
        r => panic!("status: {r:?}"),
    }
}

/// Host pid of a process of the sandbox whose command name is `comm`, not a child of the
/// sandbox init (whose endless `sleep` loop is not part of any action).
fn find_process(d: &Daemon, id: &str, comm: &str) -> Option<i32> {
    let info = d.inspect(id);
    info.pids.into_iter().find(|p| {
        let ppid = std::fs::read_to_string(format!("/proc/{p}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i32>().ok())
            });
        std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == comm)
            && ppid.is_some()
            && ppid != info.init_pid
    })
}

/// Runs `action` while another thread waits for a `sleep` process in the sandbox and SIGKILLs
/// it from the host.
fn kill_during_action(d: &Daemon, id: &str, action: &str) -> (belayer_ipc::ExecResult, i32) {
    thread::scope(|s| {
        let killer = s.spawn(|| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                if let Some(pid) = find_process(d, id, "sleep") {
                    // SAFETY: kill(2) with a pid and a signal number; no memory involved.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return pid;
                }
                assert!(Instant::now() < deadline, "no sleep process appeared");
                thread::sleep(Duration::from_millis(10));
            }
        });
        let r = d.exec(id, action);
        (r, killer.join().unwrap())
    })
}

fn wait_failed(d: &Daemon, id: &str, within: Duration) -> Duration {
    let t = Instant::now();
    while d.inspect(id).state != "failed" {
        assert!(
            t.elapsed() < within,
            "sandbox {id} not failed after {within:?}"
        );
        thread::sleep(Duration::from_millis(2));
    }
    t.elapsed()
}

fn external_kill(bpf: bool) {
    let d = daemon(bpf);
    assert_eq!(tracer_of(&d).starts_with("bpf"), bpf, "{}", tracer_of(&d));
    let id = d.create("bb").id;
    // The action's own process is killed (the fallback only sees that one).
    let (r, pid) = kill_during_action(&d, &id, "exec sleep 30");
    let f = r
        .infra_fault
        .clone()
        .unwrap_or_else(|| panic!("no infra fault: {r:?}\n{}", d.log_text()));
    assert_eq!(f.kind, InfraFaultKind::ExternalKill, "{f:?}");
    assert_eq!(f.signal, Some(libc::SIGKILL));
    if bpf {
        assert_eq!(f.pid, Some(pid));
    }
    wait_failed(&d, &id, Duration::from_secs(2));
    assert!(
        matches!(d.call(Request::Exec(belayer_ipc::ExecRequest { id: id.clone(), argv: vec!["true".into()], ..Default::default() })), Response::Error(e) if e.code == belayer_ipc::ErrorCode::InvalidState)
    );
    d.restore(&id);
    assert_eq!(d.exec(&id, "echo back").infra_fault, None);
}

#[test]
fn external_kill_is_infra_bpf() {
    external_kill(true);
}

#[test]
fn external_kill_is_infra_fallback() {
    external_kill(false);
}

/// With BPF, a child killed from outside is attributed even though the shell goes on, and the
/// sandbox is marked failed within milliseconds.
#[test]
fn external_kill_of_a_child_bpf() {
    let d = daemon(true);
    let id = d.create("bb").id;
    let (r, pid) = kill_during_action(&d, &id, "sleep 30; echo went on");
    assert_eq!(r.exit_code, 0);
    let f = r.infra_fault.expect("infra fault");
    assert_eq!(
        (f.kind, f.pid, f.signal),
        (InfraFaultKind::ExternalKill, Some(pid), Some(9))
    );
    assert_eq!(d.inspect(&id).state, "failed");
}

fn task_level(bpf: bool) {
    let d = daemon(bpf);
    let id = d.create("bb").id;
    let r = d.exec(&id, "echo no; exit 1");
    assert_eq!((r.exit_code, r.infra_fault), (1, None));
    let r = d.exec(&id, "sleep 30 & kill -9 $!; wait $!; echo $?");
    assert_eq!(r.infra_fault, None, "{r:?}");
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "137");
    let r = d.exec(&id, "sleep 30 & kill -TERM $!; wait");
    assert_eq!(r.infra_fault, None);
    // Our own timeout is not an infrastructure fault either.
    let req = belayer_ipc::ExecRequest {
        id: id.clone(),
        argv: vec!["sleep 30".into()],
        timeout_ms: Some(200),
        ..Default::default()
    };
    match d.call(Request::Exec(req)) {
        Response::Exec(r) => assert!(r.timed_out && r.infra_fault.is_none(), "{r:?}"),
        r => panic!("{r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "running");
}

#[test]
fn task_level_failures_are_not_infra_bpf() {
    task_level(true);
}

#[test]
fn task_level_failures_are_not_infra_fallback() {
    task_level(false);
}

fn oom(bpf: bool) {
    let d = daemon(bpf);
    let id = d
        .create_spec(SandboxSpec {
            image: "bb".into(),
            memory_max: Some(32 << 20),
            ..Default::default()
        })
        .id;
    let r = d.exec(
        &id,
        "dd if=/dev/zero of=/dev/null bs=256M count=1; echo survived $?",
    );
    let f = r
        .infra_fault
        .clone()
        .unwrap_or_else(|| panic!("no oom fault: {r:?}"));
    assert_eq!(f.kind, InfraFaultKind::Oom, "{r:?}");
    if bpf {
        assert!(f.pid.is_some_and(|p| p > 0), "{f:?}");
    }
    wait_failed(&d, &id, Duration::from_secs(2));
}

#[test]
fn oom_kill_is_infra_bpf() {
    oom(true);
}

#[test]
fn oom_kill_is_infra_fallback() {
    oom(false);
}

fn dirtiness(bpf: bool) {
    let d = daemon(bpf);
    let id = d.create("bb").id;
    let dirty = |cmd: &str| {
        let r = d.exec(&id, cmd);
        assert_eq!(r.exit_code, 0, "{cmd}: {r:?}");
        assert_eq!(r.infra_fault, None);
        r.dirty
            .unwrap_or_else(|| panic!("{cmd}: dirtiness unknown"))
    };
    assert!(dirty("mkdir -p /work && echo seed > /work/seed"));
    for clean in [
        "cat /etc/passwd",
        "ls -la / /work",
        "grep root /etc/passwd",
        "cat /etc/passwd | grep -c root > /dev/null; echo done >&2",
        "test -e /work/seed && ls /nonexistent 2>/dev/null; true",
    ] {
        assert!(!dirty(clean), "{clean} should be clean");
    }
    for changing in [
        "echo x > /work/a",
        "echo y >> /work/a",
        "rm /work/a",
        "mkdir /work/d",
        "touch /work/d/t",
        "mv /work/d/t /work/d/u",
        "chmod 600 /work/seed",
        "rm -r /work/d",
    ] {
        assert!(dirty(changing), "{changing} should be dirty");
    }
    // A process left running changes the sandbox; once it runs, reads stay clean; stopping it
    // (a pending fatal signal is enough) changes the sandbox again.
    // (Only that process is killed: the sandbox init's own `sleep` must stay.)
    assert!(dirty("sleep 300 > /dev/null 2>&1 &"));
    // Until it sleeps, the background process runs: a step meanwhile would be dirty.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!dirty("ls /work"));
    let bg = String::from_utf8(d.exec(&id, "pidof sleep").stdout).unwrap();
    let bg = bg
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .max()
        .expect("the background sleep");
    assert!(!dirty("pidof sleep"));
    assert!(dirty(&format!("kill {bg}")));
    // The init reaps the killed process when it wakes, after the action: a step meanwhile
    // would be dirty (the init ran during it).
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!dirty("cat /work/seed"));
}

#[test]
fn dirtiness_bpf() {
    dirtiness(true);
}

#[test]
fn dirtiness_fallback() {
    dirtiness(false);
}

fn cli(d: &Daemon, args: &[&str]) -> (i32, Value) {
    let out = belayer_json(d, args);
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), json)
}

#[test]
fn cli_reports_tracer_fault_and_dirtiness() {
    for bpf in [true, false] {
        let d = daemon(bpf);
        let (_, status) = cli(&d, &["status"]);
        let tracer = status["tracer"].as_str().unwrap().to_string();
        assert_eq!(tracer.starts_with("bpf"), bpf, "{status}");
        let id = d.create("bb").id;
        let (code, r) = cli(&d, &["exec", &id, "--", "echo hi > /f"]);
        assert_eq!(code, 0);
        assert_eq!(r["infra_fault"], Value::Null, "{r}");
        assert_eq!(r["dirty"], Value::Bool(true), "{r}");
        let (_, r) = cli(&d, &["exec", &id, "--", "cat /f"]);
        assert_eq!(r["dirty"], Value::Bool(false), "{r}");
        let sleeper = thread::spawn({
            let socket = d.socket.clone();
            let id = id.clone();
            move || {
                let out = Command::new(bin("belayer"))
                    .arg("--socket")
                    .arg(&socket)
                    .arg("--json")
                    .args(["exec", &id, "--", "exec sleep 30"])
                    .output()
                    .unwrap();
                serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let pid = loop {
            if let Some(p) = find_process(&d, &id, "sleep") {
                break p;
            }
            assert!(Instant::now() < deadline);
            thread::sleep(Duration::from_millis(10));
        };
        // SAFETY: kill(2) with a pid and a signal number; no memory involved.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let r = sleeper.join().unwrap();
        assert_eq!(r["infra_fault"]["kind"], "external_kill", "{r}");
        assert_eq!(r["infra_fault"]["signal"], 15, "{r}");
    }
}

/// The rollout driver feeds the tracer's verdicts to the policy: on recorded trajectories with
/// read-only steps, the adaptive policy skips checkpoints as clean, and the report counts them
/// (and the infrastructure faults per kind).
#[test]
fn rollout_report_counts_clean_skips() {
    let d = Daemon::start();
    let out = tempfile::tempdir().unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/cli/trajectories");
    let output = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .arg("rollout")
        .arg(dir.join("tbmini__new-encrypt-command__2025-08-15__16-23-45.jsonl"))
        .args([
            "--policy",
            "adaptive",
            "--failure-rate",
            "0.1",
            "--seed",
            "3",
        ])
        .args([
            "--time-scale",
            "0.02",
            "--action-timeout",
            "10",
            "--no-overhead-run",
            // Checkpoint from the first step on: "clean" is relative to a ready checkpoint
            // (the set-up action already changed the fresh sandbox).
            "--initial-checkpoint-cost",
            "0",
        ])
        .arg("--image-rootfs")
        .arg(belayer_tests::python_rootfs())
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.path().join("report.json")).unwrap()).unwrap();
    let adaptive = &report["policies"]["adaptive"];
    let clean = adaptive["checkpoints_clean"].as_u64().unwrap();
    assert!(clean > 0, "{adaptive}");
    assert!(clean <= adaptive["checkpoints_skipped"].as_u64().unwrap());
    assert!(adaptive["infra_faults"].is_object(), "{adaptive}");
    assert!(stdout.contains("skipped as clean"), "{stdout}");
}
