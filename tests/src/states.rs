//! Process-state probes, in the manner of CRIU's zdtm static tests: a small program starts in a
//! sandbox and sets up one process state (a pty, an inotify watch, a lease, ...), says it is
//! ready, and waits for `SIGTERM`; the test checkpoints the sandbox, SIGKILLs every sandbox
//! process from the host, restores, and sends `SIGTERM`; the program then checks that its state
//! is what it set up and writes `PASS` or `FAIL: why` into its result file.
//!
//! Files of probe `NAME` live in `/probes` inside the sandbox: `NAME.py` (the program, for
//! Python probes), `NAME.pid`, `NAME.ready`, `NAME.log` (its stdout and stderr) and
//! `NAME.result`.

use std::cell::Cell;
use std::time::{Duration, Instant};

use belayer_ipc::RestoreInfo;

use crate::{python_rootfs, Daemon};

/// The Python helpers every Python probe starts with: `ready()` records the pid and marks the
/// probe ready; `wait_term()` sleeps until `SIGTERM`; `result(ok, why)` writes the verdict;
/// `check(cond, why)` collects failures that `finish()` reports.
pub const PY_PRELUDE: &str = r#"
import os, signal, sys, time
NAME = sys.argv[1]
DIR = "/probes"
_term = [False]
_fails = []
def _on_term(signum, frame):
    _term[0] = True
signal.signal(signal.SIGTERM, _on_term)
def _put(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)
def ready():
    _put(f"{DIR}/{NAME}.pid", str(os.getpid()))
    _put(f"{DIR}/{NAME}.ready", "1")
def wait_term():
    while not _term[0]:
        time.sleep(0.02)
def check(cond, why):
    if not cond:
        _fails.append(why)
    return cond
def finish():
    _put(f"{DIR}/{NAME}.result", "PASS\n" if not _fails else "FAIL: " + "; ".join(_fails) + "\n")
    sys.exit(0 if not _fails else 1)
"#;

/// Imports the python image as `python` (once per daemon) and creates a sandbox from it;
/// returns its id.
pub fn python_sandbox(d: &Daemon) -> String {
    d.image("python", &python_rootfs());
    d.create("python").id
}

/// A sandbox of the python image made with `spec` (its image set to that image).
pub fn python_sandbox_spec(d: &Daemon, spec: belayer_ipc::SandboxSpec) -> String {
    d.image("python", &python_rootfs());
    d.create_spec(belayer_ipc::SandboxSpec {
        image: "python".into(),
        ..spec
    })
    .id
}

/// Writes `content` to `path` inside the sandbox (through an action, as an agent would).
pub fn write_file(d: &Daemon, id: &str, path: &str, content: &str) {
    const EOF: &str = "BELAYER_PROBE_EOF";
    assert!(
        !content.contains(EOF),
        "content holds the heredoc delimiter"
    );
    d.sh(
        id,
        &format!("mkdir -p \"$(dirname {path})\" && cat > {path} <<'{EOF}'\n{content}\n{EOF}"),
    );
}

/// A probe started in a sandbox.
pub struct Probe<'a> {
    d: &'a Daemon,
    id: String,
    name: String,
    prefix: Cell<u64>,
}

impl std::fmt::Debug for Probe<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Probe")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish()
    }
}

impl<'a> Probe<'a> {
    /// Starts the Python probe `name` (`PY_PRELUDE` followed by `body`) in the background in
    /// sandbox `id` and waits until it calls `ready()`.
    pub fn python(d: &'a Daemon, id: &str, name: &str, body: &str) -> Probe<'a> {
        write_file(
            d,
            id,
            &format!("/probes/{name}.py"),
            &format!("{PY_PRELUDE}\n{body}"),
        );
        Self::command(d, id, name, &format!("python3 /probes/{name}.py {name}"))
    }

    /// Starts `cmd` (a shell command line) in the background as probe `name`: it must write
    /// `/probes/NAME.pid` and `/probes/NAME.ready` itself (as `ready()` does), and
    /// `/probes/NAME.result` on `SIGTERM`. Waits until it is ready.
    pub fn command(d: &'a Daemon, id: &str, name: &str, cmd: &str) -> Probe<'a> {
        d.sh(
            id,
            &format!("mkdir -p /probes && cd /probes && (setsid {cmd} >/probes/{name}.log 2>&1 </dev/null &)"),
        );
        let probe = Probe {
            d,
            id: id.into(),
            name: name.into(),
            prefix: Cell::new(0),
        };
        probe.wait_for("ready", Duration::from_secs(30));
        probe
    }

    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The probe's log (stdout and stderr) so far.
    pub fn log(&self) -> String {
        let r = self
            .d
            .exec(&self.id, &format!("cat /probes/{}.log", self.name));
        String::from_utf8_lossy(&r.stdout).into_owned()
    }

    fn wait_for(&self, what: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let r = self
                .d
                .exec(&self.id, &format!("cat /probes/{}.{what}", self.name));
            if r.exit_code == 0 && !r.stdout.is_empty() {
                return String::from_utf8_lossy(&r.stdout).trim().to_string();
            }
            assert!(
                Instant::now() < deadline,
                "probe {} never wrote {what}; its log:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Checkpoints the sandbox (at the next prefix), SIGKILLs every one of its processes from
    /// the host and restores it; returns the restore's answer.
    pub fn checkpoint_kill_restore(&self) -> RestoreInfo {
        let k = self.prefix.get() + 1;
        self.prefix.set(k);
        self.d
            .checkpoint(&self.id, k, format!("prefix {k}").as_bytes());
        self.d.fail_stop(&self.id);
        self.d.restore(&self.id)
    }

    /// Sends `SIGTERM` and returns the probe's verdict (`PASS` or `FAIL: why`).
    pub fn verdict(&self) -> String {
        self.d.sh(
            &self.id,
            &format!("kill -TERM $(cat /probes/{}.pid)", self.name),
        );
        self.wait_for("result", Duration::from_secs(30))
    }

    /// Sends `SIGTERM` and asserts that the probe passed.
    pub fn assert_pass(&self) {
        let v = self.verdict();
        assert_eq!(
            v,
            "PASS",
            "probe {}: {v}; its log:\n{}",
            self.name,
            self.log()
        );
    }
}
