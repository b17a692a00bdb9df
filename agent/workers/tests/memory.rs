//! Memory servers with real processes: a `belayer-memd` child owns the memory, workers
//! are this test binary re-executed as helpers (one of them as uid 65534), and they are killed
//! with SIGKILL the way workers crash.
//!
//! The backend is `host` unless `BELAYER_TEST_DEVICE` says otherwise (`cuda:0` on a GPU
//! machine, see `scripts/gpu-check.sh`); CUDA runs skip with a printed reason when no driver is
//! present.

use std::ffi::{c_char, CStr, CString};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use belayer as ffi;
use belayer_ipc::memory::cuda::driver_present;
use belayer_ipc::memory::{
    AttachRequest, Backend, Layout, LeaseMode, MapError, MemClient, MemClientError, MemErrorCode,
    OwnerError, Placeholder, Role,
};
use belayer_ipc::AccessPolicy;
use belayer_workers::memory::process::ServerProcess;
use belayer_workers::memory::{MemoryServer, MemoryServerConfig};

/// The `belayer-memd` binary: `BELAYER_MEMD` when set (prebuilt binaries moved to another
/// machine, see `scripts/gpu-check.sh`), else the one cargo built with this test.
fn memd() -> PathBuf {
    std::env::var_os("BELAYER_MEMD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_belayer-memd")))
}
const HELPER: &str = "BELAYER_MEM_TEST_HELPER";
const HELPER_SOCKET: &str = "BELAYER_MEM_TEST_SOCKET";
const HELPER_HASH: &str = "BELAYER_MEM_TEST_HASH";
const NOBODY: u32 = 65534;

const WEIGHTS: &str = "[[region]]\nname = \"embed\"\nsize = 3145728\n\
                       [[region]]\nname = \"layers\"\nsize = 1048676\n";
const KV: &str = "[kv]\nblock_size = 65536\nblock_count = 40\n";

/// The backend under test, or `None` (after printing why) when it cannot run here.
fn device() -> Option<Backend> {
    let device: Backend = std::env::var("BELAYER_TEST_DEVICE")
        .unwrap_or_else(|_| "host".to_owned())
        .parse()
        .expect("BELAYER_TEST_DEVICE is host or cuda:N");
    if matches!(device, Backend::Cuda { .. }) && !driver_present() {
        eprintln!("skipping: BELAYER_TEST_DEVICE={device} but no CUDA driver is present");
        return None;
    }
    Some(device)
}

/// Deterministic contents of region `name` of `len` bytes.
fn contents(name: &str, len: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len as usize];
    let mut hasher = blake3::Hasher::new();
    hasher.update(name.as_bytes());
    hasher.finalize_xof().fill(&mut bytes);
    bytes
}

/// A temporary directory that an unprivileged helper can traverse, with a layout file.
struct Setup {
    dir: tempfile::TempDir,
    layout: Layout,
    layout_path: PathBuf,
}

impl Setup {
    fn new(text: &str) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let layout_path = dir.path().join("layout.toml");
        std::fs::write(&layout_path, text).unwrap();
        Setup {
            layout: Layout::from_toml(text).unwrap(),
            layout_path,
            dir,
        }
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("mem.sock")
    }

    fn spawn(&self, role: Role, device: Backend, extra: &[&str]) -> ServerProcess {
        ServerProcess::spawn(
            &memd(),
            role,
            device,
            &self.layout_path,
            &self.socket(),
            extra,
        )
        .unwrap()
    }
}

/// A helper process (this test binary re-executed) whose stdout lines arrive on a channel.
struct Helper {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Helper {
    fn spawn(role: &str, socket: &Path, hash: &str) -> Helper {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "helper_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER, role)
            .env(HELPER_SOCKET, socket)
            .env(HELPER_HASH, hash)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Helper { child, lines }
    }

    /// The rest of the first line starting with `prefix`, within 20 s.
    fn wait_for(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    // libtest prints "test helper_process ... " before the helper's line.
                    if let Some((_, rest)) = line.split_once(prefix) {
                        return rest.trim().to_owned();
                    }
                }
                Err(err) => panic!("helper never printed {prefix:?}: {err}"),
            }
        }
    }

    fn sigkill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn attach(
    client: &mut MemClient,
    layout: &Layout,
    mode: LeaseMode,
) -> Result<belayer_ipc::memory::Mapping, MemClientError> {
    client.attach_layout("test-worker", layout, mode)
}

fn refused(result: Result<impl std::fmt::Debug, MemClientError>, code: MemErrorCode) {
    match result {
        Err(MemClientError::Refused { code: got, .. }) if got == code => {}
        other => panic!("expected {code:?}, got {other:?}"),
    }
}

/// Retries `op` until the server has noticed a dead peer's closed connection (lease released).
fn eventually<T, E: std::fmt::Debug>(mut op: impl FnMut() -> Result<T, E>) -> T {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match op() {
            Ok(value) => return value,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => panic!("still failing after 5 s: {err:?}"),
        }
    }
}

/// Runs only when re-executed by [`Helper::spawn`].
#[test]
fn helper_process() {
    let Ok(role) = std::env::var(HELPER) else {
        return;
    };
    let socket = PathBuf::from(std::env::var(HELPER_SOCKET).unwrap());
    let hash = std::env::var(HELPER_HASH).unwrap();
    let request = |mode| AttachRequest {
        worker: "helper".to_owned(),
        layout_hash: hash.clone(),
        mode,
        regions: Vec::new(),
    };
    match role.as_str() {
        // Maps every region writable, fills it, reports, and waits to be killed.
        "writer" => {
            let mut client = MemClient::connect(&socket).unwrap();
            let mut mapping = client.attach(request(LeaseMode::Write)).unwrap();
            for region in mapping.info().regions.clone() {
                mapping
                    .write(&region.name, 0, &contents(&region.name, region.size))
                    .unwrap();
            }
            println!("HELPER-READY {:#x}", mapping.base());
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        // Maps every region read-only and prints a digest of all of it.
        "reader" => {
            let mut client = MemClient::connect(&socket).unwrap();
            let mapping = client.attach(request(LeaseMode::Read)).unwrap();
            let mut hasher = blake3::Hasher::new();
            for region in &mapping.info().regions {
                let mut bytes = vec![0u8; region.size as usize];
                mapping.read(&region.name, 0, &mut bytes).unwrap();
                hasher.update(&bytes);
            }
            println!("HELPER-RESULT {}", hasher.finalize().to_hex());
        }
        // Drops to uid/gid 65534 and tries to attach.
        "nobody" => {
            nix::unistd::setgroups(&[]).unwrap();
            nix::unistd::setgid(nix::unistd::Gid::from_raw(NOBODY)).unwrap();
            nix::unistd::setuid(nix::unistd::Uid::from_raw(NOBODY)).unwrap();
            let outcome = match MemClient::connect(&socket) {
                Err(err) => format!("connect-error {err}"),
                Ok(mut client) => match client.attach(request(LeaseMode::Read)) {
                    Ok(mapping) => format!("attached {}", mapping.regions().len()),
                    Err(MemClientError::Refused { code, .. }) => format!("refused {code:?}"),
                    Err(err) => format!("error {err}"),
                },
            };
            println!("HELPER-RESULT {outcome}");
        }
        other => panic!("unknown helper role {other}"),
    }
}

fn expected_digest(layout: &Layout) -> String {
    let mut hasher = blake3::Hasher::new();
    for region in &layout.regions {
        hasher.update(&contents(&region.name, region.size));
    }
    if let Some(kv) = &layout.kv {
        hasher.update(&contents(&kv.name, kv.block_size * kv.block_count));
    }
    hasher.finalize().to_hex().to_string()
}

#[test]
fn weights_survive_a_sigkilled_worker_and_a_second_process_reads_them() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let hash = setup.layout.hash();

    let writer = Helper::spawn("writer", &setup.socket(), &hash);
    writer.wait_for("HELPER-READY");
    let mut control = MemClient::connect(setup.socket()).unwrap();
    assert_eq!(control.ping().unwrap().attachments, 1);
    writer.sigkill();

    // A second process maps the same allocations and reads identical bytes.
    let reader = Helper::spawn("reader", &setup.socket(), &hash);
    assert_eq!(
        reader.wait_for("HELPER-RESULT"),
        expected_digest(&setup.layout)
    );
    // The dead writer's lease is gone: a new writer gets in.
    let mapping = eventually(|| attach(&mut control, &setup.layout, LeaseMode::Exclusive));
    let mut buf = vec![0u8; 64];
    mapping.read("layers", 1000, &mut buf).unwrap();
    assert_eq!(buf, contents("layers", 1048676)[1000..1064]);
    assert_eq!(server.pid(), control.ping().unwrap().pid);
    server.stop().unwrap();
}

#[test]
fn the_kv_arena_survives_a_worker_and_is_flushed_on_request() {
    let Some(device) = device() else { return };
    let setup = Setup::new(KV);
    let server = setup.spawn(Role::Kv, device, &[]);
    let writer = Helper::spawn("writer", &setup.socket(), &setup.layout.hash());
    writer.wait_for("HELPER-READY");

    // The shadow maps the arena read-only beside the serving worker.
    let mut shadow = MemClient::connect(setup.socket()).unwrap();
    let arena = attach(&mut shadow, &setup.layout, LeaseMode::Read).unwrap();
    let len = 65536 * 40;
    let expected = contents("kv", len);
    let mut bytes = vec![0u8; len as usize];
    arena.read("kv", 0, &mut bytes).unwrap();
    assert!(bytes == expected, "the shadow sees the worker's KV blocks");
    // No flush while the serving worker holds its write lease.
    refused(shadow.flush("kv"), MemErrorCode::NoLease);

    writer.sigkill();
    arena.read("kv", 0, &mut bytes).unwrap();
    assert!(bytes == expected, "the arena survives the worker");
    let flushed = eventually(|| shadow.flush("kv"));
    assert_eq!(flushed, len);
    arena.read("kv", 0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&b| b == 0), "flushed to zeros");
    refused(shadow.flush("nope"), MemErrorCode::UnknownRegion);
    shadow.detach(arena).unwrap();
    server.stop().unwrap();
}

#[test]
fn unmap_and_remap_keep_the_address() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let mut client = MemClient::connect(setup.socket()).unwrap();
    let mut mapping = attach(&mut client, &setup.layout, LeaseMode::Write).unwrap();
    mapping.write("embed", 4096, b"placeholder").unwrap();
    let addr = mapping.addr("embed").unwrap();
    assert_eq!(addr, mapping.base());
    assert_eq!(mapping.unmap("embed").unwrap(), addr);
    if device == Backend::Host {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps
            .lines()
            .find(|l| l.starts_with(&format!("{addr:x}-")))
            .expect("the range stays reserved");
        assert!(line.contains("---p"), "{line}");
    }
    assert!(matches!(
        mapping.read("embed", 0, &mut [0; 4]),
        Err(MapError::NotMapped { .. })
    ));
    // Other regions stay usable meanwhile.
    mapping.write("layers", 0, b"still here").unwrap();
    assert_eq!(mapping.remap("embed").unwrap(), addr);
    let mut buf = [0u8; 11];
    mapping.read("embed", 4096, &mut buf).unwrap();
    assert_eq!(&buf, b"placeholder");

    // A worker-local placeholder keeps its address too, with fresh memory.
    let mut placeholder = Placeholder::new(device, 3 << 20).unwrap();
    let at = placeholder.addr();
    assert_eq!(placeholder.unmap().unwrap(), at);
    assert_eq!(placeholder.remap().unwrap(), at);
    client.detach(mapping).unwrap();
    server.stop().unwrap();
}

#[test]
fn a_writer_lease_excludes_a_second_writer() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let writer = Helper::spawn("writer", &setup.socket(), &setup.layout.hash());
    writer.wait_for("HELPER-READY");

    let mut second = MemClient::connect(setup.socket()).unwrap();
    refused(
        attach(&mut second, &setup.layout, LeaseMode::Write),
        MemErrorCode::LeaseConflict,
    );
    refused(
        attach(&mut second, &setup.layout, LeaseMode::Exclusive),
        MemErrorCode::LeaseConflict,
    );
    // Readers may map beside the writer, but cannot bump the weights version.
    let reader = attach(&mut second, &setup.layout, LeaseMode::Read).unwrap();
    refused(second.bump_version(), MemErrorCode::NoLease);
    // An exclusive holder (the weight-update path) needs the readers gone too.
    writer.sigkill();
    let mut updater = MemClient::connect(setup.socket()).unwrap();
    refused(
        attach(&mut updater, &setup.layout, LeaseMode::Exclusive),
        MemErrorCode::LeaseConflict,
    );
    second.detach(reader).unwrap();
    let update = eventually(|| attach(&mut updater, &setup.layout, LeaseMode::Exclusive));
    assert_eq!(updater.bump_version().unwrap(), 1);
    assert_eq!(second.version().unwrap(), 1);
    refused(
        attach(&mut second, &setup.layout, LeaseMode::Read),
        MemErrorCode::LeaseConflict,
    );
    updater.detach(update).unwrap();
    let after = attach(&mut second, &setup.layout, LeaseMode::Read).unwrap();
    assert_eq!(after.info().version, 1);
    server.stop().unwrap();
}

#[test]
fn a_layout_hash_mismatch_and_unknown_regions_are_refused() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let mut client = MemClient::connect(setup.socket()).unwrap();
    let mut other = setup.layout.clone();
    other.regions[1].size += 1;
    refused(
        attach(&mut client, &other, LeaseMode::Read),
        MemErrorCode::LayoutMismatch,
    );
    refused(
        client.attach(AttachRequest {
            worker: "w".to_owned(),
            layout_hash: setup.layout.hash(),
            mode: LeaseMode::Read,
            regions: vec!["missing".to_owned()],
        }),
        MemErrorCode::UnknownRegion,
    );
    // The connection is still fine after refusals.
    assert_eq!(client.ping().unwrap().layout_hash, setup.layout.hash());
    server.stop().unwrap();
}

#[test]
fn an_unauthorized_peer_is_refused() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test drops privileges in a child and needs root"
    );
    let setup = Setup::new(WEIGHTS);
    let hash = setup.layout.hash();
    let config = |policy| {
        // The socket file belongs to group 65534 so that the helper passes the file permission
        // check; the credential check decides.
        MemoryServerConfig::new(
            Role::Weights,
            Backend::Host,
            setup.layout.clone(),
            setup.socket(),
        )
        .socket_group(NOBODY)
        .policy(policy)
    };
    let server = MemoryServer::start(config(AccessPolicy::root_only())).unwrap();
    let nobody = Helper::spawn("nobody", &setup.socket(), &hash);
    assert_eq!(nobody.wait_for("HELPER-RESULT"), "refused PermissionDenied");
    // Root is still served.
    MemClient::connect(setup.socket()).unwrap().ping().unwrap();
    server.shutdown();

    // Admitted by group, but the worker id is registered to another uid.
    let server =
        MemoryServer::start(config(AccessPolicy::group(NOBODY)).worker("helper", 0)).unwrap();
    let nobody = Helper::spawn("nobody", &setup.socket(), &hash);
    assert_eq!(nobody.wait_for("HELPER-RESULT"), "refused UnknownWorker");
    server.shutdown();

    // Admitted and registered: it attaches (read-only).
    let server =
        MemoryServer::start(config(AccessPolicy::group(NOBODY)).worker("helper", NOBODY)).unwrap();
    let nobody = Helper::spawn("nobody", &setup.socket(), &hash);
    assert_eq!(nobody.wait_for("HELPER-RESULT"), "attached 2");
    server.shutdown();
}

#[test]
fn killing_the_server_is_detected_by_attached_workers() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let mut client = MemClient::connect(setup.socket()).unwrap();
    let mut mapping = attach(&mut client, &setup.layout, LeaseMode::Write).unwrap();
    mapping.write("embed", 0, b"before").unwrap();
    client.owner_alive().unwrap();
    assert_eq!(client.server().pid, server.pid());
    server.kill().unwrap();
    match client.owner_alive() {
        Err(OwnerError::ServerExited { pid }) => assert!(pid > 0),
        other => panic!("{other:?}"),
    }
    assert!(client.ping().is_err());

    // A clean stop is detected too (connection closed, socket removed).
    let server = setup.spawn(Role::Weights, device, &[]);
    let client = MemClient::connect(setup.socket()).unwrap();
    client.owner_alive().unwrap();
    assert_eq!(server.stop().unwrap(), Some(0));
    assert!(client.owner_alive().is_err());
    assert!(!setup.socket().exists());
}

#[test]
fn a_cuda_device_without_a_driver_fails_with_a_clear_error() {
    if driver_present() {
        eprintln!("skipping: a CUDA driver is present here; the BELAYER_TEST_DEVICE runs cover it");
        return;
    }
    let setup = Setup::new(WEIGHTS);
    let output = Command::new(memd())
        .args(["--role", "weights", "--device", "cuda:0", "--layout"])
        .arg(&setup.layout_path)
        .arg("--socket")
        .arg(setup.socket())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no CUDA driver library"), "{stderr}");
    assert!(!setup.socket().exists());
}

#[test]
fn the_c_abi_attaches_remaps_and_checks_the_owner() {
    let Some(device) = device() else { return };
    let setup = Setup::new(WEIGHTS);
    let server = setup.spawn(Role::Weights, device, &[]);
    let socket = CString::new(setup.socket().to_str().unwrap()).unwrap();
    let layout_path = CString::new(setup.layout_path.to_str().unwrap()).unwrap();
    let last_error = || {
        // SAFETY: never null; valid until the next failing call on this thread.
        unsafe { CStr::from_ptr(ffi::belayer_last_error()) }
            .to_string_lossy()
            .into_owned()
    };
    let mut hash = [0 as c_char; 65];
    let mut client = std::ptr::null_mut();
    let mut mapping = std::ptr::null_mut();
    let (mut addr, mut size, mut again, mut version) = (0u64, 0u64, 0u64, 9u64);
    // SAFETY: every pointer passed is valid for the call; handles are used while live and
    // freed once.
    unsafe {
        assert_eq!(
            ffi::belayer_mem_layout_hash(layout_path.as_ptr(), hash.as_mut_ptr()),
            0
        );
        assert_eq!(ffi::belayer_mem_connect(socket.as_ptr(), &mut client), 0);
        let rc = ffi::belayer_mem_attach(
            client,
            c"c-worker".as_ptr(),
            hash.as_ptr(),
            ffi::BELAYER_LEASE_WRITE,
            &mut mapping,
        );
        assert_eq!(rc, 0, "{}", last_error());
        assert_eq!(
            ffi::belayer_mem_region(mapping, c"layers".as_ptr(), &mut addr, &mut size),
            0
        );
        assert_eq!(size, 1048676);
        assert_eq!(
            ffi::belayer_mem_unmap(mapping, c"layers".as_ptr(), &mut again),
            0
        );
        assert_eq!(again, addr);
        assert_eq!(
            ffi::belayer_mem_remap(mapping, c"layers".as_ptr(), &mut again),
            0
        );
        assert_eq!(again, addr);
        assert_eq!(ffi::belayer_mem_version(client, &mut version), 0);
        assert_eq!(version, 0);
        let mut second = std::ptr::null_mut();
        let mut other = std::ptr::null_mut();
        assert_eq!(ffi::belayer_mem_connect(socket.as_ptr(), &mut second), 0);
        let rc = ffi::belayer_mem_attach(
            second,
            c"x".as_ptr(),
            hash.as_ptr(),
            ffi::BELAYER_LEASE_WRITE,
            &mut other,
        );
        assert_eq!(rc, ffi::BELAYER_E_REFUSED);
        assert!(last_error().contains("LeaseConflict"), "{}", last_error());
        ffi::belayer_mem_client_free(second);
        assert_eq!(ffi::belayer_mem_owner_alive(client), 0);
        assert_eq!(ffi::belayer_mem_detach(client, mapping), 0);
    }
    server.kill().unwrap();
    // SAFETY: `client` is live until freed just below.
    unsafe {
        assert_eq!(
            ffi::belayer_mem_owner_alive(client),
            ffi::BELAYER_E_OWNER_GONE
        );
        assert!(last_error().contains("exited"), "{}", last_error());
        ffi::belayer_mem_client_free(client);
    }
}
