//! Sandboxes belong to the peer that created them: a member of the socket group (an
//! unprivileged uid) sees and acts only on its own; another peer's sandbox answers exactly
//! like an unknown id, is not listed, not collected by its gc and not in its event stream;
//! root sees everything. The peer is this test binary re-executed in a forked child that
//! drops to uid/gid 65534 with the socket group as a supplementary group.

use belayer_ipc::{
    CheckpointRequest, ErrorCode, Event, ExecRequest, MaybeCheckpointRequest, Request, Response,
    SandboxSpec, UsernsMode,
};
use belayer_tests::peer::{error_of, response, run_as, run_as_with, Op, Outcome};
use belayer_tests::{busybox_rootfs, Daemon, DaemonOptions, Identity};

/// Group allowed on the daemon socket.
const SOCKET_GID: u32 = 4271;

fn peer(groups: &[u32]) -> Identity {
    Identity::nobody(groups)
}

/// The peer's entry point (see `belayer_tests::peer`).
#[test]
fn peer_child() {
    belayer_tests::peer::child_main();
}

#[test]
fn a_group_member_sees_and_acts_only_on_its_own_sandboxes() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    d.image("busybox", &busybox_rootfs());
    let roots = d.create_spec(SandboxSpec {
        image: "busybox".into(),
        tag: Some("shared-tag".into()),
        ..Default::default()
    });
    let id = roots.id.clone();
    d.sh(&id, "echo root-state > /root/state");
    d.checkpoint(&id, 1, b"root's context");
    let made_up = "sb-000000000000".to_string();

    let requests = |id: &str| -> Vec<Request> {
        vec![
            Request::InspectSandbox { id: id.into() },
            Request::Exec(ExecRequest {
                id: id.into(),
                argv: vec!["cat /root/state".into()],
                ..Default::default()
            }),
            Request::Checkpoint(CheckpointRequest {
                id: id.into(),
                prefix: 2,
                context: b"stolen".to_vec(),
                fault: None,
            }),
            Request::MaybeCheckpoint(MaybeCheckpointRequest {
                id: id.into(),
                prefix: 2,
                context: vec![],
                step_duration_s: 1.0,
                regen_cost_s: None,
                llm_elapsed_s: 0.0,
                llm_response_s: None,
                policy: None,
            }),
            Request::Restore {
                id: id.into(),
                verify: false,
                prefix: None,
            },
            Request::RestoreCheckpoint {
                id: id.into(),
                verify: false,
                checkpoint: "c000001-k1".into(),
            },
            Request::ListCheckpoints { id: id.into() },
            Request::RemoveSandbox { id: id.into() },
        ]
    };
    let mut ops: Vec<Op> = Vec::new();
    ops.extend(requests(&id).into_iter().map(Op::Call));
    ops.extend(requests(&made_up).into_iter().map(Op::Call));
    ops.push(Op::Call(Request::ListSandboxes));
    ops.push(Op::Call(Request::Gc {
        older_than_s: Some(0),
        tag: Some("shared-tag".into()),
    }));
    ops.push(Op::Call(Request::RemoveImage {
        name: "busybox".into(),
    }));
    ops.push(Op::Call(Request::CreateSandbox(SandboxSpec {
        image: "busybox".into(),
        ..Default::default()
    })));
    ops.push(Op::Call(Request::ListSandboxes));
    let results = run_as(&d, &peer(&[SOCKET_GID]), &ops);
    let n = requests("").len();
    for i in 0..n {
        let (code, message) = error_of(&results[i]);
        let (code2, message2) = error_of(&results[n + i]);
        assert_eq!(code, ErrorCode::UnknownSandbox, "{message}");
        assert_eq!(
            (code, message.replace(&id, "ID")),
            (code2, message2.replace(&made_up, "ID")),
            "another peer's sandbox answers exactly like an unknown id"
        );
    }
    match response(&results[2 * n]) {
        Response::Sandboxes(v) => assert!(v.is_empty(), "{v:?}"),
        other => panic!("{other:?}"),
    }
    match response(&results[2 * n + 1]) {
        Response::Gc { removed, .. } => assert_eq!(*removed, 0),
        other => panic!("{other:?}"),
    }
    let (code, message) = error_of(&results[2 * n + 2]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    let own = match response(&results[2 * n + 3]) {
        Response::Sandbox(s) => s.id.clone(),
        other => panic!("a group member creates its own sandbox: {other:?}"),
    };
    match response(&results[2 * n + 4]) {
        Response::Sandboxes(v) => {
            assert_eq!(
                v.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
                [own.as_str()]
            )
        }
        other => panic!("{other:?}"),
    }

    // Root's sandbox is untouched; root sees both.
    assert_eq!(d.inspect(&id).state, "running");
    assert_eq!(d.sh(&id, "cat /root/state"), "root-state");
    match d.call(Request::ListCheckpoints { id: id.clone() }) {
        Response::Checkpoints(v) => assert_eq!(v.len(), 1),
        r => panic!("{r:?}"),
    }
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => assert_eq!(v.len(), 2),
        r => panic!("{r:?}"),
    }

    // The peer's own sandbox works for it; its event stream holds only its own sandbox.
    let results = run_as_with(
        &d,
        &peer(&[SOCKET_GID]),
        &[
            Op::Call(Request::Exec(ExecRequest {
                id: own.clone(),
                argv: vec!["echo mine".into()],
                ..Default::default()
            })),
            Op::Events { ms: 4000 },
        ],
        || {
            d.checkpoint(&id, 2, b"root k=2");
            d.checkpoint(&own, 1, b"peer k=1");
        },
    );
    match response(&results[0]) {
        Response::Exec(r) => assert_eq!(r.stdout, b"mine\n"),
        other => panic!("{other:?}"),
    }
    match &results[1] {
        Outcome::Events(events) => {
            assert!(
                events.iter().any(
                    |e| matches!(e, Event::CheckpointReady { id: e_id, prefix: 1 } if *e_id == own)
                ),
                "{events:?}"
            );
            assert!(
                !events.iter().any(|e| match e {
                    Event::CheckpointReady { id: e_id, .. }
                    | Event::SandboxFailed { id: e_id, .. } => *e_id == id,
                }),
                "root's sandbox events leak: {events:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn only_root_may_ask_for_the_host_user_namespace() {
    // Sandbox root in the host's user namespace is host uid 0: a group member asking for it
    // would run processes with more rights than its own.
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    d.image("busybox", &busybox_rootfs());
    let spec = |userns| {
        Request::CreateSandbox(SandboxSpec {
            image: "busybox".into(),
            userns,
            ..Default::default()
        })
    };
    let results = run_as(
        &d,
        &peer(&[SOCKET_GID]),
        &[
            Op::Call(spec(Some(UsernsMode::Host))),
            Op::Call(spec(Some(UsernsMode::Private))),
            Op::Call(Request::ListSandboxes),
        ],
    );
    let (code, message) = error_of(&results[0]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    let own = match response(&results[1]) {
        Response::Sandbox(s) => s,
        other => panic!("a private sandbox is the peer's to make: {other:?}"),
    };
    assert_eq!(
        own.userns.as_ref().map(|u| u.mode.as_str()),
        Some("private")
    );
    match response(&results[2]) {
        Response::Sandboxes(v) => assert_eq!(v.len(), 1, "{v:?}"),
        other => panic!("{other:?}"),
    }
    // Root keeps the explicit opt-in.
    let host = d.create_spec(SandboxSpec {
        image: "busybox".into(),
        userns: Some(UsernsMode::Host),
        ..Default::default()
    });
    assert_eq!(host.userns.map(|u| u.mode), Some("host".to_string()));
}

#[test]
fn a_group_member_gets_at_most_the_defaults_and_a_bounded_number_of_sandboxes() {
    // The operator's defaults are the ceilings of non-root peers: a peer cannot hand its
    // sandboxes more memory, tasks, CPU or disk, nor hold more than max_sandboxes_per_uid.
    let d = Daemon::start_options(DaemonOptions {
        socket_gid: Some(SOCKET_GID),
        config: "default_memory_max_bytes = 268435456\ndefault_pids_max = 256\n\
                 default_cpus = 1.0\ndefault_disk_max_bytes = 1073741824\n\
                 max_sandboxes_per_uid = 2\n"
            .into(),
        ..DaemonOptions::default()
    });
    d.image("busybox", &busybox_rootfs());
    let spec = |f: &dyn Fn(&mut SandboxSpec)| {
        let mut s = SandboxSpec {
            image: "busybox".into(),
            ..Default::default()
        };
        f(&mut s);
        Op::Call(Request::CreateSandbox(s))
    };
    let results = run_as(
        &d,
        &peer(&[SOCKET_GID]),
        &[
            spec(&|s| s.memory_max = Some(512 << 20)),
            spec(&|s| s.pids_max = Some(100_000)),
            spec(&|s| s.cpus = Some(2.0)),
            spec(&|s| s.disk_max = Some(2 << 30)),
            spec(&|s| s.memory_max = Some(128 << 20)),
            spec(&|_| ()),
            spec(&|_| ()),
        ],
    );
    for (i, limit) in ["memory_max", "pids_max", "cpus", "disk_max"]
        .iter()
        .enumerate()
    {
        let (code, message) = error_of(&results[i]);
        assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
        assert!(
            message.contains(limit) && message.contains("ceiling"),
            "{message}"
        );
    }
    for r in &results[4..6] {
        assert!(matches!(response(r), Response::Sandbox(_)), "{r:?}");
    }
    let (code, message) = error_of(&results[6]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    assert!(message.contains("already holds 2 sandboxes"), "{message}");
    // Creations in flight count: parallel requests cannot overshoot the cap either.
    let _ = d.call(Request::RemoveSandbox {
        id: match response(&results[5]) {
            Response::Sandbox(s) => s.id.clone(),
            other => panic!("{other:?}"),
        },
    });
    let who = peer(&[SOCKET_GID]);
    let made = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| scope.spawn(|| run_as(&d, &who, &[spec(&|_| ())])))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|r| matches!(response(&r[0]), Response::Sandbox(_)))
            .count()
    });
    assert_eq!(
        made, 1,
        "parallel creations went past max_sandboxes_per_uid"
    );
    // Nothing was made by the refused requests; root is not limited.
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => assert_eq!(v.len(), 2, "{v:?}"),
        other => panic!("{other:?}"),
    }
    let big = d.create_spec(SandboxSpec {
        image: "busybox".into(),
        memory_max: Some(512 << 20),
        ..Default::default()
    });
    assert_eq!(d.sh(&big.id, "echo ok"), "ok");
}
