//! The BPF device allow-list of cgroup v2 nodes (`device_filter = "bpf"`, forced here: this
//! hybrid host would otherwise use the v1 `devices` controller, whose sandbox cgroup is then left
//! unrestricted, so what these tests meet is the BPF program alone).
//!
//! From inside, a sandbox reaches only the six devices its `/dev` binds from the host and the
//! ptys of its own devpts instance (and cannot `mknod` in its user namespace anyway), so the
//! denials are probed by a host process (root, every capability) moved into the sandbox's v2
//! cgroup: it is refused every device but the listed ones (`ptmx` 5:2 and the pty slaves
//! 136:* included, whose numbers are the same in every devpts instance: the host's are kept
//! out of reach by the mount tree, see `states_terminals.rs`), and `mknod` of any.

use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use belayer_ebpf::devices::attached_programs;
use belayer_ebpf::{AttachMode, DeviceProgram};
use belayer_ipc::{ErrorCode, Request, Response, SandboxSpec};
use belayer_tests::{busybox_rootfs, Daemon, DaemonOptions};

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

fn bpf_daemon(extra: &str) -> Daemon {
    Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: format!("device_filter = \"bpf\"\n{extra}"),
        ..DaemonOptions::default()
    })
}

/// The sandbox's v2 cgroup directory.
fn v2_dir(d: &Daemon, id: &str) -> PathBuf {
    let rel = d.inspect(id).cgroup;
    v2_root().join(rel.trim_start_matches('/'))
}

/// A block device this test may open outside any sandbox cgroup (this VM refuses opens of its
/// root disk to everyone, so a loop device usually).
fn block_device() -> PathBuf {
    std::fs::read_dir("/dev")
        .expect("/dev")
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_block_device()))
        .find(|p| std::fs::File::open(p).is_ok())
        .expect("a block device root may open")
}

/// Runs `sh -c script` on the host as a process of the cgroup `cgroup` (moved there before
/// the script starts); its exit code and stderr.
fn probe_in(cgroup: &Path, script: &str) -> (Option<i32>, String) {
    let mut child = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("read _; {script}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sh");
    std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string()).expect("join cgroup");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"\n").expect("release probe");
    drop(stdin);
    let out = child.wait_with_output().expect("wait probe");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts from a host process in `cgroup` that the listed devices work and everything else is
/// refused with EPERM: a char device not listed, a block device, `mknod` of a listed device.
fn assert_enforced(cgroup: &Path, step: &str) {
    let tmp = tempfile::tempdir_in("/tmp").expect("tempdir");
    let eperm = "2>&1 | grep -q 'Operation not permitted'";
    // Terminal devices next to the allowed ones, made outside the cgroup: the console (5:1),
    // a pty slave beyond the sandbox's 256 (137:0) and the pty master range (128:0).
    for (name, major, minor) in [("console", 5, 1), ("pts256", 137, 0), ("ptm", 128, 0)] {
        let made = Command::new("mknod")
            .arg(tmp.path().join(name))
            .args(["c", &major.to_string(), &minor.to_string()])
            .status()
            .expect("mknod");
        assert!(made.success(), "mknod {name}");
    }
    let script = format!(
        "echo x > /dev/null || exit 11; \
         head -c 4 /dev/urandom | wc -c | grep -qx 4 || exit 12; \
         (exec 3<>/dev/ptmx) || exit 13; \
         cat /dev/loop-control {eperm} || exit 21; \
         head -c 1 {block} {eperm} || exit 22; \
         mknod {tmp}/null c 1 3 {eperm} || exit 23; \
         test ! -e {tmp}/null || exit 24; \
         mknod {tmp}/pts0 c 136 0 {eperm} || exit 25; \
         cat {tmp}/console {eperm} || exit 26; \
         cat {tmp}/pts256 {eperm} || exit 27; \
         cat {tmp}/ptm {eperm} || exit 28",
        block = block_device().display(),
        tmp = tmp.path().display()
    );
    let (code, stderr) = probe_in(cgroup, &script);
    assert_eq!(code, Some(0), "{step}: probe step failed: {stderr}");
    let attached = attached_programs(cgroup).expect("query device programs");
    assert_eq!(attached.len(), 1, "{step}: {attached:?}");
    assert!(attached[0].is_allow_list(), "{step}: {attached:?}");
}

/// From inside the sandbox: the bound devices read and write, a pty opens (the master holds
/// `/dev/pts/0` while the shell keeps it open); `mknod` fails.
fn assert_devices_work_inside(d: &Daemon, id: &str) {
    assert_eq!(
        d.sh(
            id,
            "echo x > /dev/null && head -c 4 /dev/urandom | wc -c && head -c 4 /dev/zero | wc -c"
        ),
        "4\n4"
    );
    assert_eq!(
        d.sh(id, "exec 3<>/dev/ptmx && ls /dev/pts | tr '\\n' ' '"),
        "0 ptmx"
    );
    assert_ne!(d.exec(id, "mknod /tmp/null c 1 3").exit_code, 0);
    assert_ne!(d.exec(id, "mknod /tmp/sda b 8 0").exit_code, 0);
}

#[test]
fn bpf_allow_list_holds_across_daemon_restart_and_restore() {
    let mut d = bpf_daemon("");
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let cg = v2_dir(&d, &id);
    println!("sandbox cgroup {}", cg.display());
    // BPF alone: the sandbox's v1 devices cgroup (hybrid host) allows everything.
    let v1 = PathBuf::from("/sys/fs/cgroup/devices")
        .join(d.inspect(&id).cgroup.trim_start_matches('/'))
        .join("devices.list");
    if let Ok(list) = std::fs::read_to_string(&v1) {
        assert_eq!(list.trim(), "a *:* rwm");
    }
    assert_devices_work_inside(&d, &id);
    assert_enforced(&cg, "created");
    // A background process keeps using /dev/urandom across everything below.
    d.sh(
        &id,
        "(while :; do if head -c 1 /dev/urandom > /dev/null; then echo ok; else echo denied; fi \
         > /tmp/dev.new; mv /tmp/dev.new /tmp/dev; sleep 0.05; done) </dev/null >/dev/null 2>&1 &",
    );

    // The daemon dies: the cgroup holds the program, nothing is lost while it is gone.
    d.kill();
    assert_enforced(&cg, "daemon down");
    d.restart();
    assert_devices_work_inside(&d, &id);
    assert_enforced(&cg, "daemon restarted");
    assert!(
        !d.log_text().contains("device allow-list was missing"),
        "adoption had to attach the program again"
    );

    // Checkpoint, fail-stop, restore: the fresh cgroup gets the program too.
    let before = std::fs::metadata(&cg).unwrap().ino();
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    let restored = d.restore(&id);
    println!("restored: {restored:?}");
    let cg = v2_dir(&d, &id);
    let after = std::fs::metadata(&cg).unwrap().ino();
    assert_ne!(before, after, "the restore reused the old cgroup");
    assert_enforced(&cg, "restored");
    assert_devices_work_inside(&d, &id);
    // The restored background process still reads /dev/urandom.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(d.sh(&id, "cat /tmp/dev"), "ok");
    d.assert_alive("after restore");
}

#[test]
fn sandbox_is_refused_when_the_allow_list_cannot_be_attached() {
    // An exclusive device program on the sandboxes' parent cgroup makes every attachment below
    // it fail (EPERM): the daemon must refuse the sandbox, not run it without its list.
    let parent = format!("belayer-e2e-devexcl-{}", std::process::id());
    let parent_dir = v2_root().join(&parent);
    std::fs::create_dir_all(&parent_dir).expect("parent cgroup");
    let deny_all = DeviceProgram::load(&[]).expect("load deny-all");
    deny_all
        .attach(&parent_dir, AttachMode::Exclusive)
        .expect("attach deny-all");
    let d = bpf_daemon(&format!("cgroup_parent = {parent:?}\n"));
    d.image("busybox", &busybox_rootfs());
    let reply = d.call(Request::CreateSandbox(SandboxSpec {
        image: "busybox".into(),
        ..Default::default()
    }));
    let listed = match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => v.len(),
        r => panic!("list: {r:?}"),
    };
    let children: Vec<String> = std::fs::read_dir(&parent_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    d.assert_alive("after the refused create");
    drop(d);
    // The parent exists in every hierarchy the daemon made it in.
    for mount in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let _ = std::fs::remove_dir(mount.path().join(&parent));
    }
    let _ = std::fs::remove_dir(&parent_dir);
    match reply {
        Response::Error(e) => {
            println!("refused: {:?}: {}", e.code, e.message);
            assert_eq!(e.code, ErrorCode::Internal);
            assert!(e.message.contains("BPF device allow-list"), "{}", e.message);
            assert!(
                e.message.contains("Operation not permitted"),
                "{}",
                e.message
            );
        }
        r => panic!("a sandbox was created without its device allow-list: {r:?}"),
    }
    assert_eq!(listed, 0);
    assert!(children.is_empty(), "cgroups left behind: {children:?}");
}
