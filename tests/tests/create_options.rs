//! `CreateSandbox` options against the real daemon and kernel: the workdir is every action's
//! default cwd (an action's own cwd wins, a missing one fails the action, a restore keeps
//! it), bad workdirs are refused, and the limits and env of the spec show in `InspectSandbox`
//! and are enforced by the kernel.

use belayer_ipc::{ErrorCode, ExecRequest, Request, Response, SandboxLimits, SandboxSpec};
use belayer_tests::{busybox_rootfs, Daemon};

fn daemon() -> Daemon {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    d
}

/// A busybox sandbox whose workdir is `workdir`; its id.
fn with_workdir(d: &Daemon, workdir: &str) -> String {
    d.create_spec(SandboxSpec {
        image: "busybox".into(),
        workdir: Some(workdir.into()),
        ..Default::default()
    })
    .id
}

fn exec_raw(d: &Daemon, id: &str, cmd: &str, cwd: Option<&str>) -> Response {
    d.call(Request::Exec(ExecRequest {
        id: id.into(),
        argv: vec![cmd.into()],
        cwd: cwd.map(str::to_owned),
        timeout_ms: Some(60_000),
        ..Default::default()
    }))
}

#[test]
fn the_workdir_is_the_default_cwd_and_survives_a_restore() {
    let d = daemon();
    let id = with_workdir(&d, "/srv/task");
    assert_eq!(d.inspect(&id).workdir.as_deref(), Some("/srv/task"));
    // Not created: an action without its own cwd fails as a missing cwd does.
    match exec_raw(&d, &id, "pwd", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::ExecFailed, "{}", e.message);
            assert!(
                e.message.contains("chdir") && e.message.contains("/srv/task"),
                "{}",
                e.message
            );
        }
        r => panic!("an action ran in a missing workdir: {r:?}"),
    }
    match exec_raw(&d, &id, "mkdir -p /srv/task && echo made", Some("/")) {
        Response::Exec(r) => assert_eq!(r.stdout, b"made\n"),
        r => panic!("{r:?}"),
    }
    assert_eq!(d.sh(&id, "pwd; touch here"), "/srv/task");
    match exec_raw(&d, &id, "pwd", Some("/tmp")) {
        Response::Exec(r) => assert_eq!(r.stdout, b"/tmp\n", "an action's cwd wins"),
        r => panic!("{r:?}"),
    }
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    assert_eq!(d.sh(&id, "pwd; ls"), "/srv/task\nhere");
    assert_eq!(d.inspect(&id).workdir.as_deref(), Some("/srv/task"));
    // The workdir lives in the record: a restarted daemon keeps it.
    let mut d = d;
    d.restart();
    assert_eq!(d.sh(&id, "pwd"), "/srv/task");
}

#[test]
fn a_symlinked_workdir_resolves_inside_the_sandbox() {
    let d = daemon();
    let id = with_workdir(&d, "/w");
    // A hostile sandbox points its workdir at a host path: the chdir happens in the sandbox's
    // root, so the link names the sandbox's own /etc, never the host's.
    let marker = format!("/etc/belayer-host-marker-{id}");
    std::fs::write(&marker, b"host").unwrap();
    match exec_raw(&d, &id, "ln -s /etc /w && echo linked", Some("/")) {
        Response::Exec(r) => assert_eq!(r.stdout, b"linked\n"),
        r => panic!("{r:?}"),
    }
    let seen = d.sh(&id, &format!("pwd; cat {marker} 2>&1 || echo absent"));
    std::fs::remove_file(&marker).unwrap();
    assert!(seen.ends_with("absent"), "{seen}");
}

#[test]
fn bad_workdirs_are_refused() {
    let d = daemon();
    for bad in [
        "relative/dir",
        "",
        "/with\0nul",
        &format!("/{}", "a".repeat(5000)),
    ] {
        match d.call(Request::CreateSandbox(SandboxSpec {
            image: "busybox".into(),
            workdir: Some(bad.to_owned()),
            ..Default::default()
        })) {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
                assert!(e.message.contains("workdir"), "{}", e.message);
            }
            r => panic!("workdir {bad:?} accepted: {r:?}"),
        }
    }
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => assert!(v.is_empty(), "a refused spec left {v:?}"),
        r => panic!("{r:?}"),
    }
}

/// The memory limit (`memory`, bytes) or CPU quota (`cpu`, µs per 100 ms period) the kernel
/// holds for cgroup `cg`: v2 `memory.max` / `cpu.max`, else the v1 hierarchies' files.
fn cgroup_value(cg: &str, what: &str) -> String {
    let v2 = std::path::Path::new("/sys/fs/cgroup").join(cg.trim_start_matches('/'));
    let (v2_file, v1_file) = match what {
        "memory" => ("memory.max", "memory/{}/memory.limit_in_bytes"),
        _ => ("cpu.max", "cpu/{}/cpu.cfs_quota_us"),
    };
    if let Ok(v) = std::fs::read_to_string(v2.join(v2_file)) {
        return v.split_whitespace().next().unwrap_or_default().to_owned();
    }
    let v1 = format!(
        "/sys/fs/cgroup/{}",
        v1_file.replace("{}", cg.trim_start_matches('/'))
    );
    std::fs::read_to_string(&v1)
        .unwrap_or_else(|e| panic!("{v1}: {e}"))
        .trim()
        .to_owned()
}

#[test]
fn limits_and_env_show_in_inspect_and_are_enforced() {
    let d = daemon();
    let spec = SandboxSpec {
        image: "busybox".into(),
        memory_max: Some(64 << 20),
        pids_max: Some(12),
        cpus: Some(0.5),
        disk_max: Some(32 << 20),
        env: vec![("MODE".into(), "strict".into())],
        tag: Some("limits".into()),
        ..Default::default()
    };
    let id = d.create_spec(spec).id;
    let info = d.inspect(&id);
    assert_eq!(
        info.limits,
        SandboxLimits {
            memory_max: Some(64 << 20),
            pids_max: Some(12),
            cpus: Some(0.5),
            disk_max: Some(32 << 20),
        }
    );
    assert_eq!(info.env, [("MODE".to_owned(), "strict".to_owned())]);
    assert_eq!(info.tag.as_deref(), Some("limits"));
    assert_eq!(info.workdir, None);
    assert_eq!(d.sh(&id, "echo $MODE"), "strict");

    // pids: a fork bomb stops at the limit, and the sandbox still answers once it is over.
    assert!(fork_bomb(&d, &id) <= 12, "more processes than pids_max 12");
    // disk: writes past the limit fail inside.
    let r = d.exec(&id, "dd if=/dev/zero of=/big bs=1M count=64 2>&1");
    assert_ne!(r.exit_code, 0, "wrote 64 MiB under a 32 MiB disk limit");
    d.sh(&id, "rm -f /big");
    // memory and cpu: the kernel's own files of the sandbox cgroup.
    assert_eq!(
        cgroup_value(&info.cgroup, "memory"),
        (64u64 << 20).to_string()
    );
    assert_eq!(cgroup_value(&info.cgroup, "cpu"), "50000");

    // Limits and env are the sandbox's for life: a restored instance has them again.
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    let again = d.inspect(&id);
    assert_eq!(again.limits, info.limits);
    assert_eq!(again.env, info.env);
    assert!(fork_bomb(&d, &id) <= 12, "over pids_max after a restore");
}

/// Starts 40 background processes in the sandbox and returns how many processes it held at
/// most (counted with shell builtins: no fork is left at the limit), then kills them.
fn fork_bomb(d: &Daemon, id: &str) -> u64 {
    let out = d.sh(
        id,
        "(for i in $(seq 40); do sleep 60 & done) 2>/dev/null; \
         set -- /proc/[0-9]*; echo $#",
    );
    d.exec(id, "kill -9 -1 2>/dev/null; true");
    let procs = out.trim().parse().unwrap();
    assert!(procs > 5, "the fork bomb did not run: {out}");
    procs
}
