//! `ContextRemove` against a member of the socket group: it removes its own trajectories
//! (which gives their budget back, also for logs not used since a restart) and cannot remove
//! another peer's, which answers exactly like an unknown one; root removes anyone's by
//! `<name>@<uid>`. The peer is this test binary re-executed in a forked child that drops to
//! uid/gid 65534 with the socket group as a supplementary group.

use belayer_ipc::{ErrorCode, Request, Response};
use belayer_tests::peer::{error_of, response, run_as, Op, Outcome};
use belayer_tests::{Daemon, DaemonOptions, Identity};

const NOBODY: u32 = 65534;
/// Group allowed on the daemon socket.
const SOCKET_GID: u32 = 4273;
const MIB: usize = 1 << 20;

fn peer() -> Identity {
    Identity::nobody(&[SOCKET_GID])
}

/// The peer's entry point (see `belayer_tests::peer`).
#[test]
fn peer_child() {
    belayer_tests::peer::child_main();
}

fn remove(trajectory: &str) -> Request {
    Request::ContextRemove {
        trajectory: trajectory.into(),
    }
}

/// Three 1 MiB contexts fill a 4 MiB budget (with their charges); the fourth is refused.
fn fill(trajectory: &str) -> Op {
    Op::ContextAppends {
        trajectory: trajectory.into(),
        count: 4,
        bytes: MIB,
        distinct: false,
    }
}

fn appended(outcome: &Outcome) -> u32 {
    match outcome {
        Outcome::Appends { ok, .. } => *ok,
        other => panic!("expected appends, got {other:?}"),
    }
}

fn done(outcome: &Outcome) {
    match response(outcome) {
        Response::Done => {}
        other => panic!("expected Done, got {other:?}"),
    }
}

#[test]
fn removals_free_the_budget_and_reach_only_the_callers_own_logs() {
    let mut d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: "context_budget_bytes = 4194304\n".into(),
        socket_gid: Some(SOCKET_GID),
        ..DaemonOptions::default()
    });
    assert!(matches!(
        d.call(Request::ContextAppend {
            trajectory: "root-traj".into(),
            prefix: 1,
            context: b"root's".to_vec(),
        }),
        Response::Context(_)
    ));
    let peer_log = d.state_dir.join(format!("contexts/u{NOBODY}/big.ctxlog"));

    let results = run_as(
        &d,
        &peer(),
        &[
            // Root's trajectory, qualified and by plain name (the peer's own namespace).
            Op::Call(remove("root-traj@0")),
            Op::Call(remove("never-made@0")),
            Op::Call(remove("root-traj")),
            Op::Call(remove("../escape")),
            // A full budget, emptied by a removal.
            fill("big"),
            Op::Call(remove("big")),
            fill("big"),
        ],
    );
    let (code, message) = error_of(&results[0]);
    let (code2, message2) = error_of(&results[1]);
    assert_eq!(code, ErrorCode::NotFound, "{message}");
    assert_eq!(
        (code, message.replace("root-traj", "ID")),
        (code2, message2.replace("never-made", "ID")),
        "another peer's trajectory answers exactly like an unknown one"
    );
    assert_eq!(error_of(&results[2]).0, ErrorCode::NotFound);
    assert_eq!(error_of(&results[3]).0, ErrorCode::BadRequest);
    assert_eq!(appended(&results[4]), 3, "{:?}", results[4]);
    done(&results[5]);
    assert_eq!(
        appended(&results[6]),
        3,
        "the budget is back: {:?}",
        results[6]
    );
    assert!(peer_log.is_file());
    assert!(matches!(
        d.call(Request::ContextLookup {
            trajectory: "root-traj".into(),
            prefix: None,
        }),
        Response::Context(_)
    ));

    // After a restart (the log listed, not scanned), a removal frees its charge too; then
    // root removes the peer's new log by its qualified id.
    d.restart();
    let results = run_as(&d, &peer(), &[Op::Call(remove("big")), fill("big")]);
    done(&results[0]);
    assert_eq!(appended(&results[1]), 3, "{:?}", results[1]);
    assert!(matches!(d.call(remove("big@65534")), Response::Done));
    assert!(!peer_log.exists());
    let results = run_as(
        &d,
        &peer(),
        &[
            Op::Call(Request::ContextLookup {
                trajectory: "big".into(),
                prefix: None,
            }),
            fill("big"),
        ],
    );
    assert_eq!(error_of(&results[0]).0, ErrorCode::NotFound);
    assert_eq!(appended(&results[1]), 3);
    d.assert_alive("after the removals");
}
