//! File locks and leases across checkpoint → SIGKILL of every sandbox process → restore
//! (issue 13; split from `states_files.rs` for size): POSIX, BSD and OFD locks, read and
//! write leases and a lease being broken. Each test names the state it probes;
//! `docs/process-states.md` "Locks and leases" says what survives and why.

use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::Daemon;

/// Python helper `other(code)`: runs `code` in a fresh python3 process (not a child sharing
/// our locks' owner) and returns its stdout, stripped.
const OTHER: &str = r#"
import subprocess, fcntl, struct, errno
def other(code):
    r = subprocess.run(["python3", "-c", "import os, fcntl, struct, errno\n" + code], capture_output=True, text=True, timeout=30)
    return (r.stdout + r.stderr).strip()
F_OFD_GETLK, F_OFD_SETLK = 36, 37
def flock_struct(kind, start=0, length=0):
    return struct.pack("hhqqi", kind, 0, start, length, 0)
"#;

/// State: a POSIX (fcntl) write lock, as sqlite takes: after the restore it is still held by
/// the restored process, and another process's `F_SETLK` is refused and `F_GETLK` names the
/// holder.
#[test]
fn fcntl_lock_still_excludes_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lk_posix",
        &format!(
            "{OTHER}{}",
            r#"
os.makedirs("/work", exist_ok=True)
f = open("/work/posix.db", "w+b")
f.write(b"x" * 100)
f.flush()
fcntl.lockf(f, fcntl.LOCK_EX, 50, 10)
probe = """
f = open('/work/posix.db', 'r+b')
try:
    fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 50, 10)
    print('GOT')
except OSError as e:
    print('REFUSED', e.errno)
r = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))
print('HOLDER', struct.unpack('hhqqi', r)[4])
"""
check(other(probe).startswith("REFUSED"), "not held before")
ready()
wait_term()
out = other(probe)
check(out.startswith("REFUSED"), f"another process got the lock after restore: {out}")
check(f"HOLDER {os.getpid()}" in out, f"holder is not us: {out}")
fcntl.lockf(f, fcntl.LOCK_UN, 50, 10)
check(other(probe).startswith("GOT"), "still held after unlock")
finish()
"#
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a BSD `flock` exclusive lock: another process's `LOCK_EX | LOCK_NB` is refused
/// after the restore, and succeeds once the restored holder unlocks.
#[test]
fn flock_still_excludes_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lk_flock",
        &format!(
            "{OTHER}{}",
            r#"
os.makedirs("/work", exist_ok=True)
f = open("/work/flock.lock", "w")
fcntl.flock(f, fcntl.LOCK_EX)
probe = """
f = open('/work/flock.lock')
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print('GOT')
except OSError as e:
    print('REFUSED', e.errno)
"""
check(other(probe).startswith("REFUSED"), "not held before")
ready()
wait_term()
out = other(probe)
check(out.startswith("REFUSED"), f"another process got the flock after restore: {out}")
fcntl.flock(f, fcntl.LOCK_UN)
check(other(probe).startswith("GOT"), "still held after unlock")
finish()
"#
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: an open-file-description (OFD) write lock: another open file description's
/// `F_OFD_SETLK` is refused after the restore.
#[test]
fn ofd_lock_still_excludes_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lk_ofd",
        &format!(
            "{OTHER}{}",
            r#"
os.makedirs("/work", exist_ok=True)
fd = os.open("/work/ofd.lock", os.O_RDWR | os.O_CREAT, 0o644)
fcntl.fcntl(fd, F_OFD_SETLK, flock_struct(fcntl.F_WRLCK))
probe = """
fd = os.open('/work/ofd.lock', os.O_RDWR)
try:
    fcntl.fcntl(fd, 37, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))
    print('GOT')
except OSError as e:
    print('REFUSED', e.errno)
"""
check(other(probe).startswith("REFUSED"), "not held before")
ready()
wait_term()
out = other(probe)
check(out.startswith("REFUSED"), f"another description got the OFD lock after restore: {out}")
fcntl.fcntl(fd, F_OFD_SETLK, flock_struct(fcntl.F_UNLCK))
check(other(probe).startswith("GOT"), "still held after unlock")
finish()
"#
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// A lease probe: takes lease `kind` (`F_RDLCK` on a read-only fd, `F_WRLCK` on a write fd),
/// asks for `SIGIO`-style break notification with `F_SETSIG` and, after the restore, lets a
/// second process open the file `breaker_mode`; the break signal must arrive at the restored
/// holder, which then releases the lease and the opener gets through.
fn lease_probe(kind: &str, holder_flags: &str, breaker_mode: &str) -> String {
    format!(
        r#"
os.makedirs("/work", exist_ok=True)
path = "/work/lease_{kind}"
with open(path, "w") as g:
    g.write("data")
broken = []
fd = os.open(path, {holder_flags})
def on_break(signum, frame):
    broken.append(fcntl.fcntl(fd, fcntl.F_GETLEASE))
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
signal.signal(signal.SIGUSR1, on_break)
fcntl.fcntl(fd, 10, signal.SIGUSR1)  # F_SETSIG
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_{kind})
check(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_{kind}, "lease not taken")
ready()
wait_term()
check(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_{kind}, f"lease after restore: {{fcntl.fcntl(fd, fcntl.F_GETLEASE)}}")
t0 = time.time()
opener = subprocess.Popen(["python3", "-c", "import os, time; t = time.time(); os.close(os.open('" + path + "', {breaker_mode})); print(round(time.time() - t, 2))"], stdout=subprocess.PIPE, text=True)
while not broken and time.time() - t0 < 10:
    time.sleep(0.01)
out = opener.communicate(timeout=60)[0].strip()
check(broken, "no lease-break signal after restore")
check(float(out or 99) < 10, f"opener waited {{out}} s (lease never released)")
finish()
"#
    )
}

/// State: a read lease (`F_SETLEASE F_RDLCK`) with `F_SETSIG`: after the restore it is still
/// held, an opener for writing breaks it, and the break signal reaches the restored holder.
#[test]
fn read_lease_break_signal_arrives_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lease_rd",
        &format!(
            "import subprocess, fcntl\n{}",
            lease_probe("RDLCK", "os.O_RDONLY", "os.O_WRONLY")
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: a write lease (`F_SETLEASE F_WRLCK`) with `F_SETSIG`: after the restore it is still
/// held, an opener for reading breaks it, and the break signal reaches the restored holder.
#[test]
fn write_lease_break_signal_arrives_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lease_wr",
        &format!(
            "import subprocess, fcntl\n{}",
            lease_probe("WRLCK", "os.O_WRONLY", "os.O_RDONLY")
        ),
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// State: zdtm `file_lease02` — a read lease whose break is in progress at the checkpoint (a
/// non-blocking conflicting open broke it, the holder has not released it yet). After the
/// restore `F_GETLEASE` still reports the break's target (`F_UNLCK`), and the probe records
/// how many break signals arrived after the restore in `/probes/lease_brk.signals` (CRIU
/// breaks the lease once more while restoring; see docs/process-states.md).
#[test]
fn breaking_lease_is_still_breaking_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(
        &d,
        &id,
        "lease_brk",
        r#"
import fcntl
os.makedirs("/work", exist_ok=True)
path = "/work/lease_brk"
open(path, "w").close()
sigs = []
signal.signal(signal.SIGIO, lambda s, f: sigs.append(s))
fd = os.open(path, os.O_RDONLY)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
fcntl.fcntl(fd, 10, signal.SIGIO)  # F_SETSIG
try:
    os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    check(False, "conflicting open got through")
except BlockingIOError:
    pass
time.sleep(0.2)
check(len(sigs) == 1, f"{len(sigs)} break signals before")
check(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK, "not breaking before")
sigs.clear()
ready()
wait_term()
time.sleep(0.2)
_put(f"{DIR}/{NAME}.signals", str(len(sigs)))
check(fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK, f"lease after restore: {fcntl.fcntl(fd, fcntl.F_GETLEASE)}")
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
    // CRIU's restore breaks the lease again: one more signal, as documented.
    let signals = d.sh(&id, "cat /probes/lease_brk.signals");
    assert_eq!(signals.trim(), "1", "break signals after the restore");
}
