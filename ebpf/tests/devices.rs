//! The device allow-list against the real kernel (root): scratch cgroups in the v2 hierarchy
//! (`/sys/fs/cgroup/unified` on this hybrid host, where v2 device programs apply as well),
//! probed by shell processes moved into them before they open anything.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use belayer_ebpf::devices::{attached_programs, PROGRAM_NAME};
use belayer_ebpf::{AttachMode, CharDevice, DeviceProgram, DeviceProgramError};

const NULL: CharDevice = CharDevice { major: 1, minor: 3 };
const URANDOM: CharDevice = CharDevice { major: 1, minor: 9 };

/// The cgroup v2 mount: `/sys/fs/cgroup/unified` on hybrid hosts, else `/sys/fs/cgroup`.
fn v2_root() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    info.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("cgroup2 ")
                .then(|| PathBuf::from(pre.split_whitespace().nth(4).unwrap_or("")))
        })
        .expect("cgroup v2 mounted")
}

/// A scratch v2 cgroup (with an optional child), removed on drop.
struct Scratch {
    dir: PathBuf,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = v2_root().join(format!(
            "belayer-ebpf-devtest-{name}-{}",
            std::process::id()
        ));
        remove(&dir);
        std::fs::create_dir(&dir).expect("mkdir scratch cgroup");
        Scratch { dir }
    }

    fn child(&self, name: &str) -> PathBuf {
        let dir = self.dir.join(name);
        std::fs::create_dir(&dir).expect("mkdir child cgroup");
        dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove(&self.dir);
    }
}

/// rmdir of a cgroup and its children (the probes are gone by then).
fn remove(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Runs `sh -c script` as a process of `cgroup` (moved there before the script starts; `None`:
/// left where the test runs). Returns (success, stderr).
fn probe(cgroup: Option<&Path>, script: &str) -> (bool, String) {
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("read _; {script}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sh");
    if let Some(dir) = cgroup {
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).expect("join cgroup");
    }
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"\n").expect("release probe");
    drop(stdin);
    let out = child.wait_with_output().expect("wait probe");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts that `script` fails with EPERM inside `cgroup` (and works outside it, so the
/// refusal is the program's).
fn denied(cgroup: &Path, script: &str) {
    let (ok, err) = probe(cgroup.into(), script);
    println!("in the cgroup: {script}: {}", err.trim());
    assert!(!ok, "{script} allowed");
    assert!(err.contains("Operation not permitted"), "{script}: {err}");
    let (ok, err) = probe(None, script);
    assert!(ok, "outside the cgroup {script} failed too: {err}");
}

fn allowed(cgroup: &Path, script: &str) {
    let (ok, err) = probe(cgroup.into(), script);
    assert!(ok, "{script} refused: {err}");
}

/// A block device node of this host that the test itself may open (outside the cgroup): the
/// disk behind `/` when it can, else another one (this VM refuses opens of its root disk to
/// every process, whatever the cgroup).
fn block_device() -> PathBuf {
    let root = std::fs::metadata("/").expect("stat /").dev();
    let mut found: Vec<(bool, PathBuf)> = std::fs::read_dir("/dev")
        .expect("/dev")
        .flatten()
        .filter_map(|e| {
            let meta = std::fs::symlink_metadata(e.path()).ok()?;
            meta.file_type()
                .is_block_device()
                .then(|| (meta.rdev() != root, e.path()))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .map(|(_, path)| path)
        .find(|path| std::fs::File::open(path).is_ok())
        .expect("a block device in /dev that root may open")
}

fn mknod_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("belayer-devtest-{name}-"))
        .tempdir_in("/tmp")
        .expect("tempdir")
}

#[test]
fn allows_exactly_the_listed_char_devices() {
    let s = Scratch::new("list");
    let prog = DeviceProgram::load(&[NULL, URANDOM]).expect("load");
    assert_eq!(prog.allowed(), [NULL, URANDOM]);
    prog.attach(&s.dir, AttachMode::Multi).expect("attach");
    let attached = attached_programs(&s.dir).unwrap();
    println!("attached: {attached:?}");
    assert_eq!(attached.len(), 1);
    assert!(attached[0].is_allow_list());

    allowed(&s.dir, "exec 3<>/dev/null; echo x >&3");
    allowed(&s.dir, "head -c 16 /dev/urandom | wc -c | grep -qx 16");
    // /dev/zero (1:5) is not in this list: the list is what the loader passed.
    denied(&s.dir, "exec 3</dev/zero");
    // A char device never listed, and the disk.
    denied(&s.dir, "exec 3</dev/loop-control");
    let disk = block_device();
    println!("block device: {}", disk.display());
    denied(&s.dir, &format!("exec 3<{}", disk.display()));
    // mknod, even of an allowed device, and of a block device.
    let tmp = mknod_dir("list");
    denied(
        &s.dir,
        &format!("mknod {}/null c 1 3", tmp.path().display()),
    );
    let _ = std::fs::remove_file(tmp.path().join("null"));
    denied(&s.dir, &format!("mknod {}/sda b 8 0", tmp.path().display()));
    // Descendant cgroups are held to it as well.
    let child = s.child("inner");
    denied(&child, "exec 3</dev/loop-control");
    allowed(&child, "echo x > /dev/null");
}

#[test]
fn any_minor_allows_every_minor_of_its_major_only() {
    // The pty entries of sandboxes: 5:2 (ptmx) and every minor of 136 (the slaves).
    let s = Scratch::new("anyminor");
    let ptmx = CharDevice { major: 5, minor: 2 };
    let slaves = CharDevice {
        major: 136,
        minor: CharDevice::ANY_MINOR,
    };
    let prog = DeviceProgram::load(&[NULL, ptmx, slaves]).expect("load");
    prog.attach(&s.dir, AttachMode::Multi).expect("attach");
    allowed(&s.dir, "exec 3<>/dev/ptmx");
    // Nodes of pty slaves and of their neighbours, made outside the cgroup: 136:7 passes the
    // program (the open then fails for another reason: the node is not on a devpts), 137:0,
    // 135:0, 5:1 (console) and 5:0 are refused by it.
    let tmp = mknod_dir("anyminor");
    let node = |name: &str, major: u32, minor: u32| {
        let p = tmp.path().join(name);
        let made = Command::new("mknod")
            .arg(&p)
            .args(["c", &major.to_string(), &minor.to_string()])
            .status()
            .expect("mknod");
        assert!(made.success(), "mknod {major}:{minor}");
        p.display().to_string()
    };
    let slave = node("pts7", 136, 7);
    let (ok, err) = probe(Some(&s.dir), &format!("exec 3<>{slave}"));
    assert!(
        !ok && !err.contains("Operation not permitted"),
        "136:7: {err}"
    );
    for (name, major, minor) in [
        ("next", 137, 0),
        ("prev", 135, 0),
        ("console", 5, 1),
        ("tty", 5, 0),
    ] {
        let p = node(name, major, minor);
        let (ok, err) = probe(Some(&s.dir), &format!("exec 3<>{p}"));
        println!("{major}:{minor}: {}", err.trim());
        assert!(
            !ok && err.contains("Operation not permitted"),
            "{major}:{minor}: {err}"
        );
    }
    denied(&s.dir, "exec 3</dev/zero");
}

#[test]
fn stays_attached_when_the_loader_is_gone_and_detaches_explicitly() {
    let s = Scratch::new("stays");
    let prog = DeviceProgram::load(&[NULL]).expect("load");
    prog.attach(&s.dir, AttachMode::Multi).expect("attach");
    // A second attach of the same program to the same cgroup is refused, not doubled.
    let again = prog.attach(&s.dir, AttachMode::Multi).unwrap_err();
    assert!(
        matches!(&again, DeviceProgramError::Attach { source, .. }
            if source.raw_os_error() == Some(libc::EINVAL)),
        "{again:?}"
    );
    drop(prog);
    // Every descriptor of the loader is closed: the cgroup still holds the program.
    let attached = attached_programs(&s.dir).unwrap();
    assert_eq!(attached.len(), 1, "{attached:?}");
    assert_eq!(attached[0].name.as_deref(), Some(PROGRAM_NAME));
    denied(&s.dir, "exec 3</dev/loop-control");
    allowed(&s.dir, "echo x > /dev/null");

    // A program of this process detaches again.
    let other = Scratch::new("detach");
    let prog = DeviceProgram::load(&[NULL]).expect("load");
    prog.attach(&other.dir, AttachMode::Multi).expect("attach");
    denied(&other.dir, "exec 3</dev/loop-control");
    prog.detach(&other.dir).expect("detach");
    assert!(attached_programs(&other.dir).unwrap().is_empty());
    allowed(&other.dir, "exec 3</dev/loop-control");
    assert!(matches!(
        prog.detach(&other.dir),
        Err(DeviceProgramError::Detach { .. })
    ));
}

#[test]
fn an_exclusive_ancestor_refuses_the_attachment() {
    let s = Scratch::new("exclusive");
    let deny_all = DeviceProgram::load(&[]).expect("load deny-all");
    deny_all
        .attach(&s.dir, AttachMode::Exclusive)
        .expect("attach exclusive");
    let child = s.child("sandbox");
    let prog = DeviceProgram::load(&[NULL]).expect("load");
    let err = prog.attach(&child, AttachMode::Multi).unwrap_err();
    println!("{err}: {:?}", std::error::Error::source(&err));
    assert!(
        matches!(&err, DeviceProgramError::Attach { path, source }
            if path == &child && source.raw_os_error() == Some(libc::EPERM)),
        "{err:?}"
    );
    // The ancestor's deny-all applies below it.
    denied(&child, "exec 3</dev/null");
}

#[test]
fn bad_input_is_refused() {
    let many: Vec<CharDevice> = (0..=DeviceProgram::MAX_DEVICES as u32)
        .map(|minor| CharDevice { major: 1, minor })
        .collect();
    assert!(matches!(
        DeviceProgram::load(&many),
        Err(DeviceProgramError::TooManyDevices { count: 17, max: 16 })
    ));
    let prog = DeviceProgram::load(&[NULL]).expect("load");
    // Not a cgroup v2 directory.
    let tmp = mknod_dir("notcg");
    let err = prog.attach(tmp.path(), AttachMode::Multi).unwrap_err();
    assert!(matches!(err, DeviceProgramError::Attach { .. }), "{err:?}");
    let err = prog
        .attach(Path::new("/nonexistent-cgroup"), AttachMode::Multi)
        .unwrap_err();
    assert!(
        matches!(err, DeviceProgramError::OpenCgroup { .. }),
        "{err:?}"
    );
}
