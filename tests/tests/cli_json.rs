//! The `--json` shape of every `belayer` command against a real daemon (as `docs/cli.md`
//! documents it): status, images, sandbox create (every option) / ls / inspect / rm, exec in
//! the workdir, checkpoint and its listing, restore of a chosen prefix, gc by tag and by age,
//! and failures (`{"error","message"}` with exit 1, or 3 when no daemon answers).

use std::process::Command;

use belayer_tests::cli::belayer_json;
use belayer_tests::{bin, busybox_rootfs, Daemon};
use serde_json::Value;

fn belayer(d: &Daemon, args: &[&str]) -> (i32, Value, String) {
    let out = belayer_json(d, args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {stdout:?}"));
    (
        out.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Runs a command that must succeed.
fn ok(d: &Daemon, args: &[&str]) -> Value {
    let (code, v, err) = belayer(d, args);
    assert_eq!(code, 0, "{args:?}: {err}");
    v
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .map(String::as_str)
        .collect();
    k.sort();
    k
}

const SANDBOX_KEYS: [&str; 16] = [
    "cgroup",
    "created_unix_ms",
    "env",
    "id",
    "image",
    "image_digest",
    "init_pid",
    "instance",
    "limits",
    "pids",
    "ready_prefix",
    "state",
    "tag",
    "user",
    "userns",
    "workdir",
];

#[test]
fn every_command_prints_its_documented_json() {
    let d = Daemon::start();
    let status = ok(&d, &["status"]);
    assert_eq!(
        keys(&status),
        [
            "cgroup",
            "criu",
            "protocol",
            "sandboxes",
            "tracer",
            "version"
        ]
    );
    assert_eq!(status["protocol"], belayer_ipc::PROTOCOL_VERSION);
    let image = ok(
        &d,
        &["image", "import", "bb", busybox_rootfs().to_str().unwrap()],
    );
    assert_eq!(image["name"], "bb");
    let images = ok(&d, &["image", "ls"]);
    assert_eq!(
        keys(&images[0]),
        [
            "bytes",
            "config",
            "created_unix_ms",
            "digest",
            "dropped_devices",
            "kind",
            "layers",
            "name",
            "owner_uid",
            "skipped_sockets",
            "source"
        ]
    );
    assert_eq!(images[0]["kind"], "flat");
    assert!(images[0]["digest"].as_str().unwrap().starts_with("blake3:"));

    let created = ok(
        &d,
        &[
            "sandbox",
            "create",
            "--image",
            "bb",
            "--memory-max",
            "64M",
            "--pids-max",
            "32",
            "--cpus",
            "0.5",
            "--disk-max",
            "32M",
            "--env",
            "MODE=cli",
            "--tag",
            "cli-json",
            "--userns",
            "private",
            "--workdir",
            "/tmp",
        ],
    );
    assert_eq!(keys(&created), SANDBOX_KEYS);
    let id = created["id"].as_str().unwrap().to_owned();
    assert_eq!(created["workdir"], "/tmp");
    assert_eq!(
        created["limits"],
        serde_json::json!({
            "memory_max": 64 << 20, "pids_max": 32, "cpus": 0.5, "disk_max": 32 << 20
        })
    );
    assert_eq!(created["env"], serde_json::json!([["MODE", "cli"]]));
    assert_eq!(created["userns"]["mode"], "private");
    let other = ok(&d, &["sandbox", "create", "--image", "bb"])["id"]
        .as_str()
        .unwrap()
        .to_owned();

    let listed = ok(&d, &["sandbox", "ls"]);
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[0]["id"], id.as_str(), "oldest first");
    assert_eq!(keys(&listed[1]), SANDBOX_KEYS);
    assert!(listed[1]["workdir"].is_null());
    let info = ok(&d, &["sandbox", "inspect", &id]);
    assert_eq!(keys(&info), SANDBOX_KEYS);
    assert_eq!(
        (info["state"].as_str(), info["tag"].as_str()),
        (Some("running"), Some("cli-json"))
    );

    // exec runs in the workdir; its JSON carries every field of the result.
    let (code, r, err) = belayer(&d, &["exec", &id, "--", "pwd; echo $MODE; touch f"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(r["stdout"], "/tmp\ncli\n");
    assert_eq!(
        keys(&r),
        [
            "dirty",
            "duration_ms",
            "exit_code",
            "infra_fault",
            "signal",
            "stderr",
            "stdout",
            "timed_out",
            "truncated"
        ]
    );

    for k in 1..=3 {
        let c = ok(&d, &["checkpoint", &id, "--prefix", &k.to_string()]);
        assert_eq!(
            keys(&c),
            [
                "bytes",
                "checkpoint",
                "context_digest",
                "created_unix_ms",
                "parent",
                "prefix",
                "ready",
                "sandbox",
                "timings_ms"
            ]
        );
        assert_eq!(c["prefix"], k);
    }
    let cps = ok(&d, &["checkpoint", "ls", &id]);
    let prefixes: Vec<u64> = cps
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prefix"].as_u64().unwrap())
        .collect();
    assert_eq!(prefixes, [1, 2, 3]);

    let r = ok(&d, &["restore", &id, "--prefix", "2", "--verify"]);
    assert_eq!(
        keys(&r),
        [
            "context",
            "dropped_prefixes",
            "init_pid",
            "inodes_kept",
            "prefix",
            "restarted_from_base",
            "sandbox",
            "timings_ms",
            "validity"
        ]
    );
    assert_eq!(r["prefix"], 2);
    assert_eq!(r["dropped_prefixes"], serde_json::json!([]));
    assert_eq!(r["validity"]["fs_matches"], true);
    // C_3 stays, as a branch; C_2 is the ready one.
    let cps = ok(&d, &["checkpoint", "ls", &id]);
    let ready: Vec<bool> = cps
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["ready"].as_bool().unwrap())
        .collect();
    assert_eq!(ready, [false, true, false], "{cps}");
    assert_eq!(cps[2]["parent"], cps[1]["checkpoint"], "{cps}");
    // Without --verify the validity is absent (null), not a failed check.
    let r = ok(&d, &["restore", &id]);
    assert!(r["validity"].is_null(), "{r}");
    assert_eq!(r["dropped_prefixes"], serde_json::json!([]));

    // fork: N children of C_K, each listed, L_K written where asked.
    let ctx = d.state_dir.join("../fork-ctx");
    let ctx_arg = ctx.display().to_string();
    let f = ok(
        &d,
        &[
            "fork",
            &id,
            "--prefix",
            "1",
            "--count",
            "2",
            "--verify",
            "--context-out",
            &ctx_arg,
        ],
    );
    assert_eq!(
        keys(&f),
        [
            "checkpoint",
            "children",
            "context_file",
            "fork",
            "prefix",
            "source",
            "total_ms"
        ]
    );
    assert_eq!(
        (f["prefix"].as_u64(), f["source"].as_str()),
        (Some(1), Some(id.as_str()))
    );
    let children = f["children"].as_array().unwrap();
    assert_eq!(children.len(), 2);
    assert!(ctx.is_file(), "L_K written to {ctx_arg}");
    assert_eq!(
        keys(&children[0]),
        ["init_pid", "sandbox", "timings_ms", "validity"]
    );
    assert_eq!(children[0]["validity"]["processes_match"], true);
    for c in children {
        ok(&d, &["sandbox", "rm", c["sandbox"].as_str().unwrap()]);
    }
    let (code, e, _) = belayer(&d, &["fork", &id, "--count", "0"]);
    assert_eq!((code, e["error"].as_str()), (1, Some("BadRequest")));

    // Failures: JSON on stdout, exit 1.
    let (code, e, _) = belayer(&d, &["restore", &id, "--prefix", "9"]);
    assert_eq!(code, 1);
    assert_eq!(e["error"], "NotFound");
    assert!(e["message"].as_str().unwrap().contains("prefix 9"), "{e}");
    let (code, e, _) = belayer(&d, &["sandbox", "inspect", "sb-unknown"]);
    assert_eq!((code, e["error"].as_str()), (1, Some("UnknownSandbox")));
    let (code, e, _) = belayer(&d, &["gc"]);
    assert_eq!((code, e["error"].as_str()), (1, Some("BadRequest")));
    let out = Command::new(bin("belayer"))
        .args(["--socket", "/nonexistent.sock", "--json", "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let e: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(e["error"], "Unreachable");

    // gc: by tag (every checkpoint of the tagged sandbox), then by age (ready ones kept).
    ok(&d, &["checkpoint", &other, "--prefix", "1"]);
    ok(&d, &["checkpoint", &other, "--prefix", "2"]);
    let gc = ok(&d, &["gc", "--tag", "cli-json"]);
    assert_eq!(keys(&gc), ["bytes", "removed"]);
    // C_1, C_2 and the branch C_3 of the tagged sandbox.
    assert_eq!(gc["removed"], 3);
    let gc = ok(&d, &["gc", "--older-than", "0"]);
    assert_eq!(gc["removed"], 1);
    assert_eq!(ok(&d, &["checkpoint", "ls", &other])[0]["prefix"], 2);

    assert_eq!(
        ok(&d, &["sandbox", "rm", &id]),
        serde_json::json!({"ok": true})
    );
    assert_eq!(
        ok(&d, &["sandbox", "rm", &other]),
        serde_json::json!({"ok": true})
    );
    assert_eq!(
        ok(&d, &["image", "rm", "bb"]),
        serde_json::json!({"ok": true})
    );
}
