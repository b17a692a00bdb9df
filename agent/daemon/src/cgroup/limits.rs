//! What a sandbox cgroup enforces beyond membership: its [`Limits`], CPU bandwidth and the
//! cpuset a v1 `cpuset` cgroup needs before it can hold a task (the device allow-list is in
//! `devices.rs`).

use std::path::Path;

use super::devices::DeviceFilter;
use super::sys::{read_file, write_file};
use super::CgroupError;

/// Resource limits of a sandbox cgroup. `None` leaves the kernel default (no limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Memory limit in bytes (v2 `memory.max`, v1 `memory.limit_in_bytes`; swap is not limited).
    pub memory_max: Option<u64>,
    /// Maximum number of tasks (processes and threads) in the cgroup (`pids.max`).
    pub pids_max: Option<u64>,
    /// CPU bandwidth (`cpu.max`, or v1 `cpu.cfs_quota_us`).
    pub cpu: Option<CpuMax>,
    /// Restrict devices to [`super::ALLOWED_DEVICES`] with this mechanism (`None`: no
    /// allow-list).
    pub devices: Option<DeviceFilter>,
}

/// CPU bandwidth: `quota_us` of CPU time per `period_us` of wall time (v2 `cpu.max`, v1
/// `cpu.cfs_quota_us` / `cpu.cfs_period_us`). `cpus = quota / period`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuMax {
    /// CPU time allowed per period, microseconds (≥ 1000).
    pub quota_us: u64,
    /// Period, microseconds (1000 ..= 1 000 000).
    pub period_us: u64,
}

impl CpuMax {
    /// Period used for a limit given as a number of CPUs.
    pub const PERIOD_US: u64 = 100_000;

    /// `cpus` CPUs (e.g. `1.5`); `None` for a value that is not finite or below 0.01.
    pub fn from_cpus(cpus: f64) -> Option<CpuMax> {
        if !cpus.is_finite() || !(0.01..=65_536.0).contains(&cpus) {
            return None;
        }
        Some(CpuMax {
            quota_us: ((cpus * Self::PERIOD_US as f64).round() as u64).max(1000),
            period_us: Self::PERIOD_US,
        })
    }
}

/// Applies `cpu` in the v2 dir (`cpu.max`) or the v1 `cpu` dir.
pub(super) fn apply_cpu(
    v2: Option<&Path>,
    v1_cpu: Option<&Path>,
    cpu: CpuMax,
) -> Result<(), CgroupError> {
    match (v2.filter(|d| d.join("cpu.max").exists()), v1_cpu) {
        (Some(dir), _) => write_file(
            &dir.join("cpu.max"),
            &format!("{} {}", cpu.quota_us, cpu.period_us),
        ),
        (None, Some(dir)) => {
            write_file(&dir.join("cpu.cfs_period_us"), &cpu.period_us.to_string())?;
            write_file(&dir.join("cpu.cfs_quota_us"), &cpu.quota_us.to_string())
        }
        (None, None) => Err(CgroupError::LimitUnsupported { controller: "cpu" }),
    }
}

/// Gives every level of `rel` below the v1 cpuset root the cpus and memory nodes of its
/// parent where it has none (a v1 cpuset cgroup with empty `cpuset.cpus` refuses tasks).
pub(super) fn init_cpuset(root: &Path, rel: &Path) -> Result<(), CgroupError> {
    let mut parent = root.to_path_buf();
    for component in rel.components() {
        let dir = parent.join(component);
        for file in ["cpuset.cpus", "cpuset.mems"] {
            let current = read_file(&dir.join(file))?;
            if current.trim().is_empty() {
                let inherited = read_file(&parent.join(file))?;
                write_file(&dir.join(file), inherited.trim())?;
            }
        }
        parent = dir;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpus_convert_to_bandwidth() {
        assert_eq!(
            CpuMax::from_cpus(1.5),
            Some(CpuMax {
                quota_us: 150_000,
                period_us: 100_000
            })
        );
        assert_eq!(CpuMax::from_cpus(0.001), None);
        assert_eq!(CpuMax::from_cpus(f64::NAN), None);
        assert_eq!(CpuMax::from_cpus(-1.0), None);
        assert_eq!(CpuMax::from_cpus(0.01).unwrap().quota_us, 1000);
    }
}
