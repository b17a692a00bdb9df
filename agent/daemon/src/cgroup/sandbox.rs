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
mod tests;
