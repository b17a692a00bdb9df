//! End to end: `belayer router --gpus N` supervising main + shadow toy engines (host backend
//! memory servers), streaming clients, and failures injected with real signals (SIGKILL,
//! SIGSTOP/SIGCONT). Every client's token sequence is compared with a failure-free run.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use belayer_tests::bin;
use serde_json::{json, Value};

struct Router {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Router {
    fn start(gpus: usize, extra: &[&str]) -> Router {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let mut child = Command::new(bin("belayer"))
            .args(["router", "--listen", &addr, "--gpus", &gpus.to_string()])
            .arg("--state-dir")
            .arg(dir.path())
            .arg("--context-log")
            .arg(dir.path().join("context.log"))
            .args(["--token-ms", "1"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.starts_with("listening"), "router said {line:?}");
        Router {
            child,
            addr,
            _dir: dir,
        }
    }

    fn engines(&self) -> Value {
        let (status, body) = request(&self.addr, "GET", "/engines", "");
        assert_eq!(status, 200);
        serde_json::from_str(&body).unwrap()
    }

    fn epoch(&self, gpu: usize) -> u64 {
        self.engines()["engines"][gpu]["epoch"].as_u64().unwrap()
    }

    /// Pid of the engine registered for `gpu` (asked over its `/health`).
    fn main_pid(&self, gpu: usize) -> i32 {
        let addr = self.engines()["engines"][gpu]["addr"]
            .as_str()
            .unwrap()
            .to_owned();
        let (_, body) = request(&addr, "GET", "/health", "");
        serde_json::from_str::<Value>(&body).unwrap()["pid"]
            .as_i64()
            .unwrap() as i32
    }

    fn wait_epoch_change(&self, gpu: usize, from: u64) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let e = &self.engines()["engines"][gpu];
            if e["epoch"].as_u64() != Some(from) && e["addr"].is_string() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no handover on gpu{gpu}");
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        // SIGTERM: the router stops its workers and memory servers before exiting.
        // SAFETY: kill(2) with the pid of our own child and a valid signal number.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

/// A streaming request; `on_token(count)` runs after each token.
fn stream(addr: &str, prompt: &[u32], n: u32, mut on_token: impl FnMut(usize)) -> Vec<u32> {
    let body =
        json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": n}, "stream": true})
            .to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(
        s,
        "POST /generate HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
    }
    let mut out = Vec::new();
    for line in r.lines() {
        let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if v.get("done").is_some() {
            return out;
        }
        assert!(v.get("error").is_none(), "stream error {v}");
        assert_eq!(v["index"].as_u64().unwrap() as usize, out.len(), "order");
        out.push(v["token"].as_u64().unwrap() as u32);
        on_token(out.len());
    }
    panic!("stream ended without done after {} tokens", out.len());
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) with a pid read from the engine and a valid signal number.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

fn alive(pid: i32) -> bool {
    // Zombies count as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

#[test]
fn kill9_mid_stream_resumes_every_token_once_twice_in_a_row() {
    let r = Router::start(1, &["--unhealthy-window-ms", "0"]);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| vec![i, 42, 7]).collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| stream(&r.addr, p, 300, |_| {}))
        .collect();
    for round in 0..2 {
        let epoch = r.epoch(0);
        let pid = r.main_pid(0);
        let (tx, rx) = std::sync::mpsc::channel();
        let clients: Vec<_> = prompts
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, p)| {
                let (addr, tx) = (r.addr.clone(), tx.clone());
                std::thread::spawn(move || {
                    stream(&addr, &p, 300, |n| {
                        if i == 0 && n == 40 + 70 * round {
                            let _ = tx.send(());
                        }
                    })
                })
            })
            .collect();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        signal(pid, libc::SIGKILL);
        for (c, w) in clients.into_iter().zip(&want) {
            assert_eq!(&c.join().unwrap(), w, "round {round}");
        }
        assert!(r.epoch(0) > epoch);
        // A new shadow is prepared after each handover (the second round needs it).
        std::thread::sleep(Duration::from_millis(300));
    }
    let e = r.engines();
    assert!(e["resumed"].as_u64().unwrap() >= 2, "{e}");
    assert!(e["prefix_records"].as_u64().unwrap() > 0, "{e}");
    assert_eq!(e["engines"][0]["load"], 0);
}

#[test]
fn sigstop_hang_is_taken_over_and_the_old_worker_never_delivers() {
    let r = Router::start(1, &["--heartbeat-timeout-ms", "300"]);
    let prompt = vec![9u32, 9, 9];
    let want = stream(&r.addr, &prompt, 400, |_| {});
    let epoch = r.epoch(0);
    let pid = r.main_pid(0);
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = r.addr.clone();
    let p = prompt.clone();
    let client = std::thread::spawn(move || {
        stream(&addr, &p, 400, |n| {
            if n == 50 {
                let _ = tx.send(());
            }
        })
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let stopped = Instant::now();
    signal(pid, libc::SIGSTOP);
    r.wait_epoch_change(0, epoch);
    let took = stopped.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "took over after {took:?}"
    );
    // The old worker continues (if it still exists): it must not reach the client.
    let _ = unsafe_sigcont(pid);
    assert_eq!(client.join().unwrap(), want);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!alive(pid), "residual main worker {pid} still runs");
}

fn unsafe_sigcont(pid: i32) -> i32 {
    // SAFETY: kill(2) with a pid and a valid signal number; the pid may be gone (ESRCH).
    unsafe { libc::kill(pid, libc::SIGCONT) }
}

#[test]
fn repeated_failure_marks_the_gpu_unhealthy_and_redistributes() {
    let r = Router::start(2, &[]);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| vec![i, 1, 1]).collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| stream(&r.addr, p, 400, |_| {}))
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let clients: Vec<_> = prompts
        .iter()
        .cloned()
        .map(|p| {
            let (addr, tx) = (r.addr.clone(), tx.clone());
            std::thread::spawn(move || {
                stream(&addr, &p, 400, |n| {
                    if n == 30 {
                        let _ = tx.send(());
                    }
                })
            })
        })
        .collect();
    for _ in 0..4 {
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
    }
    let e0 = r.epoch(0);
    signal(r.main_pid(0), libc::SIGKILL);
    r.wait_epoch_change(0, e0);
    std::thread::sleep(Duration::from_millis(50));
    signal(r.main_pid(0), libc::SIGKILL);
    for (c, w) in clients.into_iter().zip(&want) {
        assert_eq!(&c.join().unwrap(), w);
    }
    let e = r.engines();
    assert_eq!(e["engines"][0]["healthy"], false, "{e}");
    assert_eq!(e["engines"][1]["healthy"], true, "{e}");
    assert!(
        e["alerts"][0]
            .as_str()
            .unwrap()
            .contains("gpu0 marked unhealthy"),
        "{e}"
    );
    // New requests go to the healthy GPU only.
    assert_eq!(stream(&r.addr, &prompts[0], 400, |_| {}), want[0]);
}

#[test]
fn router_input_errors_are_clear_and_nothing_leaks() {
    let r = Router::start(1, &[]);
    let (s, b) = request(&r.addr, "POST", "/generate", "{not json");
    assert_eq!(s, 400);
    assert!(b.contains("bad /generate body"), "{b}");
    let (s, b) = request(&r.addr, "POST", "/generate", r#"{"input_ids": []}"#);
    assert_eq!(s, 400);
    assert!(b.contains("input_ids is empty"), "{b}");
    let (s, b) = request(
        &r.addr,
        "POST",
        "/unregister",
        r#"{"gpu": "gpu7", "epoch": 1}"#,
    );
    assert_eq!(s, 404);
    assert!(b.contains("unknown engine gpu7 epoch 1"), "{b}");
    let (s, b) = request(
        &r.addr,
        "POST",
        "/register",
        r#"{"gpu": "g", "addr": "nope"}"#,
    );
    assert_eq!(s, 400, "{b}");
    let (s, _) = request(&r.addr, "GET", "/nope", "");
    assert_eq!(s, 404);
    // Client disconnect mid-stream: the request is dropped, its load released.
    for _ in 0..3 {
        let body =
            json!({"input_ids": [5], "sampling_params": {"max_new_tokens": 5000}, "stream": true})
                .to_string();
        let mut s = TcpStream::connect(&r.addr).unwrap();
        write!(
            s,
            "POST /generate HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.engines()["engines"][0]["load"] != 0 {
        assert!(Instant::now() < deadline, "load leaked: {}", r.engines());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(stream(&r.addr, &[5], 10, |_| {}).len(), 10);
}

/// Split brain: a replacement registered over the API while the old engine still streams (it
/// is alive and never stopped) fences the old one; the client's sequence is still exact.
#[test]
fn a_live_stale_engine_is_fenced_by_epoch() {
    let r = Router::start(1, &[]);
    let prompt = vec![3u32, 1, 4];
    let want = stream(&r.addr, &prompt, 400, |_| {});
    let stale = r.engines()["engines"][0]["addr"]
        .as_str()
        .unwrap()
        .to_owned();
    let stale_pid = r.main_pid(0);
    let (tx, rx) = std::sync::mpsc::channel();
    let (addr, p) = (r.addr.clone(), prompt.clone());
    let client = std::thread::spawn(move || {
        stream(&addr, &p, 400, |n| {
            if n == 60 {
                let _ = tx.send(());
            }
        })
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // Re-register the same (still live) engine under a new epoch: the running stream belongs to
    // the old epoch and must be cut and resumed.
    let (s, b) = request(
        &r.addr,
        "POST",
        "/register",
        &json!({"gpu": "gpu0", "addr": stale}).to_string(),
    );
    assert_eq!(s, 200, "{b}");
    assert_eq!(client.join().unwrap(), want);
    assert!(alive(stale_pid));
    let e = r.engines();
    assert!(e["resumed"].as_u64().unwrap() >= 1, "{e}");
}

/// Conventional recovery in the same harness: health-check timeout, engine restart from
/// scratch, regeneration from the start; the client still sees every token once and in order.
#[test]
fn conventional_recovery_regenerates_without_duplicates() {
    let r = Router::start(1, &["--conventional", "--baseline-timeout-ms", "300"]);
    let prompt = vec![2u32, 7, 1];
    let want = stream(&r.addr, &prompt, 300, |_| {});
    let epoch = r.epoch(0);
    let pid = r.main_pid(0);
    let (tx, rx) = std::sync::mpsc::channel();
    let (addr, p) = (r.addr.clone(), prompt.clone());
    let client = std::thread::spawn(move || {
        stream(&addr, &p, 300, |n| {
            if n == 100 {
                let _ = tx.send(());
            }
        })
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    signal(pid, libc::SIGKILL);
    assert_eq!(client.join().unwrap(), want);
    assert!(r.epoch(0) > epoch);
}
