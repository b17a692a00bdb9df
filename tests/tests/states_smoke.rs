//! The probe harness itself (`belayer_tests::states`): a probe whose only state is its own
//! process (pid and a counter in memory) passes after checkpoint → SIGKILL → restore.

use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::Daemon;

/// State: a plain process with memory of its own (a counter that keeps running).
#[test]
fn a_plain_process_passes_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "plain",
        r#"
pid = os.getpid()
n = 0
ready()
while not _term[0]:
    n += 1
    time.sleep(0.01)
check(os.getpid() == pid, "pid changed")
check(n > 0, "counter never ran")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}
