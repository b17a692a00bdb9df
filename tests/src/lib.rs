//! Shared fixtures of the end-to-end tests: a real `belayerd` started on a private socket and
//! state dir, plus small helpers around the protocol client.
//!
//! The tests need root, CRIU 4.x and the images built by `scripts/setup.sh`
//! (`BELAYER_TEST_BUSYBOX_ROOTFS`, `BELAYER_TEST_PYTHON_ROOTFS`, defaulting to
//! `/var/cache/belayer/images/{busybox,bookworm-python}/rootfs`).
//!
//! Dependencies: `belayer-ipc` (the protocol client), `belayer-overlay` (blob names, to damage
//! a stored blob on purpose), `libc` (signals), `serde`/`serde_json`, `tempfile`, `sha2`
//! (digests of hand-written OCI layouts, [`oci`]), `tar` (hand-written layer tars), `flate2`
//! (gzip layers). The registry fixtures ([`registry`], [`oci`], [`oci_build`]) run Debian's
//! `docker-registry`, `umoci`, `skopeo` and `htpasswd`.
#![warn(missing_docs)]

pub mod cli;
pub mod oci;
pub mod oci_build;
pub mod orphans;
pub mod peer;
pub mod policy;
pub mod registry;
pub mod states;

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

/// Where test daemons keep their state dirs: `BELAYER_TEST_STATE_ROOT` (exported by
/// `scripts/setup.sh`), else `/var/lib/belayer/test-runs`. It must be on btrfs with quotas (the
/// file system set-up mounts at `/var/lib/belayer`), since daemons enforce the default disk
/// limit; panics with a hint to run set-up otherwise.
pub fn state_root() -> PathBuf {
    let root = std::env::var_os("BELAYER_TEST_STATE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/belayer/test-runs"));
    let parent = root.parent().unwrap_or(&root);
    if !is_btrfs(parent) {
        panic!(
            "test state root {} is not on btrfs, so daemons cannot enforce disk quotas there: \
             run `bash scripts/setup.sh` (it mounts a btrfs image at /var/lib/belayer) and use \
             the BELAYER_TEST_STATE_ROOT it exports",
            root.display()
        );
    }
    std::fs::create_dir_all(&root)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", root.display()));
    root
}

/// Whether the existing directory `path` is on btrfs (`statfs` magic `BTRFS_SUPER_MAGIC`).
pub fn is_btrfs(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: an all-zero statfs is a valid value of this plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a live statfs the call writes into.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == 0x9123_683e
}

/// An unprivileged identity a test process runs as: uid, primary gid and supplementary
/// groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

impl Identity {
    /// uid/gid 65534 (`nobody`) with the supplementary `groups` (e.g. the socket group).
    pub fn nobody(groups: &[u32]) -> Identity {
        Identity {
            uid: 65534,
            gid: 65534,
            groups: groups.to_vec(),
        }
    }
}

impl Identity {
    /// Makes `cmd` run as this identity: the forked child calls `setgroups`, `setresgid` and
    /// `setresuid` (in that order, real, effective and saved ids) before it execs.
    pub fn apply(&self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        let (uid, gid) = (self.uid, self.gid);
        let groups: Vec<libc::gid_t> = self.groups.clone();
        // SAFETY: the closure runs in the forked child before exec and only makes the
        // async-signal-safe calls setgroups, setresgid and setresuid on memory (`groups`)
        // that was allocated before the fork and is only read.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(gid, gid, gid) != 0
                    || libc::setresuid(uid, uid, uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
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
    sock_dir: tempfile::TempDir,
    child: Option<Child>,
    log: PathBuf,
    test_hooks: bool,
    no_bpf: bool,
    config: Option<PathBuf>,
    socket_gid: Option<u32>,
}

/// How [`Daemon::start_options`] starts a daemon.
#[derive(Debug, Clone, Default)]
pub struct DaemonOptions {
    /// Honour test-fault hooks.
    pub test_hooks: bool,
    /// Use the tracer's fallback instead of BPF.
    pub no_bpf: bool,
    /// TOML of the daemon's config file (empty: none).
    pub config: String,
    /// State dir (default: `state` in the daemon's temp dir on [`state_root`]).
    pub state_dir: Option<PathBuf>,
    /// `--socket-gid`: members of this group may use the socket.
    pub socket_gid: Option<u32>,
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

    /// Starts a daemon with test hooks whose socket also admits the members of group `gid`
    /// (`--socket-gid`): the socket file belongs to that group (mode 0660) and the test dir
    /// is made traversable (0711), so an unprivileged process in the group can connect.
    pub fn start_with_socket_gid(gid: u32) -> Daemon {
        Self::start_full(true, false, Some(gid))
    }

    fn start_opts(test_hooks: bool, no_bpf: bool) -> Daemon {
        Self::start_options(DaemonOptions {
            test_hooks,
            no_bpf,
            ..DaemonOptions::default()
        })
    }

    fn start_full(test_hooks: bool, no_bpf: bool, socket_gid: Option<u32>) -> Daemon {
        Self::start_options(DaemonOptions {
            test_hooks,
            no_bpf,
            socket_gid,
            ..DaemonOptions::default()
        })
    }

    /// Starts a daemon as `opts` say.
    pub fn start_options(opts: DaemonOptions) -> Daemon {
        let dir = tempfile::Builder::new()
            .prefix("belayer-e2e-")
            .tempdir_in(state_root())
            .expect("tempdir");
        // The socket lives apart from the state (whose parent is root-only), in a dir that a
        // socket-group member can traverse.
        let sock_dir = tempfile::Builder::new()
            .prefix("belayer-e2e-sock-")
            .tempdir_in("/tmp")
            .expect("socket tempdir");
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(sock_dir.path(), std::fs::Permissions::from_mode(0o711))
                .expect("chmod socket dir");
        }
        let socket = sock_dir.path().join("belayer.sock");
        let state_dir = opts.state_dir.unwrap_or_else(|| dir.path().join("state"));
        let log = dir.path().join("belayerd.log");
        let config = (!opts.config.is_empty()).then(|| {
            let path = dir.path().join("belayer.toml");
            std::fs::write(&path, &opts.config).expect("config");
            path
        });
        let mut d = Daemon {
            socket,
            state_dir,
            dir,
            sock_dir,
            child: None,
            log,
            test_hooks: opts.test_hooks,
            no_bpf: opts.no_bpf,
            config,
            socket_gid: opts.socket_gid,
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
        if let Some(gid) = self.socket_gid {
            cmd.arg("--socket-gid").arg(gid.to_string());
        }
        let child = cmd
            .arg("--socket")
            .arg(&self.socket)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--config")
            .arg(self.config.as_deref().unwrap_or(Path::new("/dev/null")))
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

    /// Replaces the daemon's config file with `toml` (read at the next [`Self::restart`]).
    pub fn set_config(&mut self, toml: &str) {
        let path = self.dir.path().join("belayer.toml");
        std::fs::write(&path, toml).expect("config");
        self.config = Some(path);
    }

    /// Pids of the daemon's children that are zombies (from every thread's `children` list
    /// in `/proc`).
    pub fn zombie_children(&self) -> Vec<i32> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        let mut zombies = Vec::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children.split_whitespace() {
                let status =
                    std::fs::read_to_string(format!("/proc/{child}/status")).unwrap_or_default();
                if status
                    .lines()
                    .any(|l| l.starts_with("State:") && l.contains('Z'))
                {
                    zombies.extend(child.parse::<i32>().ok());
                }
            }
        }
        zombies
    }

    /// Pid of the running daemon process, if one was started and not yet killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Asserts, from `/proc`, that the daemon process exists and has not died (no zombie),
    /// and that it answers a ping; `step` names the test step in the message.
    pub fn assert_alive(&self, step: &str) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{step}: no daemon process"));
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_else(|e| panic!("{step}: belayerd {pid} gone: {e}\n{}", self.log_text()));
        // The state is the first field after the parenthesised command name.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .unwrap_or("?");
        assert!(
            !matches!(state, "Z" | "X" | "x"),
            "{step}: belayerd {pid} is dead (state {state})\n{}",
            self.log_text()
        );
        assert!(
            matches!(self.call(Request::Ping), Response::Pong { .. }),
            "{step}: belayerd does not answer"
        );
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
            with_fd: false,
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
            prefix: None,
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

    /// Flips the first byte of the blob in the node's blob store whose content is `content`
    /// (a file of that content was captured by a checkpoint).
    pub fn corrupt_blob(&self, content: &[u8]) {
        let blob = belayer_overlay::layer::BlobId::of(content).to_hex();
        let blob = self.state_dir.join("blobs").join(&blob[..2]).join(&blob);
        let mut bytes = std::fs::read(&blob).expect("blob");
        bytes[0] ^= 0x01;
        std::fs::write(&blob, bytes).expect("write blob");
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
        let _ = (&self.dir, &self.sock_dir);
    }
}

/// A number unique within this process (for scratch names).
pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
