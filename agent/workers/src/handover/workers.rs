//! Worker supervision, run inside the router process (`belayer-router --gpus N`): per GPU a
//! weights and a KV memory server (host backend), a main worker and a pre-initialised shadow
//! worker (`belayer-toy-engine --standby`), a monitor thread, and the five-step handover.
//!
//! Detection (Belayer mode): the main worker's pidfd (a fail-stop is seen at once) and the
//! mtime of its heartbeat file (a hang is seen after `heartbeat_timeout`). On a failure the
//! monitor fences the failed worker in the router (its epoch is unregistered, so none of its
//! tokens reaches a client any more), terminates the residual process (on the host backend it
//! still holds the KV arena's write lease, which the shadow's flush needs), and writes the
//! shadow's handover flag. The shadow runs steps 1–3 (flag, health check + KV flush,
//! placeholder remap) and prints `ready`; the monitor registers it with a new epoch (step 4),
//! which wakes the interrupted requests that resume on it from their token prefixes (step 5).
//! Then a new shadow is prepared. A second failure within `unhealthy_window` of a handover
//! marks the GPU unhealthy: it leaves the pool, its requests move to healthy GPUs, and an alert
//! is raised. Re-establishing communication groups before the next weight update is the
//! [`PoolConfig::on_handover`] hook.
//!
//! Conventional mode (`shadow = false`): detection by a remote health check (`GET /health`)
//! with a timeout (default 30 s, scaled), then an engine restart from scratch (weights
//! re-loaded) and regeneration from the start (router `resume = false`).

use std::io::{BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use belayer_ipc::memory::{Backend, Role};

use super::engine::read_status_line;
use super::router::Router;
use crate::memory::process::ServerProcess;
use crate::ENGINE_BIN;

/// Hook run with the GPU name after each handover.
pub type HandoverHook = Arc<dyn Fn(&str) + Send + Sync>;

/// Supervisor configuration.
#[derive(Clone)]
pub struct PoolConfig {
    /// Directory holding `belayer-toy-engine` and `belayer-memd`.
    pub bin_dir: PathBuf,
    /// Number of GPUs (slots `gpu0`, `gpu1`, ...).
    pub gpus: usize,
    /// Directory for layouts, sockets, heartbeat and flag files.
    pub dir: PathBuf,
    /// Engine token delay, ms.
    pub token_ms: u64,
    /// Belayer mode (shadow workers) or conventional recovery.
    pub shadow: bool,
    /// Heartbeat timeout (hang detection), ms.
    pub heartbeat_timeout_ms: u64,
    /// Conventional remote health-check timeout, ms (paper: 30 s).
    pub baseline_timeout_ms: u64,
    /// A second failure within this many ms after a handover marks the GPU unhealthy.
    pub unhealthy_window_ms: u64,
    /// Weights region size, bytes.
    pub weights_bytes: u64,
    /// Backend of the memory servers and engines: `host`, or `cuda:N` (GPU i of the pool is
    /// then `cuda:N+i`).
    pub device: Backend,
    /// Hook run after each handover (re-establish communication groups).
    pub on_handover: Option<HandoverHook>,
}

impl std::fmt::Debug for PoolConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolConfig")
            .field("gpus", &self.gpus)
            .field("dir", &self.dir)
            .field("shadow", &self.shadow)
            .finish_non_exhaustive()
    }
}

/// One failure handled by a monitor.
#[derive(Debug, Clone)]
pub struct Failure {
    /// Slot name.
    pub gpu: String,
    /// Pid of the failed worker.
    pub pid: i32,
    /// `exit` (pidfd), `hang` (heartbeat) or `unreachable` (conventional health check).
    pub kind: &'static str,
    /// When the failure was detected.
    pub detected: Instant,
    /// When the replacement was registered (None when the GPU was marked unhealthy).
    pub registered: Option<Instant>,
}

#[derive(Debug)]
struct Worker {
    child: Child,
    _stdout: BufReader<ChildStdout>,
    pidfd: OwnedFd,
    addr: String,
    heartbeat: PathBuf,
    flag: PathBuf,
}

impl Worker {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.flag);
    }
}

#[derive(Debug)]
struct GpuState {
    main: Option<Worker>,
    shadow: Option<Worker>,
    epoch: u64,
    last_handover: Option<Instant>,
    healthy: bool,
}

#[derive(Debug)]
struct Gpu {
    name: String,
    dir: PathBuf,
    weights: ServerProcess,
    kv: ServerProcess,
    device: Backend,
    /// Worker generation counter (file names); outside `state`, which spawns happen under.
    generation: AtomicU64,
    state: Mutex<GpuState>,
}

/// The supervised workers of all GPUs. Dropping it stops the monitors and kills every worker
/// and memory server.
#[derive(Debug)]
pub struct Pool {
    gpus: Vec<Arc<Gpu>>,
    stop: Arc<AtomicBool>,
    failures: Arc<Mutex<Vec<Failure>>>,
    monitors: Vec<std::thread::JoinHandle<()>>,
}

fn layout_files(dir: &Path, weights_bytes: u64) -> Result<(PathBuf, PathBuf)> {
    let wl = dir.join("weights.toml");
    let kl = dir.join("kv.toml");
    std::fs::write(
        &wl,
        format!("[[region]]\nname = \"weights\"\nsize = {weights_bytes}\n"),
    )?;
    std::fs::write(&kl, "[kv]\nblock_size = 65536\nblock_count = 64\n")?;
    Ok((wl, kl))
}

impl Gpu {
    fn spawn_worker(&self, cfg: &PoolConfig, standby: bool, load: bool) -> Result<Worker> {
        let g = self.generation.fetch_add(1, Ordering::SeqCst) + 1;
        let heartbeat = self.dir.join(format!("heartbeat-{g}"));
        let flag = self.dir.join(format!("handover-{g}"));
        let _ = std::fs::remove_file(&flag);
        let mut cmd = Command::new(cfg.bin_dir.join(ENGINE_BIN));
        cmd.arg("--weights-socket")
            .arg(self.weights.socket())
            .arg("--weights-layout")
            .arg(self.dir.join("weights.toml"))
            .arg("--kv-socket")
            .arg(self.kv.socket())
            .arg("--kv-layout")
            .arg(self.dir.join("kv.toml"))
            .args(["--worker", &format!("{}-w{g}", self.name)])
            .arg("--heartbeat")
            .arg(&heartbeat)
            .args(["--token-ms", &cfg.token_ms.to_string()])
            .args(["--device", &self.device.to_string()])
            .arg("--flag")
            .arg(&flag);
        if standby {
            cmd.arg("--standby");
        }
        if load {
            cmd.arg("--load-weights");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawning {}", cfg.bin_dir.join(ENGINE_BIN).display()))?;
        let stdout = child.stdout.take().context("engine stdout")?;
        let mut stdout = BufReader::new(stdout);
        let line = read_status_line(&mut stdout, if standby { "standby" } else { "ready" });
        let fields = match line {
            Ok(f) => f,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        let port = fields.get("port").cloned().unwrap_or_default();
        let pid = rustix::process::Pid::from_child(&child);
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .context("pidfd_open")?;
        Ok(Worker {
            child,
            _stdout: stdout,
            pidfd,
            addr: format!("127.0.0.1:{port}"),
            heartbeat,
            flag,
        })
    }
}

fn mtime_age(path: &Path) -> Duration {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|m| SystemTime::now().duration_since(m).ok())
        .unwrap_or_default()
}

fn health_ok(addr: &str) -> bool {
    let Ok(a) = addr.parse::<std::net::SocketAddr>() else {
        return false;
    };
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&a, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = [0u8; 12];
    std::io::Read::read_exact(&mut s, &mut buf).is_ok() && buf.starts_with(b"HTTP/1.1 200")
}

impl Pool {
    /// Starts memory servers, loads the weights, starts main (and shadow) workers for each GPU
    /// and registers the mains with `router`; then starts the monitors.
    ///
    /// Errors: spawning a memory server or a worker, writing the layouts.
    pub fn start(router: &Arc<Router>, cfg: PoolConfig) -> Result<Pool> {
        let mut gpus = Vec::new();
        for i in 0..cfg.gpus {
            let name = format!("gpu{i}");
            let dir = cfg.dir.join(&name);
            std::fs::create_dir_all(&dir).with_context(|| format!("{}", dir.display()))?;
            let (wl, kl) = layout_files(&dir, cfg.weights_bytes)?;
            let device = match cfg.device {
                Backend::Host => Backend::Host,
                Backend::Cuda { device } => Backend::Cuda {
                    device: device + i as i32,
                },
            };
            let weights = ServerProcess::spawn(
                &cfg.bin_dir.join(crate::MEMD_BIN),
                Role::Weights,
                device,
                &wl,
                &dir.join("weights.sock"),
                &[],
            )?;
            let kv = ServerProcess::spawn(
                &cfg.bin_dir.join(crate::MEMD_BIN),
                Role::Kv,
                device,
                &kl,
                &dir.join("kv.sock"),
                &[],
            )?;
            let gpu = Arc::new(Gpu {
                name: name.clone(),
                dir,
                weights,
                kv,
                device,
                state: Mutex::new(GpuState {
                    main: None,
                    shadow: None,
                    epoch: 0,
                    last_handover: None,
                    healthy: true,
                }),
                generation: AtomicU64::new(0),
            });
            let main = gpu.spawn_worker(&cfg, false, true)?;
            let shadow = if cfg.shadow {
                Some(gpu.spawn_worker(&cfg, true, false)?)
            } else {
                None
            };
            let epoch = router.register(&name, &main.addr);
            {
                let mut st = gpu.state.lock().unwrap_or_else(|e| e.into_inner());
                st.main = Some(main);
                st.shadow = shadow;
                st.epoch = epoch;
            }
            gpus.push(gpu);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let monitors = gpus
            .iter()
            .map(|g| {
                let (g, r, c, s, f) = (
                    Arc::clone(g),
                    Arc::clone(router),
                    cfg.clone(),
                    Arc::clone(&stop),
                    Arc::clone(&failures),
                );
                std::thread::spawn(move || monitor(&g, &r, &c, &s, &f))
            })
            .collect();
        Ok(Pool {
            gpus,
            stop,
            failures,
            monitors,
        })
    }

    /// Pid of the main worker of GPU `i`.
    pub fn main_pid(&self, i: usize) -> Option<i32> {
        let st = self.gpus.get(i)?.state.lock().ok()?;
        st.main.as_ref().map(Worker::pid)
    }

    /// Whether GPU `i` has a standby shadow ready.
    pub fn shadow_ready(&self, i: usize) -> bool {
        self.gpus
            .get(i)
            .and_then(|g| g.state.lock().ok().map(|s| s.shadow.is_some()))
            .unwrap_or(false)
    }

    /// Failures handled so far.
    pub fn failures(&self) -> Vec<Failure> {
        self.failures.lock().map(|f| f.clone()).unwrap_or_default()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for m in self.monitors.drain(..) {
            let _ = m.join();
        }
        for g in &self.gpus {
            let mut st = g.state.lock().unwrap_or_else(|e| e.into_inner());
            st.main = None;
            st.shadow = None;
        }
    }
}

/// Whether the process behind `pidfd` exits within `ms` milliseconds (a poll error counts as
/// not exited: the heartbeat check decides then).
fn exited_within(pidfd: std::os::fd::BorrowedFd<'_>, ms: u8) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut fds = [PollFd::new(pidfd, PollFlags::POLLIN)];
    matches!(poll(&mut fds, PollTimeout::from(ms)), Ok(n) if n > 0)
}

fn detect(gpu: &Gpu, cfg: &PoolConfig, last_ok: &mut Instant) -> Option<(&'static str, i32)> {
    let st = gpu.state.lock().unwrap_or_else(|e| e.into_inner());
    let main = st.main.as_ref()?;
    let pid = main.pid();
    if cfg.shadow {
        let fd = main.pidfd.try_clone().ok()?;
        let hb = main.heartbeat.clone();
        drop(st);
        if exited_within(fd.as_fd(), 2) {
            return Some(("exit", pid));
        }
        if mtime_age(&hb) > Duration::from_millis(cfg.heartbeat_timeout_ms) {
            return Some(("hang", pid));
        }
        None
    } else {
        let addr = main.addr.clone();
        drop(st);
        let period = (cfg.baseline_timeout_ms / 10).clamp(1, 1000);
        std::thread::sleep(Duration::from_millis(period));
        if health_ok(&addr) {
            *last_ok = Instant::now();
            None
        } else if last_ok.elapsed() > Duration::from_millis(cfg.baseline_timeout_ms) {
            Some(("unreachable", pid))
        } else {
            None
        }
    }
}

fn monitor(
    gpu: &Gpu,
    router: &Router,
    cfg: &PoolConfig,
    stop: &AtomicBool,
    failures: &Mutex<Vec<Failure>>,
) {
    let mut last_ok = Instant::now();
    while !stop.load(Ordering::SeqCst) {
        let Some((kind, pid)) = detect(gpu, cfg, &mut last_ok) else {
            continue;
        };
        let detected = Instant::now();
        tracing::warn!(gpu = gpu.name, pid, kind, "main worker failure detected");
        let mut st = gpu.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = router.unregister(&gpu.name, st.epoch);
        // Terminate the residual worker (fenced already; releases its KV write lease).
        if let Some(mut m) = st.main.take() {
            m.kill();
        }
        let repeated = st
            .last_handover
            .is_some_and(|t| t.elapsed() < Duration::from_millis(cfg.unhealthy_window_ms));
        let mut record = Failure {
            gpu: gpu.name.clone(),
            pid,
            kind,
            detected,
            registered: None,
        };
        if repeated {
            st.shadow = None;
            st.healthy = false;
            drop(st);
            router.mark_unhealthy(
                &gpu.name,
                &format!(
                    "repeated failure ({kind}) within {} ms",
                    cfg.unhealthy_window_ms
                ),
            );
            if let Ok(mut f) = failures.lock() {
                f.push(record);
            }
            return;
        }
        let replacement = if cfg.shadow {
            take_over(gpu, &mut st)
        } else {
            gpu.spawn_worker(cfg, false, true)
        };
        match replacement {
            Ok(w) => {
                st.epoch = router.register(&gpu.name, &w.addr);
                record.registered = Some(Instant::now());
                st.main = Some(w);
                st.last_handover = Some(Instant::now());
                drop(st);
                if let Some(hook) = &cfg.on_handover {
                    hook(&gpu.name);
                }
                if cfg.shadow {
                    match gpu.spawn_worker(cfg, true, false) {
                        Ok(s) => {
                            gpu.state.lock().unwrap_or_else(|e| e.into_inner()).shadow = Some(s)
                        }
                        Err(e) => {
                            tracing::error!(gpu = gpu.name, error = %e, "preparing a new shadow failed")
                        }
                    }
                }
                last_ok = Instant::now();
            }
            Err(e) => {
                st.healthy = false;
                drop(st);
                router.mark_unhealthy(&gpu.name, &format!("handover failed: {e:#}"));
                if let Ok(mut f) = failures.lock() {
                    f.push(record);
                }
                return;
            }
        }
        if let Ok(mut f) = failures.lock() {
            f.push(record);
        }
    }
}

/// Steps 1–3 through the shadow: write its flag, wait for its `ready` line.
fn take_over(gpu: &Gpu, st: &mut GpuState) -> Result<Worker> {
    let mut shadow = st.shadow.take().context("no shadow worker prepared")?;
    std::fs::write(&shadow.flag, b"1").context("writing the handover flag")?;
    let fields = read_status_line(&mut shadow._stdout, "ready")
        .with_context(|| format!("shadow of {} did not take over", gpu.name))?;
    tracing::info!(
        gpu = gpu.name,
        health_ms = fields.get("health_ms").map(String::as_str).unwrap_or(""),
        flush_ms = fields.get("flush_ms").map(String::as_str).unwrap_or(""),
        remap_ms = fields.get("remap_ms").map(String::as_str).unwrap_or(""),
        "shadow took over"
    );
    Ok(shadow)
}
