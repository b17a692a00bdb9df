//! `belayer cp` against a real daemon: both directions, `--json` summaries, tar streams on
//! stdin and stdout (a hostile one refused), and the exit codes of bad command lines.

use std::fs;
use std::io::Write;
use std::process::{Command, Stdio};

use belayer_tests::{bin, busybox_rootfs, Daemon};
use serde_json::Value;

/// Runs `belayer --socket S ARGS` with `stdin`; returns (exit code, stdout, stderr).
fn belayer(d: &Daemon, args: &[&str], stdin: &[u8]) -> (i32, Vec<u8>, String) {
    let mut child = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    let data = stdin.to_vec();
    let feeder = std::thread::spawn(move || {
        let _ = input.write_all(&data);
    });
    let out = child.wait_with_output().unwrap();
    feeder.join().unwrap();
    (
        out.status.code().unwrap_or(-1),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cp_copies_both_ways_and_reports_json() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("proj");
    fs::create_dir_all(src.join("tests")).unwrap();
    fs::write(src.join("tests/test_a.py"), b"assert True\n").unwrap();
    fs::write(src.join("README"), b"hello\n").unwrap();

    let to = format!("{id}:/root");
    let (code, out, err) = belayer(&d, &["--json", "cp", src.to_str().unwrap(), &to], b"");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["bytes"], 12 + 6);
    assert_eq!(v["files"], 4, "{v}");
    assert!(v["seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(d.sh(&id, "cat /root/proj/tests/test_a.py"), "assert True");

    d.sh(&id, "mkdir -p /root/logs && echo line > /root/logs/run.log");
    let back = host.path().join("logs-copy");
    let from = format!("{id}:/root/logs");
    let (code, out, err) = belayer(&d, &["cp", &from, back.to_str().unwrap()], b"");
    assert_eq!(code, 0, "{err}");
    assert!(
        String::from_utf8_lossy(&out).starts_with("copied "),
        "{out:?}"
    );
    assert_eq!(fs::read(back.join("run.log")).unwrap(), b"line\n");

    // `-`: the tar of a sandbox path on stdout, and a tar on stdin into a directory.
    let (code, tar, err) = belayer(&d, &["--json", "cp", &from, "-"], b"");
    assert_eq!(code, 0, "{err}");
    let summary: Value = serde_json::from_str(err.trim().lines().last().unwrap()).unwrap();
    assert_eq!(summary["files"], 2);
    let mut names: Vec<String> = tar::Archive::new(tar.as_slice())
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    names.sort();
    assert_eq!(names, ["logs/", "logs/run.log"]);
    d.sh(&id, "mkdir /root/unpacked");
    let (code, _, err) = belayer(&d, &["cp", "-", &format!("{id}:/root/unpacked")], &tar);
    assert_eq!(code, 0, "{err}");
    assert_eq!(d.sh(&id, "cat /root/unpacked/logs/run.log"), "line");

    // A hostile archive on stdin: refused, exit 1, the daemon's code in the message.
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.as_old_mut().name[..12].copy_from_slice(b"../../escape");
    h.set_size(1);
    h.set_cksum();
    b.append(&h, &b"x"[..]).unwrap();
    let evil = b.into_inner().unwrap();
    let (code, _, err) = belayer(&d, &["cp", "-", &format!("{id}:/root")], &evil);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("TransferFailed") && err.contains("`..`"),
        "{err}"
    );

    // Bad command lines.
    let (code, _, err) = belayer(&d, &["cp", "/a", "/b"], b"");
    assert_eq!(code, 1);
    assert!(err.contains("ID:PATH"), "{err}");
    let (code, _, err) = belayer(&d, &["cp", &from, &to], b"");
    assert_eq!(code, 1);
    assert!(err.contains("both sides"), "{err}");
    let (code, _, err) = belayer(&d, &["cp", src.to_str().unwrap(), "sb-nope:/root"], b"");
    assert_eq!(code, 1);
    assert!(err.contains("UnknownSandbox"), "{err}");
}
