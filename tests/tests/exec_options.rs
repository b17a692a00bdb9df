//! `Exec` options against the real kernel: stdin bytes in a sealed memfd (round trip, an action
//! that tries to overwrite them, a refused oversized stdin), stdout and stderr merged into one
//! ordered stream with the output limit on it, cwd and env.

use belayer_ipc::{ErrorCode, ExecRequest, ExecResult, Request, Response};
use belayer_tests::{busybox_rootfs, Daemon};

fn started() -> (Daemon, String) {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    (d, id)
}

fn run(d: &Daemon, req: ExecRequest) -> ExecResult {
    match d.call(Request::Exec(ExecRequest {
        timeout_ms: Some(60_000),
        ..req
    })) {
        Response::Exec(r) => r,
        r => panic!("exec failed: {r:?}\n{}", d.log_text()),
    }
}

#[test]
fn stdin_bytes_reach_the_action_and_cannot_be_changed_by_it() {
    let (d, id) = started();
    let bytes: Vec<u8> = (0..=255u8).chain([0, 0, b'\n', 0xff]).collect();
    let r = run(
        &d,
        ExecRequest {
            id: id.clone(),
            argv: vec!["cat".into()],
            stdin: bytes.clone(),
            ..Default::default()
        },
    );
    assert_eq!(r.exit_code, 0, "{:?}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(
        r.stdout, bytes,
        "cat echoes stdin byte for byte, NULs included"
    );
    assert!(!r.truncated);

    // Through /proc/self/fd/0 (the shell's, `$$`, for dd in a pipe) the action reopens the
    // memfd itself: truncating, appending and overwriting all fail on the seals, and a second
    // read sees the bytes unchanged.
    let script = "echo XX > /proc/self/fd/0; echo trunc=$?; \
                  echo XX >> /proc/self/fd/0; echo append=$?; \
                  printf XX | dd of=/proc/$$/fd/0 conv=notrunc 2>/dev/null; echo overwrite=$?; \
                  cat";
    let r = run(
        &d,
        ExecRequest {
            id: id.clone(),
            argv: vec![script.into()],
            stdin: b"original\n".to_vec(),
            ..Default::default()
        },
    );
    let out = String::from_utf8_lossy(&r.stdout).into_owned();
    for step in ["trunc", "append", "overwrite"] {
        assert!(
            out.contains(&format!("{step}=")) && !out.contains(&format!("{step}=0")),
            "{step} of the sealed stdin succeeded: {out:?}"
        );
    }
    assert!(out.ends_with("original\n"), "{out:?}");
    // The memfd is no named file: reading it leaves the sandbox clean.
    assert_ne!(r.dirty, Some(true), "{r:?}");

    // Without stdin the action still reads end of file at once.
    let r = run(
        &d,
        ExecRequest {
            id,
            argv: vec!["cat; echo done".into()],
            ..Default::default()
        },
    );
    assert_eq!(r.stdout, b"done\n");
}

#[test]
fn merged_output_keeps_the_order_and_the_limit() {
    let (d, id) = started();
    let r = run(
        &d,
        ExecRequest {
            id: id.clone(),
            argv: vec!["echo a; echo b >&2; echo c".into()],
            merge_stderr: true,
            ..Default::default()
        },
    );
    assert_eq!(r.stdout, b"a\nb\nc\n");
    assert!(r.stderr.is_empty());
    assert!(!r.truncated);

    let r = run(
        &d,
        ExecRequest {
            id: id.clone(),
            argv: vec!["echo aaaa; echo bbbb >&2; echo cccc".into()],
            merge_stderr: true,
            output_limit: Some(10),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout, b"aaaa\nbbbb\n");
    assert!(r.stderr.is_empty());
    assert!(r.truncated, "the limit applies to the merged stream");

    // Unmerged, the streams stay apart.
    let r = run(
        &d,
        ExecRequest {
            id,
            argv: vec!["echo a; echo b >&2; echo c".into()],
            ..Default::default()
        },
    );
    assert_eq!(
        (&r.stdout[..], &r.stderr[..]),
        (&b"a\nc\n"[..], &b"b\n"[..])
    );
}

#[test]
fn cwd_and_env_are_honoured() {
    let (d, id) = started();
    let r = run(
        &d,
        ExecRequest {
            id,
            argv: vec!["pwd; echo \"$GREETING\"".into()],
            cwd: Some("/tmp".into()),
            env: vec![("GREETING".into(), "hello there".into())],
            ..Default::default()
        },
    );
    assert_eq!(r.stdout, b"/tmp\nhello there\n");
}

#[test]
fn oversized_stdin_is_refused_and_the_sandbox_stays_usable() {
    let (d, id) = started();
    // The daemon's default output limit (1 MiB) bounds stdin; the frame itself is well
    // inside the 16 MiB maximum.
    let r = d.call(Request::Exec(ExecRequest {
        id: id.clone(),
        argv: vec!["cat".into()],
        stdin: vec![b'x'; (1 << 20) + 1],
        ..Default::default()
    }));
    match r {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
            assert!(e.message.contains("stdin"), "{}", e.message);
        }
        r => panic!("expected BadRequest, got {r:?}"),
    }
    let r = run(
        &d,
        ExecRequest {
            id,
            argv: vec!["wc -c".into()],
            stdin: vec![b'x'; 1 << 20],
            ..Default::default()
        },
    );
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "1048576");
}

#[test]
fn a_background_process_holding_the_stdin_memfd_checkpoints_and_restores() {
    let (d, id) = started();
    // A non-interactive shell gives background jobs /dev/null as stdin (before their own
    // redirections): the job inherits the stdin memfd as the shell's fd 3.
    let r = run(
        &d,
        ExecRequest {
            id: id.clone(),
            argv: vec!["exec 3<&0; sleep 1000 & echo started".into()],
            stdin: b"kept by the background job\n".to_vec(),
            ..Default::default()
        },
    );
    assert_eq!(r.stdout, b"started\n");
    let held = "for p in /proc/[0-9]*; do \
                [ \"$(cat $p/comm)\" = sleep ] && cat $p/fd/3; done; true";
    assert_eq!(d.sh(&id, held), "kept by the background job");
    d.checkpoint(&id, 1, b"ctx");
    d.fail_stop(&id);
    let restored = d.restore(&id);
    assert_eq!(restored.prefix, Some(1));
    // The restored job still holds the memfd, with the same bytes and its seals.
    assert_eq!(d.sh(&id, held), "kept by the background job");
    let write = "for p in /proc/[0-9]*; do [ \"$(cat $p/comm)\" = sleep ] && \
                 [ -e $p/fd/3 ] && { echo XX >> $p/fd/3 && echo wrote; }; done; true";
    assert_eq!(
        d.sh(&id, write),
        "",
        "the restored stdin memfd took a write"
    );
    assert_eq!(d.sh(&id, held), "kept by the background job");
}

#[test]
fn a_host_userns_sandbox_gets_its_stdin_and_cannot_change_it_either() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(belayer_ipc::SandboxSpec {
            image: "busybox".into(),
            userns: Some(belayer_ipc::UsernsMode::Host),
            ..belayer_ipc::SandboxSpec::default()
        })
        .id;
    // Host root (with the container capability set) in the sandbox: the seals still hold.
    let r = run(
        &d,
        ExecRequest {
            id,
            argv: vec!["echo XX >> /proc/self/fd/0; echo append=$?; cat".into()],
            stdin: b"\0host\n".to_vec(),
            ..Default::default()
        },
    );
    let out = String::from_utf8_lossy(&r.stdout).into_owned();
    assert!(
        out.starts_with("append=") && !out.starts_with("append=0"),
        "{out:?}"
    );
    assert!(out.ends_with("\0host\n"), "{out:?}");
}
