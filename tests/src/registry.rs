//! A real OCI registry for tests: Debian's `docker-registry` (distribution 2.8) serving a
//! temp storage dir on a free port of 127.0.0.1, optionally behind htpasswd basic auth
//! (bcrypt, made with `htpasswd -Bbn` from `apache2-utils`). Killed and cleaned on drop.

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
