//! One checkpoint-policy path: the daemon keeps, per sandbox, what changed since its ready
//! checkpoint (the tracer's verdict of every `Exec`), and `MaybeCheckpoint` (the call of the C
//! ABI, the Python package and `belayer rollout`) skips a step after which nothing changed as
//! `clean`, and checkpoints after a writing one. Checked with BPF and with the fallback, across a
//! restore, and after a restart of `belayerd` (which cannot know what ran before it: it decides
//! as if the sandbox were dirty until its next checkpoint). Changes no file shows count too: a
//! step that makes a process started earlier run (a line into the FIFO it reads, a signal it
//! traps), and what a restored process does after CRIU resumes it, before the next action.

use belayer_ipc::{DecisionReason, MaybeCheckpointResult, Request, Response};
use belayer_tests::policy::ask_unless_clean;
use belayer_tests::{busybox_rootfs, Daemon};

/// A policy that checkpoints whenever the step is not clean, with L_k = `L_<prefix>`.
fn ask(d: &Daemon, id: &str, prefix: u64) -> MaybeCheckpointResult {
    ask_unless_clean(d, id, prefix, format!("L_{prefix}").into_bytes())
}

fn run(d: &mut Daemon) {
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    // A fresh sandbox is its image: a read-only first step is clean.
    assert_eq!(d.exec(&id, "cat /etc/passwd >/dev/null").dirty, Some(false));
    let r = ask(d, &id, 1);
    assert!(!r.checkpointed, "{r:?}");
    assert_eq!(r.decision.reason, DecisionReason::Clean);

    // A writing step checkpoints; a read after it is clean against that checkpoint.
    assert_eq!(d.exec(&id, "echo one > /state").dirty, Some(true));
    let r = ask(d, &id, 2);
    assert!(r.checkpointed, "{r:?}");
    assert_eq!(r.decision.reason, DecisionReason::Benefit);
    assert_eq!(r.checkpoint.as_ref().map(|c| c.prefix), Some(2));
    assert_eq!(d.exec(&id, "cat /state").dirty, Some(false));
    let r = ask(d, &id, 3);
    assert_eq!(
        (r.checkpointed, r.decision.reason),
        (false, DecisionReason::Clean)
    );

    // A write, then a read: dirty since the ready checkpoint, though the last step was clean.
    assert_eq!(d.exec(&id, "echo two > /state").dirty, Some(true));
    assert_eq!(d.exec(&id, "cat /state").dirty, Some(false));
    let r = ask(d, &id, 5);
    assert!(r.checkpointed, "{r:?}");

    // After a restore the sandbox is its ready checkpoint: clean.
    d.exec(&id, "echo three > /state");
    d.fail_stop(&id);
    assert_eq!(d.restore(&id).prefix, Some(5));
    let r = ask(d, &id, 6);
    assert_eq!(
        (r.checkpointed, r.decision.reason),
        (false, DecisionReason::Clean)
    );

    // A restarted daemon cannot know what ran before it: not clean until a checkpoint.
    d.restart();
    assert_eq!(d.exec(&id, "cat /state").dirty, Some(false));
    let r = ask(d, &id, 7);
    assert!(r.checkpointed, "after a restart: {r:?}");
    assert_eq!(d.exec(&id, "cat /state").dirty, Some(false));
    let r = ask(d, &id, 8);
    assert_eq!(
        (r.checkpointed, r.decision.reason),
        (false, DecisionReason::Clean)
    );

    // gc dropping the ready checkpoint: no checkpoint holds this state any more.
    let spec = belayer_ipc::SandboxSpec {
        image: "busybox".into(),
        tag: Some("gc-me".into()),
        ..Default::default()
    };
    let tagged = d.create_spec(spec).id;
    assert_eq!(d.exec(&tagged, "echo a > /a").dirty, Some(true));
    assert!(ask(d, &tagged, 1).checkpointed);
    assert_eq!(ask(d, &tagged, 2).decision.reason, DecisionReason::Clean);
    match d.call(Request::Gc {
        older_than_s: None,
        tag: Some("gc-me".into()),
    }) {
        Response::Gc { removed, .. } => assert_eq!(removed, 1),
        other => panic!("gc: {other:?}"),
    }
    let r = ask(d, &tagged, 3);
    assert!(
        r.checkpointed,
        "after gc removed the ready checkpoint: {r:?}"
    );
}

/// A step is dirty when it made a process that ran before it run, though no file changed; and
/// the first step after a restore covers what the restored tree did once it ran.
fn live_state(d: &mut Daemon) {
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    // A reader that counts, in its memory only, the lines of a FIFO and the USR1s it gets.
    let start = "mkfifo /fifo; sh -c 'trap \"n=$((n+1))\" USR1; exec 3<>/fifo; \
                 while read -r l <&3; do n=$((n+1)); done' </dev/null >/dev/null 2>&1 & \
                 echo $! > /reader";
    assert_eq!(d.exec(&id, start).dirty, Some(true));
    assert!(ask(d, &id, 1).checkpointed);
    // Blocked in its read, the reader does not run: a read-only step stays clean.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(
        d.exec(&id, "cat /reader >/dev/null").dirty,
        Some(false),
        "{}",
        d.log_text()
    );
    assert_eq!(ask(d, &id, 2).decision.reason, DecisionReason::Clean);

    // A line into the FIFO changes only the reader's memory.
    assert_eq!(d.exec(&id, "echo hello > /fifo").dirty, Some(true));
    let r = ask(d, &id, 3);
    assert!(r.checkpointed, "after a write to the reader's FIFO: {r:?}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(d.exec(&id, "true").dirty, Some(false));
    // So does a signal it traps.
    assert_eq!(
        d.exec(&id, "kill -USR1 $(cat /reader)").dirty,
        Some(true),
        "a trapped signal"
    );
    assert!(ask(d, &id, 5).checkpointed);

    // A job that writes a file after the step that started it, and after a clean step:
    // the write happened before the call, so the call does not skip.
    // (The step waits until the job has started its `sleep`, so the next step's process
    // set is the same.)
    let later = "sh -c 'sleep 1; echo later > /later' </dev/null >/dev/null 2>&1 & sleep 0.2";
    assert_eq!(d.exec(&id, later).dirty, Some(true));
    assert!(ask(d, &id, 6).checkpointed);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(d.exec(&id, "true").dirty, Some(false));
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let r = ask(d, &id, 7);
    assert!(
        r.checkpointed,
        "after a background write since the last step: {r:?}"
    );

    // A job that writes a file a second after it starts, checkpointed while it sleeps: once
    // restored, it writes before the next action, which must not be called clean.
    let job = "sh -c 'sleep 1; echo late > /late' </dev/null >/dev/null 2>&1 &";
    assert_eq!(d.exec(&id, job).dirty, Some(true));
    assert!(ask(d, &id, 8).checkpointed);
    d.fail_stop(&id);
    assert_eq!(d.restore(&id).prefix, Some(8));
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let read = d.exec(&id, "cat /late");
    assert_eq!(String::from_utf8_lossy(&read.stdout).trim(), "late");
    assert_eq!(read.dirty, Some(true), "the restored job wrote /late");
    let r = ask(d, &id, 9);
    assert!(r.checkpointed, "after the restored job's write: {r:?}");
}

#[test]
fn live_process_state_is_a_change_with_bpf() {
    live_state(&mut Daemon::start());
}

#[test]
fn live_process_state_is_a_change_with_the_fallback() {
    live_state(&mut Daemon::start_no_bpf());
}

#[test]
fn maybe_checkpoint_skips_clean_steps_with_bpf() {
    run(&mut Daemon::start());
}

#[test]
fn maybe_checkpoint_skips_clean_steps_with_the_fallback() {
    run(&mut Daemon::start_no_bpf());
}
