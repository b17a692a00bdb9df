//! The cgroup v2 device allow-list: a `BPF_PROG_TYPE_CGROUP_DEVICE` program
//! (`bpf/devices.bpf.c`) that lets the tasks of a cgroup read and write a fixed set of
//! character devices and nothing else (no `mknod`, no block device).
//!
//! The set is the caller's (the agent keeps its table in one place and hands it over here): it
//! is written into the object's `.rodata` before the program is loaded, and aya freezes that map
//! after filling it, so the list of a loaded program can change neither from user space nor from
//! the program. One loaded [`DeviceProgram`] is attached to any number of cgroups.
//!
//! Attachment is the legacy `BPF_PROG_ATTACH` (aya 0.14 makes a bpf_link on Linux ≥ 5.7,
//! which detaches when its last descriptor closes): the cgroup then holds the program, which
//! stays attached when the loading process exits or restarts (sandboxes outlive the daemon) and
//! is released with the cgroup's directory. It is attached with `BPF_F_ALLOW_MULTI`, so
//! programs of ancestor cgroups (systemd's device policies) still run and must allow too, and a
//! program attached below can only deny more, never replace this one.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use aya::programs::CgroupDevice;
use aya::{Ebpf, EbpfLoader};

use crate::sys;

/// The object built from `bpf/devices.bpf.c`.
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/devices.bpf.o"));

/// Name of the program in the kernel (`bpftool prog`, [`attached_programs`]): the C
/// function's name, which fits the kernel's 15 characters.
pub const PROGRAM_NAME: &str = "belayer_devices";

/// A character device the tasks of a cgroup may open for reading and writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CharDevice {
    /// Major number.
    pub major: u32,
    /// Minor number, or [`CharDevice::ANY_MINOR`] for every minor of `major`.
    pub minor: u32,
}

impl CharDevice {
    /// A minor no device has (minors have 20 bits): an entry with it allows every minor of its
    /// major (`c 136:*` in the v1 controller's syntax). `ANY_MINOR` of bpf/devices.bpf.c.
    pub const ANY_MINOR: u32 = u32::MAX;
}

/// `struct char_device` of bpf/devices.bpf.c.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawCharDevice {
    major: u32,
    minor: u32,
}

// SAFETY: RawCharDevice is repr(C), made of two u32 without padding: every byte pattern is a
// valid value and it holds no pointers.
unsafe impl aya::Pod for RawCharDevice {}

/// How [`DeviceProgram::attach`] attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// `BPF_F_ALLOW_MULTI`: the programs of ancestors and descendants run as well, every one
    /// must allow. What sandboxes get.
    Multi,
    /// No flag: the only program of the subtree; attaching any device program to a descendant
    /// then fails with `EPERM` (a node-wide policy that no cgroup below may extend).
    Exclusive,
}

/// A program attached to a cgroup (see [`attached_programs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachedProgram {
    /// Kernel id of the program.
    pub id: u32,
    /// Its name (`None` when the program is gone or unreadable).
    pub name: Option<String>,
}

impl AttachedProgram {
    /// Whether this is a device allow-list loaded by a [`DeviceProgram`].
    pub fn is_allow_list(&self) -> bool {
        self.name.as_deref() == Some(PROGRAM_NAME)
    }
}

/// Errors of the device allow-list. Paths name the cgroup directory.
#[derive(Debug, thiserror::Error)]
pub enum DeviceProgramError {
    /// More devices than the program has room for.
    #[error("{count} allowed devices, the BPF device program holds at most {max}")]
    TooManyDevices {
        /// Devices given.
        count: usize,
        /// [`DeviceProgram::MAX_DEVICES`].
        max: usize,
    },
    /// Parsing the object or creating its maps failed.
    #[error("loading the BPF device object")]
    Load(#[source] Box<aya::EbpfError>),
    /// The object lacks the program, or it has another type.
    #[error("the BPF device object has no cgroup device program {PROGRAM_NAME}")]
    Missing,
    /// The kernel refused the program (no BPF, no `CAP_BPF`/`CAP_SYS_ADMIN`, verifier).
    #[error("loading the BPF device program into the kernel")]
    Program(#[source] Box<aya::programs::ProgramError>),
    /// The cgroup directory could not be opened.
    #[error("opening cgroup {}", path.display())]
    OpenCgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `BPF_PROG_ATTACH` failed (`EPERM`: an ancestor holds an exclusive device program;
    /// `EBADF`: not a cgroup v2 directory; `EINVAL`: this program is attached there already).
    #[error("BPF_PROG_ATTACH of the device program to {}", path.display())]
    Attach {
        /// The cgroup directory.
        path: PathBuf,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// `BPF_PROG_DETACH` failed (`ENOENT`: not attached there).
    #[error("BPF_PROG_DETACH of the device program from {}", path.display())]
    Detach {
        /// The cgroup directory.
        path: PathBuf,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
    /// `BPF_PROG_QUERY` failed.
    #[error("BPF_PROG_QUERY of the device programs of {}", path.display())]
    Query {
        /// The cgroup directory.
        path: PathBuf,
        /// The errno.
        #[source]
        source: std::io::Error,
    },
}

/// The device allow-list program, loaded into the kernel (not attached anywhere yet). Dropping
/// it closes the loader's descriptors; attachments made with [`Self::attach`] stay.
#[derive(Debug)]
pub struct DeviceProgram {
    ebpf: Ebpf,
    allowed: Vec<CharDevice>,
}

impl DeviceProgram {
    /// Room for allowed devices in the program (`MAX_DEVICES` of bpf/devices.bpf.c).
    pub const MAX_DEVICES: usize = 16;

    /// Loads the program with `allowed` as its list (read/write of these character devices;
    /// an empty list denies every device).
    ///
    /// Errors: [`DeviceProgramError::TooManyDevices`] past [`Self::MAX_DEVICES`],
    /// [`DeviceProgramError::Load`], [`DeviceProgramError::Missing`],
    /// [`DeviceProgramError::Program`] (kernel without cgroup BPF, Linux < 4.15, or no
    /// privilege). Needs `CAP_BPF` + `CAP_NET_ADMIN`/`CAP_SYS_ADMIN` (root).
    pub fn load(allowed: &[CharDevice]) -> Result<DeviceProgram, DeviceProgramError> {
        if allowed.len() > Self::MAX_DEVICES {
            return Err(DeviceProgramError::TooManyDevices {
                count: allowed.len(),
                max: Self::MAX_DEVICES,
            });
        }
        let mut table = [RawCharDevice::default(); Self::MAX_DEVICES];
        for (slot, dev) in table.iter_mut().zip(allowed) {
            *slot = RawCharDevice {
                major: dev.major,
                minor: dev.minor,
            };
        }
        // Bounded by MAX_DEVICES above.
        let count = allowed.len() as u32;
        // No CO-RE relocation in this program: skip parsing the kernel's BTF (≈ 100 ms).
        let mut ebpf = EbpfLoader::new()
            .btf(None)
            .override_global("n_devices", &count, true)
            .override_global("devices", &table, true)
            .load(OBJECT)
            .map_err(|e| DeviceProgramError::Load(Box::new(e)))?;
        let prog: &mut CgroupDevice = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or(DeviceProgramError::Missing)?
            .try_into()
            .map_err(|_| DeviceProgramError::Missing)?;
        prog.load()
            .map_err(|e| DeviceProgramError::Program(Box::new(e)))?;
        tracing::debug!(devices = allowed.len(), "BPF device allow-list loaded");
        Ok(DeviceProgram {
            ebpf,
            allowed: allowed.to_vec(),
        })
    }

    /// The devices this program allows.
    pub fn allowed(&self) -> &[CharDevice] {
        &self.allowed
    }

    fn prog(&self) -> Result<&CgroupDevice, DeviceProgramError> {
        self.ebpf
            .program(PROGRAM_NAME)
            .ok_or(DeviceProgramError::Missing)?
            .try_into()
            .map_err(|_| DeviceProgramError::Missing)
    }

    /// Attaches the program to the cgroup v2 directory `cgroup` with a legacy
    /// `BPF_PROG_ATTACH`: from now on every task of the cgroup and of its descendants is held
    /// to the list, also after this process exits; the attachment ends with the cgroup.
    ///
    /// Errors: [`DeviceProgramError::OpenCgroup`], [`DeviceProgramError::Attach`].
    pub fn attach(&self, cgroup: &Path, mode: AttachMode) -> Result<(), DeviceProgramError> {
        let dir = open_cgroup(cgroup)?;
        let fd = self
            .prog()?
            .fd()
            .map_err(|e| DeviceProgramError::Program(Box::new(e)))?;
        let flags = match mode {
            AttachMode::Multi => sys::BPF_F_ALLOW_MULTI,
            AttachMode::Exclusive => 0,
        };
        sys::prog_attach(fd.as_fd(), dir.as_fd(), sys::BPF_CGROUP_DEVICE, flags).map_err(
            |source| DeviceProgramError::Attach {
                path: cgroup.to_path_buf(),
                source,
            },
        )?;
        tracing::debug!(cgroup = %cgroup.display(), ?mode, "BPF device allow-list attached");
        Ok(())
    }

    /// Detaches this program from `cgroup` (where [`Self::attach`] put it).
    ///
    /// Errors: [`DeviceProgramError::OpenCgroup`], [`DeviceProgramError::Detach`].
    pub fn detach(&self, cgroup: &Path) -> Result<(), DeviceProgramError> {
        let dir = open_cgroup(cgroup)?;
        let fd = self
            .prog()?
            .fd()
            .map_err(|e| DeviceProgramError::Program(Box::new(e)))?;
        sys::prog_detach(fd.as_fd(), dir.as_fd(), sys::BPF_CGROUP_DEVICE).map_err(|source| {
            DeviceProgramError::Detach {
                path: cgroup.to_path_buf(),
                source,
            }
        })
    }
}

/// The device programs attached to the cgroup v2 directory `cgroup` itself (not those of its
/// ancestors), whoever attached them, in attachment order.
///
/// Errors: [`DeviceProgramError::OpenCgroup`], [`DeviceProgramError::Query`].
pub fn attached_programs(cgroup: &Path) -> Result<Vec<AttachedProgram>, DeviceProgramError> {
    let dir = open_cgroup(cgroup)?;
    let ids = sys::prog_query(dir.as_fd(), sys::BPF_CGROUP_DEVICE).map_err(|source| {
        DeviceProgramError::Query {
            path: cgroup.to_path_buf(),
            source,
        }
    })?;
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut found: Vec<AttachedProgram> = ids
        .iter()
        .map(|&id| AttachedProgram { id, name: None })
        .collect();
    for info in aya::programs::loaded_programs().flatten() {
        if let Some(p) = found.iter_mut().find(|p| p.id == info.id()) {
            p.name = info.name_as_str().map(str::to_owned);
        }
    }
    Ok(found)
}

fn open_cgroup(cgroup: &Path) -> Result<OwnedFd, DeviceProgramError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(cgroup)
        .map(OwnedFd::from)
        .map_err(|source| DeviceProgramError::OpenCgroup {
            path: cgroup.to_path_buf(),
            source,
        })
}
