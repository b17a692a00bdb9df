//! Hostile clients against the server's connection limits, over real sockets: thousands of idle
//! connections, a uid at its cap (unprivileged helpers that drop to other uids), half frames and
//! drip-fed frames, idle connections, slow handlers, subscribers that stop reading.
//!
//! The tests of this file run one at a time (`SERIAL`): the first one counts the threads of
//! this process.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use belayer_ipc::{
    encode_frame, read_frame, AccessPolicy, Client, ClientError, ConnectionLimits, Envelope,
    ErrorCode, ErrorReply, Event, ExecRequest, Handler, PeerCred, Request, Response, Server,
    ServerConfig, ServerHandle, DEFAULT_MAX_FRAME,
};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Answers Ping with Pong, sleeps `ms` for `Exec ["sleep", ms]`, and streams events from `bus`.
#[derive(Default)]
struct Service {
    subscribers: Mutex<Vec<Sender<Event>>>,
}

impl Service {
    /// Sends `event` to every live subscriber; returns how many there are.
    fn publish(&self, event: &Event) -> usize {
        let mut subscribers = self.subscribers.lock().unwrap();
        subscribers.retain(|tx| tx.send(event.clone()).is_ok());
        subscribers.len()
    }
}

impl Handler for Service {
    fn handle(&self, _peer: &PeerCred, request: Request) -> Response {
        match request {
            Request::Ping => Response::Pong {
                version: "test".to_owned(),
            },
            Request::Exec(exec) => {
                if let [verb, ms] = exec.argv.as_slice() {
                    if verb == "sleep" {
                        thread::sleep(Duration::from_millis(ms.parse().unwrap()));
                    }
                }
                Response::Done
            }
            _ => Response::Done,
        }
    }

    fn subscribe(&self, _peer: &PeerCred) -> Option<Receiver<Event>> {
        let (tx, rx) = mpsc::channel();
        self.subscribers.lock().unwrap().push(tx);
        Some(rx)
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: PathBuf,
    service: Arc<Service>,
    handle: ServerHandle,
}

fn start(configure: impl FnOnce(ServerConfig) -> ServerConfig) -> Running {
    let dir = tempfile::tempdir().unwrap();
    // Let the unprivileged helpers reach the socket inside.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("belayer.sock");
    let server = Server::bind(configure(ServerConfig::new(&path))).unwrap();
    let service = Arc::new(Service::default());
    let handle = server.spawn(service.clone()).unwrap();
    Running {
        _dir: dir,
        path,
        service,
        handle,
    }
}

fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn ping(path: &Path) -> Response {
    Client::connect(path).unwrap().call(Request::Ping).unwrap()
}

fn assert_pong(response: Response) {
    assert!(matches!(response, Response::Pong { .. }), "{response:?}");
}

fn request_frame(id: u64, request: Request) -> Vec<u8> {
    encode_frame(&Envelope { id, body: request }, DEFAULT_MAX_FRAME).unwrap()
}

fn sleep_request(ms: u64) -> Request {
    Request::Exec(ExecRequest {
        id: "sb".to_owned(),
        argv: vec!["sleep".to_owned(), ms.to_string()],
        ..ExecRequest::default()
    })
}

/// Reads one response frame (10 s at most), then expects the end of the stream.
fn expect_error_then_close(raw: &mut UnixStream, code: ErrorCode, needle: &str) {
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let reply: Envelope<Response> = read_frame(raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(reply.id, 0);
    match reply.body {
        Response::Error(ErrorReply { code: got, message }) => {
            assert_eq!(got, code, "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        other => panic!("{other:?}"),
    }
    let mut rest = Vec::new();
    match raw.read_to_end(&mut rest) {
        Ok(_) => assert!(rest.is_empty(), "bytes after the error: {rest:?}"),
        Err(err) => assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset),
    }
}

#[test]
fn three_thousand_idle_connections_hold_a_bounded_number_of_threads() {
    let _serial = serial();
    let running = start(|config| config);
    let limits = ConnectionLimits::default();
    assert_pong(ping(&running.path));
    let baseline = threads();
    let mut peak = baseline;
    let mut idle = Vec::with_capacity(3000);
    let started = Instant::now();
    for i in 0..3000 {
        idle.push(UnixStream::connect(&running.path).unwrap());
        if i % 25 == 0 {
            peak = peak.max(threads());
        }
    }
    // Let the accept loop catch up with the backlog, watching the thread count meanwhile.
    let settle = Instant::now() + Duration::from_secs(2);
    while Instant::now() < settle {
        peak = peak.max(threads());
        thread::sleep(Duration::from_millis(20));
    }
    // A normal client is answered at once: an idle connection makes room for it.
    let asked = Instant::now();
    assert_pong(ping(&running.path));
    let answered_in = asked.elapsed();
    peak = peak.max(threads());
    eprintln!(
        "3000 idle connections opened in {:?}; threads: {baseline} before, peak {peak}; \
         a new client answered in {answered_in:?}",
        started.elapsed()
    );
    // One thread per served connection, at most 16 more while evicted ones end (the accept
    // loop never runs more), plus slack for threads of other tests of this binary that are
    // still ending.
    let bound = baseline + limits.connections.total + 16 + 4;
    assert!(peak <= bound, "peak {peak} threads over {bound}");
    assert!(answered_in < Duration::from_secs(2), "{answered_in:?}");
    // The connections over the limit were told why.
    let mut busy = 0;
    for stream in idle.iter_mut().take(100) {
        stream.set_nonblocking(true).unwrap();
        let mut header = [0u8; 1];
        if stream.read(&mut header).is_ok_and(|n| n == 1) {
            busy += 1;
        }
    }
    assert!(busy > 0, "no refused connection got a reply");
    drop(idle);
    running.handle.shutdown().unwrap();
}

const HELPER_SOCK: &str = "BELAYER_IPC_LIMITS_HELPER_SOCK";
const HELPER_UID: &str = "BELAYER_IPC_LIMITS_HELPER_UID";
const HELPER_COUNT: &str = "BELAYER_IPC_LIMITS_HELPER_COUNT";
const NOBODY: u32 = 65534;

/// Runs only when re-executed by `Helper::start`: drops to the uid given (gid 65534), opens
/// the given number of connections, pings on each, prints `HELPER-RESULT pong=P busy=B`, and
/// holds the connections until its stdin ends.
#[test]
fn helper_holding_connections() {
    let Ok(sock) = std::env::var(HELPER_SOCK) else {
        return;
    };
    let uid: u32 = std::env::var(HELPER_UID).unwrap().parse().unwrap();
    let count: usize = std::env::var(HELPER_COUNT).unwrap().parse().unwrap();
    nix::unistd::setgroups(&[]).unwrap();
    nix::unistd::setgid(nix::unistd::Gid::from_raw(NOBODY)).unwrap();
    nix::unistd::setuid(nix::unistd::Uid::from_raw(uid)).unwrap();
    assert_eq!(nix::unistd::geteuid().as_raw(), uid);
    let (mut pong, mut busy) = (0, 0);
    let mut held = Vec::new();
    for _ in 0..count {
        let mut client = Client::connect(&sock).unwrap();
        match client.call(Request::Ping) {
            Ok(Response::Pong { .. }) => pong += 1,
            Ok(Response::Error(ErrorReply {
                code: ErrorCode::Busy,
                ..
            })) => busy += 1,
            other => panic!("unexpected {other:?}"),
        }
        held.push(client);
    }
    // Straight to fd 1: the test harness may buffer `println!` output until the process ends,
    // and this process waits for its parent to read the line first.
    let line = format!("HELPER-RESULT pong={pong} busy={busy}\n");
    nix::unistd::write(std::io::stdout(), line.as_bytes()).unwrap();
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(held);
}

/// An unprivileged helper process holding connections (see `helper_holding_connections`).
struct Helper {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    result: String,
}

impl Helper {
    fn start(sock: &Path, uid: u32, count: usize) -> Helper {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "helper_holding_connections",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER_SOCK, sock)
            .env(HELPER_UID, uid.to_string())
            .env(HELPER_COUNT, count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut seen = Vec::new();
        loop {
            let mut line = String::new();
            if stdout.read_line(&mut line).unwrap() == 0 {
                break;
            }
            // The harness may have written "test NAME ... " on the same line first.
            if let Some((_, result)) = line.split_once("HELPER-RESULT ") {
                let result = result.trim().to_owned();
                return Helper {
                    child,
                    stdin,
                    stdout,
                    result,
                };
            }
            seen.push(line);
        }
        let _ = child.wait();
        panic!("helper uid {uid} printed no result: {seen:?}");
    }

    /// Lets the helper close its connections and end; reads the rest of its output so that
    /// its harness can write it.
    fn stop(mut self) {
        drop(self.stdin.take());
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}: {rest}");
    }
}

#[test]
fn a_uid_at_its_cap_keeps_neither_root_nor_other_uids_out() {
    let _serial = serial();
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test drops privileges in children and needs root"
    );
    // 12 connections, 4 per non-root uid, 4 kept for root: non-root peers share 8.
    let running = start(|config| {
        config
            .group(NOBODY)
            .policy(AccessPolicy::group(NOBODY))
            .limits(ConnectionLimits::default().connections(12, 4, 4))
    });
    let a = Helper::start(&running.path, NOBODY, 6);
    assert_eq!(a.result, "pong=4 busy=2");
    // Another uid is not kept out by the one at its cap.
    let b = Helper::start(&running.path, NOBODY - 1, 6);
    assert_eq!(b.result, "pong=4 busy=2");
    // The non-root share is full now; root still gets in, on its reserved slots.
    let root: Vec<Client> = (0..4)
        .map(|_| {
            let mut client = Client::connect(&running.path).unwrap();
            assert_pong(client.call(Request::Ping).unwrap());
            client
        })
        .collect();
    // And a third uid takes an idle connection of one holding more than it.
    let c = Helper::start(&running.path, NOBODY - 2, 1);
    assert_eq!(c.result, "pong=1 busy=0");
    drop(root);
    for helper in [a, b, c] {
        helper.stop();
    }
    running.handle.shutdown().unwrap();
}

#[test]
fn half_and_drip_fed_frames_are_dropped_after_the_frame_timeout() {
    let _serial = serial();
    let timeout = Duration::from_millis(300);
    let running = start(|config| config.limits(ConnectionLimits::default().frame_timeout(timeout)));
    let ping_frame = request_frame(1, Request::Ping);

    // Half a frame, then nothing.
    let mut half = UnixStream::connect(&running.path).unwrap();
    let sent = Instant::now();
    half.write_all(&ping_frame[..10]).unwrap();
    expect_error_then_close(
        &mut half,
        ErrorCode::BadRequest,
        "not complete within 300 ms",
    );
    let took = sent.elapsed();
    assert!(took >= timeout && took < Duration::from_secs(5), "{took:?}");

    // A frame fed one byte every 100 ms: each read is quick, the frame as a whole is not.
    let long_frame = request_frame(2, sleep_request(1));
    let mut drip = UnixStream::connect(&running.path).unwrap();
    let mut writer = drip.try_clone().unwrap();
    let dripper = thread::spawn(move || {
        for byte in long_frame {
            if writer.write_all(&[byte]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(100));
        }
    });
    let sent = Instant::now();
    expect_error_then_close(&mut drip, ErrorCode::BadRequest, "not complete within");
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    dripper.join().unwrap();

    assert_pong(ping(&running.path));
    running.handle.shutdown().unwrap();
}

#[test]
fn idle_connections_are_closed_but_slow_requests_are_not_cut() {
    let _serial = serial();
    let idle = Duration::from_millis(500);
    let running = start(|config| config.limits(ConnectionLimits::default().idle_timeout(idle)));

    // Connected, never sends anything: closed after the idle timeout.
    let mut silent = UnixStream::connect(&running.path).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let opened = Instant::now();
    let mut rest = Vec::new();
    silent.read_to_end(&mut rest).unwrap();
    let took = opened.elapsed();
    assert!(rest.is_empty());
    assert!(took >= idle && took < Duration::from_secs(5), "{took:?}");

    // A request handled for three idle timeouts is answered, and the connection goes on.
    let mut client = Client::connect(&running.path).unwrap();
    assert_eq!(client.call(sleep_request(1500)).unwrap(), Response::Done);
    assert_pong(client.call(Request::Ping).unwrap());

    // Idle past the timeout between requests: the next call finds the connection closed.
    thread::sleep(idle * 3);
    match client.call(Request::Ping) {
        Err(ClientError::ClosedByServer { .. } | ClientError::Send { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_pong(ping(&running.path));
    running.handle.shutdown().unwrap();
}

#[test]
fn a_subscriber_that_stops_reading_is_dropped_and_a_quiet_one_is_kept() {
    let _serial = serial();
    let short = Duration::from_millis(300);
    let running = start(|config| {
        config.limits(
            ConnectionLimits::default()
                .idle_timeout(short)
                .send_timeout(short),
        )
    });

    // Subscribes, then never reads.
    let mut deaf = UnixStream::connect(&running.path).unwrap();
    deaf.write_all(&request_frame(1, Request::Subscribe))
        .unwrap();
    let answer: Envelope<Response> = read_frame(&mut deaf, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(answer.body, Response::Subscribed);
    // A quiet subscriber that reads: no events for longer than the idle timeout.
    let mut quiet = Client::connect(&running.path).unwrap().subscribe().unwrap();
    thread::sleep(short * 3);

    let big = Event::SandboxFailed {
        id: "sb".to_owned(),
        reason: "x".repeat(64 << 10),
    };
    let started = Instant::now();
    let mut received = 0;
    loop {
        let live = running.service.publish(&big);
        while let Some(event) = quiet.next_event(Some(Duration::ZERO)).unwrap() {
            assert_eq!(event, big);
            received += 1;
        }
        if live == 1 {
            break; // the deaf subscriber's channel was dropped by the server
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the deaf subscriber was never dropped"
        );
        thread::sleep(Duration::from_millis(10));
    }
    eprintln!("deaf subscriber dropped after {:?}", started.elapsed());
    let small = Event::CheckpointReady {
        id: "sb".to_owned(),
        prefix: 7,
    };
    assert_eq!(running.service.publish(&small), 1);
    loop {
        match quiet.next_event(Some(Duration::from_secs(5))).unwrap() {
            Some(event) if event == small => break,
            Some(event) => {
                assert_eq!(event, big);
                received += 1;
            }
            None => panic!("the quiet subscriber got nothing"),
        }
    }
    assert!(received > 0);
    drop(deaf);
    running.handle.shutdown().unwrap();
}

#[test]
fn event_streams_have_their_own_quota() {
    let _serial = serial();
    let running = start(|config| config.limits(ConnectionLimits::default().subscriptions(2, 1, 1)));
    let first = Client::connect(&running.path).unwrap().subscribe().unwrap();
    let _second = Client::connect(&running.path).unwrap().subscribe().unwrap();
    match Client::connect(&running.path).unwrap().subscribe() {
        Err(ClientError::SubscribeRefused {
            code: ErrorCode::Busy,
            message,
        }) => assert!(message.contains("event streams"), "{message}"),
        other => panic!("{other:?}"),
    }
    // A refused subscription leaves the connection usable for requests.
    let mut raw = UnixStream::connect(&running.path).unwrap();
    let mut bytes = request_frame(5, Request::Subscribe);
    bytes.extend_from_slice(&request_frame(6, Request::Ping));
    raw.write_all(&bytes).unwrap();
    let refused: Envelope<Response> = read_frame(&mut raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(refused.id, 5);
    assert!(matches!(
        refused.body,
        Response::Error(ErrorReply {
            code: ErrorCode::Busy,
            ..
        })
    ));
    let pong: Envelope<Response> = read_frame(&mut raw, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(pong.id, 6);
    assert_pong(pong.body);
    // A closed stream gives its slot back.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match Client::connect(&running.path).unwrap().subscribe() {
            Ok(_) => break,
            Err(ClientError::SubscribeRefused {
                code: ErrorCode::Busy,
                ..
            }) => {
                assert!(Instant::now() < deadline, "the slot was never given back");
                thread::sleep(Duration::from_millis(50));
            }
            Err(err) => panic!("{err:?}"),
        }
    }
    running.handle.shutdown().unwrap();
}
