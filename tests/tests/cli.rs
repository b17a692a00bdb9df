//! The `belayer` command against a real daemon: JSON shapes and exit codes.

use std::process::Command;

use belayer_tests::cli::belayer_json;
use belayer_tests::{bin, busybox_rootfs, Daemon};
use serde_json::Value;

fn belayer(d: &Daemon, args: &[&str]) -> (i32, Value, String) {
    let out = belayer_json(d, args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn cli_cycle_with_json() {
    let d = Daemon::start();
    let (code, _, err) = belayer(
        &d,
        &["image", "import", "bb", busybox_rootfs().to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    let (_, images, _) = belayer(&d, &["image", "ls"]);
    assert_eq!(images[0]["name"], "bb");

    let (code, created, err) = belayer(
        &d,
        &[
            "sandbox",
            "create",
            "--image",
            "bb",
            "--memory-max",
            "256M",
            "--pids-max",
            "64",
            "--env",
            "GREETING=hi",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let id = created["id"].as_str().unwrap().to_string();

    let (code, r, _) = belayer(
        &d,
        &["exec", &id, "--", "echo $GREETING; echo oops >&2; exit 3"],
    );
    assert_eq!(code, 3, "the CLI exits with the action's code");
    assert_eq!(r["exit_code"], 3);
    assert_eq!(r["stdout"], "hi\n");
    assert_eq!(r["stderr"], "oops\n");
    assert!(r["duration_ms"].as_f64().unwrap() > 0.0);

    let (code, _, _) = belayer(&d, &["exec", &id, "--cwd", "/tmp", "--", "pwd", ">", "/x"]);
    assert_eq!(code, 0);

    let ctx = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ctx.path(), b"[{\"role\":\"user\",\"content\":\"k=1\"}]").unwrap();
    let (code, c, err) = belayer(
        &d,
        &[
            "checkpoint",
            &id,
            "--prefix",
            "1",
            "--context",
            ctx.path().to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(c["prefix"], 1);
    assert_eq!(c["sandbox"], id.as_str());
    for k in [
        "freeze",
        "fs_capture",
        "criu_dump",
        "publish",
        "frozen_total",
        "total",
    ] {
        assert!(
            c["timings_ms"][k].as_f64().is_some(),
            "timings_ms.{k} missing: {c}"
        );
    }
    assert!(c["bytes"].as_u64().unwrap() > 0);

    let (_, info, _) = belayer(&d, &["sandbox", "inspect", &id]);
    assert_eq!(info["state"], "running");
    assert_eq!(info["ready_prefix"], 1);
    assert!(!info["pids"].as_array().unwrap().is_empty());
    assert!(info["cgroup"].as_str().unwrap().ends_with(&id));

    let (_, list, _) = belayer(&d, &["checkpoints", &id]);
    assert_eq!(list.as_array().unwrap().len(), 1);

    d.fail_stop(&id);
    let out = tempfile::NamedTempFile::new().unwrap();
    let (code, r, err) = belayer(
        &d,
        &[
            "restore",
            &id,
            "--context-out",
            out.path().to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(r["prefix"], 1);
    assert_eq!(r["context_file"], out.path().to_str().unwrap());
    assert_eq!(
        std::fs::read(out.path()).unwrap(),
        std::fs::read(ctx.path()).unwrap()
    );
    assert!(r["timings_ms"]["total"].as_f64().unwrap() > 0.0);

    // Errors: unknown sandbox → exit 1 with a message; no daemon → exit 3.
    let (code, _, err) = belayer(&d, &["sandbox", "inspect", "sb-unknown"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown sandbox"), "{err}");
    let out = Command::new(bin("belayer"))
        .args(["--socket", "/nonexistent.sock", "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));

    let (code, _, _) = belayer(&d, &["sandbox", "rm", &id]);
    assert_eq!(code, 0);
}

#[test]
fn cli_exec_options() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;

    // -i: the CLI's own stdin goes to the action; merged output, cwd, env, the whole JSON.
    let mut child = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["--json", "exec", &id, "--cwd", "/tmp", "--env", "WHO=cli"])
        .args(["--merge-stderr", "-i", "--timeout", "30", "--"])
        .arg("pwd; echo $WHO >&2; cat")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["stdout"], "/tmp\ncli\nfrom stdin\n");
    assert_eq!(r["stderr"], "");
    assert_eq!(r["truncated"], false);
    assert!(r["infra_fault"].is_null(), "{r}");
    assert!(r.get("dirty").is_some(), "{r}");

    // --stdin-file, and the limit on the merged stream.
    let input = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(input.path(), b"0123456789abcdef").unwrap();
    let (code, r, err) = belayer(
        &d,
        &[
            "exec",
            &id,
            "--stdin-file",
            input.path().to_str().unwrap(),
            "--merge-stderr",
            "--output-limit",
            "10",
            "--",
            "cat >&2",
        ],
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(r["stdout"], "0123456789");
    assert_eq!(r["truncated"], true);

    // Both stdin sources at once are a usage error.
    let (code, _, _) = belayer(&d, &["exec", &id, "-i", "--stdin-file", "/x", "--", "cat"]);
    assert_eq!(code, 2);
}
