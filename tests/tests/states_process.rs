//! Process states after checkpoint → SIGKILL of every sandbox process → restore, in the manner
//! of CRIU's zdtm static tests (`seccomp_filter`, `rlimits`, `personality`, `itimer`,
//! `posix_timers`, `timerfd`, `sigpending`, `pthread00`, `ipc_namespace`, `shm`, `sem`,
//! `msgque`, `posix_mq`), and the pid counter. Each test names its state.

use belayer_ipc::{ErrorCode, Response};
use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::Daemon;

/// ctypes helpers shared by the probes below: `libc`, `seccomp_filter(rules)` (a BPF program
/// that answers `rules[nr]` for syscall `nr` and allows the rest), `sigset(sigs)`.
const CTYPES: &str = r#"
import ctypes, ctypes.util, struct
libc = ctypes.CDLL(None, use_errno=True)
def die_errno(what):
    e = ctypes.get_errno()
    raise OSError(e, what + ": " + os.strerror(e))
SECCOMP_RET_ALLOW = 0x7fff0000
SECCOMP_RET_ERRNO = 0x00050000
def seccomp_filter(rules):
    # struct sock_filter { u16 code; u8 jt; u8 jf; u32 k; }
    ins = [(0x20, 0, 0, 0)]  # ld [0] (seccomp_data.nr)
    for nr, ret in rules.items():
        ins.append((0x15, 0, 1, nr))  # jeq nr, next, skip
        ins.append((0x06, 0, 0, ret))  # ret
    ins.append((0x06, 0, 0, SECCOMP_RET_ALLOW))
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(ins), ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        die_errno("no_new_privs")
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
        die_errno("PR_SET_SECCOMP")
def seccomp_filters():
    for line in open("/proc/self/status"):
        if line.startswith("Seccomp_filters:"):
            return int(line.split()[1])
    return -1
def sigset(sigs):
    s = ctypes.create_string_buffer(128)
    libc.sigemptyset(s)
    for sig in sigs:
        libc.sigaddset(s, sig)
    return s
"#;

fn probe<'a>(d: &'a Daemon, id: &str, name: &str, body: &str) -> Probe<'a> {
    Probe::python(d, id, name, &format!("{CTYPES}\n{body}"))
}

/// Runs probe `name` through checkpoint → SIGKILL → restore and asserts it passed.
fn survives(name: &str, body: &str) {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = probe(&d, &id, name, body);
    p.checkpoint_kill_restore();
    p.assert_pass();
}

/// Runs probe `name`, whose checkpoint must be refused with `CheckpointFailed` and a message
/// containing `why`; the probe must then pass without any restore (nothing was touched).
fn refused(name: &str, why: &str, body: &str) {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = probe(&d, &id, name, body);
    match d.checkpoint_raw(&id, 1, b"k1", None) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::CheckpointFailed, "{e:?}");
            assert!(e.message.contains(why), "{}", e.message);
        }
        r => panic!("checkpoint accepted: {r:?}"),
    }
    p.assert_pass();
}

/// State: a seccomp filter installed by a sandbox process on top of the sandbox's own
/// (zdtm `seccomp_filter`): `getpgid` answers `EACCES`, and the filter count stays.
#[test]
fn seccomp_filter_of_a_sandbox_process_survives() {
    survives(
        "seccomp",
        r#"
seccomp_filter({121: SECCOMP_RET_ERRNO | 13})
n = seccomp_filters()
def denied():
    try:
        os.getpgid(0)
        return False
    except PermissionError:
        return True
check(denied(), "filter not in force before")
ready()
wait_term()
check(denied(), "getpgid allowed after restore")
check(seccomp_filters() == n, f"{seccomp_filters()} filters, was {n}")
finish()
"#,
    );
}

/// State (hostile): a seccomp filter that denies what CRIU's parasite uses to talk to CRIU
/// (socket, connect, sendmsg, recvmsg, memfd_create). CRIU suspends seccomp for the tasks it
/// seizes (`PTRACE_O_SUSPEND_SECCOMP`), so the dump works and the filter comes back.
#[test]
fn seccomp_filter_against_criu_parasite_survives() {
    survives(
        "seccomp_hostile",
        r#"
import socket
rules = {nr: SECCOMP_RET_ERRNO | 1 for nr in (41, 42, 46, 47, 319)}
seccomp_filter(rules)
def denied():
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        return False
    except PermissionError:
        return True
check(denied(), "filter not in force before")
ready()
wait_term()
check(denied(), "socket allowed after restore")
finish()
"#,
    );
}

/// State (hostile): a process whose seccomp filter kills it on the calls CRIU's restorer makes
/// after it has put the filters back (`rt_sigreturn`, `munmap`, `setresuid`, `setresgid`,
/// `capset`, `setitimer`, `timer_settime`): CRIU suspends seccomp for the tasks it holds
/// (`PTRACE_O_SUSPEND_SECCOMP`) until it lets them go, so the process comes back alive, with
/// its filter.
#[test]
fn seccomp_filter_against_criu_restorer_survives() {
    survives(
        "seccomp_restorer",
        r#"
KILL_PROCESS = 0x80000000
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    seccomp_filter({nr: KILL_PROCESS for nr in (15, 11, 117, 119, 126, 38, 223)})
    os.write(w, str(seccomp_filters()).encode())
    while True:
        time.sleep(0.5)
os.close(w)
filters = int(os.read(r, 16))
def child_state():
    with open(f"/proc/{child}/status") as f:
        st = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
    return st["State"].split()[0], int(st["Seccomp_filters"])
before = child_state()
check(before[0] in ("S", "R") and before[1] == filters, f"child before: {before}")
ready()
wait_term()
state = child_state()
check(state[0] in ("S", "R") and state[1] == filters, f"child after restore: {state}, filters {filters}")
os.kill(child, signal.SIGKILL)
os.waitpid(child, 0)
finish()
"#,
    );
}

/// State: resource limits (zdtm `rlimits`), soft below hard.
#[test]
fn rlimits_survive() {
    survives(
        "rlimits",
        r#"
import resource
want = {
    resource.RLIMIT_NOFILE: (200, 300),
    resource.RLIMIT_CORE: (0, 4096),
    resource.RLIMIT_STACK: (4 << 20, 16 << 20),
    resource.RLIMIT_NPROC: (500, 600),
    resource.RLIMIT_MSGQUEUE: (4096, 8192),
}
for r, v in want.items():
    resource.setrlimit(r, v)
ready()
wait_term()
for r, v in want.items():
    got = resource.getrlimit(r)
    check(got == v, f"limit {r}: {got}, want {v}")
finish()
"#,
    );
}

/// State: the execution domain (zdtm `personality`): `PER_LINUX32 | UNAME26` (of what the
/// sandbox's seccomp filter lets a process choose, the one furthest from the default). CRIU
/// 4.2.1 records personalities but never sets them at restore, so the checkpoint is refused
/// with a typed error naming the process, and the process runs on with its personality.
#[test]
fn personality_is_refused_at_checkpoint() {
    refused(
        "personality",
        "has personality 0x20008: CRIU does not restore personalities",
        r#"
PER_LINUX32, UNAME26 = 0x0008, 0x0020000
want = PER_LINUX32 | UNAME26
if libc.personality(want) < 0:
    die_errno("personality")
check(libc.personality(ctypes.c_ulong(0xffffffff)) == want, "personality not set before")
ready()
wait_term()
got = libc.personality(ctypes.c_ulong(0xffffffff))
check(got == want, f"personality {got:#x}, want {want:#x}")
finish()
"#,
    );
}

/// State: interval timers (zdtm `itimer`): `ITIMER_REAL` far off (remaining time kept, not
/// reset) and a periodic `ITIMER_VIRTUAL`.
#[test]
fn itimers_survive() {
    survives(
        "itimer",
        r#"
signal.signal(signal.SIGALRM, lambda *a: None)
signal.signal(signal.SIGVTALRM, lambda *a: None)
signal.setitimer(signal.ITIMER_REAL, 1000, 500)
signal.setitimer(signal.ITIMER_VIRTUAL, 100, 50)
ready()
wait_term()
real = signal.getitimer(signal.ITIMER_REAL)
virt = signal.getitimer(signal.ITIMER_VIRTUAL)
check(900 < real[0] <= 1000 and real[1] == 500, f"ITIMER_REAL {real}")
# CRIU rounds the remaining CPU time up to its tick: a few ms more than was left.
check(0 < virt[0] <= 100.1 and virt[1] == 50, f"ITIMER_VIRTUAL {virt}")
finish()
"#,
    );
}

/// State: POSIX timers (zdtm `posix_timers`): one armed far off with its interval, one
/// periodic whose signals keep arriving after the restore.
#[test]
fn posix_timers_survive() {
    survives(
        "posix_timers",
        r#"
class Sigevent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_byte * 48)]
class Itimerspec(ctypes.Structure):
    _fields_ = [("isec", ctypes.c_long), ("insec", ctypes.c_long),
                ("vsec", ctypes.c_long), ("vnsec", ctypes.c_long)]
fired = [0]
signal.signal(signal.SIGUSR2, lambda *a: fired.__setitem__(0, fired[0] + 1))
signal.signal(signal.SIGUSR1, lambda *a: None)
def timer(clock, signo, value, interval):
    ev = Sigevent(None, signo, 0)  # SIGEV_SIGNAL
    t = ctypes.c_void_p()
    if libc.timer_create(clock, ctypes.byref(ev), ctypes.byref(t)) != 0:
        die_errno("timer_create")
    spec = Itimerspec(interval[0], interval[1], value[0], value[1])
    if libc.timer_settime(t, 0, ctypes.byref(spec), None) != 0:
        die_errno("timer_settime")
    return t
far = timer(1, signal.SIGUSR1, (1000, 0), (300, 0))  # CLOCK_MONOTONIC
tick = timer(0, signal.SIGUSR2, (0, 20_000_000), (0, 20_000_000))  # CLOCK_REALTIME
ready()
wait_term()
spec = Itimerspec()
libc.timer_gettime(far, ctypes.byref(spec))
check(900 < spec.vsec <= 1000 and spec.isec == 300, f"far timer {spec.vsec}s left, every {spec.isec}s")
before = fired[0]
time.sleep(0.3)
check(fired[0] > before, f"periodic timer stopped ({before} -> {fired[0]})")
finish()
"#,
    );
}

/// State: a periodic timerfd (zdtm `timerfd`): still armed with its interval, and it keeps
/// expiring.
#[test]
fn timerfd_survives() {
    survives(
        "timerfd",
        r#"
class Itimerspec(ctypes.Structure):
    _fields_ = [("isec", ctypes.c_long), ("insec", ctypes.c_long),
                ("vsec", ctypes.c_long), ("vnsec", ctypes.c_long)]
fd = libc.timerfd_create(1, 0)  # CLOCK_MONOTONIC
if fd < 0:
    die_errno("timerfd_create")
spec = Itimerspec(0, 10_000_000, 0, 10_000_000)
if libc.timerfd_settime(fd, 0, ctypes.byref(spec), None) != 0:
    die_errno("timerfd_settime")
os.read(fd, 8)
ready()
wait_term()
got = Itimerspec()
libc.timerfd_gettime(fd, ctypes.byref(got))
check(got.isec == 0 and got.insec == 10_000_000, f"interval {got.isec}s {got.insec}ns")
n = struct.unpack("Q", os.read(fd, 8))[0]
check(n >= 1, "no expiration")
finish()
"#,
    );
}

/// State: pending signals (zdtm `sigpending`): a blocked standard signal, and blocked
/// real-time signals queued twice with different payloads (`rt_sigqueueinfo` through
/// `sigqueue`), received after the restore in order with their payloads.
#[test]
fn pending_signals_survive() {
    survives(
        "sigpending",
        r#"
RT = signal.SIGRTMIN + 2
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, RT})
os.kill(os.getpid(), signal.SIGUSR1)
for payload in (1234, 5678):
    if libc.sigqueue(os.getpid(), RT, ctypes.c_void_p(payload)) != 0:
        die_errno("sigqueue")
check(signal.sigpending() >= {signal.SIGUSR1, RT}, "not pending before")
ready()
wait_term()
check(signal.sigpending() >= {signal.SIGUSR1, RT}, f"pending after restore: {signal.sigpending()}")
info = ctypes.create_string_buffer(128)
ts = struct.pack("ll", 1, 0)
got = []
for _ in range(2):
    sig = libc.sigtimedwait(sigset([RT]), info, ts)
    si_code = struct.unpack_from("i", info, 8)[0]
    value = struct.unpack_from("q", info, 24)[0]
    got.append((sig, si_code, value))
check(got == [(RT, -1, 1234), (RT, -1, 5678)], f"queued signals {got}")
sig = libc.sigtimedwait(sigset([signal.SIGUSR1]), info, ts)
check(sig == signal.SIGUSR1, f"SIGUSR1 not pending ({sig})")
finish()
"#,
    );
}

/// State: threads (zdtm `pthread00`): three threads with their own thread ids, names and
/// signal masks, each still running after the restore.
#[test]
fn threads_survive() {
    survives(
        "threads",
        r#"
import threading
counts = [0, 0, 0]
tids = [0, 0, 0]
started = threading.Barrier(4)
def work(i):
    libc.prctl(15, f"worker{i}".encode(), 0, 0, 0)  # PR_SET_NAME
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1 + 0, signal.SIGRTMIN + i})
    tids[i] = threading.get_native_id()
    started.wait()
    while True:
        counts[i] += 1
        time.sleep(0.005)
threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
started.wait()
def comm(tid):
    return open(f"/proc/self/task/{tid}/comm").read().strip()
def masked(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("SigBlk:"):
            return int(line.split()[1], 16)
names = [comm(t) for t in tids]
masks = [masked(t) for t in tids]
ready()
time.sleep(0.05)
wait_term()
t0 = list(counts)
time.sleep(0.2)
check(all(a < b for a, b in zip(t0, counts)), f"threads stopped: {t0} -> {counts}")
check(sorted(os.listdir("/proc/self/task")) == sorted(map(str, [os.getpid()] + tids)), "task list differs")
check([comm(t) for t in tids] == names, "thread names differ")
check([masked(t) for t in tids] == masks, "thread signal masks differ")
finish()
"#,
    );
}

/// State: System V IPC (zdtm `shm`, `sem`, `msgque`): a shared memory segment with data
/// (attached and by id), a semaphore set with values, a message queue with typed messages.
#[test]
fn sysv_ipc_survives() {
    survives(
        "sysv_ipc",
        r#"
IPC_PRIVATE, IPC_CREAT, IPC_NOWAIT = 0, 0o1000, 0o4000
GETVAL, SETVAL = 12, 16
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0o600)
if shmid < 0:
    die_errno("shmget")
addr = libc.shmat(shmid, None, 0)
data = bytes(range(256)) * 16
ctypes.memmove(addr, data, len(data))
semid = libc.semget(IPC_PRIVATE, 3, IPC_CREAT | 0o600)
for i, v in enumerate((3, 0, 77)):
    if libc.semctl(semid, i, SETVAL, ctypes.c_int(v)) != 0:
        die_errno("semctl")
msqid = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
msgs = [(5, b"five"), (2, b"two"), (5, b"five again")]
for t, body in msgs:
    m = struct.pack("l", t) + body
    if libc.msgsnd(msqid, m, len(body), IPC_NOWAIT) != 0:
        die_errno("msgsnd")
ready()
wait_term()
check(ctypes.string_at(addr, len(data)) == data, "attached segment differs")
again = libc.shmat(shmid, None, 0)
check(again not in (None, ctypes.c_void_p(-1).value) and ctypes.string_at(again, len(data)) == data, "segment by id differs")
vals = [libc.semctl(semid, i, GETVAL) for i in range(3)]
check(vals == [3, 0, 77], f"semaphores {vals}")
got = []
buf = ctypes.create_string_buffer(256)
while True:
    n = libc.msgrcv(msqid, buf, 200, 0, IPC_NOWAIT)
    if n < 0:
        break
    got.append((struct.unpack_from("l", buf)[0], buf.raw[8:8 + n]))
check(got == msgs, f"messages {got}")
finish()
"#,
    );
}

/// State: POSIX shared memory (zdtm `shm` via `shm_open`): an object in `/dev/shm`, mapped
/// shared, with its data and an open descriptor.
#[test]
fn posix_shm_survives() {
    survives(
        "posix_shm",
        r#"
import mmap
fd = os.open("/dev/shm/belayer-probe", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 16)
m = mmap.mmap(fd, 1 << 16, mmap.MAP_SHARED)
data = bytes(range(251)) * 100
m[: len(data)] = data
ready()
wait_term()
check(m[: len(data)] == data, "mapping differs")
check(os.pread(fd, len(data), 0) == data, "file differs")
m[0:4] = b"PONG"
check(open("/dev/shm/belayer-probe", "rb").read(4) == b"PONG", "mapping no longer shared")
finish()
"#,
    );
}

/// State: POSIX message queues (zdtm `posix_mq`): a queue with messages of two priorities,
/// opened through librt's `mq_open`. CRIU 4.2.1 cannot dump an mqueue fd (it looks for the
/// fd's mount in the sandbox's mount namespace), so the checkpoint fails with a typed error
/// naming the process and fd, and the queue is untouched.
#[test]
fn posix_mq_is_refused_at_checkpoint() {
    refused(
        "posix_mq",
        "holds a POSIX message queue (fd 3): CRIU cannot dump mqueue files",
        r#"
rt = ctypes.CDLL(ctypes.util.find_library("rt") or "librt.so.1", use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
attr = Attr(0, 8, 64, 0)
q = rt.mq_open(b"/belayer-probe", os.O_CREAT | os.O_RDWR | os.O_NONBLOCK, 0o600, ctypes.byref(attr))
if q != 3:
    die_errno(f"mq_open gave {q}")
for body, prio in ((b"low", 1), (b"high", 9), (b"low2", 1)):
    if rt.mq_send(q, body, len(body), prio) != 0:
        die_errno("mq_send")
ready()
wait_term()
got = []
buf = ctypes.create_string_buffer(64)
prio = ctypes.c_uint()
while True:
    n = rt.mq_receive(q, buf, 64, ctypes.byref(prio))
    if n < 0:
        break
    got.append((buf.raw[:n], prio.value))
check(got == [(b"high", 9), (b"low", 1), (b"low2", 1)], f"messages {got}")
finish()
"#,
    );
}

/// State: the pid counter of the sandbox's pid namespace: the first commands after a restore
/// get the pids they get in the failure-free run (the checkpoint's own look at the counter
/// costs no pid either).
#[test]
fn first_pids_after_restore_match_the_failure_free_run() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    // Move the counter away from where a fresh namespace starts.
    d.sh(&id, "for i in 1 2 3 4 5 6; do (true); done");
    d.checkpoint(&id, 1, b"k1");
    let pids = |d: &Daemon| {
        let a = d.sh(&id, "echo $$").trim().to_string();
        let b = d.sh(&id, "sh -c 'echo $$'").trim().to_string();
        (a, b)
    };
    let free = pids(&d);
    for round in 0..2 {
        d.fail_stop(&id);
        d.restore(&id);
        assert_eq!(
            pids(&d),
            free,
            "round {round}: pids differ from the failure-free run"
        );
    }
}

/// State: a task the sandbox stopped itself (`SIGSTOP`; zdtm `stopped`, `stopped01`) stays
/// stopped after a verified restore while its running sibling runs; its parent still gets the
/// stop from `waitpid(WUNTRACED)`, and `SIGCONT` then continues it.
#[test]
fn a_task_stopped_by_the_sandbox_stays_stopped() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = probe(
        &d,
        &id,
        "stopped",
        r#"
child = os.fork()
if child == 0:
    time.sleep(1000)
    os._exit(0)
os.kill(child, signal.SIGSTOP)
os.waitid(os.P_PID, child, os.WSTOPPED | os.WNOWAIT)
open("/tmp/stopped", "w").write(str(child))
ready()
wait_term()
_, st = os.waitpid(child, os.WUNTRACED | os.WCONTINUED)
check(os.WIFSTOPPED(st), f"waitpid: not stopped ({st:#x})")
os.kill(child, signal.SIGCONT)
_, st = os.waitpid(child, os.WCONTINUED)
check(os.WIFCONTINUED(st), f"waitpid: not continued ({st:#x})")
os.kill(child, signal.SIGKILL)
finish()
"#,
    );
    d.sh(&id, "sleep 1000 >/dev/null 2>&1 & echo $! >/tmp/running");
    let state = |d: &Daemon, task: &str| {
        d.sh(&id, &format!("cut -d' ' -f3 /proc/$(cat /tmp/{task})/stat"))
            .trim()
            .to_string()
    };
    assert_eq!(state(&d, "stopped"), "T");
    p.checkpoint_kill_restore();
    assert_eq!(state(&d, "stopped"), "T", "the stopped task runs again");
    assert_eq!(state(&d, "running"), "S", "the running task stays stopped");
    p.assert_pass();
}

/// State: job-control events. A restore must not show a parent stop or continue events of its
/// running children that never happened (a shell would print "Stopped" for its jobs).
#[test]
fn running_children_report_no_job_control_events_after_restore() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = probe(
        &d,
        &id,
        "jobs",
        r#"
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
child = os.fork()
if child == 0:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
    time.sleep(1000)
    os._exit(0)
ready()
wait_term()
pid, st = os.waitpid(child, os.WUNTRACED | os.WCONTINUED | os.WNOHANG)
check(pid == 0, f"waitpid reports a change of the running child: {st:#x}")
info = signal.sigtimedwait([signal.SIGCHLD], 0)
check(info is None, f"SIGCHLD pending: code {info and info.si_code}")
os.kill(child, signal.SIGKILL)
finish()
"#,
    );
    p.checkpoint_kill_restore();
    p.assert_pass();
}
