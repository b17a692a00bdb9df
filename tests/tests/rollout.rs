//! `belayer rollout` end to end: short recorded trajectories, a high failure rate and a small
//! time scale finish under every policy, every restore passes the validity check, the report
//! files exist and parse, and no context log is left in the daemon.

use std::process::Command;

use belayer_tests::{bin, python_rootfs, Daemon};
use serde_json::Value;

#[test]
fn rollout_under_every_policy_with_failures() {
    let d = Daemon::start();
    let out = tempfile::tempdir().unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/cli/trajectories");
    let files = [
        "sweagent__0.00__p-0.95__c-3.00__install-1_swe-agent__test-repo-i1.jsonl",
        "openhands__basic_gui_mode.jsonl",
        "tbmini__new-encrypt-command__2025-08-15__16-23-45.jsonl",
    ];
    let output = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .arg("rollout")
        .args(files.iter().map(|f| dir.join(f)))
        .args(["--compare", "adaptive,always,every:2,restart,never"])
        .args([
            "--failure-rate",
            "0.15",
            "--seed",
            "3",
            "--time-scale",
            "0.02",
            "--concurrency",
            "3",
        ])
        .args(["--action-timeout", "10"])
        .arg("--image-rootfs")
        .arg(python_rootfs())
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "rollout failed:\n{stdout}\n{stderr}"
    );

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json")).unwrap())
            .unwrap();
    assert!(report["failure_free"]["makespan_s"].as_f64().unwrap() > 0.0);
    let policies = report["policies"].as_object().unwrap();
    for name in [
        "adaptive",
        "always",
        "every:2",
        "restart",
        "never",
        "adaptive (no failures)",
    ] {
        let p = &policies[name];
        for key in [
            "makespan_s",
            "increase_s",
            "increase_pct",
            "failures",
            "restores",
            "regenerated_steps",
            "regenerated_s",
            "checkpoints_taken",
            "checkpoints_skipped",
            "checkpoint_hidden_s",
            "checkpoint_visible_s",
            "validity_errors",
        ] {
            assert!(!p[key].is_null(), "{name}.{key} missing in {p}");
        }
        assert_eq!(
            p["validity_errors"], 0,
            "{name}: {}",
            p["validity_error_messages"]
        );
        assert_eq!(
            p["failures"], p["restores"],
            "{name}: every failure is recovered"
        );
    }
    // The same failure schedule hits every policy that injects.
    let failures: u64 = policies["restart"]["failures"].as_u64().unwrap();
    assert!(failures > 0, "p=0.15 over 21 steps injected no failure");
    assert_eq!(policies["adaptive (no failures)"]["failures"], 0);
    // Checkpointing policies restore checkpoints, the baselines restart.
    assert!(policies["always"]["checkpoints_taken"].as_u64().unwrap() > 0);
    assert_eq!(policies["restart"]["checkpoints_taken"], 0);
    for f in [
        "report.md",
        "increase.svg",
        "timeline-always.svg",
        "timeline-restart.svg",
    ] {
        let text = std::fs::read_to_string(out.path().join(f)).unwrap();
        assert!(!text.is_empty(), "{f} is empty");
    }
    // The daemon held the context logs L_k, one per trajectory and run, and each was removed
    // when its run was over.
    let log = d.log_text();
    for f in files {
        let stem = f.trim_end_matches(".jsonl");
        let removed = log
            .lines()
            .filter(|l| l.contains("context log removed") && l.contains(stem))
            .count();
        assert!(removed >= 6, "{stem}: {removed} context logs removed");
    }
    let mut logs = Vec::new();
    let mut dirs = vec![d.state_dir.join("contexts")];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                dirs.push(e.path());
            } else {
                logs.push(e.file_name().to_string_lossy().into_owned());
            }
        }
    }
    assert!(logs.is_empty(), "context logs left: {logs:?}");
}

/// With no daemon answering, `belayer rollout` starts a private `belayerd` child, runs through
/// it, and leaves neither the child nor its state dir behind.
#[test]
fn rollout_without_a_daemon_runs_a_private_one() {
    let out = tempfile::tempdir().unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/cli/trajectories");
    let socket = out.path().join("nobody-listens.sock");
    let child = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&socket)
        .arg("rollout")
        .arg(dir.join("openhands__basic_gui_mode.jsonl"))
        .args(["--policy", "adaptive", "--no-overhead-run"])
        .args([
            "--failure-rate",
            "0.2",
            "--seed",
            "5",
            "--time-scale",
            "0.02",
        ])
        .arg("--image-rootfs")
        .arg(python_rootfs())
        .arg("--out")
        .arg(out.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "rollout failed:\n{stdout}\n{stderr}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json")).unwrap())
            .unwrap();
    assert_eq!(report["policies"]["adaptive"]["validity_errors"], 0);
    // The private daemon's state dir (`embedded-<belayer pid>-<nonce>`) is gone.
    let prefix = format!("embedded-{pid}-");
    if let Ok(entries) = std::fs::read_dir("/var/lib/belayer/scratch") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(!name.starts_with(&prefix), "left behind: {name}");
        }
    }
}
