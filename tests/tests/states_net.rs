//! TCP states after checkpoint → SIGKILL of every sandbox process → restore (CRIU's zdtm
//! `socket-tcpbuf`, `socket-tcp-skip-in-flight`, a server with clients mid-request). Each test
//! names its state.

use belayer_ipc::{SandboxSpec, UsernsMode};
use belayer_tests::states::{python_sandbox, Probe};
use belayer_tests::{python_rootfs, Daemon};

/// A python sandbox in the host's user namespace (`--userns=host`).
fn host_userns_sandbox(d: &Daemon) -> String {
    d.image("python", &python_rootfs());
    d.create_spec(SandboxSpec {
        image: "python".into(),
        userns: Some(UsernsMode::Host),
        ..SandboxSpec::default()
    })
    .id
}

/// State: the same connections (zdtm `socket-tcpbuf`) in a sandbox in the host's user
/// namespace, where CRIU can restore them: every byte arrives, in order. Three rounds, since
/// the failure this guards against (the first restored end transmits its unsent data while
/// the other end does not exist yet, the fresh namespace answers RST: "Can't restore not-sent
/// send queue data: Broken pipe") is a race; the restore's network lock prevents it.
#[test]
fn tcp_send_queue_with_unsent_data_survives_in_the_host_userns() {
    let d = Daemon::start();
    let id = host_userns_sandbox(&d);
    let p = Probe::python(&d, &id, "tcpbuf", TCPBUF);
    for _ in 0..3 {
        p.checkpoint_kill_restore();
    }
    p.assert_pass();
    eprintln!("tcpbuf: {}", p.log());
}

/// State: an established loopback connection whose send queue holds data the peer has not
/// acknowledged and data never sent (the receiver's window is closed), in both directions
/// (zdtm `socket-tcpbuf`), in a sandbox with a private user namespace (the default): its
/// network namespace belongs to that user namespace, so the tasks CRIU restores may put their
/// sockets in repair mode; every byte arrives, in order, over three rounds (the network lock
/// is taken at CRIU's post-setup-namespaces stage).
#[test]
fn tcp_send_queue_with_unsent_data_survives_in_a_private_userns() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(&d, &id, "tcpbuf", TCPBUF);
    for _ in 0..3 {
        p.checkpoint_kill_restore();
    }
    p.assert_pass();
    eprintln!("tcpbuf: {}", p.log());
}

/// State: the dev server with a client mid-request, in a sandbox with a private user
/// namespace: the client finishes its request after the restore and gets the answer.
#[test]
fn dev_server_with_clients_mid_request_survives_in_a_private_userns() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(&d, &id, "devserver", DEV_SERVER);
    p.checkpoint_kill_restore();
    p.checkpoint_kill_restore();
    p.assert_pass();
}

const TCPBUF: &str = r#"
import socket, select
def pattern(n, off):
    return bytes((off + i) % 251 for i in range(n))
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
a = socket.create_connection(srv.getsockname())
b, _ = srv.accept()
def fill(s):
    s.setblocking(False)
    sent = 0
    chunk = 65536
    while True:
        try:
            sent += s.send(pattern(chunk, sent)[: chunk])
        except BlockingIOError:
            return sent
# The pattern restarts each chunk at `sent`, so byte k of the stream is k % 251.
sent_ab = fill(a)
sent_ba = fill(b)
def drain(s, want):
    s.setblocking(False)
    got = bytearray()
    deadline = time.time() + 20
    while len(got) < want and time.time() < deadline:
        r, _, _ = select.select([s], [], [], 0.5)
        if r:
            data = s.recv(1 << 20)
            if not data:
                break
            got += data
    return bytes(got)
ready()
wait_term()
for name, s, want in (("a->b", b, sent_ab), ("b->a", a, sent_ba)):
    t0 = time.time()
    got = drain(s, want)
    print(f"{name}: {want} bytes in {time.time() - t0:.3f} s", flush=True)
    check(len(got) == want, f"{name}: {len(got)} of {want} bytes arrived")
    check(got == pattern(len(got), 0), f"{name}: data differs")
check(sent_ab > 0 and sent_ba > 0, "nothing queued")
finish()
"#;

/// State: a dev server listening on loopback, idle (no connection), in a sandbox with a
/// private user namespace: after the restore it accepts a new client and answers it.
#[test]
fn listening_server_survives_in_a_private_userns() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    let p = Probe::python(&d, &id, "listen", LISTEN);
    p.checkpoint_kill_restore();
    p.assert_pass();
}

const LISTEN: &str = r#"
import socket, threading
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8765))
srv.listen(16)
def serve():
    while True:
        c, _ = srv.accept()
        c.sendall(b"hello " + c.recv(100))
        c.close()
threading.Thread(target=serve, daemon=True).start()
ready()
wait_term()
c = socket.create_connection(("127.0.0.1", 8765), timeout=5)
c.sendall(b"after")
check(c.recv(100) == b"hello after", "no answer after restore")
finish()
"#;

/// State: an agent's dev server with a client connected mid-request (the request half sent,
/// the server blocked reading the rest), in the host user namespace: after the restore the
/// client finishes its request and gets the answer, and a new client is served too.
#[test]
fn dev_server_with_clients_mid_request_survives() {
    let d = Daemon::start();
    let id = host_userns_sandbox(&d);
    let p = Probe::python(&d, &id, "devserver", DEV_SERVER);
    p.checkpoint_kill_restore();
    p.assert_pass();
}

const DEV_SERVER: &str = r#"
import socket, threading
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(16)
def handle(c):
    req = b""
    while not req.endswith(b"\r\n\r\n"):
        data = c.recv(100)
        if not data:
            return
        req += data
    c.sendall(b"HTTP/1.0 200 OK\r\n\r\n" + req.split(b" ")[1])
    c.close()
a = socket.create_connection(srv.getsockname())
s, _ = srv.accept()
threading.Thread(target=handle, args=(s,), daemon=True).start()
a.sendall(b"GET /first HTT")
time.sleep(0.1)
ready()
wait_term()
a.sendall(b"P/1.0\r\n\r\n")
a.settimeout(5)
resp = b""
try:
    while True:
        data = a.recv(1000)
        if not data:
            break
        resp += data
except OSError as e:
    check(False, f"first client: {e!r}")
check(resp == b"HTTP/1.0 200 OK\r\n\r\n/first", f"first client got {resp!r}")
b = socket.create_connection(srv.getsockname(), timeout=5)
s2, _ = srv.accept()
threading.Thread(target=handle, args=(s2,), daemon=True).start()
b.sendall(b"GET /second HTTP/1.0\r\n\r\n")
check(b.recv(1000).endswith(b"/second"), "second client unanswered")
finish()
"#;

/// State: in-flight connections (zdtm `socket-tcp-skip-in-flight`): a client connected to a
/// listening socket whose server has not accepted it yet (the server's end exists only in the
/// listen queue), in the host user namespace. CRIU cannot dump a connection still in an accept
/// queue; with `--skip-in-flight` the checkpoint leaves it out, so after the restore the
/// listener is there (and serves new clients), the server never sees that connection, and the
/// client's next segment is answered with RST: it sees `ECONNRESET`, as after a network
/// failure, instead of the checkpoint failing.
#[test]
fn in_flight_connection_is_reset_after_restore() {
    let d = Daemon::start();
    let id = host_userns_sandbox(&d);
    let p = Probe::python(&d, &id, "inflight", IN_FLIGHT);
    p.checkpoint_kill_restore();
    p.assert_pass();
}

const IN_FLIGHT: &str = r#"
import socket
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(16)
a = socket.create_connection(srv.getsockname())
a.sendall(b"early")
ready()
wait_term()
srv.settimeout(0.5)
try:
    srv.accept()
    check(False, "the in-flight connection was accepted")
except TimeoutError:
    pass
a.settimeout(5)
try:
    a.sendall(b"more")
    got = a.recv(100)
    check(False, f"client read {got!r} instead of a reset")
except ConnectionResetError:
    pass
except OSError as e:
    check(False, f"client: {e!r} instead of a reset")
srv.settimeout(5)
b = socket.create_connection(srv.getsockname(), timeout=5)
s, _ = srv.accept()
b.sendall(b"new")
check(s.recv(100) == b"new", "new client not served")
finish()
"#;

/// State (hostile): a sandbox holding thousands of loopback connections (1000 pairs, idle) and eight
/// pairs with both send queues flooded to the kernel's limit, in the host user namespace:
/// the checkpoint and restore end well inside CRIU's time limit, and afterwards every idle
/// connection still carries data and every flooded one delivers its whole queue in order.
#[test]
fn many_connections_and_flooded_queues_survive() {
    let d = Daemon::start();
    let id = host_userns_sandbox(&d);
    let p = Probe::python(&d, &id, "flood", FLOOD);
    let t = std::time::Instant::now();
    let info = p.checkpoint_kill_restore();
    let took = t.elapsed();
    eprintln!(
        "flood: checkpoint + kill + restore took {took:?}; restore {:?}",
        info.timings_ms
    );
    assert!(took < std::time::Duration::from_secs(120), "took {took:?}");
    p.assert_pass();
}

const FLOOD: &str = r#"
import socket, select, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))
def pattern(n, off):
    return bytes((off + i) % 251 for i in range(n))
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1024)
def pair():
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    return a, b
idle = [pair() for _ in range(1000)]
def fill(s):
    s.setblocking(False)
    sent = 0
    while True:
        try:
            sent += s.send(pattern(65536, sent))
        except BlockingIOError:
            return sent
flooded = []
for _ in range(8):
    a, b = pair()
    flooded.append((a, b, fill(a), fill(b)))
def drain(s, want):
    s.setblocking(False)
    got = bytearray()
    deadline = time.time() + 30
    p = select.poll()
    p.register(s, select.POLLIN)
    while len(got) < want and time.time() < deadline:
        if p.poll(500):
            data = s.recv(1 << 20)
            if not data:
                break
            got += data
    return bytes(got)
ready()
wait_term()
bad = 0
for a, b in idle:
    a.sendall(b"x")
    b.settimeout(5)
    if b.recv(1) != b"x":
        bad += 1
check(bad == 0, f"{bad} idle connections broken")
for i, (a, b, ab, ba) in enumerate(flooded):
    got = drain(b, ab)
    check(got == pattern(ab, 0), f"flood {i} a->b: {len(got)} of {ab} bytes")
    got = drain(a, ba)
    check(got == pattern(ba, 0), f"flood {i} b->a: {len(got)} of {ba} bytes")
finish()
"#;
