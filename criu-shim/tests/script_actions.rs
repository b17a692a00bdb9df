//! A gated dump and a staged restore, with the real CRIU, as root: CRIU runs the action script
//! only at the stages the caller acts on (the gate's `pre-dump`; the held `pre-resume`), not
//! a fork and an exec of it at every other stage, which in a dump would be in the frozen window
//! (the CRIU that `scripts/setup.sh` builds, with `scripts/criu-patches`; its logs show each
//! script run). Skips (printing why) only when no usable CRIU is found.

use belayer_criu::{DumpRequest, RestoreRequest, RestoreStage, DUMP_LOG, RESTORE_LOG};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::Pid;

mod common;

/// The lines of CRIU's log `log` that name a run of the script called `script`, and the
/// stages CRIU reached ("Running <stage> scripts").
fn script_runs(log: &str, script: &str) -> (usize, usize) {
    let runs = log
        .lines()
        .filter(|l| l.trim_end().ends_with(&format!("/{script}]")))
        .count();
    let stages = log
        .lines()
        .filter(|l| l.contains("Running ") && l.trim_end().ends_with(" scripts"))
        .count();
    (runs, stages)
}

#[test]
fn the_scripts_run_only_at_the_stages_they_act_on() {
    let Some(criu) = common::criu_or_skip("the_scripts_run_only_at_the_stages_they_act_on") else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let images = tmp.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let (mut child, pid) = common::sleeping_task();
    let dump_work = tmp.path().join("dump-work");
    criu.dump_gated(&DumpRequest::new(pid, &images, &dump_work), || {
        Ok::<(), std::io::Error>(())
    })
    .expect("gated dump");
    let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    child.wait().unwrap();
    let log = std::fs::read_to_string(dump_work.join(DUMP_LOG)).unwrap();
    let (runs, stages) = script_runs(&log, "gate.sh");
    println!("dump: the gate ran {runs} times in {stages} stages");
    assert!(
        stages > 1,
        "CRIU's dump passed no stage but pre-dump?\n{log}"
    );
    assert_eq!(
        runs, 1,
        "the gate ran at stages it does not act on (a CRIU without scripts/criu-patches? run \
         scripts/setup.sh)"
    );

    let work = tmp.path().join("restore-work");
    let mut held = 0;
    criu.restore_staged(
        &RestoreRequest::new(&images, &work),
        &[RestoreStage::PreResume],
        |_, _| {
            held += 1;
            Ok::<(), std::io::Error>(())
        },
    )
    .expect("staged restore");
    let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    let _ = waitpid(Pid::from_raw(pid), None);
    assert_eq!(held, 1);
    let log = std::fs::read_to_string(work.join(RESTORE_LOG)).unwrap();
    let (runs, stages) = script_runs(&log, "hook.sh");
    println!("restore: the hook ran {runs} times in {stages} stages");
    assert!(
        stages > 1,
        "CRIU's restore passed no stage but pre-resume?\n{log}"
    );
    assert_eq!(
        runs, 1,
        "the hook ran at stages it does not act on (a CRIU without scripts/criu-patches?)"
    );
}
