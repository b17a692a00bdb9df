//! A freezer cgroup of its own for a hand-made sandbox (cgroup v2 where mounted, else the v1
//! `freezer` hierarchy): freeze, thaw, kill, and removal on drop.

use std::io;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::{HostError, HostResult};

/// Which freezer a [`FreezerCgroup`] uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Freezer {
    /// cgroup v2 `cgroup.freeze` / `cgroup.events` / `cgroup.kill`.
    V2,
    /// cgroup v1 `freezer.state`.
    V1,
}

/// A cgroup of its own for a hand-made sandbox: v2 where a cgroup2 hierarchy is mounted (it has
/// `cgroup.freeze` and `cgroup.kill`), else the v1 `freezer` hierarchy. Its processes are
/// killed and the cgroup removed on drop.
#[derive(Debug)]
pub struct FreezerCgroup {
    dir: PathBuf,
    kind: Freezer,
}

/// Mount points of cgroup2 and of the v1 freezer hierarchy, from `/proc/self/mountinfo`.
fn cgroup_mounts() -> HostResult<(Option<PathBuf>, Option<PathBuf>)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| HostError::Io {
        step: "reading the mount table",
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split(' ');
        let (fstype, _src, opts) = (r.next(), r.next(), r.next().unwrap_or(""));
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        match fstype {
            Some("cgroup2") if v2.is_none() => v2 = Some(PathBuf::from(point)),
            Some("cgroup") if v1.is_none() && opts.split(',').any(|o| o == "freezer") => {
                v1 = Some(PathBuf::from(point))
            }
            _ => {}
        }
    }
    Ok((v2, v1))
}

impl FreezerCgroup {
    /// Creates cgroup `name` under the cgroup2 root (or the v1 freezer root).
    pub fn create(name: &str) -> HostResult<FreezerCgroup> {
        let (v2, v1) = cgroup_mounts()?;
        let (dir, kind) = match (v2, v1) {
            (Some(root), _) if root.join("cgroup.procs").exists() => (root.join(name), Freezer::V2),
            (_, Some(root)) => (root.join(name), Freezer::V1),
            _ => return Err(HostError::NoFreezer),
        };
        std::fs::create_dir(&dir).map_err(|source| HostError::Io {
            step: "creating the sandbox cgroup",
            path: dir.clone(),
            source,
        })?;
        let cg = FreezerCgroup { dir, kind };
        if kind == Freezer::V2 && !cg.dir.join("cgroup.freeze").exists() {
            return Err(HostError::NoFreezer);
        }
        Ok(cg)
    }

    /// The cgroup dir.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its `cgroup.procs` file.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn write(&self, file: &str, value: &str) -> HostResult<()> {
        let path = self.dir.join(file);
        std::fs::write(&path, value).map_err(|source| HostError::Io {
            step: "writing a cgroup file",
            path,
            source,
        })
    }

    fn read(&self, file: &str) -> HostResult<String> {
        let path = self.dir.join(file);
        std::fs::read_to_string(&path).map_err(|source| HostError::Io {
            step: "reading a cgroup file",
            path,
            source,
        })
    }

    /// Freezes every task and waits (polling every 0.2 ms, at most 10 s) until the kernel
    /// reports the cgroup frozen.
    pub fn freeze(&self) -> HostResult<()> {
        let t0 = Instant::now();
        let (file, on, done): (&str, &str, fn(&str) -> bool) = match self.kind {
            Freezer::V2 => ("cgroup.freeze", "1", |s| s.lines().any(|l| l == "frozen 1")),
            Freezer::V1 => ("freezer.state", "FROZEN", |s| s.trim() == "FROZEN"),
        };
        self.write(file, on)?;
        let status = if self.kind == Freezer::V2 {
            "cgroup.events"
        } else {
            file
        };
        loop {
            if done(&self.read(status)?) {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                let _ = self.thaw();
                return Err(HostError::FreezeTimeout {
                    path: self.dir.clone(),
                    waited_ms: t0.elapsed().as_millis(),
                });
            }
            if self.kind == Freezer::V1 {
                self.write(file, on)?;
            }
            thread::sleep(Duration::from_micros(200));
        }
    }

    /// Thaws the cgroup.
    pub fn thaw(&self) -> HostResult<()> {
        match self.kind {
            Freezer::V2 => self.write("cgroup.freeze", "0"),
            Freezer::V1 => self.write("freezer.state", "THAWED"),
        }
    }

    /// Pids in the cgroup.
    pub fn pids(&self) -> HostResult<Vec<i32>> {
        Ok(self
            .read("cgroup.procs")?
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect())
    }

    /// SIGKILLs every process in the cgroup (thawing it first) and waits until it is empty.
    pub fn kill_all(&self) -> HostResult<()> {
        let t0 = Instant::now();
        let _ = self.thaw();
        loop {
            let pids = self.pids()?;
            if pids.is_empty() {
                return Ok(());
            }
            if t0.elapsed() > Duration::from_secs(10) {
                return Err(HostError::KillTimeout {
                    path: self.dir.clone(),
                    waited_ms: t0.elapsed().as_millis(),
                });
            }
            match self.kind {
                Freezer::V2 => self.write("cgroup.kill", "1")?,
                Freezer::V1 => {
                    for pid in pids {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
            thread::sleep(Duration::from_micros(500));
        }
    }
}

impl Drop for FreezerCgroup {
    fn drop(&mut self) {
        if let Err(e) = self.kill_all() {
            tracing::warn!(cgroup = %self.dir.display(), error = %e, "processes left in cgroup");
        }
        // The last killed task may leave the cgroup a moment after cgroup.procs reads empty.
        for _ in 0..200 {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
        tracing::warn!(cgroup = %self.dir.display(), "cgroup left behind");
    }
}
