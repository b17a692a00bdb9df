//! Soak (issue 13, bug 3 and what it hid): 500 busybox sandboxes, each created, checkpointed,
//! (half of them) SIGKILLed from the host, restored and removed, by several client threads at once. Afterwards
//! belayerd holds no zombie child, no mount under its state dir, no sandbox cgroup, no more fds
//! than at the start (± a few), and its dump stage holds no file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use belayer_ipc::{Request, Response};
use belayer_tests::{busybox_rootfs, Daemon};

/// Sandboxes the soak goes through.
const SANDBOXES: usize = 500;
/// Client threads.
const THREADS: usize = 4;

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Every cgroup hierarchy's dir of sandbox `id` (`belayer/<id>`) that still exists.
fn cgroups_left(ids: &[String]) -> Vec<PathBuf> {
    let mut roots = vec![PathBuf::from("/sys/fs/cgroup")];
    roots.extend(
        std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path()),
    );
    let mut left = Vec::new();
    for root in roots {
        for id in ids {
            let dir = root.join("belayer").join(id);
            if dir.exists() {
                left.push(dir);
            }
        }
    }
    left
}

/// Mount points under `dir` in this process's mount table.
fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&prefix))
        .collect()
}

/// Files in this daemon's dump stage dir (the stage tmpfs is shared with the daemons of other
/// state dirs, each in a dir of its own).
fn stage_files(state_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![stage_owner(state_dir)];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// The stage dir the daemon of `state_dir` uses (named by the first 16 hex digits of the
/// blake3 digest of the state dir's path).
fn stage_owner(state_dir: &Path) -> PathBuf {
    let digest = blake3::hash(state_dir.as_os_str().as_encoded_bytes()).to_hex();
    Path::new("/run/belayer/dump-stage").join(&digest.as_str()[..16])
}

/// Bug 3 (zombies) and the leaks a long run would show: see the module docs.
#[test]
fn five_hundred_sandboxes_leave_nothing_behind() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let pid = d.pid().expect("daemon pid");
    // One round first, so that lazily opened fds (tracer maps, the blob store) count as the
    // start value.
    let warm = d.create("busybox").id;
    d.checkpoint(&warm, 1, b"warm");
    d.restore(&warm);
    d.call(Request::RemoveSandbox { id: warm.clone() });
    std::thread::sleep(Duration::from_millis(500));
    let fds_before = fd_count(pid);

    let started = Instant::now();
    let next = AtomicUsize::new(0);
    let ids = Mutex::new(vec![warm]);
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::SeqCst);
                if n >= SANDBOXES {
                    break;
                }
                let id = d.create("busybox").id;
                ids.lock().unwrap().push(id.clone());
                // Every fifth writes a file that must come back (the rest spare the two
                // actions: the soak is about what the daemon leaves behind).
                let probe = n.is_multiple_of(5);
                if probe {
                    d.sh(&id, &format!("echo {n} > /tmp/n"));
                }
                d.checkpoint(&id, 1, format!("L{n}").as_bytes());
                if n.is_multiple_of(2) {
                    // Half of them die first (killed from the host) and come back.
                    d.fail_stop(&id);
                }
                let r = d.restore(&id);
                assert_eq!(r.prefix, Some(1));
                if probe {
                    assert_eq!(d.sh(&id, "cat /tmp/n"), n.to_string());
                }
                match d.call(Request::RemoveSandbox { id: id.clone() }) {
                    Response::Done => {}
                    other => panic!("rm {id}: {other:?}"),
                }
            });
        }
    });
    let took = started.elapsed();
    println!(
        "soak: {SANDBOXES} sandboxes created, checkpointed, restored and removed by {THREADS} threads in {:.1} s",
        took.as_secs_f64()
    );
    let ids = ids.into_inner().unwrap();

    // The reaper runs every 200 ms; background retirements finish shortly after the answers.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let zombies = d.zombie_children();
        let mounts = mounts_under(&d.state_dir);
        let cgroups = cgroups_left(&ids);
        let fds = fd_count(pid);
        let staged = stage_files(&d.state_dir);
        let clean = zombies.is_empty()
            && mounts.is_empty()
            && cgroups.is_empty()
            && fds <= fds_before + 4
            && staged.is_empty();
        if clean {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the soak: zombies {zombies:?}, mounts {mounts:?}, cgroups {cgroups:?}, \
             fds {fds} (start {fds_before}), stage files {staged:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let left: Vec<_> = std::fs::read_dir(d.state_dir.join("sandboxes"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left in sandboxes/: {left:?}");
    d.assert_alive("after the soak");
}
