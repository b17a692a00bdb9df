//! The cgroup of one sandbox: create or adopt, limits, membership, removal.

use std::path::{Path, PathBuf};

use super::devices::{apply_devices_bpf, apply_devices_v1, has_devices_bpf, DeviceFilter};
use super::layout::{CgroupLayout, LIMIT_CONTROLLERS};
use super::limits::{apply_cpu, init_cpuset, Limits};
use super::sys::{read_u64, write_file};
use super::tree::{
    collect_pids, enable_v2_controller, limit_for, make_leaf, mkdir_p, remove_tree, validate_rel,
};
use super::CgroupError;

/// Which freezer freezes a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezerKind {
    /// cgroup v2 `cgroup.freeze` / `cgroup.events` (Linux 5.2+). Frozen tasks sleep interruptibly
    /// and stay killable.
    V2,
    /// cgroup v1 `freezer.state`. Frozen tasks show state `D` and take no signal until thawed.
    V1,
}

/// How [`SandboxCgroup::kill_all`] kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillMethod {
    /// v2 `cgroup.kill` (Linux 5.14+) when the cgroup has it, else [`KillMethod::Signals`].
    CgroupKill,
    /// `SIGKILL` to every listed pid, repeated until the cgroup is empty, with the cgroup frozen
    /// while the pids are listed and signalled so that none can fork or be recycled meanwhile.
    Signals,
}

/// One sandbox's cgroup: the same relative path in the v2 hierarchy and in each v1 hierarchy used
/// for limits or freezing.
///
/// The directories outlive this handle on purpose (sandboxes outlive a restart of the daemon,
/// which adopts them with [`SandboxCgroup::open`]); [`SandboxCgroup::remove`] deletes them.
#[derive(Debug)]
pub struct SandboxCgroup {
    pub(super) rel: String,
    pub(super) v2: Option<PathBuf>,
    pub(super) v1_memory: Option<PathBuf>,
    pub(super) v1_pids: Option<PathBuf>,
    pub(super) v1_freezer: Option<PathBuf>,
    /// Dirs in every other v1 hierarchy (cpu, cpuset, devices, `name=systemd`, ...).
    pub(super) v1_others: Vec<PathBuf>,
    pub(super) freezer: FreezerKind,
    pub(super) kill: KillMethod,
}

impl SandboxCgroup {
    /// Creates the cgroup `rel` (e.g. `"belayer/<sandbox id>"`, parents made as needed) in every
    /// hierarchy it needs and applies `limits`.
    ///
    /// v2 `memory` and `pids` are used when the v2 root offers them; they are enabled in
    /// `cgroup.subtree_control` of each ancestor first. Otherwise the v1 `memory` and `pids`
    /// hierarchies are used. The cgroup is also made in the v1 `freezer` hierarchy when one is
    /// mounted, so that [`FreezerKind::V1`] can be chosen later. The default freezer is v2 when v2
    /// is mounted.
    ///
    /// Errors: [`CgroupError::InvalidPath`], [`CgroupError::AlreadyExists`] when the cgroup exists in
    /// the v2 hierarchy (in the first v1 one without v2; use [`Self::open`] to adopt it),
    /// [`CgroupError::LimitUnsupported`] when a limit has no controller,
    /// [`CgroupError::DeviceFilterUnavailable`] / [`CgroupError::DeviceProgram`] when the device
    /// allow-list cannot be applied, I/O errors naming the file. On error, the directories made
    /// so far are removed again (which also releases an attached device program).
    pub fn create(rel: &str, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        let rel_path = validate_rel(rel)?;
        let layout = CgroupLayout::detect()?;
        let devices = limits.devices.map(|f| f.resolve(layout)).transpose()?;

        let v2 = match layout.v2_mount() {
            Some(root) => {
                let dir = root.join(&rel_path);
                make_leaf(&dir)?;
                Some(dir)
            }
            None => None,
        };
        // From here on, undo what was made if anything fails.
        let mut cg = SandboxCgroup {
            rel: rel.to_owned(),
            v2,
            v1_memory: None,
            v1_pids: None,
            v1_freezer: None,
            v1_others: Vec::new(),
            freezer: FreezerKind::V2,
            kill: KillMethod::CgroupKill,
        };
        match cg.finish_create(layout, &rel_path, limits, devices) {
            Ok(()) => {
                tracing::debug!(
                    cgroup = %cg.rel,
                    layout = %layout.describe(),
                    memory_max = ?limits.memory_max,
                    pids_max = ?limits.pids_max,
                    ?devices,
                    "sandbox cgroup created"
                );
                Ok(cg)
            }
            Err(err) => {
                cg.remove_dirs_best_effort();
                Err(err)
            }
        }
    }

    fn finish_create(
        &mut self,
        layout: &CgroupLayout,
        rel_path: &Path,
        limits: &Limits,
        devices: Option<DeviceFilter>,
    ) -> Result<(), CgroupError> {
        if devices == Some(DeviceFilter::Bpf) {
            // resolve() saw cgroup2 mounted, so the v2 leaf exists.
            if let Some(leaf) = &self.v2 {
                apply_devices_bpf(leaf)?;
            }
        }
        // Which controllers v2 can carry for this cgroup.
        let mut v2_ok = [false; LIMIT_CONTROLLERS.len()];
        if let (Some(root), Some(leaf)) = (layout.v2_mount(), &self.v2) {
            for (i, controller) in LIMIT_CONTROLLERS.into_iter().enumerate() {
                if !layout.v2_has(controller) {
                    continue;
                }
                match enable_v2_controller(root, rel_path, controller) {
                    Ok(()) => v2_ok[i] = leaf.join(format!("{controller}.max")).exists(),
                    Err(err) if layout.v1_mount(controller).is_some() => {
                        tracing::warn!(%err, controller, "cannot enable v2 controller, using v1");
                    }
                    Err(err) if limit_for(limits, controller).is_some() => return Err(err),
                    Err(err) => {
                        tracing::warn!(%err, controller, "cannot enable v2 controller");
                    }
                }
            }
        }
        let [v2_memory, v2_pids] = v2_ok;
        let primary_is_v1 = self.v2.is_none();

        // v1 hierarchies: freezer first, it is the primary one when v2 is absent.
        let mut first_v1 = primary_is_v1;
        for (controller, needed) in [
            ("freezer", true),
            ("memory", !v2_memory),
            ("pids", !v2_pids),
        ] {
            let Some(root) = layout.v1_mount(controller).filter(|_| needed) else {
                continue;
            };
            let dir = root.join(rel_path);
            if first_v1 {
                make_leaf(&dir)?;
                first_v1 = false;
            } else {
                mkdir_p(&dir)?;
            }
            match controller {
                "freezer" => self.v1_freezer = Some(dir),
                "memory" => self.v1_memory = Some(dir),
                _ => self.v1_pids = Some(dir),
            }
        }
        if self.v2.is_none() {
            self.freezer = FreezerKind::V1;
        }
        // Every other v1 hierarchy: the sandbox gets a cgroup of its own there too.
        let mut v1_cpu = None;
        for h in layout.v1_others() {
            let dir = h.mount.join(rel_path);
            if first_v1 {
                make_leaf(&dir)?;
                first_v1 = false;
            } else {
                mkdir_p(&dir)?;
            }
            self.v1_others.push(dir.clone());
            if h.has("cpuset") {
                init_cpuset(&h.mount, rel_path)?;
            }
            if h.has("devices") && devices == Some(DeviceFilter::V1) {
                apply_devices_v1(&dir)?;
            }
            if h.has("cpu") {
                v1_cpu = Some(dir);
            }
        }
        if let Some(cpu) = limits.cpu {
            let v2_cpu = match (layout.v2_mount(), &self.v2) {
                (Some(root), Some(leaf)) if layout.v2_has("cpu") => {
                    enable_v2_controller(root, rel_path, "cpu")?;
                    Some(leaf.as_path())
                }
                _ => None,
            };
            apply_cpu(v2_cpu, v1_cpu.as_deref(), cpu)?;
        }

        if let Some(bytes) = limits.memory_max {
            let (dir, file) = match (&self.v2, &self.v1_memory) {
                (Some(v2), _) if v2_memory => (v2, "memory.max"),
                (_, Some(v1)) => (v1, "memory.limit_in_bytes"),
                _ => {
                    return Err(CgroupError::LimitUnsupported {
                        controller: "memory",
                    })
                }
            };
            write_file(&dir.join(file), &bytes.to_string())?;
        }
        if let Some(max) = limits.pids_max {
            let dir = match (&self.v2, &self.v1_pids) {
                (Some(v2), _) if v2_pids => v2,
                (_, Some(v1)) => v1,
                _ => return Err(CgroupError::LimitUnsupported { controller: "pids" }),
            };
            write_file(&dir.join("pids.max"), &max.to_string())?;
        }
        Ok(())
    }

    /// Adopts the existing cgroup `rel` (after a restart of the daemon): the v2 directory must exist
    /// when v2 is mounted; the v1 directories are used where they exist. Limits are left as they are.
    /// The freezer is v2 when the v2 directory has `cgroup.freeze`, else v1.
    ///
    /// Errors: [`CgroupError::InvalidPath`], [`CgroupError::NotFound`].
    pub fn open(rel: &str) -> Result<SandboxCgroup, CgroupError> {
        let rel_path = validate_rel(rel)?;
        let layout = CgroupLayout::detect()?;
        let existing = |root: Option<&Path>| root.map(|r| r.join(&rel_path)).filter(|d| d.is_dir());
        let v2 = existing(layout.v2_mount());
        let v1_freezer = existing(layout.v1_mount("freezer"));
        let v1_memory = existing(layout.v1_mount("memory"));
        let v1_pids = existing(layout.v1_mount("pids"));
        let v1_others = layout
            .v1_others()
            .iter()
            .filter_map(|h| existing(Some(&h.mount)))
            .collect();
        let primary = layout
            .v2_mount()
            .or(layout.v1_mount("freezer"))
            .or(layout.v1_mount("memory"))
            .or(layout.v1_mount("pids"))
            .ok_or(CgroupError::NoHierarchy)?
            .join(&rel_path);
        let found = if layout.v2_mount().is_some() {
            v2.is_some()
        } else {
            v1_freezer.is_some() || v1_memory.is_some() || v1_pids.is_some()
        };
        if !found {
            return Err(CgroupError::NotFound { path: primary });
        }
        let freezer = match &v2 {
            Some(dir) if dir.join("cgroup.freeze").exists() => FreezerKind::V2,
            _ => FreezerKind::V1,
        };
        Ok(SandboxCgroup {
            rel: rel.to_owned(),
            v2,
            v1_memory,
            v1_pids,
            v1_freezer,
            v1_others,
            freezer,
            kill: KillMethod::CgroupKill,
        })
    }

    /// Chooses the freezer (e.g. [`FreezerKind::V1`] to use the v1 freezer although v2 is
    /// available). A freezer this cgroup lacks makes [`Self::freeze`] fail with
    /// [`CgroupError::FreezerUnavailable`].
    pub fn with_freezer(mut self, kind: FreezerKind) -> Self {
        self.freezer = kind;
        self
    }

    /// Chooses how [`Self::kill_all`] kills (default [`KillMethod::CgroupKill`]).
    pub fn with_kill_method(mut self, method: KillMethod) -> Self {
        self.kill = method;
        self
    }

    /// The freezer in use.
    pub fn freezer_kind(&self) -> FreezerKind {
        self.freezer
    }

    /// The relative path given to [`Self::create`] or [`Self::open`].
    pub fn rel_path(&self) -> &str {
        &self.rel
    }

    /// The v2 directory of this cgroup, if v2 is mounted.
    pub fn v2_dir(&self) -> Option<&Path> {
        self.v2.as_deref()
    }

    /// The directory of the freezer in use: the v2 directory for [`FreezerKind::V2`] (what CRIU's
    /// `--freeze-cgroup` gets), the v1 freezer directory for [`FreezerKind::V1`]. Falls back to the
    /// other one when the chosen one is missing.
    pub fn freezer_dir(&self) -> PathBuf {
        let (first, second) = match self.freezer {
            FreezerKind::V2 => (&self.v2, &self.v1_freezer),
            FreezerKind::V1 => (&self.v1_freezer, &self.v2),
        };
        first
            .as_ref()
            .or(second.as_ref())
            .or(self.v1_pids.as_ref())
            .or(self.v1_memory.as_ref())
            .cloned()
            .unwrap_or_default()
    }

    /// Every directory of this cgroup: v2 first, then v1 freezer, memory, pids and the
    /// other v1 hierarchies.
    pub(super) fn dirs(&self) -> impl Iterator<Item = &Path> {
        [&self.v2, &self.v1_freezer, &self.v1_memory, &self.v1_pids]
            .into_iter()
            .filter_map(|d| d.as_deref())
            .chain(self.v1_others.iter().map(PathBuf::as_path))
    }

    /// The `cgroup.procs` file of every hierarchy this cgroup lives in (v2 first). A process joins
    /// the sandbox by writing its pid (or `0` for itself) to each of them, e.g. between fork and exec.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Moves process `pid` (host pid namespace; `0` is the caller) into this cgroup in every
    /// hierarchy. Errors: [`CgroupError::Write`] naming the `cgroup.procs` file (`ESRCH` for a gone
    /// process).
    pub fn add_pid(&self, pid: i32) -> Result<(), CgroupError> {
        let value = pid.to_string();
        for file in self.procs_files() {
            write_file(&file, &value)?;
        }
        Ok(())
    }

    /// The directory whose `cgroup.procs` lists the sandbox: v2 when mounted, else a v1 one.
    pub(super) fn main_dir(&self) -> Option<&Path> {
        self.dirs().next()
    }

    /// Every pid in the cgroup and its descendant cgroups (host pid namespace), sorted.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let mut pids = Vec::new();
        if let Some(dir) = self.main_dir() {
            collect_pids(dir, &mut pids)?;
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// Memory charged to the cgroup in bytes (v2 `memory.current`, else v1
    /// `memory.usage_in_bytes`), `None` when no memory controller covers it.
    pub fn memory_current(&self) -> Option<u64> {
        let v2 = self.v2.as_ref().map(|d| d.join("memory.current"));
        let v1 = self
            .v1_memory
            .as_ref()
            .map(|d| d.join("memory.usage_in_bytes"));
        [v2, v1]
            .into_iter()
            .flatten()
            .find_map(|file| read_u64(&file).ok())
    }

    /// The file counting OOM kills in this cgroup (an `oom_kill <n>` line): v2 `memory.events`
    /// when v2 has the memory controller, else v1 `memory.oom_control`; `None` without one.
    pub fn oom_events_file(&self) -> Option<PathBuf> {
        let v2 = self.v2.as_ref().map(|d| d.join("memory.events"));
        let v1 = self
            .v1_memory
            .as_ref()
            .map(|d| d.join("memory.oom_control"));
        [v2, v1].into_iter().flatten().find(|f| f.exists())
    }

    /// Removes the cgroup directories in every hierarchy, descendants first. A directory already
    /// gone is fine. Every hierarchy is tried; the first error is returned
    /// ([`CgroupError::RemoveDir`], `EBUSY` while processes remain: use [`Self::kill_all`] first).
    pub fn remove(self) -> Result<(), CgroupError> {
        let mut first_err = None;
        for dir in self.dirs() {
            if let Err(err) = remove_tree(dir) {
                tracing::debug!(cgroup = %self.rel, %err, "cgroup removal failed");
                first_err.get_or_insert(err);
            }
        }
        match first_err {
            Some(err) => Err(err),
            None => {
                tracing::debug!(cgroup = %self.rel, "sandbox cgroup removed");
                Ok(())
            }
        }
    }

    fn remove_dirs_best_effort(&self) {
        for dir in self.dirs() {
            if let Err(err) = remove_tree(dir) {
                tracing::warn!(%err, "cleanup of a half-created cgroup failed");
            }
        }
    }

    /// Checks, for an adopted cgroup, that the allow-list `filter` means on this node is in
    /// place, and attaches the BPF program again where it is missing from the v2 cgroup
    /// (nothing a sandbox can do detaches it; host root can). Returns whether it attached.
    /// The v1 `devices` settings stay in the cgroup and are not re-checked.
    ///
    /// Errors: [`CgroupError::DeviceFilterUnavailable`], [`CgroupError::DeviceProgram`].
    pub fn ensure_device_filter(&self, filter: DeviceFilter) -> Result<bool, CgroupError> {
        let layout = CgroupLayout::detect()?;
        match (filter.resolve(layout)?, &self.v2) {
            (DeviceFilter::Bpf, Some(dir)) if !has_devices_bpf(dir)? => {
                apply_devices_bpf(dir)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::sys::{read_file, read_pids};
    use super::*;
    use crate::cgroup::test_support::{spawn_gated, unique_rel, TestCgroup};

    #[test]
    fn rejects_bad_paths() {
        for bad in [
            "", "/abs", "a//b", "a/", "a/../b", "..", ".", "a/./b", "a\0b",
        ] {
            assert!(
                matches!(validate_rel(bad), Err(CgroupError::InvalidPath { .. })),
                "{bad:?} accepted"
            );
        }
        assert_eq!(
            validate_rel("belayer/sb-1").unwrap(),
            Path::new("belayer/sb-1")
        );
        assert!(matches!(
            SandboxCgroup::create("../etc", &Limits::default()),
            Err(CgroupError::InvalidPath { .. })
        ));
    }

    #[test]
    fn create_applies_limits_in_the_right_hierarchies() {
        let layout = CgroupLayout::detect().unwrap();
        let limits = Limits {
            memory_max: Some(64 << 20),
            pids_max: Some(7),
            ..Limits::default()
        };
        let t = TestCgroup::create("limits", &limits);
        let cg = t.cg();
        let (mem_file, pids_file) = match cg.v2_dir() {
            Some(v2) if layout.v2_has("memory") => (v2.join("memory.max"), v2.join("pids.max")),
            _ => (
                cg.v1_memory.as_ref().unwrap().join("memory.limit_in_bytes"),
                cg.v1_pids.as_ref().unwrap().join("pids.max"),
            ),
        };
        println!(
            "limits in {} and {}",
            mem_file.display(),
            pids_file.display()
        );
        assert_eq!(
            std::fs::read_to_string(&mem_file).unwrap().trim(),
            "67108864"
        );
        assert_eq!(std::fs::read_to_string(&pids_file).unwrap().trim(), "7");
        if layout.v2_mount().is_some() {
            assert!(cg.v2_dir().unwrap().is_dir());
            assert_eq!(cg.freezer_kind(), FreezerKind::V2);
            assert_eq!(cg.freezer_dir(), cg.v2_dir().unwrap());
        }
        if !layout.v2_has("memory") {
            // Hybrid: the v2 directory carries no limit files.
            assert!(!cg.v2_dir().unwrap().join("memory.max").exists());
        }
        assert_eq!(cg.procs_files().len(), cg.dirs().count());
        assert!(cg.procs_files().iter().all(|f| f.is_file()));
    }

    #[test]
    fn create_twice_fails_and_open_adopts() {
        let t = TestCgroup::create("adopt", &Limits::default());
        let err = SandboxCgroup::create(t.cg().rel_path(), &Limits::default()).unwrap_err();
        assert!(matches!(err, CgroupError::AlreadyExists { .. }), "{err}");
        let child = t.spawn_in("exec sleep 1000");
        let opened = SandboxCgroup::open(t.cg().rel_path()).unwrap();
        assert_eq!(opened.rel_path(), t.cg().rel_path());
        assert_eq!(opened.procs_files(), t.cg().procs_files());
        assert_eq!(opened.freezer_kind(), t.cg().freezer_kind());
        assert_eq!(opened.pids().unwrap(), vec![child]);
        assert!(matches!(
            SandboxCgroup::open(&unique_rel("never-created")),
            Err(CgroupError::NotFound { .. })
        ));
    }

    #[test]
    fn add_pid_puts_a_process_in_every_hierarchy() {
        let t = TestCgroup::create("add", &Limits::default());
        let pid = t.spawn_in("exec sleep 1000");
        assert_eq!(t.cg().pids().unwrap(), vec![pid]);
        let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let suffix = format!("/{}", t.cg().rel_path());
        let lines: Vec<&str> = membership
            .lines()
            .filter(|l| l.ends_with(&suffix))
            .collect();
        println!("/proc/{pid}/cgroup entries in the sandbox: {lines:?}");
        assert_eq!(lines.len(), t.cg().dirs().count());
        for file in t.cg().procs_files() {
            assert_eq!(read_pids(&file).unwrap(), vec![pid], "{}", file.display());
        }
        assert!(t.cg().memory_current().is_some());
    }

    #[test]
    fn pids_include_child_cgroups() {
        let t = TestCgroup::create("nested", &Limits::default());
        let top = t.spawn_in("exec sleep 1000");
        let nested = t.cg().main_dir().unwrap().join("inner");
        std::fs::create_dir(&nested).unwrap();
        let (mut child, gate) = spawn_gated("exec sleep 1000");
        let inner_pid = i32::try_from(child.id()).unwrap();
        std::fs::write(nested.join("cgroup.procs"), inner_pid.to_string()).unwrap();
        drop(gate);
        let mut expected = vec![top, inner_pid];
        expected.sort_unstable();
        assert_eq!(t.cg().pids().unwrap(), expected);
        // kill_all and remove (via the guard) handle the nested cgroup too.
        t.cg().kill_all(std::time::Duration::from_secs(5)).unwrap();
        child.wait().unwrap();
        assert!(t.cg().pids().unwrap().is_empty());
    }

    #[test]
    fn pids_max_stops_forks() {
        let t = TestCgroup::create(
            "pidsmax",
            &Limits {
                pids_max: Some(5),
                ..Limits::default()
            },
        );
        // The shell itself counts: four sleeps start, the fifth fork fails and dash gives up.
        let shell = t.spawn_in("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 1000 & done; exit 0");
        let status = t.wait_child(shell);
        println!("pids.max=5: the shell forking 10 sleeps ended with {status:?}");
        assert_eq!(status.code(), Some(2));
        let pids = t.cg().pids().unwrap();
        assert_eq!(pids.len(), 4, "{pids:?}");
        let layout = CgroupLayout::detect().unwrap();
        let pids_dir = match t.cg().v2_dir() {
            Some(v2) if layout.v2_has("pids") => v2.to_path_buf(),
            _ => t.cg().v1_pids.clone().unwrap(),
        };
        let events = std::fs::read_to_string(pids_dir.join("pids.events")).unwrap();
        println!("pids.events: {}", events.trim());
        let refused: u64 = events
            .lines()
            .find_map(|l| l.strip_prefix("max "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(refused >= 1, "{events}");
    }

    #[test]
    fn memory_limit_is_enforced() {
        let t = TestCgroup::create(
            "memmax",
            &Limits {
                memory_max: Some(32 << 20),
                ..Limits::default()
            },
        );
        // A shell variable of 64 MiB cannot fit in 32 MiB: the shell is OOM-killed.
        let pid = t.spawn_in("x=$(head -c 67108864 /dev/zero | tr '\\0' a); sleep 1000");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while t.cg().pids().unwrap().contains(&pid) {
            assert!(std::time::Instant::now() < deadline, "not OOM-killed");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let status = t.wait_child(pid);
        println!("memory.max=32MiB: allocating shell ended with {status:?}");
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }

    #[test]
    fn enables_v2_controllers_along_the_path() {
        // Memory and pids are v1 here, but any v2 controller takes the same path; hugetlb is
        // the one a hybrid v2 root usually offers.
        let layout = CgroupLayout::detect().unwrap();
        let (Some(root), Some(controller)) = (
            layout.v2_mount(),
            ["hugetlb", "pids", "memory"]
                .into_iter()
                .find(|c| layout.v2_has(c)),
        ) else {
            println!("no v2 controller to enable here, skipped");
            return;
        };
        let root_control = root.join("cgroup.subtree_control");
        let was_enabled = read_file(&root_control)
            .unwrap()
            .split_whitespace()
            .any(|c| c == controller);
        let top = format!("belayer-test-enable-{}", std::process::id());
        let rel = PathBuf::from(format!("{top}/mid/leaf"));
        mkdir_p(&root.join(&rel)).unwrap();
        enable_v2_controller(root, &rel, controller).unwrap();
        // Idempotent: a second call finds it enabled everywhere.
        enable_v2_controller(root, &rel, controller).unwrap();
        let leaf_files: Vec<String> = std::fs::read_dir(root.join(&rel))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&format!("{controller}.")))
            .collect();
        println!("{controller} files in the leaf: {leaf_files:?}");
        let leaf_controllers = read_file(&root.join(&rel).join("cgroup.controllers")).unwrap();
        let mid_control = read_file(&root.join(&top).join("mid/cgroup.subtree_control")).unwrap();
        remove_tree(&root.join(&top)).unwrap();
        if !was_enabled {
            write_file(&root_control, &format!("-{controller}")).unwrap();
        }
        assert!(leaf_controllers.split_whitespace().any(|c| c == controller));
        assert!(mid_control.split_whitespace().any(|c| c == controller));
        assert!(!leaf_files.is_empty());
    }

    #[test]
    fn remove_is_idempotent_and_refuses_busy() {
        let rel = unique_rel("remove");
        let cg = SandboxCgroup::create(&rel, &Limits::default()).unwrap();
        let dirs: Vec<PathBuf> = cg.dirs().map(Path::to_path_buf).collect();
        let nested = cg.main_dir().unwrap().join("a/b");
        std::fs::create_dir_all(&nested).unwrap();
        let again = SandboxCgroup::open(&rel).unwrap();
        cg.remove().unwrap();
        assert!(dirs.iter().all(|d| !d.exists()));
        again.remove().unwrap();

        let t = TestCgroup::create("busy", &Limits::default());
        t.spawn_in("sleep 1000");
        let err = SandboxCgroup::open(t.cg().rel_path())
            .unwrap()
            .remove()
            .unwrap_err();
        assert!(matches!(err, CgroupError::RemoveDir { .. }), "{err}");
        println!("busy removal: {err}: {:?}", std::error::Error::source(&err));
    }
}
