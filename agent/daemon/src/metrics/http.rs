//! The metrics endpoint: a small, bounded HTTP/1.1 listener that answers `GET /metrics`.
//!
//! Built for a hostile network neighbour, not for features: one accept thread hands
//! connections to [`WORKERS`] worker threads through a queue of [`QUEUE`]; a connection that
//! finds the queue full is closed at once. A worker gives each connection [`REQUEST_DEADLINE`]
//! in total to send a request head of at most [`MAX_HEAD_BYTES`] (slow senders and endless
//! headers are cut off), answers it, and closes it (`Connection: close`, no keep-alive, no
//! request body read); it has [`SEND_TIMEOUT`] in total to take the answer, and closing
//! drains what it still sends for at most [`LINGER`]. So the endpoint never holds more than
//! `WORKERS + QUEUE` connections or more than `WORKERS + 1` threads, and no connection more
//! than about 14 s, whatever clients do, and the agent's socket server is never touched by
//! it. What it cannot do is tell a scraper from another local client: one that keeps opening
//! idle connections (about a dozen a second) keeps the workers and the queue full and so
//! keeps scrapes out while it lasts. The accept loop polls a stop flag, so dropping the
//! server always ends it. `httparse` parses the request head.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Worker threads answering requests.
pub const WORKERS: usize = 4;
/// Accepted connections waiting for a worker; beyond, newcomers are closed.
pub const QUEUE: usize = 32;
/// Largest request head (request line and headers), bytes.
pub const MAX_HEAD_BYTES: usize = 8192;
/// Time a client has to send its whole request head, counted from its accept (time spent
/// queued counts).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(3);
/// Time a client has to take the whole response.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Produces the body of `GET /metrics` (OpenMetrics text).
pub type Scrape = Arc<dyn Fn() -> String + Send + Sync>;

/// Errors starting the endpoint.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address cannot be listened on (in use, not local, no permission).
    #[error("cannot listen for metrics on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A thread could not be started.
    #[error("cannot start the metrics endpoint's threads")]
    Spawn(#[source] std::io::Error),
}

/// The running endpoint; dropping it stops the accept thread and the workers.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` and serves `scrape`'s text at `/metrics`.
    ///
    /// Errors: [`MetricsError::Bind`], [`MetricsError::Spawn`].
    pub fn start(addr: SocketAddr, scrape: Scrape) -> Result<MetricsServer, MetricsError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| MetricsError::Bind { addr, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| MetricsError::Bind { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = sync_channel::<(TcpStream, Instant)>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::with_capacity(WORKERS + 1);
        for i in 0..WORKERS {
            let rx = Arc::clone(&rx);
            let scrape = Arc::clone(&scrape);
            let worker = std::thread::Builder::new()
                .name(format!("metrics-{i}"))
                .spawn(move || work(&rx, &scrape))
                .map_err(MetricsError::Spawn)?;
            threads.push(worker);
        }
        let flag = Arc::clone(&stop);
        let acceptor = std::thread::Builder::new()
            .name("metrics-accept".into())
            .spawn(move || accept(&listener, &tx, &flag))
            .map_err(MetricsError::Spawn)?;
        threads.push(acceptor);
        tracing::info!(%addr, "serving metrics at /metrics");
        Ok(MetricsServer {
            addr,
            stop,
            threads,
        })
    }

    /// The address listened on (the real port when asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        // The accept loop sees the flag within one poll interval; once it returns, the
        // queue's sender is gone and the workers end after their current connection (each
        // bounded by the request, send and linger deadlines).
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How often the accept loop looks at the stop flag.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

fn accept(
    listener: &TcpListener,
    tx: &std::sync::mpsc::SyncSender<(TcpStream, Instant)>,
    stop: &AtomicBool,
) {
    use std::os::fd::AsFd;
    let mut last_warning: Option<Instant> = None;
    let mut warn = |e: &dyn std::fmt::Display| {
        // Out of descriptors and the like: say so once a minute, back off a little.
        if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
            tracing::warn!(error = %e, "metrics endpoint: accept failed");
            last_warning = Some(Instant::now());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Err(e) = listener.set_nonblocking(true) {
        warn(&e);
        return;
    }
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let mut fds = [nix::poll::PollFd::new(
            listener.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let timeout =
            nix::poll::PollTimeout::try_from(POLL_INTERVAL).unwrap_or(nix::poll::PollTimeout::NONE);
        match nix::poll::poll(&mut fds, timeout) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                warn(&e);
                continue;
            }
        }
        let conn = match listener.accept() {
            Ok((stream, _)) => stream.set_nonblocking(false).map(|()| stream),
            Err(e) => Err(e),
        };
        match conn {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Ok(stream) => match tx.try_send((stream, Instant::now())) {
                Ok(()) => {}
                Err(TrySendError::Full((stream, _))) => {
                    // Every worker busy and the queue full: close without reading.
                    let _ = stream.shutdown(Shutdown::Both);
                }
                Err(TrySendError::Disconnected(_)) => return,
            },
            Err(e) => warn(&e),
        }
    }
}

fn work(rx: &Mutex<Receiver<(TcpStream, Instant)>>, scrape: &Scrape) {
    loop {
        let next = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
        let Ok((stream, accepted)) = next else { return };
        serve(stream, accepted + REQUEST_DEADLINE, scrape);
    }
}

/// What a request asked for.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool },
    Index { head_only: bool },
    NotFound,
    MethodNotAllowed,
    BadRequest,
    HeadTooLarge,
}

fn serve(mut stream: TcpStream, deadline: Instant, scrape: &Scrape) {
    let _ = stream.set_nodelay(true);
    let route = match read_head(&mut stream, deadline) {
        Some(head) => route(&head),
        // Timed out, closed early or failed: nothing worth answering.
        None => return,
    };
    let (status, content_type, body, head_only) = match route {
        Route::Metrics { head_only } => {
            // A scrape that panics answers 500 and leaves this worker serving.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| scrape())) {
                Ok(text) => ("200 OK", super::CONTENT_TYPE, text, head_only),
                Err(_) => {
                    tracing::error!("metrics endpoint: the scrape panicked");
                    (
                        "500 Internal Server Error",
                        "text/plain",
                        "scrape failed\n".into(),
                        false,
                    )
                }
            }
        }
        Route::Index { head_only } => (
            "200 OK",
            "text/plain; charset=utf-8",
            "belayerd metrics: GET /metrics\n".to_string(),
            head_only,
        ),
        Route::NotFound => ("404 Not Found", "text/plain", "not found\n".into(), false),
        Route::MethodNotAllowed => (
            "405 Method Not Allowed",
            "text/plain",
            "only GET and HEAD\n".into(),
            false,
        ),
        Route::BadRequest => (
            "400 Bad Request",
            "text/plain",
            "bad request\n".into(),
            false,
        ),
        Route::HeadTooLarge => (
            "431 Request Header Fields Too Large",
            "text/plain",
            "request head too large\n".into(),
            false,
        ),
    };
    let allow = if status.starts_with("405") {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}\
         Cache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let send_by = Instant::now() + SEND_TIMEOUT;
    let sent = write_by(&mut stream, head.as_bytes(), send_by)
        && (head_only || write_by(&mut stream, body.as_bytes(), send_by));
    if sent {
        linger(&mut stream);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Writes all of `bytes` by `deadline` (the time left set before each write); `false` when
/// the client did not take them in time or the write failed.
fn write_by(stream: &mut TcpStream, mut bytes: &[u8], deadline: Instant) -> bool {
    while !bytes.is_empty() {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return false;
        };
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return false;
        }
        match stream.write(bytes) {
            Ok(0) | Err(_) => return false,
            Ok(n) => bytes = &bytes[n..],
        }
    }
    true
}

/// Half-closes, then reads and drops what the client may still be sending, for at most
/// [`LINGER`] in all and [`LINGER_BYTES`], so that closing with unread bytes does not reset
/// the connection before the client read the answer.
fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = Instant::now() + LINGER;
    let mut drained = 0u64;
    let mut chunk = [0u8; 4096];
    while drained < LINGER_BYTES {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            return;
        };
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => drained += n as u64,
        }
    }
}

/// Longest wait in all, and most bytes read, while closing a connection.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: u64 = 64 << 10;

/// The request head read by `deadline`: `Some(Ok(bytes))` when complete,
/// `Some(Err(()))` when it exceeds [`MAX_HEAD_BYTES`]; `None` when the client was too slow,
/// closed the connection or the read failed.
fn read_head(stream: &mut TcpStream, deadline: Instant) -> Option<Result<Vec<u8>, ()>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return None,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            return Some(Ok(buf));
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Some(Err(()));
        }
    }
}

fn route(head: &Result<Vec<u8>, ()>) -> Route {
    let Ok(head) = head else {
        return Route::HeadTooLarge;
    };
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) | Err(_) => return Route::BadRequest,
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Route::BadRequest;
    };
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Route::MethodNotAllowed,
    };
    let path = path.split(['?', '#']).next().unwrap_or("");
    match path {
        "/metrics" => Route::Metrics { head_only },
        "/" => Route::Index { head_only },
        _ => Route::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(text: &str) -> Route {
        route(&Ok(text.as_bytes().to_vec()))
    }

    #[test]
    fn requests_are_routed_by_method_and_path() {
        assert_eq!(
            routed("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Route::Metrics { head_only: false }
        );
        assert_eq!(
            routed("HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Route::Metrics { head_only: true }
        );
        assert_eq!(
            routed("GET / HTTP/1.1\r\n\r\n"),
            Route::Index { head_only: false }
        );
        assert_eq!(routed("GET /../etc HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(
            routed("POST /metrics HTTP/1.1\r\n\r\n"),
            Route::MethodNotAllowed
        );
        assert_eq!(routed("GET /metrics\r\n\r\n"), Route::BadRequest);
        assert_eq!(routed("\u{0}\u{1}\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(&Err(())), Route::HeadTooLarge);
        let many: String = (0..100).map(|i| format!("X-{i}: y\r\n")).collect();
        assert_eq!(
            routed(&format!("GET /metrics HTTP/1.1\r\n{many}\r\n")),
            Route::BadRequest
        );
    }

    fn get(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        // The endpoint may close before taking all of an oversized request.
        let _ = s.write_all(request);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn the_endpoint_answers_while_slow_and_oversized_clients_are_cut_off() {
        let scrape: Scrape = Arc::new(|| "# EOF\n".to_string());
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), scrape).expect("start");
        let addr = server.addr();
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\n# EOF\n"), "{ok}");
        // Clients that never finish their head fill the workers and the queue; one more is
        // not served while they hold them: closed at once, or (when the workers were slow to
        // take the idle ones, on a loaded machine) queued until the idle ones' deadline.
        let idle: Vec<TcpStream> = (0..WORKERS + QUEUE)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let extra = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        let waited = started.elapsed();
        assert!(
            extra.is_empty() || waited >= REQUEST_DEADLINE - Duration::from_millis(500),
            "answered after {waited:?} while every slot was held: {extra}"
        );
        assert!(waited < REQUEST_DEADLINE * 2 + Duration::from_secs(2));
        // A client that keeps a worker without sending is cut off at the deadline.
        drop(idle);
        std::thread::sleep(Duration::from_millis(200));
        let mut slow = TcpStream::connect(addr).expect("connect");
        let waited = Instant::now();
        let mut rest = Vec::new();
        let _ = slow.read_to_end(&mut rest);
        assert!(rest.is_empty());
        assert!(waited.elapsed() < REQUEST_DEADLINE + Duration::from_secs(2));
        let ok = get(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        big.resize(MAX_HEAD_BYTES * 3, b'a');
        let refused = get(addr, &big);
        assert!(refused.starts_with("HTTP/1.1 431"), "{refused}");
        let post = get(addr, b"DELETE /metrics HTTP/1.1\r\n\r\n");
        assert!(
            post.starts_with("HTTP/1.1 405") && post.contains("Allow: GET, HEAD"),
            "{post}"
        );
        let head = get(addr, b"HEAD /metrics HTTP/1.1\r\n\r\n");
        assert!(
            head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        drop(server);
        assert!(
            TcpStream::connect(addr).is_err(),
            "still listening after drop"
        );
    }
}
