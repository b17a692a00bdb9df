//! What a daemon killed mid-operation may leave behind, as tests look for it: sandbox dirs,
//! cgroups, CRIU processes.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::Daemon;

/// The sandbox dirs of the state dir (removed ones being deleted excluded).
pub fn sandbox_dirs(d: &Daemon) -> BTreeSet<String> {
    std::fs::read_dir(d.state_dir.join("sandboxes"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("sb-"))
        .collect()
}

/// The `sb-*` cgroups under `parent` in every mounted hierarchy.
pub fn sandbox_cgroups(parent: &str) -> BTreeSet<String> {
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    for e in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        roots.push(e.path());
    }
    let mut out = BTreeSet::new();
    for root in roots {
        for e in std::fs::read_dir(root.join(parent))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("sb-") && e.path().is_dir() {
                out.insert(name);
            }
        }
    }
    out
}

/// Whether a CRIU process works on a path of this daemon's state dir.
pub fn criu_running(d: &Daemon) -> bool {
    let state = d.state_dir.display().to_string();
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            return false;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        cmd.contains("criu") && cmd.contains(&state)
    })
}

/// Waits until `f` holds, up to 20 s.
pub fn settle(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Mount points under the daemon's state dir (instance roots and their `/proc`, `/dev`).
pub fn mounts_under(d: &Daemon) -> Vec<String> {
    let state = d.state_dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| p.starts_with(&state))
        .map(str::to_string)
        .collect()
}
