//! The container baseline: an OCI bundle run by runc whose rootfs is an overlay mount of the
//! image (fresh upper dir), checkpointed with `runc pause` + `tar` of the upper dir + `runc
//! checkpoint --leave-running` + `runc resume`, restored with `runc delete -f` + untar into a
//! fresh upper dir + `runc restore -d`.
//!
//! The config is `runc spec` with: no terminal, the workload's init script as the process, a
//! writable root, hostname `bench`, and without the `/sys/fs/cgroup` mount (runc bind-mounts
//! the host's v1 hierarchies there on hybrid hosts, which the workload does not use). Its own
//! namespaces (pid, net with only `lo`, ipc, uts, mount, cgroup where the spec has it) stay.
//! runc runs with a private state dir (`--root`) and the same CRIU binary (`--criu`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::host::{
    self, init_script, mkdirs, ms_since, reap, run, run_to_file, sync_fs, tar_create, tar_extract,
    HostError, HostResult, OverlayMount, ScratchDir, READY_MARKER, SETUP_LOG,
};
use super::{Sample, Workload};

/// One container (generation `n`): its bundle, overlay and id.
#[derive(Debug)]
struct Instance {
    id: String,
    dir: PathBuf,
    upper: PathBuf,
    mount: Option<OverlayMount>,
    init_pid: i32,
}

/// A runc container under test. Dropping it deletes the container, detaches its rootfs and
/// removes its files (in that order).
#[derive(Debug)]
struct Container {
    workload: Workload,
    runc: PathBuf,
    criu: PathBuf,
    config: serde_json::Value,
    gen: u32,
    prefix: String,
    inst: Option<Instance>,
    root: ScratchDir,
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Some(mut inst) = self.inst.take() {
            let _ = self.runc_cmd().args(["delete", "-f", &inst.id]).output();
            reap(inst.init_pid);
            drop(inst.mount.take());
        }
    }
}

fn io_err<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> HostError + 'a {
    move |source| HostError::Io {
        step,
        path: path.into(),
        source,
    }
}

fn read_pid(path: &Path) -> i32 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(-1)
}

/// Whether `pid` is gone or a zombie.
fn dead(pid: i32) -> bool {
    pid <= 0 || matches!(belayer_daemon::sys::process_state(pid), None | Some('Z'))
}

impl Container {
    fn runc_cmd(&self) -> Command {
        let mut c = Command::new(&self.runc);
        c.arg("--root")
            .arg(self.root.path().join("state"))
            .arg("--criu")
            .arg(&self.criu);
        c
    }

    /// The bundle of generation `gen`: its dir (with `config.json`), upper and work dirs.
    fn bundle(&self, gen: u32) -> HostResult<(String, PathBuf, PathBuf, PathBuf)> {
        let dir = self.root.path().join(format!("g{gen}"));
        mkdirs("creating the bundle", &dir)?;
        let cfg = dir.join("config.json");
        let text = serde_json::to_vec_pretty(&self.config).expect("a JSON value serializes");
        std::fs::write(&cfg, text).map_err(io_err("writing config.json", &cfg))?;
        Ok((
            format!("{}-{gen}", self.prefix),
            dir.join("upper"),
            dir.join("work"),
            dir,
        ))
    }

    fn create(w: &Workload, work_dir: &Path, runc: &Path, criu: &Path) -> HostResult<Self> {
        let prefix = format!(
            "belayer-bench-runc-{}-{}",
            std::process::id(),
            belayer_daemon::sys::random_hex(3)
        );
        let root = ScratchDir::create(work_dir.join(&prefix))?;
        let spec_dir = root.path().join("spec");
        mkdirs("creating the spec dir", &spec_dir)?;
        run(
            "runc spec",
            Command::new(runc)
                .arg("spec")
                .arg("--bundle")
                .arg(&spec_dir),
            None,
        )?;
        let spec_path = spec_dir.join("config.json");
        let text = std::fs::read(&spec_path).map_err(io_err("reading config.json", &spec_path))?;
        let mut config: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| HostError::Io {
                step: "parsing the runc spec",
                path: spec_path.clone(),
                source: e.into(),
            })?;
        config["process"]["terminal"] = false.into();
        config["process"]["args"] = serde_json::json!(["/bin/sh", "-c", init_script("", &w.setup)]);
        config["root"] = serde_json::json!({ "path": "rootfs", "readonly": false });
        config["hostname"] = "bench".into();
        if let Some(m) = config["mounts"].as_array_mut() {
            m.retain(|m| m["destination"] != "/sys/fs/cgroup");
        }
        let mut c = Container {
            workload: w.clone(),
            runc: runc.into(),
            criu: criu.into(),
            config,
            gen: 0,
            prefix,
            inst: None,
            root,
        };
        let (id, upper, work, dir) = c.bundle(0)?;
        let mount = OverlayMount::mount(&w.rootfs, &upper, &work, &dir.join("rootfs"))?;
        let pidfile = dir.join("init.pid");
        let started = run_to_file(
            "runc run",
            c.runc_cmd()
                .args(["run", "-d", "--bundle"])
                .arg(&dir)
                .arg("--pid-file")
                .arg(&pidfile)
                .arg(&id),
            &dir.join("runc.log"),
            None,
        );
        let init_pid = read_pid(&pidfile);
        c.inst = Some(Instance {
            id,
            dir,
            upper: upper.clone(),
            mount: Some(mount),
            init_pid,
        });
        started?;
        host::wait_ready(
            &w.name,
            "runc",
            &upper.join(READY_MARKER),
            &upper.join(SETUP_LOG),
            Duration::from_secs(w.setup_timeout_s),
            || dead(init_pid).then(|| format!("(container init {init_pid} exited)")),
        )?;
        Ok(c)
    }

    fn inst(&self) -> &Instance {
        self.inst
            .as_ref()
            .expect("a container always has an instance once created")
    }

    /// Processes of the container (`runc ps --format json`).
    fn count(&self, id: &str) -> HostResult<usize> {
        let out = run(
            "runc ps",
            self.runc_cmd().args(["ps", "--format", "json", id]),
            None,
        )?;
        let pids: Vec<i64> = serde_json::from_slice(&out.stdout).map_err(|e| HostError::Io {
            step: "parsing runc ps",
            path: self.root.path().into(),
            source: e.into(),
        })?;
        Ok(pids.len())
    }

    /// `runc pause`, tar the upper dir, `runc checkpoint --leave-running`, `runc resume`,
    /// `sync -f`. Returns (frozen ms, checkpoint ms, processes dumped).
    fn checkpoint(&self, ck: &Path) -> HostResult<(f64, f64, usize)> {
        let inst = self.inst();
        let images = ck.join("criu");
        let work = ck.join("work");
        let t0 = Instant::now();
        run(
            "runc pause",
            self.runc_cmd().args(["pause", &inst.id]),
            None,
        )?;
        let dumped = self.count(&inst.id);
        let frozen = (|| {
            tar_create(&inst.upper, &ck.join("upper.tar"))?;
            run(
                "runc checkpoint",
                self.runc_cmd()
                    .args(["checkpoint", "--leave-running", "--tcp-established"])
                    .args(["--file-locks", "--image-path"])
                    .arg(&images)
                    .arg("--work-path")
                    .arg(&work)
                    .arg(&inst.id),
                Some(&work.join("dump.log")),
            )
            .map(drop)
        })();
        let resumed = run(
            "runc resume",
            self.runc_cmd().args(["resume", &inst.id]),
            None,
        );
        frozen?;
        resumed?;
        let frozen_ms = ms_since(t0);
        sync_fs(ck)?;
        Ok((frozen_ms, ms_since(t0), dumped?))
    }

    /// `runc delete -f`, untar into a fresh upper dir, mount, `runc restore -d` under a new id.
    /// Returns the restore ms (the old bundle's files are removed afterwards, untimed).
    fn restore(&mut self, ck: &Path, dumped: usize) -> HostResult<f64> {
        let images = ck.join("criu");
        let work = ck.join("restore-work");
        let (id, upper, uwork, dir) = self.bundle(self.gen + 1)?;
        self.gen += 1;
        let t0 = Instant::now();
        let mut old = self
            .inst
            .take()
            .expect("a container always has an instance");
        let deleted = run(
            "runc delete -f",
            self.runc_cmd().args(["delete", "-f", &old.id]),
            None,
        );
        reap(old.init_pid);
        if let Some(m) = old.mount.take() {
            m.unmount()?;
        }
        deleted?;
        mkdirs("creating the fresh upper dir", &upper)?;
        tar_extract(&ck.join("upper.tar"), &upper)?;
        let mount =
            OverlayMount::mount(&self.workload.rootfs, &upper, &uwork, &dir.join("rootfs"))?;
        let pidfile = dir.join("init.pid");
        let restored = run_to_file(
            "runc restore",
            self.runc_cmd()
                .args(["restore", "-d", "--tcp-established", "--file-locks"])
                .arg("--image-path")
                .arg(&images)
                .arg("--work-path")
                .arg(&work)
                .arg("--bundle")
                .arg(&dir)
                .arg("--pid-file")
                .arg(&pidfile)
                .arg(&id),
            &dir.join("runc.log"),
            Some(&work.join("restore.log")),
        );
        let ms = ms_since(t0);
        let init_pid = read_pid(&pidfile);
        self.inst = Some(Instance {
            id,
            dir,
            upper,
            mount: Some(mount),
            init_pid,
        });
        let _ = belayer_overlay::remove_dir_all(&old.dir);
        restored?;
        let id = &self.inst().id;
        host::check_restored(&self.workload.name, "runc", dumped, || self.count(id))?;
        Ok(ms)
    }
}

/// Runs the workload in a runc container under `work_dir`, then `runs` checkpoint + restore
/// cycles; every checkpoint is deleted once restored. Everything is removed, even on error.
pub fn bench(
    w: &Workload,
    work_dir: &Path,
    runc: &Path,
    criu: &Path,
    runs: usize,
) -> HostResult<Vec<Sample>> {
    let mut c = Container::create(w, work_dir, runc, criu)?;
    let mut out = Vec::with_capacity(runs);
    for k in 1..=runs {
        let ck = ScratchDir::create(c.root.path().join(format!("ck{k}")))?;
        let (frozen_ms, checkpoint_ms, dumped) = c.checkpoint(ck.path())?;
        let restore_ms = c.restore(ck.path(), dumped)?;
        out.push(Sample {
            frozen_ms,
            checkpoint_ms,
            restore_ms,
        });
    }
    Ok(out)
}
