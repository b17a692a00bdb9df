//! An unprivileged socket client for tests: the test binary re-executed in a forked child
//! that drops to another identity ([`Identity::apply`]) and performs a list of [`Op`]s
//! against a daemon, printing one [`Outcome`] per op.
//!
//! A test file using it declares the child's entry point, which does nothing unless the
//! environment says it is the child:
//!
//! ```ignore
//! #[test]
//! fn peer_child() {
//!     belayer_tests::peer::child_main();
//! }
//! ```

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::{Client, ClientError, ErrorCode, Event, Request, Response};
use serde::{Deserialize, Serialize};

use crate::{Daemon, Identity};

/// One step the peer performs.
#[derive(Debug, Serialize, Deserialize)]
pub enum Op {
    /// A request on a fresh connection.
    Call(Request),
    /// [`Client::import_image`]: the peer opens `path` itself and passes the descriptor.
    ImportFd {
        /// Image name.
        name: String,
        /// Source path, opened by the peer.
        path: PathBuf,
    },
    /// Subscribe, print `PEER-READY`, and collect events for `ms` milliseconds.
    Events {
        /// How long to collect, milliseconds.
        ms: u64,
    },
    /// `count` `ContextAppend`s on one connection, each of a `bytes`-byte context (made up
    /// in the peer, so they need not travel in its arguments): to trajectories
    /// `<trajectory>-<i>` when `distinct`, else to `trajectory` at prefixes `0..count`. Stops
    /// at the first answer that is not a context; gives [`Outcome::Appends`].
    ContextAppends {
        /// Trajectory id, or the prefix of the ids.
        trajectory: String,
        /// Appends to make.
        count: u32,
        /// Size of each context, bytes.
        bytes: usize,
        /// One new trajectory per append.
        distinct: bool,
    },
}

/// What one [`Op`] gave.
#[derive(Debug, Serialize, Deserialize)]
pub enum Outcome {
    /// The daemon's answer.
    Response(Box<Response>),
    /// The client failed (its error chain).
    ClientError(String),
    /// The events collected.
    Events(Vec<Event>),
    /// What [`Op::ContextAppends`] did.
    Appends {
        /// Appends answered with a context.
        ok: u32,
        /// The answer that stopped them, `None` when all went through.
        stopped: Option<Box<Outcome>>,
    },
}

const OPS_ENV: &str = "BELAYER_PEER_OPS";
const SOCKET_ENV: &str = "BELAYER_PEER_SOCKET";
/// The test function the child runs (`--exact`).
const CHILD_TEST: &str = "peer_child";

fn chain(err: &ClientError) -> String {
    belayer_ipc::error_chain(err)
}

/// The child's side: when re-executed by [`run_as_with`], performs the ops and prints one
/// `PEER-RESULT <json>` line per op; otherwise returns at once.
pub fn child_main() {
    let (Ok(ops), Ok(socket)) = (std::env::var(OPS_ENV), std::env::var(SOCKET_ENV)) else {
        return;
    };
    // SAFETY: geteuid takes no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_ne!(euid, 0, "the peer must run unprivileged");
    let ops: Vec<Op> = serde_json::from_str(&ops).expect("ops");
    for op in ops {
        let outcome = match op {
            Op::Call(request) => match Client::connect(&socket).and_then(|mut c| c.call(request)) {
                Ok(r) => Outcome::Response(Box::new(r)),
                Err(e) => Outcome::ClientError(chain(&e)),
            },
            Op::ImportFd { name, path } => {
                match Client::connect(&socket).and_then(|mut c| c.import_image(&name, &path)) {
                    Ok(r) => Outcome::Response(Box::new(r)),
                    Err(e) => Outcome::ClientError(chain(&e)),
                }
            }
            Op::ContextAppends {
                trajectory,
                count,
                bytes,
                distinct,
            } => context_appends(&socket, &trajectory, count, bytes, distinct),
            Op::Events { ms } => {
                let connected = Client::connect(&socket).and_then(Client::subscribe);
                match connected {
                    Err(e) => Outcome::ClientError(chain(&e)),
                    Ok(mut sub) => {
                        println!("PEER-READY");
                        let deadline = Instant::now() + Duration::from_millis(ms);
                        let mut events = Vec::new();
                        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                            match sub.next_event(Some(left)) {
                                Ok(Some(e)) => events.push(e),
                                Ok(None) => {}
                                Err(_) => break,
                            }
                        }
                        Outcome::Events(events)
                    }
                }
            }
        };
        println!(
            "PEER-RESULT {}",
            serde_json::to_string(&outcome).expect("json")
        );
    }
}

fn context_appends(
    socket: &str,
    trajectory: &str,
    count: u32,
    bytes: usize,
    distinct: bool,
) -> Outcome {
    let mut client = match Client::connect(socket) {
        Ok(c) => c,
        Err(e) => return Outcome::ClientError(chain(&e)),
    };
    for i in 0..count {
        let request = Request::ContextAppend {
            trajectory: if distinct {
                format!("{trajectory}-{i}")
            } else {
                trajectory.to_owned()
            },
            prefix: u64::from(i),
            context: vec![i as u8; bytes],
        };
        let stopped = match client.call(request) {
            Ok(Response::Context(_)) => continue,
            Ok(r) => Outcome::Response(Box::new(r)),
            Err(e) => Outcome::ClientError(chain(&e)),
        };
        return Outcome::Appends {
            ok: i,
            stopped: Some(Box::new(stopped)),
        };
    }
    Outcome::Appends {
        ok: count,
        stopped: None,
    }
}

/// Re-executes the running test binary as `who`, runs `ops` against `d`, calls `on_ready`
/// when the peer printed `PEER-READY` (its subscription is open), and returns one outcome
/// per op. Panics (with the child's stderr) when an op gave no outcome.
pub fn run_as_with(
    d: &Daemon,
    who: &Identity,
    ops: &[Op],
    mut on_ready: impl FnMut(),
) -> Vec<Outcome> {
    let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
    cmd.args(["--exact", CHILD_TEST, "--nocapture", "--test-threads=1"])
        .env(OPS_ENV, serde_json::to_string(ops).expect("json"))
        .env(SOCKET_ENV, &d.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    who.apply(&mut cmd);
    let mut child = cmd.spawn().expect("spawn the peer");
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut results = Vec::new();
    for line in stdout.lines() {
        let line = line.expect("peer output");
        // libtest prints `test peer_child ... ` in front of the first line.
        if line.trim_end().ends_with("PEER-READY") {
            on_ready();
        } else if let Some((_, json)) = line.split_once("PEER-RESULT ") {
            results.push(serde_json::from_str(json).expect("outcome"));
        }
    }
    let out = child.wait_with_output().expect("wait for the peer");
    assert_eq!(
        results.len(),
        ops.len(),
        "peer gave {} results for {} ops; stderr: {}",
        results.len(),
        ops.len(),
        String::from_utf8_lossy(&out.stderr)
    );
    results
}

/// [`run_as_with`] without a subscription.
pub fn run_as(d: &Daemon, who: &Identity, ops: &[Op]) -> Vec<Outcome> {
    run_as_with(d, who, ops, || {})
}

/// The response of an outcome; panics on anything else.
pub fn response(outcome: &Outcome) -> &Response {
    match outcome {
        Outcome::Response(r) => r,
        other => panic!("expected a response, got {other:?}"),
    }
}

/// Code and message of an error reply; panics on anything else.
pub fn error_of(outcome: &Outcome) -> (ErrorCode, String) {
    match response(outcome) {
        Response::Error(e) => (e.code, e.message.clone()),
        other => panic!("expected an error reply, got {other:?}"),
    }
}
