//! A hostile sandbox never gets a checkpoint whose CRIU restore would write outside it:
//! sandboxes keep files, cwds and sockets whose paths they then redirect to a host canary
//! directory (absolute and climbing symbolic links, a link among the names CRIU itself
//! creates, procfs magic links, the sandbox's `/dev`). Each such checkpoint is refused while
//! the tree is still frozen (`CheckpointFailed` naming the path), nothing is published, the
//! previous checkpoint stays ready and restores, the canary is untouched (same entries,
//! inodes, modes and times), the daemon keeps serving. (The same check runs again on the new
//! root before CRIU restores, covered by `belayer-criu`'s image tests.) A sandbox with ghost
//! files, a deleted cwd and a socket under `/var/run` (a link to `/run`) still checkpoints
//! and restores with its data. The check's cost on the benchmark sandboxes is printed.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use belayer_ipc::{ErrorCode, Request, Response};
use belayer_tests::{busybox_rootfs, python_rootfs, Daemon};

/// A host dir a sandbox must never reach: a file, two empty dirs.
struct Canary {
    dir: tempfile::TempDir,
    before: Vec<(PathBuf, u64, u32, i64, i64, i64, i64)>,
}

impl Canary {
    fn new() -> Canary {
        let dir = tempfile::Builder::new()
            .prefix("belayer-canary-")
            .tempdir_in("/var/tmp")
            .unwrap();
        std::fs::write(dir.path().join("keep"), "canary").unwrap();
        std::fs::create_dir(dir.path().join("c")).unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        let before = snapshot(dir.path());
        Canary { dir, before }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn assert_untouched(&self) {
        assert_eq!(snapshot(self.path()), self.before, "host canary changed");
    }
}

/// (path, inode, mode, mtime, mtime ns, ctime, ctime ns) of the dir and of each entry.
fn snapshot(dir: &Path) -> Vec<(PathBuf, u64, u32, i64, i64, i64, i64)> {
    let mut paths = vec![dir.to_path_buf()];
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    paths.extend(entries);
    paths
        .into_iter()
        .map(|p| {
            let m = std::fs::symlink_metadata(&p).unwrap();
            let t = (m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec());
            (p, m.ino(), m.mode(), t.0, t.1, t.2, t.3)
        })
        .collect()
}

/// A new sandbox of `image` with a good checkpoint at k=1, where `script` (sh) then runs,
/// which must leave `/tmp/ready` when its background processes are set up.
fn hostile(d: &Daemon, image: &str, script: &str) -> String {
    let id = d.create(image).id;
    d.checkpoint(&id, 1, b"k1");
    d.sh(
        &id,
        &format!("{script}\nwhile [ ! -e /tmp/ready ]; do sleep 0.05; done"),
    );
    id
}

/// The checkpoint at k=2 is refused naming `expect`; k=1 stays ready and restores (without
/// the hostile processes); the daemon keeps serving.
fn assert_refused(d: &Daemon, id: &str, expect: &[&str]) {
    match d.checkpoint_raw(id, 2, b"k2", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{}", e.message);
            assert!(e.message.contains("not published"), "{}", e.message);
            for s in expect {
                assert!(e.message.contains(s), "{s:?} not in {:?}", e.message);
            }
        }
        r => panic!("checkpoint of a hostile tree answered {r:?}"),
    }
    let info = d.restore(id);
    assert_eq!(info.prefix, Some(1), "the last good checkpoint restores");
    assert_eq!(d.sh(id, "ls /tmp/ready 2>/dev/null | wc -l"), "0");
    assert!(matches!(d.call(Request::Ping), Response::Pong { .. }));
}

#[test]
fn ghost_file_under_an_absolute_link_to_the_host_is_refused() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let canary = Canary::new();
    let id = hostile(
        &d,
        "busybox",
        &format!(
            "mkdir -p /tmp/d && echo payload > /tmp/d/f
             (exec 3</tmp/d/f; exec sleep 1000) >/dev/null 2>&1 &
             sleep 0.2; rm /tmp/d/f; rmdir /tmp/d; ln -s {} /tmp/d; touch /tmp/ready",
            canary.path().display()
        ),
    );
    assert_refused(
        &d,
        &id,
        &["creating ghost file", "\"/tmp/d\" is a symbolic link"],
    );
    canary.assert_untouched();
}

#[test]
fn ghost_file_under_a_link_climbing_out_with_dotdot_is_refused() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let canary = Canary::new();
    // From CRIU's host-side path /tmp/.criu.mntns.X/mnt-N/tmp/d, ten `..` reach the host root.
    let climb = format!("{}{}", "../".repeat(10), canary.path().display());
    let id = hostile(
        &d,
        "busybox",
        &format!(
            "mkdir -p /tmp/d && echo payload > /tmp/d/f
             (exec 3</tmp/d/f; exec sleep 1000) >/dev/null 2>&1 &
             sleep 0.2; rm /tmp/d/f; rmdir /tmp/d; ln -s {climb} /tmp/d; touch /tmp/ready"
        ),
    );
    assert_refused(&d, &id, &["\"/tmp/d\" is a symbolic link"]);
    canary.assert_untouched();
}

#[test]
fn dead_cwd_whose_parent_became_a_link_is_refused() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let canary = Canary::new();
    // Without the check CRIU would mkdir -p, chown, chmod and finally rmdir <canary>/c.
    let id = hostile(
        &d,
        "busybox",
        &format!(
            "mkdir -p /tmp/p/c
             (cd /tmp/p/c && exec sleep 1000) >/dev/null 2>&1 &
             sleep 0.2; rmdir /tmp/p/c /tmp/p; ln -s {} /tmp/p; touch /tmp/ready",
            canary.path().display()
        ),
    );
    assert_refused(
        &d,
        &id,
        &[
            "creating ghost file \"/tmp/p/c\"",
            "\"/tmp/p\" is a symbolic link",
        ],
    );
    canary.assert_untouched();
    assert!(canary.path().join("c").is_dir());
}

#[test]
fn ghost_file_in_dev_shm_under_a_link_is_refused() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let canary = Canary::new();
    // /dev is the sandbox's own tmpfs: CRIU extracts its archive, then creates the ghost in it.
    let id = hostile(
        &d,
        "busybox",
        &format!(
            "mkdir -p /dev/shm/d && echo payload > /dev/shm/d/f
             (exec 3</dev/shm/d/f; exec sleep 1000) >/dev/null 2>&1 &
             sleep 0.2; rm /dev/shm/d/f; rmdir /dev/shm/d; ln -s {} /dev/shm/d; touch /tmp/ready",
            canary.path().display()
        ),
    );
    assert_refused(&d, &id, &["\"/dev/shm/d\" is a symbolic link"]);
    canary.assert_untouched();
}

#[test]
fn ghost_under_a_ghost_symlink_criu_itself_creates_is_refused() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let canary = Canary::new();
    // An O_PATH fd on a deleted symlink is restored as the symlink /tmp/x.cr.1.ghost -> canary;
    // the next ghost's parent is exactly that name.
    let id = hostile(
        &d,
        "python",
        &format!(
            "cat > /tmp/g.py <<'EOF'
import os, time
os.symlink('{}', '/tmp/x')
a = os.open('/tmp/x', os.O_PATH | os.O_NOFOLLOW)
os.unlink('/tmp/x')
os.mkdir('/tmp/x.cr.1.ghost')
f = open('/tmp/x.cr.1.ghost/f', 'w'); f.write('payload'); f.flush()
os.unlink('/tmp/x.cr.1.ghost/f'); os.rmdir('/tmp/x.cr.1.ghost')
open('/tmp/ready', 'w').close()
time.sleep(1e9)
EOF
python3 /tmp/g.py >/dev/null 2>&1 &",
            canary.path().display()
        ),
    );
    assert_refused(&d, &id, &["\"/tmp/x.cr.1.ghost\" is a symbolic link"]);
    canary.assert_untouched();
}

/// A python process listening on unix socket `path` (after `setup`), then running `after`.
fn socket_script(setup: &str, path: &str, after: &str) -> String {
    format!(
        "cat > /tmp/s.py <<'EOF'
import os, socket, time
{setup}
s = socket.socket(socket.AF_UNIX); s.bind('{path}'); s.listen(1)
{after}
open('/tmp/ready', 'w').close()
time.sleep(1e9)
EOF
python3 /tmp/s.py >/dev/null 2>&1 &"
    )
}

#[test]
fn socket_whose_dir_became_a_link_to_the_host_is_refused() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let canary = Canary::new();
    let id = hostile(
        &d,
        "python",
        &socket_script(
            "os.makedirs('/tmp/sk')",
            "/tmp/sk/s.sock",
            &format!(
                "os.rename('/tmp/sk', '/tmp/sk-old'); os.symlink('{}', '/tmp/sk')",
                canary.path().display()
            ),
        ),
    );
    // CRIU binds inside chroot(<new root>): the link resolves to a dir the sandbox lacks.
    assert_refused(
        &d,
        &id,
        &["binding unix socket \"/tmp/sk/s.sock\"", "does not exist"],
    );
    canary.assert_untouched();
}

#[test]
fn socket_bound_through_a_proc_magic_link_is_refused() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let id = hostile(
        &d,
        "python",
        &socket_script("os.chdir('/tmp')", "/proc/self/cwd/s.sock", ""),
    );
    assert_refused(&d, &id, &["\"/proc/self/cwd/s.sock\"", "procfs"]);
}

#[test]
fn deleted_socket_under_a_link_is_resolved_inside_the_sandbox() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let canary = Canary::new();
    let script = |also: &str| {
        socket_script(
            "os.makedirs('/tmp/sk')",
            "/tmp/sk/s.sock",
            &format!(
                "os.unlink('/tmp/sk/s.sock'); os.rmdir('/tmp/sk'); os.symlink('{c}', '/tmp/sk'){also}",
                c = canary.path().display()
            ),
        )
    };
    // CRIU re-creates a deleted socket's dirs (mkdir of each literal prefix) and binds inside
    // chroot(<new root>): the link's target is a path of the sandbox, missing there.
    let id = hostile(&d, "python", &script(""));
    assert_refused(
        &d,
        &id,
        &["binding unix socket \"/tmp/sk/s.sock\"", "does not exist"],
    );
    canary.assert_untouched();
    // When the sandbox has that path itself, the bind lands there and the restore goes on.
    let inside = format!("; os.makedirs('{}')", canary.path().display());
    let id = hostile(&d, "python", &script(&inside));
    d.checkpoint(&id, 2, b"k2");
    d.restore(&id);
    canary.assert_untouched();
    assert_eq!(
        d.sh(&id, "readlink /tmp/sk"),
        canary.path().display().to_string()
    );
}

#[test]
fn ghost_files_deleted_cwd_and_var_run_socket_restore_with_their_data() {
    let d = Daemon::start();
    d.image("python", &python_rootfs());
    let id = hostile(
        &d,
        "python",
        &socket_script(
            "import tempfile
t = tempfile.TemporaryFile(); t.write(b'tmpfile-data'); t.flush()
n = open('/tmp/named', 'w+'); n.write('named-data'); n.flush(); os.unlink('/tmp/named')
m = open('/dev/shm/shm', 'w+'); m.write('shm-data'); m.flush(); os.unlink('/dev/shm/shm')
os.makedirs('/var/run/app')
open('/tmp/app.pid', 'w').write(str(os.getpid()))",
            "/var/run/app/app.sock",
            "os.makedirs('/tmp/gone/sub'); os.chdir('/tmp/gone/sub'); os.rmdir('/tmp/gone/sub')",
        ),
    );
    d.checkpoint(&id, 2, b"k2");
    let info = d.restore(&id);
    assert_eq!(info.prefix, Some(2));
    let pid = d.sh(&id, "cat /tmp/app.pid");
    let held = d.sh(
        &id,
        &format!(
            "for f in /proc/{pid}/fd/*; do case $(readlink $f) in *deleted*) cat $f; echo;; esac; done"
        ),
    );
    for data in ["tmpfile-data", "named-data", "shm-data"] {
        assert!(held.contains(data), "{data} lost after restore: {held:?}");
    }
    assert_eq!(
        d.sh(&id, &format!("readlink /proc/{pid}/cwd")),
        "/tmp/gone/sub (deleted)"
    );
    d.sh(
        &id,
        "python3 -c \"import socket; socket.socket(socket.AF_UNIX).connect('/var/run/app/app.sock')\"",
    );
    // No ghost names left behind in the restored tree.
    assert_eq!(d.sh(&id, "find / -xdev -name '*.cr.*.ghost' | wc -l"), "0");
}

/// The first and the median of `runs` checks of a sandbox's ready checkpoint against its live
/// root (the tree a restore materializes), in milliseconds, with the last report.
/// The host paths a sandbox's mount tree binds (as `belayerd` allows them at restore).
fn sandbox_binds() -> Vec<belayer_criu::AllowedBind<'static>> {
    let file = |host_path| belayer_criu::AllowedBind {
        host_path,
        dir: false,
    };
    let mut binds: Vec<_> = ["null", "zero", "full", "random", "urandom", "tty"]
        .iter()
        .map(|d| file(Box::leak(format!("/dev/{d}").into_boxed_str())))
        .collect();
    binds.push(belayer_criu::AllowedBind {
        host_path: "/run/belayer/empty",
        dir: true,
    });
    binds
}

fn check_cost(
    d: &Daemon,
    id: &str,
    checkpoint: &str,
    runs: usize,
) -> (f64, f64, belayer_criu::ImagePathReport) {
    let images = d
        .state_dir
        .join("sandboxes")
        .join(id)
        .join("checkpoints")
        .join(checkpoint)
        .join("criu");
    let root = d.root(id);
    let mut ms = Vec::new();
    let mut last = None;
    for _ in 0..runs {
        let t = std::time::Instant::now();
        let r = belayer_criu::validate_restore_paths_allowing(&images, &root, &sandbox_binds())
            .unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        last = Some(r);
    }
    let first = ms[0];
    ms.sort_by(f64::total_cmp);
    (first, ms[ms.len() / 2], last.unwrap())
}

#[test]
fn check_cost_on_the_benchmark_sandboxes() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    d.image("python", &python_rootfs());
    let workloads = [
        (
            "busybox-loop",
            "busybox",
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done >/dev/null 2>&1 &",
        ),
        (
            "python3-50MB",
            "python",
            "head -c 50M /dev/urandom > /root/data.bin
             python3 -c 'import time; b = bytearray((50 << 20)); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(1e9)' >/dev/null 2>&1 &
             sleep 0.5",
        ),
    ];
    for (name, image, setup) in workloads {
        let id = d.create(image).id;
        d.sh(&id, setup);
        let ck = d.checkpoint(&id, 1, b"k1");
        let (first_ms, median_ms, report) = check_cost(&d, &id, &ck.checkpoint, 21);
        // The root, proc and its masks, the device binds; no tmpfs.
        assert!(report.mounts > 4, "{report:?}");
        assert!(report.files > 0, "{report:?}");
        let restored = d.restore(&id);
        println!(
            "{name}: path check first {first_ms:.2} ms, median {median_ms:.2} ms ({} files, {} mounts, {} tmpfs members, \
             {} lookups); criu restore {:.1} ms, restore total {:.1} ms",
            report.files,
            report.mounts,
            report.tmpfs_members,
            report.lookups,
            restored.timings_ms.criu_restore,
            restored.timings_ms.total
        );
    }
}
