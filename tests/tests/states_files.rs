//! File states across checkpoint → SIGKILL of every sandbox process → restore (issue 13):
//! inotify watches, deleted-but-open files, file identity (locks and leases:
//! `states_file_locks.rs`). Each test names the state it probes; `docs/process-states.md` says
//! what survives and why.

use belayer_ipc::{ErrorCode, Response};
use belayer_tests::states::{python_sandbox, write_file, Probe};
use belayer_tests::Daemon;

/// Python helpers for inotify through ctypes: `in_init()`, `in_watch(fd, path, mask)`,
/// `in_events(fd)` (the events read within `timeout` seconds, as `(wd, mask, name)`).
const INOTIFY: &str = r#"
import ctypes, struct, select
libc = ctypes.CDLL(None, use_errno=True)
IN_MODIFY = 0x2
IN_CREATE = 0x100
def in_init():
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    return fd
def in_watch(fd, path, mask):
    wd = libc.inotify_add_watch(fd, path.encode(), mask)
    if wd < 0:
        raise OSError(ctypes.get_errno(), "inotify_add_watch " + path)
    return wd
def in_events(fd, timeout=3.0):
    evs = []
    end = time.time() + timeout
    while time.time() < end:
        r, _, _ = select.select([fd], [], [], 0.1)
        if not r:
            if evs:
                break
            continue
        buf = os.read(fd, 65536)
        off = 0
        while off < len(buf):
            wd, mask, cookie, ln = struct.unpack_from("iIII", buf, off)
            name = buf[off + 16:off + 16 + ln].rstrip(b"\0").decode()
            evs.append((wd, mask, name))
            off += 16 + ln
    return evs
"#;

/// A Python probe with the inotify helpers.
fn inotify_probe<'a>(d: &'a Daemon, id: &str, name: &str, body: &str) -> Probe<'a> {
    Probe::python(d, id, name, &format!("{INOTIFY}\n{body}"))
}

/// State: an inotify watch (IN_MODIFY) on a regular file the sandbox created in its upper
/// layer; a write after the restore is reported on the same watch descriptor.
#[test]
fn inotify_watch_on_a_created_file_reports_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = inotify_probe(
        &d,
        &id,
        "in_file",
        r#"
os.makedirs("/work/inw", exist_ok=True)
path = "/work/inw/file.txt"
with open(path, "w") as f:
    f.write("a")
fd = in_init()
wd = in_watch(fd, path, IN_MODIFY)
with open(path, "a") as f:
    f.write("b")
ev = in_events(fd)
check(any(w == wd and m & IN_MODIFY for w, m, _ in ev), f"no event before: {ev}")
ready()
wait_term()
with open(path, "a") as f:
    f.write("c")
ev = in_events(fd)
check(any(w == wd and m & IN_MODIFY for w, m, _ in ev), f"no IN_MODIFY after restore: {ev}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: an inotify watch (IN_CREATE) on a directory the sandbox created; a file created in
/// it after the restore is reported with its name.
#[test]
fn inotify_watch_on_a_created_directory_reports_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = inotify_probe(
        &d,
        &id,
        "in_dir",
        r#"
os.makedirs("/work/inwd/sub", exist_ok=True)
fd = in_init()
wd = in_watch(fd, "/work/inwd/sub", IN_CREATE)
ready()
wait_term()
open("/work/inwd/sub/after", "w").close()
ev = in_events(fd)
check(any(w == wd and m & IN_CREATE and n == "after" for w, m, n in ev), f"no IN_CREATE after restore: {ev}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: an inotify watch on `/tmp` (a directory of the image, lower layer only until the
/// sandbox writes into it); creations after the restore are reported.
#[test]
fn inotify_watch_on_tmp_reports_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = inotify_probe(
        &d,
        &id,
        "in_tmp",
        r#"
fd = in_init()
wd = in_watch(fd, "/tmp", IN_CREATE)
ready()
wait_term()
open("/tmp/in_tmp_after", "w").close()
ev = in_events(fd)
check(any(w == wd and n == "in_tmp_after" for w, m, n in ev), f"no IN_CREATE after restore: {ev}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: an `inotifywait -m` loop (a dev server's auto-reload) keeps receiving events after
/// the restore, through the same process and pipe.
#[test]
fn inotifywait_loop_receives_events_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    write_file(
        &d,
        &id,
        "/probes/iwloop.sh",
        r#"#!/bin/bash
mkdir -p /work/src
inotifywait -m -e create --format %f /work/src > /probes/iwloop.events 2> /probes/iwloop.err &
IW=$!
until grep -q "Watches established" /probes/iwloop.err; do sleep 0.05; done
touch /work/src/before
until grep -qx before /probes/iwloop.events; do sleep 0.05; done
term=0
trap 'term=1' TERM
echo $$ > /probes/iwloop.pid
echo 1 > /probes/iwloop.ready
while [ $term = 0 ]; do sleep 0.05; done
touch /work/src/after
for i in $(seq 60); do grep -qx after /probes/iwloop.events && break; sleep 0.05; done
if grep -qx after /probes/iwloop.events && kill -0 $IW; then r=PASS; else r="FAIL: events: $(tr '\n' ' ' < /probes/iwloop.events)"; fi
echo "$r" > /probes/iwloop.result.tmp && mv /probes/iwloop.result.tmp /probes/iwloop.result
"#,
    );
    let p = Probe::command(&d, &id, "iwloop", "bash /probes/iwloop.sh");
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a thousand inotify watches (one per created file) all come back.
#[test]
fn a_thousand_inotify_watches_come_back() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = inotify_probe(
        &d,
        &id,
        "in_many",
        r#"
os.makedirs("/work/many", exist_ok=True)
fd = in_init()
wds = {}
for i in range(1000):
    path = f"/work/many/f{i}"
    open(path, "w").close()
    wds[in_watch(fd, path, IN_MODIFY)] = i
ready()
wait_term()
for i in (0, 499, 999):
    with open(f"/work/many/f{i}", "a") as f:
        f.write("x")
ev = in_events(fd)
got = sorted(wds.get(w) for w, m, _ in ev if m & IN_MODIFY)
check(got == [0, 499, 999], f"events after restore for {got}: {ev[:5]}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a small deleted-but-open file (unlinked while open, `st_nlink` 0): content, size
/// and offset come back, and it stays deleted.
#[test]
fn deleted_open_small_file_comes_back() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "del_small",
        r#"
data = bytes(range(256)) * 16
f = open("/work/del_small", "w+b") if os.path.isdir("/work") else None
if f is None:
    os.makedirs("/work", exist_ok=True)
    f = open("/work/del_small", "w+b")
f.write(data)
f.flush()
os.unlink("/work/del_small")
ready()
wait_term()
st = os.fstat(f.fileno())
check(st.st_nlink == 0, f"nlink {st.st_nlink}")
check(st.st_size == len(data), f"size {st.st_size}")
check(f.tell() == len(data), f"offset {f.tell()}")
check(os.pread(f.fileno(), len(data), 0) == data, "content differs")
check(not os.path.exists("/work/del_small"), "the name came back")
check(not any(n.startswith("del_small") for n in os.listdir("/work")), f"leftovers: {os.listdir('/work')}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a deleted-but-open file above CRIU's default ghost limit (1 MiB): 8 MiB of data
/// come back.
#[test]
fn deleted_open_file_above_one_mib_comes_back() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "del_big",
        r#"
import hashlib
os.makedirs("/work", exist_ok=True)
data = hashlib.sha256(b"seed").digest() * (8 * 1024 * 1024 // 32)
f = open("/work/del_big", "w+b")
f.write(data)
f.flush()
os.unlink("/work/del_big")
ready()
wait_term()
st = os.fstat(f.fileno())
check(st.st_nlink == 0, f"nlink {st.st_nlink}")
check(st.st_size == len(data), f"size {st.st_size}")
check(os.pread(f.fileno(), len(data), 0) == data, "content differs")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a sparse deleted-but-open file of 100 GiB apparent size (a few KiB of data): its
/// size and data come back, and the checkpoint holds only the data.
#[test]
fn deleted_open_sparse_file_of_100_gib_comes_back() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "del_sparse",
        r#"
os.makedirs("/work", exist_ok=True)
G = 1 << 30
f = open("/work/del_sparse", "w+b")
os.pwrite(f.fileno(), b"head", 0)
os.pwrite(f.fileno(), b"middle", 50 * G)
os.pwrite(f.fileno(), b"tail", 100 * G - 4)
os.unlink("/work/del_sparse")
ready()
wait_term()
fd = f.fileno()
st = os.fstat(fd)
check(st.st_size == 100 * G, f"size {st.st_size}")
check(os.pread(fd, 4, 0) == b"head", "head differs")
check(os.pread(fd, 6, 50 * G) == b"middle", "middle differs")
check(os.pread(fd, 4, 100 * G - 4) == b"tail", "tail differs")
check(st.st_blocks * 512 < 64 << 20, f"{st.st_blocks} blocks: no longer sparse")
finish()
"#,
    );
    let c = d.checkpoint(p.id(), 1, b"sparse");
    assert!(c.bytes < 64 << 20, "checkpoint of {} bytes", c.bytes);
    d.fail_stop(p.id());
    d.restore(p.id());
    p.assert_pass();
}

/// State: a deleted-but-open file larger than the ghost limit (`criu_ghost_limit_bytes`, here
/// 4 MiB): the checkpoint fails with a typed error naming the file, and the previous
/// checkpoint stays ready (a restore brings back the state before the file was made).
#[test]
fn deleted_open_file_above_the_ghost_limit_fails_the_checkpoint() {
    let d = Daemon::start_options(belayer_tests::DaemonOptions {
        test_hooks: true,
        config: "criu_ghost_limit_bytes = 4194304\n".into(),
        ..Default::default()
    });
    let id = python_sandbox(&d);
    d.sh(&id, "mkdir -p /work && echo one > /work/marker");
    d.checkpoint(&id, 1, b"one");
    let p = Probe::python(
        &d,
        &id,
        "del_huge",
        r#"
os.makedirs("/work", exist_ok=True)
f = open("/work/del_huge", "w+b")
f.write(os.urandom(1 << 20) * 6)
f.flush()
os.unlink("/work/del_huge")
ready()
wait_term()
finish()
"#,
    );
    d.sh(&id, "echo two > /work/marker");
    match d.checkpoint_raw(&id, 2, b"two", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{e:?}");
            assert!(
                e.message.contains("deleted-but-open file /work/del_huge")
                    && e.message.contains("above the ghost limit of 4194304 bytes"),
                "{e:?}"
            );
        }
        r => panic!("checkpoint with a 6 MiB ghost passed: {r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "running");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /work/marker").trim(), "one");
    drop(p);
}

/// State: unlink_fstat03 — a file opened, hard-linked to a second name, its first name
/// unlinked, then its size changed (`st_nlink` 1, the fd's path gone). CRIU can dump it
/// only by hard-linking the file into the frozen tree's file system (`--link-remap`), after
/// the upper layer was captured and through paths the sandbox controls; Belayer makes no
/// such link, so the checkpoint fails with a typed refusal naming the file, nothing is
/// created next to it (the sandbox even planted a symlink where the link would go), and the
/// previous checkpoint stays ready.
#[test]
fn open_linked_then_unlinked_file_fails_the_checkpoint_precisely() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    d.sh(&id, "mkdir -p /work/lr && echo one > /work/marker");
    d.checkpoint(&id, 1, b"one");
    let p = Probe::python(
        &d,
        &id,
        "unlink_fstat03",
        r#"
os.makedirs("/work/lr", exist_ok=True)
fd = os.open("/work/lr/f", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
os.link("/work/lr/f", "/work/lr/f.link")
os.unlink("/work/lr/f")
os.write(fd, b"0" * 1000)
for i in range(64):
    os.symlink("/etc", f"/work/lr/link_remap.{i}")
ready()
wait_term()
finish()
"#,
    );
    d.sh(&id, "echo two > /work/marker");
    match d.checkpoint_raw(&id, 2, b"two", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{e:?}");
            assert!(
                e.message.contains(
                    "file open under its removed name /work/lr/f while another hard link keeps it"
                ),
                "{e:?}"
            );
        }
        r => panic!("checkpoint of an unlink_fstat03 tree passed: {r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "running");
    let listing = d.sh(
        &id,
        "ls /work/lr | grep -v '^link_remap\\.[0-9]*$'; ls /etc | grep -c link_remap || true",
    );
    assert_eq!(listing.trim(), "f.link\n0", "{listing}");
    let host_etc = std::fs::read_dir("/etc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("link_remap"))
        .count();
    assert_eq!(host_etc, 0, "a link remap on the host");
    assert_eq!(p.verdict(), "PASS");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /work/marker").trim(), "one");
}

/// State: file identity. `st_ino`, mtime and ctime of a file the sandbox wrote, of a
/// directory it made, of image files and of the root, and `st_dev`, before and after the
/// restore, as `docs/process-states.md` "File identity" states: with the checkpoint's upper
/// snapshot (the default on a btrfs state dir) every file keeps its inode number and times;
/// `st_dev` is the fresh overlay mount's; within the restored instance, names of one inode
/// agree (hard links stay one inode, a held fd is the file at its path).
#[test]
fn file_identity_is_as_documented() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "identity",
        r#"
os.makedirs("/work/id", exist_ok=True)
with open("/work/id/a", "w") as f:
    f.write("a")
os.link("/work/id/a", "/work/id/a2")
paths = ["/work/id/a", "/work/id", "/usr/bin/python3", "/etc/passwd", "/"]
before = {p: os.stat(p) for p in paths}
held = open("/work/id/a")
ready()
wait_term()
after = {p: os.stat(p) for p in paths}
lines = []
for p in paths:
    b, a = before[p], after[p]
    lines.append(f"{p} ino {b.st_ino} {a.st_ino} dev {b.st_dev} {a.st_dev} "
                 f"mtime {b.st_mtime_ns} {a.st_mtime_ns} ctime {b.st_ctime_ns} {a.st_ctime_ns}")
_put(f"{DIR}/{NAME}.ids", "\n".join(lines) + "\n")
# Image files keep their inode numbers (same lower layer, xino).
check(after["/usr/bin/python3"].st_ino == before["/usr/bin/python3"].st_ino, "image file ino changed")
# Names of one inode agree, and the held fd is that inode.
check(os.stat("/work/id/a2").st_ino == after["/work/id/a"].st_ino, "hard links split")
st = os.fstat(held.fileno())
check((st.st_ino, st.st_dev) == (after["/work/id/a"].st_ino, after["/work/id/a"].st_dev), "held fd is not the file at its path")
# All files of the sandbox share one st_dev, before and after.
check(len({s.st_dev for s in after.values()}) == 1, f"several st_dev after: {lines}")
finish()
"#,
    );
    let r = p.checkpoint_kill_restore();
    p.assert_pass();
    let ids = d.sh(&id, "cat /probes/identity.ids");
    eprintln!("{ids}");
    assert!(
        r.inodes_kept,
        "the restore did not use the upper snapshot: {r:?}"
    );
    for line in ids.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (path, ino, dev, mtime, ctime) = (
            f[0],
            (f[2], f[3]),
            (f[5], f[6]),
            (f[8], f[9]),
            (f[11], f[12]),
        );
        assert_eq!(ino.0, ino.1, "{path}: st_ino changed: {line}");
        assert_ne!(
            dev.0, dev.1,
            "{path}: st_dev kept (a new overlay has a new one): {line}"
        );
        if path.starts_with("/work/id/") {
            assert_eq!(mtime.0, mtime.1, "{path}: mtime changed: {line}");
            assert_eq!(ctime.0, ctime.1, "{path}: ctime changed: {line}");
        }
    }
}

/// State: file identity across repeated restores of one checkpoint (a rollback taken twice,
/// the agent's writes in between): each restore brings back the checkpoint's files with the
/// checkpoint's inode numbers and content, whatever the instance it replaced wrote, so the
/// upper snapshot stays what was captured. A checkpoint taken after a restore captures
/// incrementally and restores with its own inodes.
#[test]
fn repeated_restores_of_one_checkpoint_give_its_inodes_and_content() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    d.sh(
        &id,
        "mkdir -p /work && echo one > /work/f && echo keep > /work/g",
    );
    let ino = |d: &Daemon| d.sh(&id, "stat -c %i /work/f /work/g").trim().to_string();
    let at_k1 = ino(&d);
    d.checkpoint(&id, 1, b"one");
    for round in 0..2 {
        d.sh(
            &id,
            "echo changed > /work/f; rm /work/g; echo new > /work/h",
        );
        d.fail_stop(&id);
        let r = d.restore(&id);
        assert_eq!(r.prefix, Some(1));
        assert!(r.inodes_kept, "round {round}: {r:?}");
        assert_eq!(ino(&d), at_k1, "round {round}");
        assert_eq!(
            d.sh(&id, "cat /work/f /work/g; ls /work").trim(),
            "one\nkeep\nf\ng",
            "round {round}"
        );
    }
    d.sh(&id, "echo two > /work/f2");
    let at_k2 = d
        .sh(&id, "stat -c %i /work/f /work/g /work/f2")
        .trim()
        .to_string();
    d.checkpoint(&id, 2, b"two");
    d.sh(&id, "rm -f /work/*");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!((r.prefix, r.inodes_kept), (Some(2), true), "{r:?}");
    assert_eq!(
        d.sh(&id, "stat -c %i /work/f /work/g /work/f2").trim(),
        at_k2
    );
    assert_eq!(d.sh(&id, "cat /work/f2").trim(), "two");
}

/// State: an inotify watch on a file unlinked while it stays open (the watch pins the
/// inode, `st_nlink` 0). CRIU dumps it but restores the watch dropped (`IN_IGNORED` and no
/// further events), so the checkpoint is refused with a typed error naming the task, the
/// inotify fd and the inode, and the previous checkpoint stays ready.
#[test]
fn inotify_watch_on_a_deleted_file_fails_the_checkpoint_precisely() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    d.sh(&id, "mkdir -p /work && echo one > /work/marker");
    d.checkpoint(&id, 1, b"one");
    let p = inotify_probe(
        &d,
        &id,
        "in_del",
        r#"
os.makedirs("/work", exist_ok=True)
path = "/work/gone"
keep = open(path, "w")
fd = in_init()
in_watch(fd, path, IN_MODIFY)
os.unlink(path)
ready()
wait_term()
finish()
"#,
    );
    match d.checkpoint_raw(&id, 2, b"two", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{e:?}");
            assert!(
                e.message.contains("watches deleted inode")
                    && e.message.contains("through inotify fd 4"),
                "{e:?}"
            );
        }
        r => panic!("checkpoint with a watch on a deleted file passed: {r:?}"),
    }
    assert_eq!(d.inspect(&id).state, "running");
    assert_eq!(p.verdict(), "PASS");
    d.fail_stop(&id);
    assert_eq!(d.restore(&id).prefix, Some(1));
}
