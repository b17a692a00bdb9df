//! A staged restore ([`Criu::restore_staged`]) whose action script dies while CRIU holds the
//! tree at `pre-resume`, with the real CRIU, as root: the caller gets
//! [`HookedRestoreError::ScriptEnded`] with what CRIU's log says about the script, not a
//! bare error about the answer fifo. Skips (printing why) only when no usable CRIU is found.

use std::time::{Duration, Instant};

use belayer_criu::{DumpRequest, HookedRestoreError, RestoreRequest, RestoreStage};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

mod common;

/// Live processes whose command line names `needle`.
fn naming(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            text.contains(needle).then_some(pid)
        })
        .collect()
}

#[test]
fn a_script_killed_at_pre_resume_is_reported_as_such() {
    let Some(criu) = common::criu_or_skip("a_script_killed_at_pre_resume_is_reported_as_such")
    else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let (mut child, pid) = common::sleeping_task();
    criu.dump(&DumpRequest::new(
        pid,
        &images,
        tmp.path().join("dump-work"),
    ))
    .expect("dump");
    // The restored pids must be free.
    let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    child.wait().unwrap();

    let work = tmp.path().join("restore-work");
    // The held script's shell names the script (CRIU names it too, after `--action-script`).
    let script = format!("-p {}", work.join("hook.sh").display());
    let result = criu.restore_staged(
        &RestoreRequest::new(&images, &work),
        &[RestoreStage::PreResume],
        |_, _| {
            // What a stray SIGKILL does to the held script: it dies before the answer.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let held = naming(&script);
                if held.is_empty() {
                    return Ok::<(), std::io::Error>(());
                }
                assert!(Instant::now() < deadline, "the script outlived SIGKILL");
                for p in held {
                    let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        },
    );
    // CRIU went on without the answer: the tree runs again; it goes in any case.
    let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    let _ = waitpid(Pid::from_raw(pid), None);
    match result {
        Err(HookedRestoreError::ScriptEnded { stage, log }) => {
            assert_eq!(stage, RestoreStage::PreResume);
            assert!(log.contains("cript"), "CRIU's lines on the script: {log}");
            println!("reported: {log}");
        }
        other => panic!("expected ScriptEnded, got {other:?}"),
    }
}
