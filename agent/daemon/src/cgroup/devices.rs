//! The device allow-list of sandbox cgroups, [`ALLOWED_DEVICES`] and [`PTY_DEVICES`], enforced
//! by one of two kernel mechanisms:
//! - **v1**: the `devices` controller, where the node mounts its hierarchy (`devices.deny a`,
//!   then one `devices.allow` line per device);
//! - **BPF**: on cgroup v2, where the device controller is a `BPF_PROG_TYPE_CGROUP_DEVICE`
//!   program attached to the cgroup (pure v2 nodes, typical for GPU machines). The program is
//!   `belayer_ebpf::DeviceProgram`, loaded once per process with the table below as its list
//!   (written into the object's frozen `.rodata` before load, so the table here is the only
//!   copy), and attached with a legacy `BPF_PROG_ATTACH`: the cgroup holds it, so it outlives
//!   `belayerd` (sandboxes outlive the daemon) and goes when the cgroup is removed.
//!
//! [`DeviceFilter`] chooses: `Auto` takes v1 where mounted, else BPF; `V1` and `Bpf` force one
//! (tests force `Bpf` on hybrid hosts, whose v2 hierarchy runs device programs as well; the
//! sandbox's v1 `devices` cgroup is then left unrestricted, so BPF alone enforces the list).
//! A filter that cannot be applied fails the cgroup's creation: no sandbox runs without the
//! allow-list it was meant to have.

use std::path::Path;
use std::sync::OnceLock;

use belayer_ebpf::devices::attached_programs;
use belayer_ebpf::{AttachMode, CharDevice, DeviceProgram};

use super::layout::CgroupLayout;
use super::sys::write_file;
use super::CgroupError;

/// Character devices a sandbox may use (major, minor, name): the nodes its private `/dev`
/// binds from the host. With [`PTY_DEVICES`], everything else, block devices included, is
/// denied, also for `mknod`. Both mechanisms read these two tables and nothing else.
pub const ALLOWED_DEVICES: &[(u32, u32, &str)] = &[
    (1, 3, "null"),
    (1, 5, "zero"),
    (1, 7, "full"),
    (1, 8, "random"),
    (1, 9, "urandom"),
    (5, 0, "tty"),
];

/// The terminal devices of a sandbox's own `devpts` instance (major, minor or `None` for every
/// minor, what): its `/dev/pts/ptmx` (5:2, which `/dev/ptmx` links to) and its pty slaves,
/// all of major 136 (`/dev/pts/0` .. `/dev/pts/255`: the instance holds at most
/// [`crate::helper::mount::PTY_MAX`]). No node of these is bound from the host: the numbers
/// are the kernel's for every devpts instance, and the sandbox reaches only its own instance
/// (the host's `/dev/pts` is not in its mount tree and it cannot `mknod`).
pub const PTY_DEVICES: &[(u32, Option<u32>, &str)] =
    &[(5, Some(2), "ptmx"), (PTY_SLAVE_MAJOR, None, "pty slaves")];

/// Major number of the pty slaves `/dev/pts/0` .. `/dev/pts/255` (`UNIX98_PTY_SLAVE_MAJOR`).
pub const PTY_SLAVE_MAJOR: u32 = 136;

// The BPF program has room for a fixed number of devices.
const _: () = assert!(ALLOWED_DEVICES.len() + PTY_DEVICES.len() <= DeviceProgram::MAX_DEVICES);

/// Every rule of the allow-list: (major, minor or `None` for any), [`ALLOWED_DEVICES`] first.
pub fn device_rules() -> impl Iterator<Item = (u32, Option<u32>)> {
    ALLOWED_DEVICES
        .iter()
        .map(|&(major, minor, _)| (major, Some(minor)))
        .chain(PTY_DEVICES.iter().map(|&(major, minor, _)| (major, minor)))
}

/// Which mechanism enforces [`ALLOWED_DEVICES`] (config `device_filter`: `"auto"`, `"v1"`,
/// `"bpf"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceFilter {
    /// The v1 `devices` controller where its hierarchy is mounted, else the BPF program on
    /// the v2 cgroup.
    #[default]
    Auto,
    /// The v1 `devices` controller; a node without its hierarchy cannot create sandboxes.
    V1,
    /// The BPF program on the sandbox's v2 cgroup (Linux ≥ 4.15, root); a v1 `devices`
    /// cgroup, where mounted, is left unrestricted.
    Bpf,
}

impl DeviceFilter {
    /// The mechanism this choice means on a node of `layout`: [`DeviceFilter::V1`] or
    /// [`DeviceFilter::Bpf`], never `Auto`.
    ///
    /// Errors: [`CgroupError::DeviceFilterUnavailable`] when the hierarchy it needs is not
    /// mounted (no v1 `devices` for `V1`, no cgroup2 for `Bpf`, neither for `Auto`).
    pub fn resolve(self, layout: &CgroupLayout) -> Result<DeviceFilter, CgroupError> {
        let v1 = layout.v1_other("devices").is_some();
        let v2 = layout.v2_mount().is_some();
        match self {
            DeviceFilter::V1 if v1 => Ok(DeviceFilter::V1),
            DeviceFilter::Bpf if v2 => Ok(DeviceFilter::Bpf),
            DeviceFilter::Auto if v1 => Ok(DeviceFilter::V1),
            DeviceFilter::Auto if v2 => Ok(DeviceFilter::Bpf),
            filter => Err(CgroupError::DeviceFilterUnavailable { filter }),
        }
    }
}

impl DeviceFilter {
    /// Resolves this choice on this node ([`Self::resolve`]) and, for [`DeviceFilter::Bpf`],
    /// loads the program now (kept for every later sandbox of this process), so that a node
    /// that cannot enforce the allow-list says so at start rather than at the first sandbox.
    ///
    /// Errors: as [`Self::resolve`], [`CgroupError::DeviceProgram`] (naming the v2 mount).
    pub fn prepare(self) -> Result<DeviceFilter, CgroupError> {
        let layout = CgroupLayout::detect()?;
        let filter = self.resolve(layout)?;
        if let (DeviceFilter::Bpf, Some(root)) = (filter, layout.v2_mount()) {
            program(root)?;
        }
        Ok(filter)
    }
}

/// Writes the v1 device allow-list into the `devices` cgroup `dir`: deny all, then allow
/// [`device_rules`] for read/write (no `mknod`).
pub(super) fn apply_devices_v1(dir: &Path) -> Result<(), CgroupError> {
    write_file(&dir.join("devices.deny"), "a")?;
    for (major, minor) in device_rules() {
        let minor = minor.map_or("*".to_string(), |m| m.to_string());
        write_file(&dir.join("devices.allow"), &format!("c {major}:{minor} rw"))?;
    }
    Ok(())
}

/// The program of this process, loaded on first use with [`device_rules`]. A failed load
/// is not cached (the next sandbox tries again).
fn program(cgroup: &Path) -> Result<&'static DeviceProgram, CgroupError> {
    static PROGRAM: OnceLock<DeviceProgram> = OnceLock::new();
    if let Some(program) = PROGRAM.get() {
        return Ok(program);
    }
    let devices: Vec<CharDevice> = device_rules()
        .map(|(major, minor)| CharDevice {
            major,
            minor: minor.unwrap_or(CharDevice::ANY_MINOR),
        })
        .collect();
    let loaded = DeviceProgram::load(&devices).map_err(|source| CgroupError::DeviceProgram {
        path: cgroup.to_path_buf(),
        source,
    })?;
    // Two first sandboxes at once may both load: one program is kept, the other dropped
    // before it was attached anywhere.
    Ok(PROGRAM.get_or_init(|| loaded))
}

/// Attaches the BPF allow-list to the v2 cgroup `dir` (before any task joins it).
pub(super) fn apply_devices_bpf(dir: &Path) -> Result<(), CgroupError> {
    program(dir)?
        .attach(dir, AttachMode::Multi)
        .map_err(|source| CgroupError::DeviceProgram {
            path: dir.to_path_buf(),
            source,
        })
}

/// Whether the v2 cgroup `dir` holds a BPF device allow-list (one loaded by any `belayerd`:
/// the program of a previous daemon stays attached across restarts).
pub(super) fn has_devices_bpf(dir: &Path) -> Result<bool, CgroupError> {
    attached_programs(dir)
        .map(|programs| programs.iter().any(|p| p.is_allow_list()))
        .map_err(|source| CgroupError::DeviceProgram {
            path: dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileTypeExt;
    use std::path::PathBuf;

    use super::super::limits::Limits;
    use super::super::sandbox::SandboxCgroup;
    use super::*;
    use crate::cgroup::test_support::{unique_rel, TestCgroup};

    const HYBRID: &str = "\
32 31 0:29 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const PURE_V2: &str =
        "27 26 0:24 / /sys/fs/cgroup rw,relatime shared:8 - cgroup2 cgroup2 rw,nsdelegate\n";
    const V1_ONLY: &str =
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";

    #[test]
    fn choices_resolve_per_layout() {
        let hybrid = CgroupLayout::from_mountinfo(HYBRID, |_| Ok(String::new()));
        let v2 = CgroupLayout::from_mountinfo(PURE_V2, |_| Ok(String::new()));
        let v1 = CgroupLayout::from_mountinfo(V1_ONLY, |_| Ok(String::new()));
        assert_eq!(
            DeviceFilter::Auto.resolve(&hybrid).unwrap(),
            DeviceFilter::V1
        );
        assert_eq!(DeviceFilter::Auto.resolve(&v2).unwrap(), DeviceFilter::Bpf);
        assert_eq!(
            DeviceFilter::Bpf.resolve(&hybrid).unwrap(),
            DeviceFilter::Bpf
        );
        assert_eq!(DeviceFilter::V1.resolve(&hybrid).unwrap(), DeviceFilter::V1);
        for (filter, layout) in [
            (DeviceFilter::V1, &v2),
            (DeviceFilter::Bpf, &v1),
            (DeviceFilter::Auto, &v1),
        ] {
            assert!(matches!(
                filter.resolve(layout),
                Err(CgroupError::DeviceFilterUnavailable { filter: f }) if f == filter
            ));
        }
    }

    #[test]
    fn config_spelling() {
        #[derive(serde::Deserialize)]
        struct T {
            f: DeviceFilter,
        }
        for (text, want) in [
            ("auto", DeviceFilter::Auto),
            ("v1", DeviceFilter::V1),
            ("bpf", DeviceFilter::Bpf),
        ] {
            let t: T = toml::from_str(&format!("f = {text:?}")).unwrap();
            assert_eq!(t.f, want);
        }
        assert!(toml::from_str::<T>("f = \"none\"").is_err());
    }

    fn with_devices(filter: DeviceFilter) -> Limits {
        Limits {
            devices: Some(filter),
            ..Limits::default()
        }
    }

    /// A block device this test process may open (outside any sandbox cgroup).
    fn block_device() -> PathBuf {
        std::fs::read_dir("/dev")
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_block_device()))
            .find(|p| std::fs::File::open(p).is_ok())
            .expect("a block device root may open")
    }

    /// A script that exits 0 when the allowed devices work and every denied access fails
    /// with EPERM, else with the number of the failed step.
    fn probe_script(tmp: &Path) -> String {
        let eperm = "2>&1 | grep -q 'Operation not permitted'";
        format!(
            "echo x > /dev/null || exit 11; \
             head -c 4 /dev/urandom | wc -c | grep -qx 4 || exit 12; \
             head -c 4 /dev/zero | wc -c | grep -qx 4 || exit 13; \
             cat /dev/loop-control {eperm} || exit 21; \
             head -c 1 {block} {eperm} || exit 22; \
             mknod {tmp}/null c 1 3 {eperm} || exit 23; \
             test ! -e {tmp}/null || exit 24",
            block = block_device().display(),
            tmp = tmp.display()
        )
    }

    /// The v1 `devices` dir of `cg`, where that hierarchy is mounted.
    fn v1_devices_list(cg: &SandboxCgroup) -> Option<String> {
        let layout = CgroupLayout::detect().unwrap();
        let h = layout.v1_other("devices")?;
        let dir = h.mount.join(cg.rel_path());
        Some(std::fs::read_to_string(dir.join("devices.list")).unwrap())
    }

    #[test]
    fn bpf_filter_is_attached_and_enforced() {
        let t = TestCgroup::create("devbpf", &with_devices(DeviceFilter::Bpf));
        let v2 = t.cg().v2_dir().expect("cgroup v2 mounted").to_path_buf();
        assert!(has_devices_bpf(&v2).unwrap());
        // The v1 devices cgroup (hybrid host) is left open: what the probe meets is BPF.
        if let Some(list) = v1_devices_list(t.cg()) {
            assert_eq!(list.trim(), "a *:* rwm");
        }
        let tmp = tempfile::tempdir_in("/tmp").unwrap();
        let pid = t.spawn_in(&probe_script(tmp.path()));
        let status = t.wait_child(pid);
        println!("probe in {}: {status:?}", v2.display());
        assert_eq!(status.code(), Some(0), "probe step failed");
        // The same probe outside any sandbox cgroup gets every device (so the steps above
        // were refused by the program).
        let outside = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!(
                "cat /dev/loop-control 2>&1 | grep -q 'Invalid argument' && mknod {}/null c 1 3",
                tmp.path().display()
            ))
            .status()
            .unwrap();
        assert!(outside.success());
        assert!(std::fs::metadata(tmp.path().join("null"))
            .unwrap()
            .file_type()
            .is_char_device());
    }

    #[test]
    fn auto_takes_v1_where_mounted() {
        let layout = CgroupLayout::detect().unwrap();
        let t = TestCgroup::create("devauto", &with_devices(DeviceFilter::Auto));
        let v2 = t.cg().v2_dir().map(Path::to_path_buf);
        match v1_devices_list(t.cg()) {
            Some(list) => {
                println!("v1 devices.list:\n{list}");
                assert!(!list.contains("a *:* rwm"));
                assert!(list.lines().any(|l| l == "c 1:3 rw"));
                assert!(list.lines().any(|l| l == "c 5:2 rw"));
                assert!(list.lines().any(|l| l == "c 136:* rw"));
                assert_eq!(list.lines().count(), device_rules().count());
                if let Some(v2) = v2 {
                    assert!(!has_devices_bpf(&v2).unwrap());
                }
            }
            None => {
                assert!(layout.v1_other("devices").is_none());
                assert!(has_devices_bpf(&v2.unwrap()).unwrap());
            }
        }
    }

    #[test]
    fn adoption_attaches_a_missing_program_again() {
        let t = TestCgroup::create("devadopt", &with_devices(DeviceFilter::Bpf));
        let v2 = t.cg().v2_dir().unwrap().to_path_buf();
        let adopted = SandboxCgroup::open(t.cg().rel_path()).unwrap();
        assert!(!adopted.ensure_device_filter(DeviceFilter::Bpf).unwrap());
        program(&v2).unwrap().detach(&v2).unwrap();
        assert!(!has_devices_bpf(&v2).unwrap());
        assert!(adopted.ensure_device_filter(DeviceFilter::Bpf).unwrap());
        assert!(has_devices_bpf(&v2).unwrap());
        let attached = attached_programs(&v2).unwrap();
        assert_eq!(attached.len(), 1, "{attached:?}");
    }

    #[test]
    fn a_filter_that_cannot_be_applied_fails_creation() {
        let layout = CgroupLayout::detect().unwrap();
        let root = layout.v2_mount().unwrap();
        // An ancestor with an exclusive program refuses every device program below it.
        let parent = unique_rel("devexcl");
        let _ = SandboxCgroup::open(&parent).and_then(SandboxCgroup::remove);
        std::fs::create_dir_all(root.join(&parent)).unwrap();
        let deny_all = DeviceProgram::load(&[]).unwrap();
        deny_all
            .attach(&root.join(&parent), AttachMode::Exclusive)
            .unwrap();
        let rel = format!("{parent}/sb");
        let err = SandboxCgroup::create(&rel, &with_devices(DeviceFilter::Bpf)).unwrap_err();
        println!("{err}: {:?}", std::error::Error::source(&err));
        let refused = matches!(&err, CgroupError::DeviceProgram {
                source: belayer_ebpf::DeviceProgramError::Attach { source, .. }, ..
            } if source.raw_os_error() == Some(libc::EPERM));
        // Nothing of the refused cgroup is left in any hierarchy.
        let leftovers: Vec<PathBuf> = std::iter::once(root.to_path_buf())
            .chain(layout.v1_others().iter().map(|h| h.mount.clone()))
            .chain(
                ["memory", "pids", "freezer"]
                    .into_iter()
                    .filter_map(|c| layout.v1_mount(c).map(Path::to_path_buf)),
            )
            .map(|m| m.join(&rel))
            .filter(|d| d.exists())
            .collect();
        SandboxCgroup::open(&parent).unwrap().remove().unwrap();
        assert!(refused, "{err:?}");
        assert!(leftovers.is_empty(), "{leftovers:?}");
        // A filter whose hierarchy is missing is refused before anything is made.
        if layout.v1_other("devices").is_none() {
            assert!(matches!(
                SandboxCgroup::create(&unique_rel("devv1"), &with_devices(DeviceFilter::V1)),
                Err(CgroupError::DeviceFilterUnavailable { .. })
            ));
        }
    }
}
