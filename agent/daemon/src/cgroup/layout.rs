//! Which cgroup hierarchies this node mounts, probed once from `/proc/self/mountinfo`.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::CgroupError;

const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The v2 controllers a sandbox cgroup uses for limits.
pub(super) const LIMIT_CONTROLLERS: [&str; 2] = ["memory", "pids"];

/// The cgroup hierarchies mounted on this node.
///
/// Shapes seen in practice: pure v2 (`/sys/fs/cgroup`, `memory` and `pids` available) and hybrid
/// (v2 at `/sys/fs/cgroup/unified` without controllers, v1 `memory`, `pids`, `freezer` beside it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupLayout {
    v2: Option<PathBuf>,
    v2_controllers: Vec<String>,
    v1_memory: Option<PathBuf>,
    v1_pids: Option<PathBuf>,
    v1_freezer: Option<PathBuf>,
    /// Every other v1 hierarchy (cpu, cpuacct, cpuset, blkio, devices, `name=systemd`, ...):
    /// its mount point and the controllers (or `name=`) it carries.
    v1_others: Vec<V1Hierarchy>,
}

/// A v1 hierarchy beyond memory, pids and freezer. A sandbox gets a cgroup in each, so that
/// it sits in a cgroup of its own (owned by host root) everywhere, never in the host's root
/// cgroup of a hierarchy it does not use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V1Hierarchy {
    /// Mount point.
    pub mount: PathBuf,
    /// Controllers of the hierarchy (e.g. `["cpu"]`, `["cpu", "cpuacct"]`, `["name=systemd"]`).
    pub controllers: Vec<String>,
}

impl V1Hierarchy {
    /// Whether the hierarchy carries `controller`.
    pub fn has(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }
}

static LAYOUT: OnceLock<CgroupLayout> = OnceLock::new();

impl CgroupLayout {
    /// The layout of this node, probed on first use and cached for the life of the process.
    ///
    /// Errors: [`CgroupError::ReadMountinfo`] when the mount table cannot be read,
    /// [`CgroupError::NoHierarchy`] when no usable hierarchy is mounted. A failed probe is not
    /// cached.
    pub fn detect() -> Result<&'static CgroupLayout, CgroupError> {
        if let Some(layout) = LAYOUT.get() {
            return Ok(layout);
        }
        let layout = Self::probe()?;
        Ok(LAYOUT.get_or_init(|| layout))
    }

    /// Probes the layout now, without the cache (see [`Self::detect`]).
    pub fn probe() -> Result<CgroupLayout, CgroupError> {
        let text =
            std::fs::read_to_string(MOUNTINFO).map_err(|source| CgroupError::ReadMountinfo {
                path: PathBuf::from(MOUNTINFO),
                source,
            })?;
        let layout = Self::from_mountinfo(&text, |root| {
            std::fs::read_to_string(root.join("cgroup.controllers"))
        });
        tracing::debug!(layout = %layout.describe(), "cgroup layout probed");
        if layout.v2.is_none()
            && layout.v1_memory.is_none()
            && layout.v1_pids.is_none()
            && layout.v1_freezer.is_none()
        {
            return Err(CgroupError::NoHierarchy);
        }
        Ok(layout)
    }

    /// Builds the layout from the text of a `mountinfo` file; `read_controllers` returns the
    /// `cgroup.controllers` of the v2 mount root (an unreadable file counts as no controllers).
    /// The first mount of each hierarchy wins.
    pub(super) fn from_mountinfo(
        text: &str,
        read_controllers: impl Fn(&Path) -> io::Result<String>,
    ) -> CgroupLayout {
        let mut layout = CgroupLayout {
            v2: None,
            v2_controllers: Vec::new(),
            v1_memory: None,
            v1_pids: None,
            v1_freezer: None,
            v1_others: Vec::new(),
        };
        for line in text.lines() {
            let Some(mount) = MountLine::parse(line) else {
                continue;
            };
            match mount.fstype {
                "cgroup2" if layout.v2.is_none() => layout.v2 = Some(mount.mount_point),
                "cgroup" => {
                    let tracked = mount
                        .super_options
                        .split(',')
                        .any(|o| matches!(o, "memory" | "pids" | "freezer"));
                    let controllers: Vec<String> = mount
                        .super_options
                        .split(',')
                        .filter(|o| is_v1_controller(o))
                        .map(str::to_owned)
                        .collect();
                    let known = layout
                        .v1_others
                        .iter()
                        .any(|h| h.controllers == controllers);
                    if !tracked && !controllers.is_empty() && !known {
                        layout.v1_others.push(V1Hierarchy {
                            mount: mount.mount_point.clone(),
                            controllers,
                        });
                    }
                    for opt in mount.super_options.split(',') {
                        let slot = match opt {
                            "memory" => &mut layout.v1_memory,
                            "pids" => &mut layout.v1_pids,
                            "freezer" => &mut layout.v1_freezer,
                            _ => continue,
                        };
                        if slot.is_none() {
                            *slot = Some(mount.mount_point.clone());
                        }
                    }
                }
                _ => {}
            }
        }
        if let Some(root) = &layout.v2 {
            match read_controllers(root) {
                Ok(list) => {
                    layout.v2_controllers = list.split_whitespace().map(str::to_owned).collect();
                }
                Err(err) => {
                    tracing::warn!(root = %root.display(), %err, "cannot read cgroup.controllers");
                }
            }
        }
        layout
    }

    /// The cgroup2 mount point, if cgroup2 is mounted.
    pub fn v2_mount(&self) -> Option<&Path> {
        self.v2.as_deref()
    }

    /// Controllers available in the v2 root (its `cgroup.controllers`), e.g. `["memory", "pids"]`.
    pub fn v2_controllers(&self) -> &[String] {
        &self.v2_controllers
    }

    /// Whether the v2 root offers `controller`.
    pub fn v2_has(&self, controller: &str) -> bool {
        self.v2.is_some() && self.v2_controllers.iter().any(|c| c == controller)
    }

    /// The mount point of the v1 hierarchy of `controller` (`"memory"`, `"pids"` or `"freezer"`;
    /// other controllers are not tracked and give `None`).
    pub fn v1_mount(&self, controller: &str) -> Option<&Path> {
        match controller {
            "memory" => self.v1_memory.as_deref(),
            "pids" => self.v1_pids.as_deref(),
            "freezer" => self.v1_freezer.as_deref(),
            _ => None,
        }
    }

    /// Every v1 hierarchy besides memory, pids and freezer, in mount order.
    pub fn v1_others(&self) -> &[V1Hierarchy] {
        &self.v1_others
    }

    /// The v1 hierarchy carrying `controller` among [`Self::v1_others`] (e.g. `"cpu"`,
    /// `"cpuset"`, `"devices"`).
    pub fn v1_other(&self, controller: &str) -> Option<&V1Hierarchy> {
        self.v1_others.iter().find(|h| h.has(controller))
    }

    /// One line for logs: `"v2"` (pure v2 with memory and pids), `"hybrid (v2 freeze/kill; v1
    /// memory, pids)"`, `"v2 (no pids)"`, `"v1 (memory, pids, freezer)"`, ...
    pub fn describe(&self) -> String {
        if self.v2.is_some() {
            let mut v2_parts = vec!["freeze/kill"];
            let mut v1_parts = Vec::new();
            let mut missing = Vec::new();
            for c in LIMIT_CONTROLLERS {
                if self.v2_has(c) {
                    v2_parts.push(c);
                } else if self.v1_mount(c).is_some() {
                    v1_parts.push(c);
                } else {
                    missing.push(c);
                }
            }
            let missing = if missing.is_empty() {
                String::new()
            } else {
                format!("no {}", missing.join(", "))
            };
            match (v1_parts.is_empty(), missing.is_empty()) {
                (true, true) => "v2".to_owned(),
                (true, false) => format!("v2 ({missing})"),
                (false, true) => format!(
                    "hybrid (v2 {}; v1 {})",
                    v2_parts.join(", "),
                    v1_parts.join(", ")
                ),
                (false, false) => format!(
                    "hybrid (v2 {}; v1 {}; {missing})",
                    v2_parts.join(", "),
                    v1_parts.join(", ")
                ),
            }
        } else {
            let v1: Vec<&str> = ["memory", "pids", "freezer"]
                .into_iter()
                .filter(|c| self.v1_mount(c).is_some())
                .collect();
            if v1.is_empty() {
                "none".to_owned()
            } else {
                format!("v1 ({})", v1.join(", "))
            }
        }
    }
}

/// Whether a v1 super option names a hierarchy's controller (or its `name=`) rather than a
/// mount option such as `rw` or `clone_children`.
fn is_v1_controller(opt: &str) -> bool {
    opt.starts_with("name=")
        || matches!(
            opt,
            "cpu"
                | "cpuacct"
                | "cpuset"
                | "blkio"
                | "io"
                | "devices"
                | "net_cls"
                | "net_prio"
                | "perf_event"
                | "hugetlb"
                | "rdma"
                | "misc"
                | "memory"
                | "pids"
                | "freezer"
        )
}

/// The fields of one `mountinfo` line that matter here.
struct MountLine<'a> {
    mount_point: PathBuf,
    fstype: &'a str,
    super_options: &'a str,
}

impl<'a> MountLine<'a> {
    /// Parses `id parent maj:min root mount-point options [optional...] - fstype source super-options`.
    fn parse(line: &'a str) -> Option<MountLine<'a>> {
        let (head, tail) = line.split_once(" - ")?;
        let mount_point = head.split(' ').nth(4)?;
        let mut tail = tail.split(' ');
        let fstype = tail.next()?;
        let _source = tail.next()?;
        let super_options = tail.next().unwrap_or("");
        Some(MountLine {
            mount_point: unescape(mount_point),
            fstype,
            super_options,
        })
    }
}

/// Undoes the octal escapes (`\040` for space, `\011`, `\012`, `\134`) of mountinfo paths.
fn unescape(s: &str) -> PathBuf {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            if let Some(&[a, b, c]) = bytes.get(i + 1..i + 4) {
                let octal = |d: u8| (b'0'..=b'7').contains(&d);
                if (b'0'..=b'3').contains(&a) && octal(b) && octal(c) {
                    out.push(((a - b'0') << 6) | ((b - b'0') << 3) | (c - b'0'));
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    PathBuf::from(OsString::from_vec(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const PURE_V2: &str = "\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw
26 22 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
27 26 0:24 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:8 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    #[test]
    fn parses_hybrid() {
        let layout = CgroupLayout::from_mountinfo(HYBRID, |_| Ok("hugetlb\n".into()));
        assert_eq!(layout.v2_mount(), Some(Path::new("/sys/fs/cgroup/unified")));
        assert_eq!(layout.v2_controllers(), ["hugetlb"]);
        assert!(!layout.v2_has("memory"));
        assert_eq!(
            layout.v1_mount("memory"),
            Some(Path::new("/sys/fs/cgroup/memory"))
        );
        assert_eq!(
            layout.v1_mount("pids"),
            Some(Path::new("/sys/fs/cgroup/pids"))
        );
        assert_eq!(
            layout.v1_mount("freezer"),
            Some(Path::new("/sys/fs/cgroup/freezer"))
        );
        assert_eq!(layout.v1_mount("cpu"), None);
        assert_eq!(
            layout.describe(),
            "hybrid (v2 freeze/kill; v1 memory, pids)"
        );
    }

    #[test]
    fn parses_pure_v2() {
        let layout = CgroupLayout::from_mountinfo(PURE_V2, |root| {
            assert_eq!(root, Path::new("/sys/fs/cgroup"));
            Ok("cpuset cpu io memory hugetlb pids rdma misc\n".into())
        });
        assert_eq!(layout.v2_mount(), Some(Path::new("/sys/fs/cgroup")));
        assert!(layout.v2_has("memory") && layout.v2_has("pids"));
        assert_eq!(layout.v1_mount("memory"), None);
        assert_eq!(layout.describe(), "v2");
    }

    #[test]
    fn describes_partial_layouts() {
        let layout = CgroupLayout::from_mountinfo(PURE_V2, |_| Ok("memory\n".into()));
        assert_eq!(layout.describe(), "v2 (no pids)");
        let layout = CgroupLayout::from_mountinfo(HYBRID, |_| Ok("memory\n".into()));
        assert_eq!(
            layout.describe(),
            "hybrid (v2 freeze/kill, memory; v1 pids)"
        );
        let layout = CgroupLayout::from_mountinfo(PURE_V2, |_| Err(io::ErrorKind::NotFound.into()));
        assert_eq!(layout.describe(), "v2 (no memory, pids)");
        let v1_only: String = HYBRID
            .lines()
            .filter(|l| !l.contains("cgroup2"))
            .map(|l| format!("{l}\n"))
            .collect();
        let layout = CgroupLayout::from_mountinfo(&v1_only, |_| unreachable!());
        assert_eq!(layout.describe(), "v1 (memory, pids, freezer)");
        assert_eq!(
            CgroupLayout::from_mountinfo("", |_| unreachable!()).describe(),
            "none"
        );
    }

    #[test]
    fn co_mounted_and_escaped_v1() {
        let text = "40 31 0:37 / /sys/fs/cgroup/mem\\040ory rw - cgroup cgroup rw,memory,pids,clone_children\n";
        let layout = CgroupLayout::from_mountinfo(text, |_| unreachable!());
        assert_eq!(
            layout.v1_mount("memory"),
            Some(Path::new("/sys/fs/cgroup/mem ory"))
        );
        assert_eq!(
            layout.v1_mount("pids"),
            Some(Path::new("/sys/fs/cgroup/mem ory"))
        );
        assert_eq!(unescape("a\\134b\\011"), Path::new("a\\b\t"));
        assert_eq!(unescape("trailing\\04"), Path::new("trailing\\04"));
    }

    #[test]
    fn detects_this_node() {
        let layout = CgroupLayout::detect().unwrap();
        println!("cgroup layout: {}", layout.describe());
        assert!(std::ptr::eq(layout, CgroupLayout::detect().unwrap()));
        assert!(layout.v2_mount().is_some() || layout.v1_mount("freezer").is_some());
    }
}
