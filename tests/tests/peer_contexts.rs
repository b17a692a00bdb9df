//! LLM-context logs (`ContextAppend` / `ContextLookup`) against a hostile member of the socket
//! group: it can neither read nor poison another peer's trajectory (which answers exactly like
//! an unknown one), nor make the daemon hold a descriptor per trajectory or a context in
//! memory, nor fill the state disk past its budget. The peer is this test binary re-executed
//! in a forked child that drops to uid/gid 65534 with the socket group as a supplementary
//! group.

use std::os::unix::ffi::OsStrExt;

use belayer_ipc::{ErrorCode, ExecRequest, Request, Response, SandboxSpec};
use belayer_tests::peer::{error_of, response, run_as, Op, Outcome};
use belayer_tests::{busybox_rootfs, Daemon, DaemonOptions, Identity};

const NOBODY: u32 = 65534;
/// Group allowed on the daemon socket.
const SOCKET_GID: u32 = 4272;
/// `belayer_agent::daemon::contexts::MAX_OPEN_LOGS`.
const MAX_OPEN_LOGS: usize = 64;

fn peer() -> Identity {
    Identity {
        uid: NOBODY,
        gid: NOBODY,
        groups: vec![SOCKET_GID],
    }
}

/// The peer's entry point (see `belayer_tests::peer`).
#[test]
fn peer_child() {
    belayer_tests::peer::child_main();
}

fn append(trajectory: &str, prefix: u64, context: &[u8]) -> Request {
    Request::ContextAppend {
        trajectory: trajectory.into(),
        prefix,
        context: context.to_vec(),
    }
}

fn lookup(trajectory: &str, prefix: Option<u64>) -> Request {
    Request::ContextLookup {
        trajectory: trajectory.into(),
        prefix,
    }
}

/// The context of a lookup answer; panics on anything else.
fn context_of(r: &Response) -> Vec<u8> {
    match r {
        Response::Context(e) => e.context.clone(),
        other => panic!("expected a context, got {other:?}"),
    }
}

fn fds_of(d: &Daemon) -> usize {
    let pid = d.pid().expect("daemon running");
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("daemon fds")
        .count()
}

fn rss_kib(d: &Daemon) -> u64 {
    let pid = d.pid().expect("daemon running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

fn appends(outcome: &Outcome) -> (u32, Option<&Outcome>) {
    match outcome {
        Outcome::Appends { ok, stopped } => (*ok, stopped.as_deref()),
        other => panic!("expected appends, got {other:?}"),
    }
}

#[test]
fn another_peers_trajectory_answers_like_an_unknown_one_across_a_restart() {
    let mut d = Daemon::start_with_socket_gid(SOCKET_GID);
    let root_ctx = b"root's context at k=1";
    let entry = match d.call(append("root-traj", 1, root_ctx)) {
        Response::Context(e) => e,
        r => panic!("{r:?}"),
    };

    // Lookups of root's trajectory and of an unknown one (pairs), then appends into root's
    // namespace (a pair); `plain`: also by plain name, while the peer has none of its own.
    let probes = |d: &Daemon, plain: bool| {
        let mut ops = Vec::new();
        for (mine, unknown) in [("root-traj", "never-made"), ("root-traj@0", "never-made@0")] {
            if mine == "root-traj" && !plain {
                continue;
            }
            for prefix in [None, Some(1)] {
                ops.push(Op::Call(lookup(mine, prefix)));
                ops.push(Op::Call(lookup(unknown, prefix)));
            }
        }
        let lookups = ops.len();
        ops.push(Op::Call(append("root-traj@0", 2, b"POISONED by uid 65534")));
        ops.push(Op::Call(append(
            "never-made@0",
            2,
            b"POISONED by uid 65534",
        )));
        let results = run_as(d, &peer(), &ops);
        for pair in results[..lookups].chunks(2) {
            let (code, message) = error_of(&pair[0]);
            let (code2, message2) = error_of(&pair[1]);
            assert_eq!(code, ErrorCode::NotFound, "{message}");
            assert_eq!(
                (code, message.replace("root-traj", "ID")),
                (code2, message2.replace("never-made", "ID")),
                "another peer's trajectory answers exactly like an unknown one"
            );
        }
        let (code, message) = error_of(&results[lookups]);
        let (code2, message2) = error_of(&results[lookups + 1]);
        assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
        assert_eq!(
            (code, message.replace("root-traj", "ID")),
            (code2, message2.replace("never-made", "ID")),
            "refused alike whether or not it exists"
        );
    };
    probes(&d, true);
    // A plain append of the same name makes the peer's own trajectory, as for a new name.
    let results = run_as(
        &d,
        &peer(),
        &[
            Op::Call(append("root-traj", 1, b"POISONED by uid 65534")),
            Op::Call(lookup("root-traj", None)),
        ],
    );
    match response(&results[0]) {
        Response::Context(e) => assert_eq!(e.record, entry.record, "a new log's first record"),
        r => panic!("{r:?}"),
    }
    assert_eq!(context_of(response(&results[1])), b"POISONED by uid 65534");

    let check_root = |d: &Daemon| {
        match d.call(lookup("root-traj", None)) {
            Response::Context(e) => {
                assert_eq!(e.context, root_ctx, "root's trajectory is unchanged");
                assert_eq!(
                    (e.prefix, e.record, &e.digest),
                    (1, entry.record, &entry.digest)
                );
            }
            r => panic!("{r:?}"),
        }
        // Root sees the peer's trajectory under its qualified id.
        assert_eq!(
            context_of(&d.call(lookup("root-traj@65534", Some(1)))),
            b"POISONED by uid 65534"
        );
    };
    check_root(&d);

    // Owners and lookups survive a restart.
    d.restart();
    check_root(&d);
    probes(&d, false);
    let results = run_as(&d, &peer(), &[Op::Call(lookup("root-traj", Some(1)))]);
    assert_eq!(context_of(response(&results[0])), b"POISONED by uid 65534");
    d.assert_alive("after the probes");
}

#[test]
fn a_thousand_trajectories_keep_the_daemons_descriptors_bounded() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    d.image("busybox", &busybox_rootfs());
    let pid = d.pid().expect("daemon running");
    // The red team's set-up: with one descriptor per trajectory, ~270 of them exhausted this.
    let limit = libc::rlimit {
        rlim_cur: 300,
        rlim_max: 300,
    };
    // SAFETY: prlimit(2) on the daemon's pid with a valid rlimit and no old-value pointer.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let before = fds_of(&d);

    let results = run_as(
        &d,
        &peer(),
        &[
            Op::ContextAppends {
                trajectory: "flood".into(),
                count: 1000,
                bytes: 64,
                distinct: true,
            },
            Op::Call(lookup("flood-0", Some(0))),
            Op::Call(lookup("flood-999", Some(999))),
        ],
    );
    let (ok, stopped) = appends(&results[0]);
    assert_eq!(ok, 1000, "stopped by {stopped:?}");
    assert_eq!(context_of(response(&results[1])), vec![0u8; 64]);
    assert_eq!(
        context_of(response(&results[2])),
        vec![(999 % 256) as u8; 64]
    );
    let after = fds_of(&d);
    eprintln!("daemon fds: {before} before, {after} after 1000 trajectories");
    assert!(
        after <= before + MAX_OPEN_LOGS + 4,
        "daemon fds grew from {before} to {after}"
    );

    // Root's work that needs descriptors still goes through.
    let sb = d.create_spec(SandboxSpec {
        image: "busybox".into(),
        ..Default::default()
    });
    assert_eq!(d.sh(&sb.id, "echo still-serving"), "still-serving");
    match d.call(Request::Exec(ExecRequest {
        id: sb.id.clone(),
        argv: vec!["true".into()],
        ..Default::default()
    })) {
        Response::Exec(r) => assert_eq!(r.exit_code, 0),
        r => panic!("{r:?}"),
    }
    assert!(matches!(
        d.call(Request::RemoveSandbox { id: sb.id.clone() }),
        Response::Done
    ));
    assert_eq!(
        context_of(&d.call(lookup("flood-500@65534", Some(500)))),
        vec![(500 % 256) as u8; 64]
    );
    d.assert_alive("after the flood");
}

#[test]
fn contexts_stay_on_disk_not_in_the_daemons_memory() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    const MIB: usize = 1 << 20;
    // Warm up: the buffers one append and one lookup of this size need (frame, request,
    // record, response) are allocated and freed once before the baseline.
    let warm = run_as(
        &d,
        &peer(),
        &[
            Op::ContextAppends {
                trajectory: "warm".into(),
                count: 4,
                bytes: 4 * MIB,
                distinct: false,
            },
            Op::Call(lookup("warm", Some(1))),
        ],
    );
    assert_eq!(appends(&warm[0]).0, 4);
    assert_eq!(context_of(response(&warm[1])), vec![1u8; 4 * MIB]);
    let before = rss_kib(&d);
    let results = run_as(
        &d,
        &peer(),
        &[
            Op::ContextAppends {
                trajectory: "big".into(),
                count: 50,
                bytes: 4 * MIB,
                distinct: false,
            },
            Op::Call(lookup("big", Some(7))),
            Op::Call(lookup("big", None)),
        ],
    );
    let (ok, stopped) = appends(&results[0]);
    assert_eq!(ok, 50, "stopped by {stopped:?}");
    assert_eq!(context_of(response(&results[1])), vec![7u8; 4 * MIB]);
    assert_eq!(context_of(response(&results[2])), vec![49u8; 4 * MIB]);
    let after = rss_kib(&d);
    eprintln!("daemon RSS: {before} KiB before, {after} KiB after 200 MiB of contexts");
    // The allocator may keep a few freed 4 MiB buffers (one per connection thread's arena),
    // never the 200 MiB.
    assert!(
        after <= before + 16 * 1024,
        "200 MiB of contexts grew the daemon's RSS from {before} KiB to {after} KiB"
    );
    d.assert_alive("after 200 MiB of contexts");
}

#[test]
fn the_budget_and_the_size_limit_refuse_with_clear_errors() {
    const MIB: usize = 1 << 20;
    let mut d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: "context_budget_bytes = 4194304\ncontext_max_bytes = 1048576\n".into(),
        socket_gid: Some(SOCKET_GID),
        ..DaemonOptions::default()
    });
    let fill = |d: &Daemon| {
        run_as(
            d,
            &peer(),
            &[
                Op::ContextAppends {
                    trajectory: "big".into(),
                    count: 10,
                    bytes: MIB,
                    distinct: false,
                },
                // A new trajectory whose first record does not fit either.
                Op::ContextAppends {
                    trajectory: "other".into(),
                    count: 1,
                    bytes: MIB,
                    distinct: false,
                },
                // One byte over the size limit.
                Op::ContextAppends {
                    trajectory: "big".into(),
                    count: 1,
                    bytes: MIB + 1,
                    distinct: false,
                },
                Op::Call(lookup("big", Some(2))),
                Op::Call(lookup("other", None)),
            ],
        )
    };
    let results = fill(&d);
    let (ok, stopped) = appends(&results[0]);
    assert_eq!(
        ok, 3,
        "3 MiB and their charges fit in 4 MiB, a fourth does not"
    );
    let (code, message) = error_of(stopped.expect("refused"));
    assert_eq!(code, ErrorCode::InvalidState, "{message}");
    assert!(
        message.contains("context budget of uid 65534 exhausted") && message.contains("4194304"),
        "{message}"
    );
    let (ok, stopped) = appends(&results[1]);
    assert_eq!(ok, 0);
    let (code, message) = error_of(stopped.expect("refused"));
    assert_eq!(
        code,
        ErrorCode::InvalidState,
        "a new trajectory too: {message}"
    );
    let (ok, stopped) = appends(&results[2]);
    assert_eq!(ok, 0);
    let (code, message) = error_of(stopped.expect("refused"));
    assert_eq!(code, ErrorCode::BadRequest, "{message}");
    assert!(
        message.contains("exceeds the limit of 1048576"),
        "{message}"
    );
    assert_eq!(context_of(response(&results[3])), vec![2u8; MIB]);
    assert_eq!(
        error_of(&results[4]).0,
        ErrorCode::NotFound,
        "nothing was created"
    );

    // Root's budget is its own (unlimited by default); the size limit holds for it too.
    assert!(matches!(
        d.call(append("root-big", 1, &vec![0; MIB])),
        Response::Context(_)
    ));
    match d.call(append("root-big", 2, &vec![0; MIB + 1])) {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest),
        r => panic!("{r:?}"),
    }

    // The charges are rebuilt from the logs after a restart.
    d.restart();
    let results = fill(&d);
    let (ok, stopped) = appends(&results[0]);
    assert_eq!(ok, 0, "still full after a restart");
    assert_eq!(
        error_of(stopped.expect("refused")).0,
        ErrorCode::InvalidState
    );
    assert_eq!(context_of(response(&results[3])), vec![2u8; MIB]);
    d.assert_alive("after the budget probes");
}

/// What a call answered: its error code, or `None` for a context.
fn code_of(r: &Response) -> Option<ErrorCode> {
    match r {
        Response::Context(_) => None,
        Response::Error(e) => Some(e.code),
        other => panic!("expected a context or an error, got {other:?}"),
    }
}

#[test]
fn planted_links_and_corrupt_logs_neither_crash_the_daemon_nor_are_followed() {
    let mut d = Daemon::start_with_socket_gid(SOCKET_GID);
    for (t, k) in [("linked", 1), ("trunc", 1), ("trunc", 2), ("huge", 1)] {
        assert!(matches!(
            d.call(append(t, k, format!("{t} {k}").as_bytes())),
            Response::Context(_)
        ));
    }
    let results = run_as(&d, &peer(), &[Op::Call(append("mine", 1, b"peer's"))]);
    assert!(matches!(response(&results[0]), Response::Context(_)));
    d.kill();

    let contexts = d.state_dir.join("contexts");
    let outside = d.state_dir.parent().expect("test dir").join("outside");
    std::fs::create_dir_all(&outside).expect("outside dir");
    // Real logs moved out of the dir, reachable only through links planted in their place.
    std::fs::rename(
        contexts.join("linked.ctxlog"),
        outside.join("linked.ctxlog"),
    )
    .unwrap();
    let linked = std::fs::read(outside.join("linked.ctxlog")).unwrap();
    std::os::unix::fs::symlink(
        outside.join("linked.ctxlog"),
        contexts.join("linked.ctxlog"),
    )
    .unwrap();
    std::fs::rename(contexts.join("u65534"), outside.join("u65534")).unwrap();
    std::os::unix::fs::symlink(outside.join("u65534"), contexts.join("u65534")).unwrap();
    // A torn last record, a frame announcing 4 GiB, a file that is no log, a FIFO, junk.
    let trunc = contexts.join("trunc.ctxlog");
    let len = std::fs::metadata(&trunc).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&trunc)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let huge = contexts.join("huge.ctxlog");
    let huge_len = std::fs::metadata(&huge).unwrap().len();
    let mut bytes = std::fs::read(&huge).unwrap();
    bytes.extend_from_slice(&u32::MAX.to_le_bytes());
    bytes.extend_from_slice(&[0xee; 64]);
    std::fs::write(&huge, &bytes).unwrap();
    std::fs::write(contexts.join("garbage.ctxlog"), b"not a context log").unwrap();
    let fifo = std::ffi::CString::new(contexts.join("fifo.ctxlog").as_os_str().as_bytes())
        .expect("no NUL in the path");
    // SAFETY: mkfifo(3) with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    std::fs::create_dir_all(contexts.join("u0")).unwrap();
    std::fs::write(contexts.join("u0/sneaky.ctxlog"), b"x").unwrap();
    std::fs::create_dir_all(contexts.join("dir.ctxlog")).unwrap();

    d.restart();
    let before = fds_of(&d);
    // Links are not followed: the logs behind them are unknown, and appends fail without
    // writing through them.
    assert_eq!(
        code_of(&d.call(lookup("linked", None))),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code_of(&d.call(lookup("mine@65534", None))),
        Some(ErrorCode::NotFound)
    );
    assert_eq!(
        code_of(&d.call(append("linked", 2, b"through a link"))),
        Some(ErrorCode::Internal)
    );
    let results = run_as(
        &d,
        &peer(),
        &[
            Op::Call(lookup("mine", None)),
            Op::Call(append("new", 1, b"into a linked dir")),
        ],
    );
    assert_eq!(error_of(&results[0]).0, ErrorCode::NotFound);
    assert_eq!(
        error_of(&results[1]).0,
        ErrorCode::Internal,
        "{:?}",
        results[1]
    );
    assert!(!outside.join("u65534/new.ctxlog").exists());
    assert_eq!(
        std::fs::read_dir(outside.join("u65534")).unwrap().count(),
        1
    );
    assert_eq!(
        std::fs::read(outside.join("linked.ctxlog")).unwrap(),
        linked,
        "the linked log is untouched"
    );
    // Damaged logs keep their complete records; the others fail for themselves only.
    match d.call(lookup("trunc", None)) {
        Response::Context(e) => assert_eq!((e.prefix, e.context), (1, b"trunc 1".to_vec())),
        r => panic!("{r:?}"),
    }
    match d.call(lookup("huge", None)) {
        Response::Context(e) => assert_eq!((e.prefix, e.context), (1, b"huge 1".to_vec())),
        r => panic!("{r:?}"),
    }
    assert_eq!(std::fs::metadata(&huge).unwrap().len(), huge_len);
    for t in ["garbage", "fifo", "dir", "sneaky"] {
        let code = code_of(&d.call(lookup(t, None)));
        assert!(
            matches!(code, Some(ErrorCode::NotFound | ErrorCode::Internal)),
            "{t}: {code:?}"
        );
        let code = code_of(&d.call(append(t, 1, b"x")));
        assert!(
            matches!(code, None | Some(ErrorCode::Internal)),
            "{t}: {code:?}"
        );
    }
    assert_eq!(
        code_of(&d.call(append("trunc", 2, b"trunc 2 again"))),
        None,
        "a cut log takes appends"
    );
    assert!(
        fds_of(&d) <= before + 8,
        "no descriptor leaked on the failures"
    );
    d.assert_alive("after the planted files");
    // Another restart adopts the same way.
    d.restart();
    match d.call(lookup("trunc", None)) {
        Response::Context(e) => assert_eq!((e.prefix, e.context), (2, b"trunc 2 again".to_vec())),
        r => panic!("{r:?}"),
    }
    d.assert_alive("after a second restart");
}
