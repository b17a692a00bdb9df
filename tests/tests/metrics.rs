//! The Prometheus endpoint of the real `belayerd` (`metrics_listen`): a scrape after actions,
//! checkpoints, a skipped checkpoint, a fail-stop and restores parses with the Prometheus
//! project's own OpenMetrics parser (Python `prometheus_client`) and counts each of them;
//! hostile HTTP clients (idle floods, slow senders, endless headers, garbage, wrong methods)
//! neither grow the daemon's threads nor stop it answering its socket or the next scrape; a
//! non-loopback address is refused at start unless `metrics_allow_remote` is set.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::{MaybeCheckpointRequest, PolicySpec, Request, Response};
use belayer_tests::{bin, busybox_rootfs, Daemon, DaemonOptions};

/// A loopback port free right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn daemon_with_metrics() -> (Daemon, SocketAddr) {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: format!("metrics_listen = \"{addr}\"\n"),
        ..DaemonOptions::default()
    });
    (d, addr)
}

/// One HTTP exchange: the raw answer (empty when the endpoint closed without one).
fn http(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(request);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /metrics`: the body, after checking status and content type.
fn scrape(addr: SocketAddr) -> String {
    let answer = http(addr, b"GET /metrics HTTP/1.1\r\nHost: belayer\r\n\r\n");
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{answer:?}"));
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(
        head.contains("Content-Type: application/openmetrics-text; version=1.0.0"),
        "{head}"
    );
    body.to_string()
}

/// Every sample of `text` as parsed by `prometheus_client`'s OpenMetrics parser:
/// `name{label="v",…}` (labels sorted) → value. The parser rejects any malformed text.
fn parse(text: &str) -> HashMap<String, f64> {
    const PARSER: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
        out[s.name + ("{" + labels + "}" if labels else "")] = s.value
print(json.dumps(out))
"#;
    let mut child = Command::new("python3")
        .args(["-c", PARSER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/setup.sh installs prometheus_client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused the scrape: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("parser output")
}

fn value(samples: &HashMap<String, f64>, key: &str) -> f64 {
    *samples
        .get(key)
        .unwrap_or_else(|| panic!("no sample {key} in {samples:#?}"))
}

fn sum_of(samples: &HashMap<String, f64>, prefix: &str) -> f64 {
    samples
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, v)| v)
        .sum()
}

fn threads_of(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

#[test]
fn a_scrape_counts_actions_checkpoints_faults_and_restores_and_parses() {
    let (d, addr) = daemon_with_metrics();
    let empty = parse(&scrape(addr));
    assert_eq!(value(&empty, "belayer_sandboxes{state=\"running\"}"), 0.0);
    assert!(value(&empty, "belayer_threads") >= 1.0);
    assert!(empty.keys().any(|k| k.starts_with("belayer_build_info{")));

    d.image("busybox", &busybox_rootfs());
    let sb = d.create("busybox");
    assert_eq!(d.sh(&sb.id, "echo hi > /root/a; cat /root/a"), "hi");
    assert_eq!(d.exec(&sb.id, "exit 3").exit_code, 3);
    let c1 = d.checkpoint(&sb.id, 1, b"L1");
    let skip = d.call(Request::MaybeCheckpoint(MaybeCheckpointRequest {
        id: sb.id.clone(),
        prefix: 2,
        context: b"L2".to_vec(),
        step_duration_s: 1.0,
        regen_cost_s: None,
        llm_elapsed_s: 0.0,
        llm_response_s: None,
        policy: Some(PolicySpec {
            kind: Some("never".into()),
            ..Default::default()
        }),
    }));
    assert!(
        matches!(&skip, Response::MaybeCheckpoint(r) if !r.checkpointed),
        "{skip:?}"
    );
    let missing = d.call(Request::Exec(belayer_ipc::ExecRequest {
        id: "no-such-sandbox".into(),
        argv: vec!["true".into()],
        ..Default::default()
    }));
    assert!(matches!(missing, Response::Error(_)), "{missing:?}");
    d.fail_stop(&sb.id);
    // The reaper or the tracer marks it failed.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = parse(&scrape(addr));
        if value(&s, "belayer_sandboxes{state=\"failed\"}") == 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "never failed: {s:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let restored = d.restore(&sb.id);
    assert_eq!(d.sh(&sb.id, "cat /root/a"), "hi");
    let bad = d.call(Request::Restore {
        id: sb.id.clone(),
        verify: false,
        prefix: Some(99),
    });
    assert!(matches!(bad, Response::Error(_)), "{bad:?}");

    let s = parse(&scrape(addr));
    for (key, want) in [
        ("belayer_actions_total{outcome=\"ok\"}", 2.0),
        ("belayer_actions_total{outcome=\"nonzero_exit\"}", 1.0),
        ("belayer_actions_total{outcome=\"UnknownSandbox\"}", 1.0),
        ("belayer_action_duration_seconds_count", 3.0),
        ("belayer_checkpoints_total{result=\"taken\"}", 1.0),
        ("belayer_checkpoints_skipped_total{reason=\"never\"}", 1.0),
        ("belayer_checkpoint_size_bytes_count", 1.0),
        ("belayer_checkpoint_size_bytes_sum", c1.bytes as f64),
        ("belayer_checkpoint_size_bytes_bucket{le=\"+Inf\"}", 1.0),
        ("belayer_restores_total{outcome=\"ok\"}", 1.0),
        ("belayer_sandboxes{state=\"running\"}", 1.0),
        ("belayer_sandboxes{state=\"failed\"}", 0.0),
        ("belayer_images", 1.0),
    ] {
        assert_eq!(value(&s, key), want, "{key}");
    }
    let frozen = value(&s, "belayer_checkpoint_frozen_seconds_sum");
    assert!(
        (frozen - c1.timings_ms.frozen_total / 1e3).abs() < 1e-6,
        "{frozen} vs {:?}",
        c1.timings_ms
    );
    assert_eq!(sum_of(&s, "belayer_restores_total{"), 2.0, "{s:#?}");
    let restore_s = value(&s, "belayer_restore_duration_seconds_sum");
    assert!((restore_s - restored.timings_ms.total / 1e3).abs() < 1e-6);
    assert!(sum_of(&s, "belayer_infra_faults_total{") >= 1.0, "{s:#?}");
    // The blob store is measured at most every 10 s: the checkpoint's blobs may be in the next.
    assert!(value(&s, "belayer_blob_store_bytes") >= 0.0);
    assert!(value(&s, "belayer_connections") >= 0.0);
    assert!(value(&s, "belayer_threads") >= 2.0);
    dashboard_queries_name_scraped_series(&s);
}

/// Every metric a query of the Grafana dashboard (`docs/grafana/belayer.json`) names is a
/// sample name of the scrape.
fn dashboard_queries_name_scraped_series(samples: &HashMap<String, f64>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/grafana/belayer.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("JSON");
    let names: std::collections::HashSet<&str> = samples
        .keys()
        .map(|k| k.split('{').next().unwrap_or(k))
        .collect();
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() > 10, "{exprs:?}");
    for expr in &exprs {
        let mut rest = expr.as_str();
        while let Some(i) = rest.find("belayer_") {
            let tail = &rest[i..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let metric = &tail[..end];
            assert!(
                names.contains(metric),
                "the dashboard queries {metric}, which no scrape has: {expr}"
            );
            rest = &tail[end..];
        }
    }
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn hostile_http_clients_leave_the_daemon_and_the_next_scrape_unharmed() {
    let (d, addr) = daemon_with_metrics();
    let pid = d.pid().expect("daemon running");
    scrape(addr);
    let baseline = threads_of(pid);
    // 300 idle connections, 50 slow senders (a byte a second), oversized heads, garbage.
    let idle: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    let slow: Vec<std::thread::JoinHandle<()>> = (0..50)
        .map(|_| {
            std::thread::spawn(move || {
                let Ok(mut s) = TcpStream::connect(addr) else {
                    return;
                };
                for b in b"GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaa" {
                    if s.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            })
        })
        .collect();
    for _ in 0..20 {
        let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'X', 1 << 20));
        let _ = http(addr, &huge);
        let _ = http(
            addr,
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
        );
        let _ = http(
            addr,
            b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n",
        );
    }
    let peak = threads_of(pid);
    assert!(
        peak <= baseline + 2,
        "belayerd went from {baseline} to {peak} threads under hostile HTTP clients"
    );
    // The socket is served as ever.
    assert!(matches!(d.call(Request::Status), Response::Status(_)));
    drop(idle);
    for t in slow {
        let _ = t.join();
    }
    // Once the flood ends, scrapes are answered at once again.
    let started = Instant::now();
    let s = parse(&scrape(addr));
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(value(&s, "belayer_threads") >= 1.0);
    let not_found = http(addr, b"GET /../../etc/shadow HTTP/1.1\r\n\r\n");
    assert!(not_found.starts_with("HTTP/1.1 404"), "{not_found}");
    let post = http(addr, b"POST /metrics HTTP/1.1\r\n\r\n");
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    d.assert_alive("after hostile HTTP clients");
}

/// `belayerd` with `--config CONFIG` and `extra` arguments, on a socket and state dir in `dir`:
/// its stderr, after checking that it refused to start.
fn belayerd_fails(dir: &std::path::Path, config: &std::path::Path, extra: &[&str]) -> String {
    let out = Command::new(bin("belayerd"))
        .arg("--config")
        .arg(config)
        .args(extra)
        .arg("--socket")
        .arg(dir.join("s.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .stdin(Stdio::null())
        .output()
        .expect("run belayerd");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "belayerd started: {err}");
    err
}

#[test]
fn a_non_loopback_metrics_address_is_refused_unless_allowed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("belayer.toml");
    std::fs::write(&config, "metrics_listen = \"0.0.0.0:0\"\n").unwrap();
    let err = belayerd_fails(dir.path(), &config, &[]);
    assert!(
        err.contains("metrics_listen") && err.contains("metrics_allow_remote"),
        "{err}"
    );
    // The flag goes through the same check.
    let err = belayerd_fails(
        dir.path(),
        std::path::Path::new("/dev/null"),
        &["--metrics-listen", "[::]:0"],
    );
    assert!(err.contains("metrics_listen"), "{err}");
}
