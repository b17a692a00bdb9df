//! Shared fixtures of the end-to-end tests: a real `belayerd` started on a private socket and
//! state dir, plus small helpers around the protocol client.
//!
//! The tests need root, CRIU 4.x and the images built by `scripts/setup.sh`
//! (`BELAYER_TEST_BUSYBOX_ROOTFS`, `BELAYER_TEST_PYTHON_ROOTFS`, defaulting to
//! `/var/cache/belayer/images/{busybox,bookworm-python}/rootfs`).
#![warn(missing_docs)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::{
    CheckpointInfo, CheckpointRequest, Client, ExecRequest, ExecResult, Request, Response,
    RestoreInfo, SandboxInfo, SandboxSpec, TestFault,
};

/// Directory holding the built binaries (`target/<profile>`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of a workspace binary; panics with a hint when it was not built.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} not built: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Rootfs of the busybox test image.
pub fn busybox_rootfs() -> PathBuf {
    std::env::var_os("BELAYER_TEST_BUSYBOX_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/belayer/images/busybox/rootfs"))
}

/// Rootfs of the Debian python3 test image.
pub fn python_rootfs() -> PathBuf {
    std::env::var_os("BELAYER_TEST_PYTHON_ROOTFS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/belayer/images/bookworm-python/rootfs"))
}

/// A `belayerd` process with its own socket and state dir; killed and cleaned on drop
/// (sandboxes are removed first, because they outlive the daemon on purpose).
#[derive(Debug)]
pub struct Daemon {
    /// Socket path.
    pub socket: PathBuf,
    /// State dir.
    pub state_dir: PathBuf,
    dir: tempfile::TempDir,
    child: Option<Child>,
    log: PathBuf,
    test_hooks: bool,
    no_bpf: bool,
}

impl Daemon {
    /// Starts a daemon with test hooks enabled and waits until it answers.
    pub fn start() -> Daemon {
        Self::start_with(true)
    }

    /// Starts a daemon with test hooks and the BPF tracer disabled (`--no-bpf`: the
    /// pidfd/cgroup fallback detects failures).
    pub fn start_no_bpf() -> Daemon {
        Self::start_opts(true, true)
    }

    /// Starts a daemon, with or without test hooks.
    pub fn start_with(test_hooks: bool) -> Daemon {
        Self::start_opts(test_hooks, false)
    }

    fn start_opts(test_hooks: bool, no_bpf: bool) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("belayer-e2e-")
            .tempdir_in("/var/tmp")
            .expect("tempdir");
        let socket = dir.path().join("belayer.sock");
        let state_dir = dir.path().join("state");
        let log = dir.path().join("belayerd.log");
        let mut d = Daemon {
            socket,
            state_dir,
            dir,
            child: None,
            log,
            test_hooks,
            no_bpf,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        if let Err(e) = self.try_spawn() {
            panic!("{e}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("log");
        let mut cmd = Command::new(bin("belayerd"));
        if self.test_hooks {
            cmd.arg("--test-hooks");
        }
        if self.no_bpf {
            cmd.arg("--no-bpf");
        }
        let child = cmd
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--config")
            .arg("/dev/null")
            .env("BELAYER_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot spawn belayerd: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if matches!(c.call(Request::Ping), Ok(Response::Pong { .. })) {
                    return Ok(());
                }
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Err(format!(
                    "belayerd exited with {status}:\n{}",
                    self.log_text()
                ));
            }
            if Instant::now() > deadline {
                return Err(format!("belayerd did not answer:\n{}", self.log_text()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Process id of the running daemon, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILLs the daemon (sandboxes keep running).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for a daemon that killed itself (test fault) to be gone.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("daemon running");
        c.wait().expect("wait belayerd")
    }

    /// Starts the daemon again on the same socket and state dir.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A new client.
    pub fn client(&self) -> Client {
        Client::connect(&self.socket).expect("connect")
    }

    /// Sends a request; panics on transport errors.
    pub fn call(&self, req: Request) -> Response {
        self.client().call(req).expect("call")
    }

    /// Imports `rootfs` as image `name` (once).
    pub fn image(&self, name: &str, rootfs: &Path) {
        assert!(
            rootfs.is_dir(),
            "{} missing: run scripts/setup.sh",
            rootfs.display()
        );
        match self.call(Request::ImportImage {
            name: name.into(),
            source: rootfs.display().to_string(),
        }) {
            Response::Image(_) => {}
            Response::Error(e) if e.code == belayer_ipc::ErrorCode::AlreadyExists => {}
            r => panic!("import failed: {r:?}"),
        }
    }

    /// Creates a sandbox from `image`.
    pub fn create(&self, image: &str) -> SandboxInfo {
        self.create_spec(SandboxSpec {
            image: image.into(),
            ..Default::default()
        })
    }

    /// Creates a sandbox from a full spec.
    pub fn create_spec(&self, spec: SandboxSpec) -> SandboxInfo {
        match self.call(Request::CreateSandbox(spec)) {
            Response::Sandbox(s) => s,
            r => panic!("create failed: {r:?}\n{}", self.log_text()),
        }
    }

    /// Inspects a sandbox.
    pub fn inspect(&self, id: &str) -> SandboxInfo {
        match self.call(Request::InspectSandbox { id: id.into() }) {
            Response::Sandbox(s) => s,
            r => panic!("inspect failed: {r:?}"),
        }
    }

    /// Runs `cmd` with `sh -c`.
    pub fn exec(&self, id: &str, cmd: &str) -> ExecResult {
        let req = ExecRequest {
            id: id.into(),
            argv: vec![cmd.into()],
            timeout_ms: Some(60_000),
            ..Default::default()
        };
        match self.call(Request::Exec(req)) {
            Response::Exec(r) => r,
            r => panic!("exec {cmd:?} failed: {r:?}\n{}", self.log_text()),
        }
    }

    /// Runs `cmd`, asserts exit 0 and returns stdout as a trimmed string.
    pub fn sh(&self, id: &str, cmd: &str) -> String {
        let r = self.exec(id, cmd);
        assert_eq!(
            r.exit_code,
            0,
            "action {cmd:?} failed: stdout {:?} stderr {:?}",
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
        String::from_utf8_lossy(&r.stdout).trim().to_string()
    }

    /// Reads a number that a background loop of the sandbox keeps rewriting, retrying the
    /// instant between truncation and write (when the file is empty).
    pub fn number(&self, id: &str, path: &str) -> u64 {
        for _ in 0..50 {
            if let Ok(n) = self.sh(id, &format!("cat {path}")).parse() {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("{path} in {id} never held a number");
    }

    /// Takes a checkpoint; returns the daemon's raw answer.
    pub fn checkpoint_raw(
        &self,
        id: &str,
        prefix: u64,
        context: &[u8],
        fault: Option<TestFault>,
    ) -> Response {
        self.call(Request::Checkpoint(CheckpointRequest {
            id: id.into(),
            prefix,
            context: context.to_vec(),
            fault,
        }))
    }

    /// Takes a checkpoint that must succeed.
    pub fn checkpoint(&self, id: &str, prefix: u64, context: &[u8]) -> CheckpointInfo {
        match self.checkpoint_raw(id, prefix, context, None) {
            Response::Checkpoint(c) => c,
            r => panic!("checkpoint failed: {r:?}\n{}", self.log_text()),
        }
    }

    /// Restores; returns the daemon's raw answer.
    pub fn restore_raw(&self, id: &str) -> Response {
        self.call(Request::Restore {
            id: id.into(),
            verify: true,
        })
    }

    /// Restores, which must succeed.
    pub fn restore(&self, id: &str) -> RestoreInfo {
        match self.restore_raw(id) {
            Response::Restored(r) => r,
            r => panic!("restore failed: {r:?}\n{}", self.log_text()),
        }
    }

    /// SIGKILLs every process of the sandbox from the host (a fail-stop).
    pub fn fail_stop(&self, id: &str) {
        let info = self.inspect(id);
        assert!(!info.pids.is_empty(), "sandbox {id} has no processes");
        for pid in &info.pids {
            // SAFETY: kill(2) with a pid and a signal number; no memory involved.
            unsafe {
                libc::kill(*pid, libc::SIGKILL);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inspect(id).state != "failed" {
            assert!(
                Instant::now() < deadline,
                "sandbox {id} not seen failed after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The sandbox's root filesystem as the host sees it: the overlay merged dir of its current
    /// instance (without the sandbox's own /proc and /dev mounts).
    pub fn root(&self, id: &str) -> PathBuf {
        let n = self.inspect(id).instance;
        self.state_dir
            .join("sandboxes")
            .join(id)
            .join(format!("inst-{n}"))
            .join("merged")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.is_none() {
            // Sandboxes outlive the daemon: bring one up again to remove them.
            let _ = self.try_spawn();
        }
        if self.child.is_some() {
            if let Ok(mut c) = Client::connect(&self.socket) {
                if let Ok(Response::Sandboxes(list)) = c.call(Request::ListSandboxes) {
                    for s in list {
                        let _ = c.call(Request::RemoveSandbox { id: s.id });
                    }
                }
            }
        }
        self.kill();
        if std::thread::panicking() {
            eprintln!("---- belayerd log ----\n{}", self.log_text());
        }
        let _ = &self.dir;
    }
}
