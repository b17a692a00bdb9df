//! A sandbox that builds a 30 000-deep directory chain in its upper layer must not crash,
//! wedge or exhaust `belayerd`: a checkpoint fails with a typed error and the sandbox keeps
//! running, `belayer sandbox rm` removes it, a daemon restarted next to it (adoption, which
//! retires stale instances) comes up and serves, and a restore retires the old instance
//! holding the chain. `/proc` says the daemon is alive after every step.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use belayer_ipc::{ErrorCode, ExecRequest, ExecResult, Request, Response};
use belayer_tests::{bin, python_rootfs, Daemon};

const DEPTH: usize = 30_000;

/// Python that makes a `DEPTH`-deep chain of directories `d` below `root`.
fn chain_script(root: &str) -> String {
    format!(
        "import os\nos.makedirs({root:?}, exist_ok=True)\nos.chdir({root:?})\n\
         for i in range({DEPTH}):\n    os.mkdir('d'); os.chdir('d')\nprint('built')"
    )
}

/// Runs `python3 -c SCRIPT` in the sandbox with a generous timeout (deep mkdirs are slow on
/// a loaded disk).
fn python_in(d: &Daemon, id: &str, script: &str) -> ExecResult {
    let req = ExecRequest {
        id: id.into(),
        argv: vec!["python3".into(), "-c".into(), script.into()],
        timeout_ms: Some(900_000),
        ..Default::default()
    };
    match d.call(Request::Exec(req)) {
        Response::Exec(r) => r,
        r => panic!("exec failed: {r:?}\n{}", d.log_text()),
    }
}

fn build_chain_in(d: &Daemon, id: &str) {
    let t = Instant::now();
    let r = python_in(d, id, &chain_script("/tmp/deep"));
    assert_eq!(
        r.exit_code,
        0,
        "building the chain failed: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    eprintln!(
        "sandbox {id} built a {DEPTH}-deep chain in {:?}",
        t.elapsed()
    );
}

fn sandbox_dir(d: &Daemon, id: &str) -> PathBuf {
    d.state_dir.join("sandboxes").join(id)
}

/// Waits until `path` is gone (background removal), asserting the daemon stays alive.
fn wait_gone(d: &Daemon, path: &Path, step: &str) {
    let t = Instant::now();
    while path.exists() {
        d.assert_alive(step);
        assert!(
            t.elapsed() < Duration::from_secs(900),
            "{step}: {} still there\n{}",
            path.display(),
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("{step}: {} removed after {:?}", path.display(), t.elapsed());
}

#[test]
fn a_30000_deep_tree_never_takes_the_daemon_down() {
    let mut d = Daemon::start();
    d.image("python", &python_rootfs());
    let a = d.create("python").id;
    let b = d.create("python").id;
    // Both sandboxes build their chains at once.
    std::thread::scope(|s| {
        s.spawn(|| build_chain_in(&d, &a));
        s.spawn(|| build_chain_in(&d, &b));
    });
    d.assert_alive("after building the chains");

    // 1. A checkpoint fails with a typed error (the chain's paths could never be restored);
    //    the sandbox keeps running.
    match d.checkpoint_raw(&a, 1, b"k1", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{}", e.message);
            assert!(
                e.message.contains("cannot capture the upper layer")
                    && (e.message.contains("longer than 4096")
                        || e.message.contains("directory levels deep")),
                "{}",
                &e.message[..e.message.len().min(400)]
            );
        }
        r => panic!("checkpoint of a {DEPTH}-deep tree did not fail: {r:?}"),
    }
    d.assert_alive("after the failed checkpoint");
    assert_eq!(d.inspect(&a).state, "running");
    assert_eq!(d.sh(&a, "echo still-running"), "still-running");

    // 2. `belayer sandbox rm` of a sandbox holding the chain.
    let t = Instant::now();
    let out = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["sandbox", "rm", &b])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sandbox rm failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_text()
    );
    eprintln!(
        "belayer sandbox rm of a {DEPTH}-deep sandbox: {:?}",
        t.elapsed()
    );
    assert!(!sandbox_dir(&d, &b).exists());
    d.assert_alive("after sandbox rm");

    // 3. A restart next to a stale instance holding a chain (what an interrupted restore
    //    leaves): adoption retires it in the background while the daemon serves.
    d.kill();
    let stale = sandbox_dir(&d, &a).join("inst-9");
    for sub in ["upper", "work/work", "merged"] {
        std::fs::create_dir_all(stale.join(sub)).unwrap();
    }
    let upper = stale.join("upper");
    let out = Command::new("python3")
        .arg("-c")
        .arg(chain_script(upper.to_str().unwrap()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::set_permissions(
        stale.join("work/work"),
        std::os::unix::fs::PermissionsExt::from_mode(0o000),
    )
    .unwrap();
    d.restart();
    d.assert_alive("after the restart (adoption)");
    assert_eq!(d.sh(&a, "echo adopted"), "adopted");
    wait_gone(&d, &stale, "adoption");
    d.assert_alive("after adoption retired the stale instance");

    // 4. A restore (no ready checkpoint: from the base image) retires the old instance,
    //    which holds the chain the sandbox built, in the background.
    let old = sandbox_dir(&d, &a).join(format!("inst-{}", d.inspect(&a).instance));
    let restored = d.restore(&a);
    assert_eq!(restored.prefix, None);
    d.assert_alive("after the restore");
    wait_gone(&d, &old, "restore");
    d.assert_alive("after the restore retired the old instance");
    assert_eq!(d.sh(&a, "test -e /tmp/deep || echo fresh"), "fresh");
}
