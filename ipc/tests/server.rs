//! A real server on a temporary Unix socket, real clients, hostile peers and a peer that drops
//! root before connecting.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use belayer_ipc::{
    encode_frame, read_frame, AccessPolicy, BindError, Client, ClientError, Envelope, ErrorCode,
    ErrorReply, ExecRequest, ExecResult, FrameError, Handler, Header, Kind, PeerCred, Request,
    Response, Server, ServerConfig, ServerError, ServerHandle, DEFAULT_MAX_FRAME, HEADER_LEN,
};

/// Answers Ping with Pong, echoes Exec argv into stdout (with the peer's uid and gid in
/// exit_code and signal), sleeps for `["sleep", ms]`, answers `["repeat", n]` with n bytes of
/// stdout, panics on Status.
#[derive(Default)]
struct Echo {
    finished: AtomicUsize,
}

impl Handler for Echo {
    fn handle(&self, peer: &PeerCred, request: Request) -> Response {
        let response = match request {
            Request::Ping => Response::Pong {
                version: "test".to_owned(),
            },
            Request::Exec(exec) => {
                let mut stdout = exec.argv.join(" ").into_bytes();
                if let [verb, arg] = exec.argv.as_slice() {
                    match verb.as_str() {
                        "sleep" => thread::sleep(Duration::from_millis(arg.parse().unwrap())),
                        "repeat" => stdout = vec![b'x'; arg.parse().unwrap()],
                        _ => {}
                    }
                }
                Response::Exec(ExecResult {
                    exit_code: peer.uid as i32,
                    signal: Some(peer.gid as i32),
                    stdout,
                    ..ExecResult::default()
                })
            }
            Request::Status => panic!("handler failure on purpose"),
            _ => Response::Done,
        };
        self.finished.fetch_add(1, Ordering::SeqCst);
        response
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: PathBuf,
    echo: Arc<Echo>,
    handle: ServerHandle,
}

fn start(configure: impl FnOnce(ServerConfig) -> ServerConfig) -> Running {
    let dir = tempfile::tempdir().unwrap();
    // Let an unprivileged helper reach the socket inside.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("run/belayer.sock");
    let server = Server::bind(configure(ServerConfig::new(&path))).unwrap();
    let echo = Arc::new(Echo::default());
    let handle = server.spawn(echo.clone()).unwrap();
    Running {
        _dir: dir,
        path,
        echo,
        handle,
    }
}

fn exec(argv: &[&str]) -> Request {
    Request::Exec(ExecRequest {
        id: "sb-1".to_owned(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        ..ExecRequest::default()
    })
}

fn assert_pong(client: &mut Client) {
    match client.call(Request::Ping).unwrap() {
        Response::Pong { version } => assert_eq!(version, "test"),
        other => panic!("{other:?}"),
    }
}

/// Sends raw bytes on a fresh connection; expects one BadRequest error frame with id 0 whose
/// message contains `needle`, then the end of the connection.
fn expect_bad_request(path: &Path, bytes: &[u8], half_close: bool, needle: &str) {
    let mut raw = UnixStream::connect(path).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server may answer and close before it reads everything; a failed write is fine.
    let _ = raw.write_all(bytes);
    if half_close {
        raw.shutdown(Shutdown::Write).unwrap();
    }
    let reply: Envelope<Response> = read_frame(&mut raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(reply.id, 0);
    match reply.body {
        Response::Error(ErrorReply {
            code: ErrorCode::BadRequest,
            message,
        }) => assert!(message.contains(needle), "{message:?} lacks {needle:?}"),
        other => panic!("{other:?}"),
    }
    // Then the server closes: end of stream, or a reset when it left our bytes unread.
    let mut rest = Vec::new();
    match raw.read_to_end(&mut rest) {
        Ok(_) => assert!(
            rest.is_empty(),
            "unexpected bytes after the error: {rest:?}"
        ),
        Err(err) => assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset),
    }
}

fn request_frame(id: u64, request: Request) -> Vec<u8> {
    encode_frame(&Envelope { id, body: request }, DEFAULT_MAX_FRAME).unwrap()
}

#[test]
fn socket_file_gets_mode_0660_and_group_and_is_removed_on_shutdown() {
    let running = start(|config| config.group(4242));
    let meta = std::fs::metadata(&running.path).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o660);
    assert_eq!(meta.gid(), 4242);
    let path = running.path.clone();
    running.handle.shutdown().unwrap();
    assert!(!path.exists());
}

#[test]
fn a_good_client_keeps_working_while_bad_connections_are_answered_and_closed() {
    let running = start(|config| config);
    let mut good = Client::connect(&running.path).unwrap();
    assert_pong(&mut good);

    let ping = request_frame(1, Request::Ping);

    expect_bad_request(
        &running.path,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        false,
        "bad magic",
    );
    assert_pong(&mut good);

    let oversized = Header {
        kind: Kind::Request,
        len: DEFAULT_MAX_FRAME + 1,
        crc: 0,
    };
    expect_bad_request(
        &running.path,
        &oversized.to_bytes(),
        false,
        "exceeds the maximum",
    );
    assert_pong(&mut good);

    let mut wrong_version = ping.clone();
    let next = belayer_ipc::PROTOCOL_VERSION + 1;
    wrong_version[4..6].copy_from_slice(&next.to_le_bytes());
    expect_bad_request(
        &running.path,
        &wrong_version,
        false,
        &format!("unsupported protocol version {next}"),
    );
    assert_pong(&mut good);

    let mut flags = ping.clone();
    flags[7] = 1;
    expect_bad_request(&running.path, &flags, false, "reserved flags");

    let mut unknown_kind = ping.clone();
    unknown_kind[6] = 9;
    expect_bad_request(
        &running.path,
        &unknown_kind,
        false,
        "unknown message kind 9",
    );

    let mut corrupt = request_frame(1, exec(&["echo", "payload"]));
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0x10;
    expect_bad_request(&running.path, &corrupt, false, "crc32 mismatch");
    assert_pong(&mut good);

    // Valid header and CRC around a payload that is no request.
    let payload = [1u8, 250];
    let mut undecodable = Header {
        kind: Kind::Request,
        len: payload.len() as u32,
        crc: crc32fast::hash(&payload),
    }
    .to_bytes()
    .to_vec();
    undecodable.extend_from_slice(&payload);
    expect_bad_request(
        &running.path,
        &undecodable,
        false,
        "decoding the request payload",
    );

    // A response sent to the server.
    let response = encode_frame(
        &Envelope {
            id: 1,
            body: Response::Done,
        },
        DEFAULT_MAX_FRAME,
    )
    .unwrap();
    expect_bad_request(&running.path, &response, false, "unexpected response frame");

    // Half a frame, then the client stops writing.
    expect_bad_request(
        &running.path,
        &ping[..HEADER_LEN + 1],
        true,
        "stream ended mid-frame",
    );

    // A good request, then garbage on the same connection: the first is answered normally.
    let mut raw = UnixStream::connect(&running.path).unwrap();
    let mut bytes = request_frame(77, Request::Ping);
    bytes.extend_from_slice(b"garbage after a good frame");
    raw.write_all(&bytes).unwrap();
    let first: Envelope<Response> = read_frame(&mut raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(first.id, 77);
    assert!(matches!(first.body, Response::Pong { .. }));
    let second: Envelope<Response> = read_frame(&mut raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(second.id, 0);
    assert!(matches!(
        second.body,
        Response::Error(ErrorReply {
            code: ErrorCode::BadRequest,
            ..
        })
    ));

    assert_pong(&mut good);
    running.handle.shutdown().unwrap();
}

#[test]
fn a_client_leaving_mid_request_does_not_disturb_the_server() {
    let running = start(|config| config);
    let mut good = Client::connect(&running.path).unwrap();
    assert_pong(&mut good);
    let before = running.echo.finished.load(Ordering::SeqCst);

    // Send a slow request and vanish before the answer.
    let mut leaver = UnixStream::connect(&running.path).unwrap();
    leaver
        .write_all(&request_frame(5, exec(&["sleep", "200"])))
        .unwrap();
    drop(leaver);

    // Half a frame, then gone.
    let mut half = UnixStream::connect(&running.path).unwrap();
    half.write_all(&request_frame(6, Request::Ping)[..10])
        .unwrap();
    drop(half);

    let deadline = Instant::now() + Duration::from_secs(10);
    while running.echo.finished.load(Ordering::SeqCst) < before + 1 {
        assert!(
            Instant::now() < deadline,
            "the slow request was never finished"
        );
        thread::sleep(Duration::from_millis(10));
    }
    // The handler finished, its write failed quietly; everyone else is fine.
    assert_pong(&mut good);
    let mut fresh = Client::connect(&running.path).unwrap();
    assert_pong(&mut fresh);
    running.handle.shutdown().unwrap();
}

#[test]
fn concurrent_clients_get_their_own_answers() {
    let running = start(|config| config);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let path = running.path.clone();
            thread::spawn(move || {
                let mut client = Client::connect(&path).unwrap();
                for i in 0..50 {
                    let word = format!("t{t}-c{i}");
                    match client.call(exec(&["echo", &word])).unwrap() {
                        Response::Exec(result) => {
                            assert_eq!(result.stdout, format!("echo {word}").into_bytes());
                            assert_eq!(result.exit_code, 0, "peer uid seen by the handler");
                        }
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    assert_eq!(running.echo.finished.load(Ordering::SeqCst), 400);
    running.handle.shutdown().unwrap();
}

#[test]
fn a_panicking_handler_answers_internal_and_the_connection_goes_on() {
    let running = start(|config| config);
    let mut client = Client::connect(&running.path).unwrap();
    match client.call(Request::Status).unwrap() {
        Response::Error(ErrorReply {
            code: ErrorCode::Internal,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_pong(&mut client);
    running.handle.shutdown().unwrap();
}

#[test]
fn oversized_responses_become_internal_errors_with_the_same_id() {
    let running = start(|config| config.max_frame(1024));
    let mut client = Client::connect(&running.path).unwrap();
    // The request fits; the response does not.
    match client.call(exec(&["repeat", "2000"])).unwrap() {
        Response::Error(ErrorReply {
            code: ErrorCode::Internal,
            message,
        }) => assert!(
            message.contains("exceeds the maximum frame size"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    assert_pong(&mut client);
    running.handle.shutdown().unwrap();
}

#[test]
fn a_read_timeout_fails_the_call_and_breaks_the_client() {
    let running = start(|config| config);
    let mut client = Client::connect(&running.path)
        .unwrap()
        .with_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    match client.call(exec(&["sleep", "400"])) {
        Err(ClientError::Receive {
            id: 1,
            source: FrameError::Read { source },
        }) => assert!(
            matches!(
                source.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "{source:?}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        client.call(Request::Ping),
        Err(ClientError::Broken)
    ));
    running.handle.shutdown().unwrap();
}

#[test]
fn shutdown_closes_idle_connections_and_removes_the_socket() {
    let running = start(|config| config);
    let mut idle = Client::connect(&running.path).unwrap();
    assert_pong(&mut idle);
    let started = Instant::now();
    let path = running.path.clone();
    running.handle.shutdown().unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(!path.exists());
    assert!(matches!(
        idle.call(Request::Ping),
        Err(ClientError::ClosedByServer { id: 2 })
    ));
    assert!(matches!(
        Client::connect(&path),
        Err(ClientError::Connect { .. })
    ));
}

#[test]
fn binding_replaces_stale_sockets_but_not_live_ones_or_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("belayer.sock");

    // A stale socket file: bound, then its listener dropped without unlinking.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let handle = server.spawn(Arc::new(Echo::default())).unwrap();

    // A live server is not displaced.
    assert!(matches!(
        Server::bind(ServerConfig::new(&path)),
        Err(ServerError::Bind(BindError::InUse { .. }))
    ));
    let mut client = Client::connect(&path).unwrap();
    assert_pong(&mut client);
    handle.shutdown().unwrap();

    // A regular file is never removed.
    std::fs::write(&path, b"not a socket").unwrap();
    assert!(matches!(
        Server::bind(ServerConfig::new(&path)),
        Err(ServerError::Bind(BindError::NotASocket { .. }))
    ));
    assert_eq!(std::fs::read(&path).unwrap(), b"not a socket");
}

#[test]
fn a_dropped_server_removes_its_socket_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("belayer.sock");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    assert!(path.exists());
    drop(server);
    assert!(!path.exists());
}

const HELPER_SOCK: &str = "BELAYER_IPC_TEST_HELPER_SOCK";
const HELPER_GROUPS: &str = "BELAYER_IPC_TEST_HELPER_GROUPS";
const NOBODY: u32 = 65534;

/// Runs only when re-executed by `run_as_nobody`: drops to uid/gid 65534 (with the
/// supplementary groups given), connects, and prints one `HELPER-RESULT` line.
#[test]
fn helper_client_as_nobody() {
    let Ok(sock) = std::env::var(HELPER_SOCK) else {
        return;
    };
    let groups: Vec<nix::unistd::Gid> = std::env::var(HELPER_GROUPS)
        .unwrap_or_default()
        .split(',')
        .filter(|g| !g.is_empty())
        .map(|g| nix::unistd::Gid::from_raw(g.parse().unwrap()))
        .collect();
    nix::unistd::setgroups(&groups).unwrap();
    nix::unistd::setgid(nix::unistd::Gid::from_raw(NOBODY)).unwrap();
    nix::unistd::setuid(nix::unistd::Uid::from_raw(NOBODY)).unwrap();
    assert_eq!(nix::unistd::geteuid().as_raw(), NOBODY);

    let outcome = match Client::connect(&sock) {
        Err(err) => format!("connect-error {err}"),
        Ok(mut client) => match client.call(Request::Ping) {
            Ok(Response::Pong { .. }) => match client.call(exec(&["whoami"])) {
                Ok(Response::Exec(result)) => format!(
                    "pong uid={} gid={}",
                    result.exit_code,
                    result.signal.unwrap_or(-1)
                ),
                other => format!("unexpected {other:?}"),
            },
            Ok(Response::Error(reply)) => format!("error {:?}", reply.code),
            other => format!("unexpected {other:?}"),
        },
    };
    println!("HELPER-RESULT {outcome}");
}

/// Re-executes this test binary as the helper above and returns its result line.
fn run_as_nobody(sock: &Path, groups: &[u32]) -> String {
    let groups: Vec<String> = groups.iter().map(u32::to_string).collect();
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_client_as_nobody",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_SOCK, sock)
        .env(HELPER_GROUPS, groups.join(","))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .find_map(|line| line.split_once("HELPER-RESULT "))
        .map(|(_, result)| result.trim().to_owned())
        .unwrap_or_else(|| {
            panic!(
                "helper printed no result; stdout: {stdout}\nstderr: {}",
                String::from_utf8_lossy(&output.stderr)
            )
        })
}

#[test]
fn peers_outside_the_allowed_group_are_refused_and_members_admitted() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test drops privileges in a child and needs root"
    );
    // The socket file belongs to group 65534 so that the helper passes the file permission
    // check; the access policy decides the rest.

    // Primary gid 65534 is not the allowed group 4243: refused with a typed error.
    let refused = start(|config| config.group(NOBODY).policy(AccessPolicy::group(4243)));
    assert_eq!(run_as_nobody(&refused.path, &[]), "error PermissionDenied");
    // Root still gets in, and the refusal disturbed nobody.
    let mut root = Client::connect(&refused.path).unwrap();
    assert_pong(&mut root);
    refused.handle.shutdown().unwrap();

    // Root only (no group at all).
    let root_only = start(|config| config.group(NOBODY));
    assert_eq!(
        run_as_nobody(&root_only.path, &[4243]),
        "error PermissionDenied"
    );
    root_only.handle.shutdown().unwrap();

    // Primary gid matches.
    let primary = start(|config| config.group(NOBODY).policy(AccessPolicy::group(NOBODY)));
    assert_eq!(
        run_as_nobody(&primary.path, &[]),
        "pong uid=65534 gid=65534"
    );
    primary.handle.shutdown().unwrap();

    // A supplementary group matches.
    let supplementary = start(|config| config.group(NOBODY).policy(AccessPolicy::group(4242)));
    assert_eq!(
        run_as_nobody(&supplementary.path, &[4241, 4242]),
        "pong uid=65534 gid=65534"
    );
    supplementary.handle.shutdown().unwrap();
}
