//! A real OCI registry for tests: Debian's `docker-registry` (distribution 2.8) serving a
//! temp storage dir on a free port of 127.0.0.1, optionally behind htpasswd basic auth
//! (bcrypt, made with `htpasswd -Bbn` from `apache2-utils`). Killed and cleaned on drop.
//! [`FaultProxy`] sits in front of one to inject 5xx answers, stalls and cut transfers.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The registry binary (`docker-registry` package).
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";

/// How long [`TestRegistry::start`] waits for `GET /v2/` to answer.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `docker-registry serve`.
#[derive(Debug)]
pub struct TestRegistry {
    dir: tempfile::TempDir,
    addr: String,
    child: Option<Child>,
    basic_auth: Option<(String, String)>,
}

impl TestRegistry {
    /// Starts a registry without authentication; panics (with its log) when it does not
    /// answer within 20 s.
    pub fn start() -> TestRegistry {
        Self::start_inner(None)
    }

    /// Starts a registry that requires HTTP basic auth as `user`/`pass` for every request
    /// (pull and push).
    pub fn start_with_basic_auth(user: &str, pass: &str) -> TestRegistry {
        Self::start_inner(Some((user.to_string(), pass.to_string())))
    }

    fn start_inner(basic_auth: Option<(String, String)>) -> TestRegistry {
        assert!(
            Path::new(REGISTRY_BIN).is_file(),
            "{REGISTRY_BIN} missing: run `bash scripts/setup.sh` (package docker-registry)"
        );
        let dir = tempfile::Builder::new()
            .prefix("belayer-registry-")
            .tempdir_in("/tmp")
            .expect("registry tempdir");
        let auth = match &basic_auth {
            Some((user, pass)) => {
                let out = Command::new("htpasswd")
                    .args(["-Bbn", user, pass])
                    .output()
                    .expect("run htpasswd (package apache2-utils)");
                assert!(out.status.success(), "htpasswd failed: {out:?}");
                let path = dir.path().join("htpasswd");
                std::fs::write(&path, &out.stdout).expect("write htpasswd");
                format!(
                    "auth:\n  htpasswd:\n    realm: belayer-test\n    path: {}\n",
                    path.display()
                )
            }
            None => String::new(),
        };
        // The port is free when chosen; another process may take it before the registry
        // binds, so a registry that exits early is started again on another port.
        for _ in 0..5 {
            let port = free_port();
            let addr = format!("127.0.0.1:{port}");
            let config = format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: {addr}\n{auth}",
                dir.path().join("storage").display()
            );
            let config_path = dir.path().join("config.yml");
            std::fs::write(&config_path, config).expect("write registry config");
            let log = std::fs::File::create(dir.path().join("registry.log")).expect("log");
            let mut child = Command::new(REGISTRY_BIN)
                .arg("serve")
                .arg(&config_path)
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log fd"))
                .stderr(log)
                .spawn()
                .expect("spawn docker-registry");
            if wait_ready(&mut child, &addr) {
                return TestRegistry {
                    dir,
                    addr,
                    child: Some(child),
                    basic_auth,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(dir.path().join("registry.log")).unwrap_or_default();
        panic!("docker-registry did not start; log:\n{log}");
    }

    /// The HTTP status of an unauthenticated `GET /v2/`, or `None` when nothing answers.
    pub fn v2_status(&self) -> Option<u16> {
        v2_status(&self.addr)
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The basic-auth user and password, when started with them.
    pub fn basic_auth(&self) -> Option<(&str, &str)> {
        self.basic_auth
            .as_ref()
            .map(|(u, p)| (u.as_str(), p.as_str()))
    }

    /// `user:pass` for skopeo's `--dest-creds`, when started with basic auth.
    pub fn creds_arg(&self) -> Option<String> {
        self.basic_auth.as_ref().map(|(u, p)| format!("{u}:{p}"))
    }

    /// The registry's storage root (`docker/registry/v2/...` below it).
    pub fn storage_dir(&self) -> PathBuf {
        self.dir.path().join("storage")
    }

    /// Where the registry keeps the bytes of blob `digest` (`sha256:<hex>`): overwrite or
    /// truncate it to serve a corrupt blob.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let (algo, hex) = digest.split_once(':').expect("digest algo:hex");
        self.storage_dir()
            .join("docker/registry/v2/blobs")
            .join(algo)
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// The registry's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Kills the registry (for "registry down" tests); the address stays reserved to no
    /// one, so connections to it are refused. Idempotent.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the registry process is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Waits until `GET /v2/` on `addr` answers 200 or 401 (true), the process exits or
/// [`START_TIMEOUT`] passes (false).
fn wait_ready(child: &mut Child, addr: &str) -> bool {
    let deadline = Instant::now() + START_TIMEOUT;
    while Instant::now() < deadline {
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        if matches!(v2_status(addr), Some(200 | 401)) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

fn v2_status(addr: &str) -> Option<u16> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET /v2/ HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut head = [0u8; 64];
    let n = s.read(&mut head).ok()?;
    let line = std::str::from_utf8(&head[..n]).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A TCP port of 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind 127.0.0.1:0")
        .port()
}

/// What [`FaultProxy`] does to a matching request instead of forwarding it whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answers this HTTP status with an empty body.
    Status(u16),
    /// Reads the request and never answers (until the proxy is dropped).
    Stall,
    /// Forwards the request but closes the connection after this many bytes of the
    /// response (head included): a transfer cut mid-body.
    CutAfter(u64),
}

/// A fault applied to the first `times` requests whose path contains `path_contains`.
#[derive(Debug, Clone)]
pub struct FaultRule {
    /// Substring of the request path, e.g. `/manifests/` or `/blobs/`.
    pub path_contains: String,
    /// The fault.
    pub fault: Fault,
    /// How many matching requests get it (`usize::MAX`: all).
    pub times: usize,
}

/// An HTTP proxy on 127.0.0.1 in front of a [`TestRegistry`] that injects [`Fault`]s, to
/// test retries against the real registry. One request per connection (`Connection:
/// close` both ways); stops (and releases stalled connections) on drop.
#[derive(Debug)]
pub struct FaultProxy {
    addr: String,
    shared: std::sync::Arc<ProxyShared>,
    accept: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct ProxyShared {
    backend: String,
    rule: FaultRule,
    stop: std::sync::atomic::AtomicBool,
    requests: std::sync::atomic::AtomicUsize,
    faults: std::sync::atomic::AtomicUsize,
}

impl FaultProxy {
    /// Starts a proxy to `backend` (`host:port`) applying `rule`.
    pub fn start(backend: &str, rule: FaultRule) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("proxy addr").to_string();
        let shared = std::sync::Arc::new(ProxyShared {
            backend: backend.to_string(),
            rule,
            stop: false.into(),
            requests: 0.into(),
            faults: 0.into(),
        });
        let s = shared.clone();
        let accept = std::thread::spawn(move || {
            use std::sync::atomic::Ordering;
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let s = s.clone();
                        std::thread::spawn(move || {
                            let _ = serve_one(&s, conn);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        FaultProxy {
            addr,
            shared,
            accept: Some(accept),
        }
    }

    /// `127.0.0.1:<port>` of the proxy.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.shared
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn faults(&self) -> usize {
        self.shared
            .faults
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared
            .stop
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// Reads a request head (up to 64 KiB) from `conn`.
fn read_head(conn: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if conn.read(&mut byte)? == 0 || head.len() > 64 << 10 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.push(byte[0]);
    }
    Ok(head)
}

fn serve_one(s: &ProxyShared, mut conn: TcpStream) -> std::io::Result<()> {
    use std::sync::atomic::Ordering;
    conn.set_nonblocking(false)?;
    let head = read_head(&mut conn)?;
    s.requests.fetch_add(1, Ordering::Relaxed);
    let text = String::from_utf8_lossy(&head).into_owned();
    let path = text.split_whitespace().nth(1).unwrap_or("");
    let mut fault = None;
    if path.contains(&s.rule.path_contains) {
        let n = s.faults.fetch_add(1, Ordering::Relaxed);
        if n < s.rule.times {
            fault = Some(s.rule.fault);
        } else {
            s.faults.fetch_sub(1, Ordering::Relaxed);
        }
    }
    match fault {
        Some(Fault::Status(code)) => write!(
            conn,
            "HTTP/1.1 {code} Injected\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
        Some(Fault::Stall) => {
            while !s.stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }
        cut => {
            // Forward with `Connection: close`, so the response ends at EOF.
            let mut request: Vec<String> = text
                .split("\r\n")
                .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:"))
                .map(str::to_string)
                .collect();
            request.push("Connection: close".to_string());
            let mut backend = TcpStream::connect(&s.backend)?;
            write!(backend, "{}\r\n\r\n", request.join("\r\n"))?;
            let limit = match cut {
                Some(Fault::CutAfter(n)) => n,
                _ => u64::MAX,
            };
            let mut buf = vec![0u8; 64 << 10];
            let mut sent = 0u64;
            loop {
                let n = backend.read(&mut buf)?;
                if n == 0 || sent >= limit {
                    break;
                }
                let n = n.min((limit - sent).min(usize::MAX as u64) as usize);
                conn.write_all(&buf[..n])?;
                sent += n as u64;
            }
            conn.shutdown(std::net::Shutdown::Both)
        }
    }
}
