//! The sandbox is hostile root: it keeps only the usual container capabilities, cannot write
//! host-wide kernel settings, mount, or set the clock; its content is reachable by root only;
//! and one state dir has one agent.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use belayer_tests::{bin, busybox_rootfs, Daemon};

#[test]
fn sandbox_root_is_confined() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    // CAP_SYS_ADMIN (21), CAP_SYS_TIME (25), CAP_SYSLOG (34), CAP_MKNOD (27) are gone from
    // every set, the bounding set included.
    let bnd =
        u64::from_str_radix(&d.sh(&id, "grep CapBnd /proc/self/status | cut -f2"), 16).unwrap();
    for cap in [21, 25, 27, 34] {
        assert_eq!(
            bnd & (1 << cap),
            0,
            "capability {cap} still in the bounding set {bnd:x}"
        );
    }
    assert!(
        d.exec(&id, "echo 1 > /proc/sys/vm/overcommit_memory")
            .exit_code
            != 0,
        "/proc/sys writable"
    );
    assert!(
        d.exec(&id, "mkdir -p /mnt/cg && mount -t cgroup2 none /mnt/cg")
            .exit_code
            != 0,
        "mount allowed"
    );
    assert!(
        d.exec(&id, "mknod /tmp/kmsg c 1 11").exit_code != 0,
        "mknod allowed"
    );
    // Still a working root inside its own tree.
    assert_eq!(
        d.sh(
            &id,
            "id -u; touch /root/x; chown 1:1 /root/x; stat -c %u /root/x"
        ),
        "0\n1"
    );
    // The state dir (upper layers with possible setuid files, memory images) is root-only.
    let mode = std::fs::metadata(&d.state_dir)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o700);
    // Capabilities survive checkpoint and restore unchanged.
    d.checkpoint(&id, 1, b"k1");
    d.fail_stop(&id);
    d.restore(&id);
    assert_eq!(
        u64::from_str_radix(&d.sh(&id, "grep CapBnd /proc/1/status | cut -f2"), 16).unwrap(),
        bnd
    );
}

#[test]
fn one_agent_per_state_dir() {
    let d = Daemon::start();
    let out = Command::new(bin("belayerd"))
        .arg("--socket")
        .arg(d.state_dir.with_file_name("other.sock"))
        .arg("--state-dir")
        .arg(&d.state_dir)
        .arg("--config")
        .arg("/dev/null")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("in use by another belayerd"), "{stderr}");
}
