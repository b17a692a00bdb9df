//! Regressions for the daemon bugs of issue 13 (a restore that hangs on a capability it cannot
//! restore, a removal racing the failure watcher, zombies, an action killed from the host
//! losing its output) and the process state "capabilities changed by the sandbox".

use std::time::{Duration, Instant};

use belayer_ipc::{ErrorCode, ExecRequest, InfraFaultKind, Request, Response};
use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::{busybox_rootfs, Daemon};

/// Python helpers for the capability probes: `caps()` reads every `Cap*` line of
/// `/proc/self/status`; `capget()`/`capset()` work on the three 64-bit sets.
const CAPS_PRELUDE: &str = r#"
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 24, 47, 2
class Hdr(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("eff", ctypes.c_uint32), ("prm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
def capget():
    h, d = Hdr(0x20080522, 0), (Data * 2)()
    check(libc.capget(ctypes.byref(h), d) == 0, "capget")
    join = lambda f: getattr(d[0], f) | (getattr(d[1], f) << 32)
    return join("eff"), join("prm"), join("inh")
def capset(eff, prm, inh):
    h, d = Hdr(0x20080522, 0), (Data * 2)()
    for i in range(2):
        d[i].eff, d[i].prm, d[i].inh = (eff >> 32 * i) & 0xffffffff, (prm >> 32 * i) & 0xffffffff, (inh >> 32 * i) & 0xffffffff
    ok = libc.capset(ctypes.byref(h), d) == 0
    check(ok, f"capset errno {ctypes.get_errno()}")
def caps():
    return {l.split(":")[0]: l.split(":")[1].strip() for l in open("/proc/self/status") if l.startswith("Cap")}
"#;

/// The probe body of bug 1: optionally raise every permitted capability into the
/// inheritable set, then drop `CAP_SETPCAP` (8) from the bounding set, as the issue's
/// reproduction does; the sets must be the same after the restore.
fn capbset_probe(raise_inheritable: bool) -> String {
    format!(
        "{CAPS_PRELUDE}\nRAISE = {}\n{}",
        if raise_inheritable { "True" } else { "False" },
        r#"
if RAISE:
    eff, prm, inh = capget()
    capset(eff, prm, prm)
check(libc.prctl(PR_CAPBSET_DROP, 8, 0, 0, 0) == 0, "PR_CAPBSET_DROP 8")
before = caps()
ready()
wait_term()
after = caps()
check(before == after, f"caps {before} became {after}")
finish()
"#
    )
}

/// Bug 1: `prctl(PR_CAPBSET_DROP, 8)`, then checkpoint → kill → restore hung forever in
/// CRIU (its restorer's `capset` failed: sandboxes ran with CapInh = CapBnd, and a new
/// inheritable set must lie within the restorer's inheritable set ∪ bounding set). Sandboxes
/// now start with an empty inheritable set: the restore is quick and the sets are exact.
#[test]
fn restore_after_a_bounding_set_drop_is_quick_and_exact() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    assert!(d
        .sh(&id, "grep CapInh /proc/self/status")
        .ends_with("0000000000000000"));
    let p = Probe::python(&d, &id, "capbset", &capbset_probe(false));
    let t = Instant::now();
    let r = p.checkpoint_kill_restore();
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "checkpoint, kill and restore took {:?}",
        t.elapsed()
    );
    assert!(r.validity.is_some_and(|v| v.processes_match));
    p.assert_pass();
}

/// Bug 1, the case CRIU cannot restore in a user namespace: the sandbox raised capabilities
/// into its inheritable set and then dropped one of them from its bounding set. The
/// restorer there starts with an empty inheritable set (the kernel empties it for a user
/// namespace's creator), so CRIU 4.2's `capset` must fail and it would hang. The checkpoint
/// is refused instead (`CheckpointFailed`, naming the capability bits), the previous one
/// stays ready, and restoring it works.
#[test]
fn an_unrestorable_inheritable_set_is_refused_at_checkpoint() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    d.checkpoint(&id, 1, b"L1");
    let p = Probe::python(&d, &id, "capinh", &capbset_probe(true));
    match d.checkpoint_raw(&id, 2, b"L2", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{}", e.message);
            assert!(
                e.message.contains("inheritable capabilities 0x100"),
                "{}",
                e.message
            );
        }
        other => panic!("checkpoint of an unrestorable tree answered {other:?}"),
    }
    assert_eq!(d.inspect(&id).ready_prefix, Some(1));
    assert_eq!(d.inspect(&id).state, "running");
    let _ = p;
    d.fail_stop(&id);
    let t = Instant::now();
    assert_eq!(d.restore(&id).prefix, Some(1));
    assert!(t.elapsed() < Duration::from_secs(20));
}

/// Bug 1 in a sandbox in the host user namespace: there CRIU's restorer keeps CRIU's own
/// inheritable set, which `belayer-criu` raises to its permitted set, so even a raised
/// inheritable set outside the bounding set is restored exactly.
#[test]
fn a_host_userns_sandbox_restores_a_raised_inheritable_set() {
    let d = Daemon::start();
    d.image("python", &belayer_tests::python_rootfs());
    let id = d
        .create_spec(belayer_ipc::SandboxSpec {
            image: "python".into(),
            userns: Some(belayer_ipc::UsernsMode::Host),
            ..belayer_ipc::SandboxSpec::default()
        })
        .id;
    let p = Probe::python(&d, &id, "capinh", &capbset_probe(true));
    let t = Instant::now();
    p.checkpoint_kill_restore();
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "took {:?}",
        t.elapsed()
    );
    p.assert_pass();
}

/// State: capabilities changed by the sandbox (bounding-set drops, a capset of permitted,
/// effective and inheritable, an ambient capability) survive checkpoint → SIGKILL → restore.
#[test]
fn changed_capabilities_survive_checkpoint_kill_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "caps",
        &format!(
            "{CAPS_PRELUDE}{}",
            r#"
CHOWN, DAC_OVERRIDE, FOWNER, KILL, SYS_CHROOT, NET_BIND = 0, 1, 3, 5, 18, 10
eff, prm, inh = capget()
# Inheritable: CHOWN, KILL and SYS_CHROOT; CHOWN also ambient (NET_RAW, which a private user namespace drops, cannot be one).
capset(eff, prm, (1 << CHOWN) | (1 << KILL) | (1 << SYS_CHROOT))
check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CHOWN, 0, 0) == 0, "ambient raise")
# Bounding set: NET_BIND_SERVICE and SETPCAP go (the inheritable ones stay: see
# an_unrestorable_inheritable_set_is_refused_at_checkpoint).
check(libc.prctl(PR_CAPBSET_DROP, NET_BIND, 0, 0, 0) == 0, "bset drop NET_BIND_SERVICE")
# Permitted loses FOWNER; effective also loses DAC_OVERRIDE.
eff, prm, inh = capget()
prm &= ~(1 << FOWNER)
capset(eff & prm & ~(1 << DAC_OVERRIDE), prm, inh)
check(libc.prctl(PR_CAPBSET_DROP, 8, 0, 0, 0) == 0, "bset drop SETPCAP")
before = caps()
check(before["CapAmb"] != "0000000000000000", f"no ambient cap: {before}")
ready()
wait_term()
after = caps()
check(before == after, f"caps {before} became {after}")
finish()
"#
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// Bug 1 (the bound): a CRIU restore past its time limit (config `criu_time_limit_base_ms`,
/// set to 20 ms here, far below what a restore takes) is killed with the half-restored tree
/// and answers `RestoreTimedOut`; the sandbox is `failed` without processes or zombies, the
/// ready checkpoint is untouched, and a restore with a sane limit then works.
#[test]
fn a_restore_past_its_time_limit_is_killed_and_the_checkpoint_stays_restorable() {
    let mut d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo kept > /tmp/f; (sleep 1000 >/dev/null 2>&1 &)");
    d.checkpoint(&id, 1, b"L1");
    d.fail_stop(&id);
    d.kill();
    d.set_config("criu_time_limit_base_ms = 20\ncriu_time_limit_per_gib_ms = 0\n");
    d.restart();
    let r = d.restore_raw(&id);
    match &r {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::RestoreTimedOut, "{}", e.message),
        other => panic!("restore under a 20 ms limit answered {other:?}"),
    }
    let info = d.inspect(&id);
    assert_eq!(info.state, "failed");
    assert!(
        info.pids.is_empty(),
        "half-restored tree left: {:?}",
        info.pids
    );
    assert_eq!(info.ready_prefix, Some(1), "the ready checkpoint must stay");
    wait_no_zombies(&d);
    d.assert_alive("after a timed-out restore");
    d.kill();
    d.set_config("");
    d.restart();
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /tmp/f"), "kept");
    assert_eq!(d.inspect(&id).state, "running");
}

/// Bug 2: `sandbox rm` raced the failure watcher rewriting `state.json` and failed with
/// "Directory not empty", leaving the sandbox listed as `failed`. Removal right after a
/// fail-stop (the watcher writing meanwhile) and while the init is still dying must always
/// succeed and leave nothing behind.
#[test]
fn removal_never_races_the_failure_watcher() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    for round in 0..24u32 {
        let id = d.create("busybox").id;
        if round.is_multiple_of(2) {
            // Killed and seen failed (the watcher has written), then removed at once.
            d.fail_stop(&id);
        } else {
            // Removed while the init is dying: the watcher may be writing right now.
            for pid in d.inspect(&id).pids {
                // SAFETY: kill(2) with a pid and a signal number.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let r = d.call(Request::RemoveSandbox { id: id.clone() });
        assert!(
            matches!(r, Response::Done),
            "round {round}: rm answered {r:?}"
        );
        match d.call(Request::ListSandboxes) {
            Response::Sandboxes(list) => {
                assert!(
                    list.iter().all(|s| s.id != id),
                    "round {round}: still listed"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(!d.state_dir.join("sandboxes").join(&id).exists());
    }
    std::thread::sleep(Duration::from_millis(500));
    let left: Vec<_> = std::fs::read_dir(d.state_dir.join("sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left in sandboxes/: {left:?}");
    wait_no_zombies(&d);
}

/// Bug 3: belayerd leaked zombies (the inits of removed and replaced instances). After
/// restores and removals no child of the daemon stays a zombie.
#[test]
fn replaced_and_removed_instances_leave_no_zombie() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    for _ in 0..3 {
        let id = d.create("busybox").id;
        d.sh(&id, "(sleep 1000 >/dev/null 2>&1 &)");
        d.checkpoint(&id, 1, b"L1");
        d.restore(&id);
        d.fail_stop(&id);
        d.restore(&id);
        d.call(Request::RemoveSandbox { id });
    }
    wait_no_zombies(&d);
}

/// Bug 4: an action killed from the host, its exec helper included, answered `ExecFailed: no
/// status from the exec helper ("")`, dropping the output. It now returns the output so far
/// with the infrastructure fault.
#[test]
fn an_action_killed_from_the_host_returns_its_output_and_the_fault() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let (socket, exec_id) = (d.socket.clone(), id.clone());
    let action = std::thread::spawn(move || {
        let mut c = belayer_ipc::Client::connect(&socket).expect("connect");
        c.call(Request::Exec(ExecRequest {
            id: exec_id,
            argv: vec!["echo before; echo err-before >&2; sleep 7; echo after".into()],
            ..ExecRequest::default()
        }))
        .expect("exec answer")
    });
    // Once the action runs (its `sleep 7` among the sandbox's processes; the init has a
    // `sleep` of its own), kill it all from the host.
    wait_until("the action's sleep", || {
        d.inspect(&id).pids.iter().any(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == b"sleep\x007\x00")
        })
    });
    // The exec helper (a child of belayerd outside the sandbox's cgroup, reporting the
    // action's status) dies too, as when the host kills the whole action or the OOM killer
    // picks it: that lost the status line and with it the output.
    let helpers = exec_helpers(d.pid().expect("daemon pid"));
    assert!(!helpers.is_empty(), "no exec helper found");
    let t = Instant::now();
    for pid in helpers.into_iter().chain(d.inspect(&id).pids) {
        // SAFETY: kill(2) with a pid and a signal number.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let r = action.join().expect("exec thread");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the answer waited for the sleep"
    );
    let Response::Exec(r) = r else {
        panic!("exec answered {r:?}\n{}", d.log_text());
    };
    assert_eq!(String::from_utf8_lossy(&r.stdout), "before\n");
    assert_eq!(String::from_utf8_lossy(&r.stderr), "err-before\n");
    let fault = r.infra_fault.expect("an infrastructure fault");
    assert!(
        matches!(
            fault.kind,
            InfraFaultKind::ExternalKill | InfraFaultKind::SandboxLost
        ),
        "{fault:?}"
    );
    assert_eq!(r.signal, Some(libc::SIGKILL));
    d.assert_alive("after the killed action");
}

/// Children of `daemon` that are exec helpers (their arguments hold `exec` and
/// `--status-fd`).
fn exec_helpers(daemon: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{daemon}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        for pid in children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            if args.contains(&&b"exec"[..]) && args.contains(&&b"--status-fd"[..]) {
                out.push(pid);
            }
        }
    }
    out
}

/// Waits until belayerd has no zombie child; on timeout, names each one (status lines).
fn wait_no_zombies(d: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let zombies = d.zombie_children();
        if zombies.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            let described: Vec<String> = zombies
                .iter()
                .map(|z| {
                    let status =
                        std::fs::read_to_string(format!("/proc/{z}/status")).unwrap_or_default();
                    let keep = ["Name:", "PPid:", "NSpid:", "NSpgid:"];
                    status
                        .lines()
                        .filter(|l| keep.iter().any(|k| l.starts_with(k)))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            panic!("zombie children of belayerd after 30 s: {described:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    // Generous: the reaper runs every 200 ms, but a loaded 2-core machine can starve it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
