//! The hand-rolled baseline: a sandbox made with `unshare` + overlayfs + `pivot_root` in a cgroup
//! of its own, checkpointed with GNU `tar` + `criu dump` and restored with untar + `criu restore`.
//!
//! The sandbox follows what CRIU needs of such a tree (DESIGN.md, "CRIU and sandboxes"): new
//! pid, mount, net, uts and ipc namespaces; `mount --make-rprivate /`; a private `/proc` and a
//! tmpfs `/dev` with its own device nodes; `pivot_root` (not `chroot`) into the overlay and the
//! old root detached; an init that is a session leader (`setsid`) with every inherited
//! descriptor closed and its stdio on the sandbox's own `/dev/null`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::host::{
    self, init_script, mkdirs, ms_since, reap, run, sync_fs, tar_create, tar_extract,
    FreezerCgroup, HostError, HostResult, OverlayMount, ScratchDir, READY_MARKER, SETUP_LOG,
};
use super::{Sample, Workload};

/// Runs from the host shell as pid 1 of the new namespaces: joins the sandbox cgroup (only the
/// namespace's tree belongs there, not the `unshare` process above it), prepares the root, enters
/// it and execs the sandbox's own shell on the init script. `$1` = the cgroup's `cgroup.procs`,
/// `$2` = the overlay mount, `$3` = the script.
const NS_SCRIPT: &str = r#"set -e
echo 0 > "$1"
M="$2"
mount --make-rprivate /
mount -t proc -o nosuid,nodev,noexec proc "$M/proc"
mount -t tmpfs -o mode=755,size=1m,nosuid tmpfs "$M/dev"
mknod -m 666 "$M/dev/null" c 1 3
mknod -m 666 "$M/dev/zero" c 1 5
mknod -m 666 "$M/dev/full" c 1 7
mknod -m 666 "$M/dev/random" c 1 8
mknod -m 666 "$M/dev/urandom" c 1 9
ln -s /proc/self/fd "$M/dev/fd"
mkdir -p "$M/.oldroot"
cd "$M"
pivot_root . .oldroot
cd /
exec /bin/sh -c "$3"
"#;

/// Detaches the host's root from the sandbox, first thing inside it.
const INIT_PREFIX: &str = "umount -l /.oldroot\nrmdir /.oldroot\n";

/// One overlay instance (generation `n`) of the sandbox.
#[derive(Debug)]
struct Instance {
    upper: PathBuf,
    dir: PathBuf,
    mount: Option<OverlayMount>,
    /// The `unshare` launcher (first instance only).
    launcher: Option<Child>,
    /// Host pid of the namespace init.
    init_pid: i32,
}

/// A running hand-made sandbox. Dropping it kills its processes, detaches its mounts, removes
/// its cgroup and its files (in that order).
#[derive(Debug)]
struct Sandbox {
    workload: Workload,
    criu: PathBuf,
    gen: u32,
    inst: Option<Instance>,
    cg: FreezerCgroup,
    root: ScratchDir,
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.cg.kill_all();
        if let Some(mut inst) = self.inst.take() {
            if let Some(mut l) = inst.launcher.take() {
                let _ = l.kill();
                let _ = l.wait();
            }
            reap(inst.init_pid);
            drop(inst.mount.take());
        }
    }
}

fn gen_dirs(root: &Path, gen: u32) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let dir = root.join(format!("g{gen}"));
    (dir.join("upper"), dir.join("work"), dir.join("merged"), dir)
}

/// Host pid of the first child of `pid` (the namespace init forked by `unshare --fork`).
fn first_child(pid: u32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

impl Sandbox {
    fn create(w: &Workload, work_dir: &Path, criu: &Path) -> HostResult<Sandbox> {
        let name = format!(
            "belayer-bench-tarcriu-{}-{}",
            std::process::id(),
            belayer_daemon::sys::random_hex(3)
        );
        let root = ScratchDir::create(work_dir.join(&name))?;
        let cg = FreezerCgroup::create(&name)?;
        let mut sb = Sandbox {
            workload: w.clone(),
            criu: criu.into(),
            gen: 0,
            inst: None,
            cg,
            root,
        };
        let (upper, work, merged, dir) = gen_dirs(sb.root.path(), 0);
        let mount = OverlayMount::mount(&w.rootfs, &upper, &work, &merged)?;
        let launch_log = sb.root.path().join("launch.log");
        let log_file = std::fs::File::create(&launch_log).map_err(|source| HostError::Io {
            step: "creating the launcher log",
            path: launch_log.clone(),
            source,
        })?;
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--pid", "--mount", "--net", "--uts", "--ipc", "--fork", "--",
        ])
        .args(["setsid", "/bin/sh", "-c", NS_SCRIPT, "ns-init"])
        .arg(sb.cg.procs_file())
        .arg(&merged)
        .arg(init_script(INIT_PREFIX, &w.setup))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file);
        // SAFETY: the closure runs between fork and exec and only issues the close_range
        // syscall; it allocates only on the failure path, which kernels with close_range (5.9+)
        // do not take for this range.
        unsafe {
            cmd.pre_exec(|| {
                let _ = belayer_daemon::sys::close_range(3, u32::MAX);
                Ok(())
            });
        }
        let mut launcher = cmd.spawn().map_err(|source| HostError::Spawn {
            step: "starting the unshare sandbox",
            program: "unshare".into(),
            source,
        })?;
        let ready = upper.join(READY_MARKER);
        let r = host::wait_ready(
            &w.name,
            "tar_criu",
            &ready,
            &upper.join(SETUP_LOG),
            Duration::from_secs(w.setup_timeout_s),
            || match launcher.try_wait() {
                Ok(Some(st)) => Some(format!("(launcher {st}: {})", host::file_tail(&launch_log))),
                _ => None,
            },
        );
        let init_pid = first_child(launcher.id()).unwrap_or(-1);
        sb.inst = Some(Instance {
            upper,
            dir,
            mount: Some(mount),
            launcher: Some(launcher),
            init_pid,
        });
        r?;
        if init_pid <= 0 {
            return Err(HostError::SetupExited {
                workload: w.name.clone(),
                system: "tar_criu",
                log_tail: "no namespace init under the unshare launcher".into(),
            });
        }
        Ok(sb)
    }

    fn inst(&self) -> &Instance {
        self.inst
            .as_ref()
            .expect("a sandbox always has an instance once created")
    }

    /// Freeze, tar the upper dir, `criu dump --leave-running`, thaw, `sync -f`. Returns
    /// (frozen ms, checkpoint ms, processes dumped).
    fn checkpoint(&self, ck: &Path) -> HostResult<(f64, f64, usize)> {
        let images = ck.join("criu");
        mkdirs("creating the checkpoint dir", &images)?;
        let inst = self.inst();
        let t0 = Instant::now();
        self.cg.freeze()?;
        let dumped = self.cg.pids().map(|p| p.len());
        let frozen = (|| {
            tar_create(&inst.upper, &ck.join("upper.tar"))?;
            run(
                "criu dump",
                Command::new(&self.criu)
                    .arg("dump")
                    .arg("-t")
                    .arg(inst.init_pid.to_string())
                    .arg("-D")
                    .arg(&images)
                    .args(["-o", "dump.log", "--leave-running", "--tcp-established"])
                    .args(["--file-locks", "--ext-mount-map", "auto", "--freeze-cgroup"])
                    .arg(self.cg.dir()),
                Some(&images.join("dump.log")),
            )
            .map(drop)
        })();
        let thawed = self.cg.thaw();
        frozen?;
        thawed?;
        let frozen_ms = ms_since(t0);
        sync_fs(ck)?;
        Ok((frozen_ms, ms_since(t0), dumped?))
    }

    /// Kill the tree, untar into a fresh upper dir, mount a fresh overlay, `criu restore`.
    /// Returns the restore ms (the old instance's files are removed afterwards, untimed).
    fn restore(&mut self, ck: &Path, dumped: usize) -> HostResult<f64> {
        let images = ck.join("criu");
        let pidfile = ck.join("restore.pid");
        let t0 = Instant::now();
        self.cg.kill_all()?;
        let mut old = self.inst.take().expect("a sandbox always has an instance");
        if let Some(mut l) = old.launcher.take() {
            let _ = l.wait();
        }
        reap(old.init_pid);
        if let Some(m) = old.mount.take() {
            m.unmount()?;
        }
        self.gen += 1;
        let (upper, work, merged, dir) = gen_dirs(self.root.path(), self.gen);
        mkdirs("creating the fresh upper dir", &upper)?;
        tar_extract(&ck.join("upper.tar"), &upper)?;
        let mount = OverlayMount::mount(&self.workload.rootfs, &upper, &work, &merged)?;
        let restored = run(
            "criu restore",
            Command::new(&self.criu)
                .arg("restore")
                .arg("-D")
                .arg(&images)
                .args(["-o", "restore.log", "--restore-detached", "--root"])
                .arg(&merged)
                .args([
                    "--ext-mount-map",
                    "auto",
                    "--tcp-established",
                    "--file-locks",
                ])
                .arg("--pidfile")
                .arg(&pidfile),
            Some(&images.join("restore.log")),
        );
        let ms = ms_since(t0);
        let init_pid = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(-1);
        self.inst = Some(Instance {
            upper,
            dir,
            mount: Some(mount),
            launcher: None,
            init_pid,
        });
        let _ = belayer_overlay::remove_dir_all(&old.dir);
        restored?;
        host::check_restored(&self.workload.name, "tar_criu", dumped, || {
            self.cg.pids().map(|p| p.len())
        })?;
        Ok(ms)
    }
}

/// Builds the sandbox for `w` under `work_dir`, then `runs` checkpoint + restore cycles; every
/// checkpoint is deleted once restored. Everything is removed, even on error.
pub fn bench(w: &Workload, work_dir: &Path, criu: &Path, runs: usize) -> HostResult<Vec<Sample>> {
    let mut sb = Sandbox::create(w, work_dir, criu)?;
    let mut out = Vec::with_capacity(runs);
    for k in 1..=runs {
        let ck = ScratchDir::create(sb.root.path().join(format!("ck{k}")))?;
        let (frozen_ms, checkpoint_ms, dumped) = sb.checkpoint(ck.path())?;
        let restore_ms = sb.restore(ck.path(), dumped)?;
        out.push(Sample {
            frozen_ms,
            checkpoint_ms,
            restore_ms,
        });
    }
    Ok(out)
}
