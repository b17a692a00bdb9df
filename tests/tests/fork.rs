//! `Fork` against the real daemon, kernel and CRIU: N children restored from one checkpoint
//! C_K of a running sandbox, each in an instance of its own (namespaces, cgroup, upper
//! layer, user-namespace range) with L_K and a copy of C_K as its ready checkpoint. Children
//! diverge without seeing each other or the source; a listener is forked into one network
//! namespace per child; a child recovers to C_K; the source's removal and a gc leave the
//! children whole; a daemon SIGKILLed at any point of a fork leaves all children or none,
//! no orphan sandbox dir, cgroup or CRIU process, and ready checkpoints that restore; bad
//! requests and a peer past its cap get typed errors and leave nothing.

use std::collections::BTreeSet;
use std::time::Duration;

use belayer_ipc::{ErrorCode, ForkInfo, ForkRequest, Request, Response};
use belayer_tests::orphans::{criu_running, mounts_under, sandbox_cgroups, sandbox_dirs, settle};
use belayer_tests::peer::{error_of, response, run_as, Op};
use belayer_tests::states::python_sandbox;
use belayer_tests::{busybox_rootfs, unique, Daemon, DaemonOptions, Identity};

fn fork_request(id: &str, count: u32, prefix: Option<u64>) -> Request {
    Request::Fork(ForkRequest {
        id: id.into(),
        prefix,
        checkpoint: None,
        count,
        verify: true,
    })
}

fn fork(d: &Daemon, id: &str, count: u32, prefix: Option<u64>) -> ForkInfo {
    match d.call(fork_request(id, count, prefix)) {
        Response::Forked(f) => f,
        r => panic!("fork of {id} failed: {r:?}\n{}", d.log_text()),
    }
}

fn error(r: Response) -> (ErrorCode, String) {
    match r {
        Response::Error(e) => (e.code, e.message),
        r => panic!("expected an error, got {r:?}"),
    }
}

/// Command lines of the sandbox's `sleep` processes but the image's init (`sleep 3600`),
/// sorted.
fn sleeps(d: &Daemon, id: &str) -> Vec<String> {
    let out = d.sh(
        id,
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep '^sleep ' ; true",
    );
    let mut v: Vec<String> = out
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| l != "sleep 3600")
        .collect();
    v.sort();
    v
}

fn sandbox_ids(d: &Daemon) -> BTreeSet<String> {
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => v.into_iter().map(|s| s.id).collect(),
        r => panic!("{r:?}"),
    }
}

/// The first host uid of the sandbox's user namespace.
fn host_uid_base(d: &Daemon, id: &str) -> u32 {
    let u = d.inspect(id).userns.expect("a user namespace");
    assert_eq!(u.uid_map.len(), 1, "{u:?}");
    u.uid_map[0][1]
}

#[test]
fn eight_children_diverge_and_none_sees_another_or_the_source() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "echo base > /root/base; chown 1000:1000 /root/base; sleep 1000 >/dev/null 2>&1 & echo ok",
    );
    d.checkpoint(&id, 1, b"ctx1");
    // After C_1: no child has it.
    d.sh(&id, "echo later > /root/later");

    let f = fork(&d, &id, 8, None);
    assert_eq!((f.source.as_str(), f.prefix), (id.as_str(), 1));
    assert_eq!(f.context, b"ctx1");
    assert!(f.fork.starts_with("fk-"), "{}", f.fork);
    assert!(f.total_ms > 0.0);
    let children: Vec<String> = f.children.iter().map(|c| c.sandbox.clone()).collect();
    let distinct: BTreeSet<&String> = children.iter().collect();
    assert_eq!(distinct.len(), 8, "{children:?}");
    assert!(!children.contains(&id));
    for c in &f.children {
        assert_eq!(c.prefix, Some(1));
        let v = c.validity.as_ref().expect("verified");
        assert!(v.fs_matches && v.processes_match, "{c:?}");
    }
    let listed = sandbox_ids(&d);
    assert!(children.iter().all(|c| listed.contains(c)), "{listed:?}");

    // Every child diverges: its own file and its own background process.
    for (i, c) in children.iter().enumerate() {
        d.sh(
            c,
            &format!(
                "echo {i} > /root/mine; sleep {} >/dev/null 2>&1 & echo ok",
                2000 + i
            ),
        );
    }
    for (i, c) in children.iter().enumerate() {
        assert_eq!(
            d.sh(
                c,
                "cat /root/base; stat -c %u:%g /root/base; cat /root/mine; \
                 test -e /root/later && echo leaked; true"
            ),
            format!("base\n1000:1000\n{i}"),
            "child {c}"
        );
        assert_eq!(
            sleeps(&d, c),
            vec!["sleep 1000".to_string(), format!("sleep {}", 2000 + i)],
            "child {c}"
        );
    }
    assert_eq!(sleeps(&d, &id), vec!["sleep 1000".to_string()]);
    assert_eq!(
        d.sh(
            &id,
            "cat /root/later; test -e /root/mine && echo leaked; true"
        ),
        "later"
    );

    // Own host id ranges; files owned inside by 1000 are owned on the host by base + 1000.
    let mut bases: BTreeSet<u32> = children.iter().map(|c| host_uid_base(&d, c)).collect();
    bases.insert(host_uid_base(&d, &id));
    assert_eq!(bases.len(), 9, "{bases:?}");
    for c in &children {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(d.root(c).join("root/base")).unwrap();
        assert_eq!(meta.uid(), host_uid_base(&d, c) + 1000, "child {c}");
    }

    // Each child's ready checkpoint is its copy of C_1.
    for c in &children {
        let info = d.inspect(c);
        assert_eq!(info.ready_prefix, Some(1), "{info:?}");
        match d.call(Request::ListCheckpoints { id: c.clone() }) {
            Response::Checkpoints(v) => {
                assert_eq!(v.len(), 1, "{v:?}");
                assert!(v[0].ready && v[0].parent.is_none(), "{v:?}");
            }
            r => panic!("{r:?}"),
        }
    }

    // A child that fails comes back to C_1, not to what it did after.
    d.fail_stop(&children[0]);
    let r = d.restore(&children[0]);
    assert_eq!((r.prefix, r.context.as_slice()), (Some(1), &b"ctx1"[..]));
    assert_eq!(
        d.sh(
            &children[0],
            "cat /root/base; test -e /root/mine && echo mine; true"
        ),
        "base"
    );
    assert_eq!(sleeps(&d, &children[0]), vec!["sleep 1000".to_string()]);

    // The source's removal and a gc leave the children whole: their blobs stay.
    assert!(matches!(
        d.call(Request::RemoveSandbox { id: id.clone() }),
        Response::Done
    ));
    let _ = d.call(Request::Gc {
        older_than_s: Some(0),
        tag: None,
    });
    d.fail_stop(&children[1]);
    let r = d.restore(&children[1]);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&children[1], "cat /root/base"), "base");
    // And a child forks in turn, from its own later checkpoint.
    d.checkpoint(&children[2], 2, b"ctx2");
    let g = fork(&d, &children[2], 2, None);
    assert_eq!((g.prefix, g.context.as_slice()), (2, &b"ctx2"[..]));
    for c in &g.children {
        assert_eq!(
            d.sh(&c.sandbox, "cat /root/base; cat /root/mine"),
            "base\n2",
            "grandchild {}",
            c.sandbox
        );
    }
}

const SERVER: &str = r#"
import os, socket, threading, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8765))
srv.listen(16)
open("/tmp/srv.pid", "w").write(str(os.getpid()))
def serve():
    while True:
        c, _ = srv.accept()
        c.sendall(b"hello " + c.recv(100))
        c.close()
threading.Thread(target=serve, daemon=True).start()
while True:
    time.sleep(1)
"#;

const CLIENT: &str = r#"
import socket, sys
try:
    c = socket.create_connection(("127.0.0.1", 8765), timeout=5)
    c.sendall(sys.argv[1].encode())
    print(c.recv(100).decode())
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else repr(e))
"#;

fn ask(d: &Daemon, id: &str, what: &str) -> String {
    d.sh(id, &format!("python3 /tmp/client.py {what}"))
        .trim()
        .to_string()
}

#[test]
fn a_listener_is_forked_into_one_network_namespace_per_child() {
    let d = Daemon::start();
    let id = python_sandbox(&d);
    belayer_tests::states::write_file(&d, &id, "/tmp/server.py", SERVER);
    belayer_tests::states::write_file(&d, &id, "/tmp/client.py", CLIENT);
    d.sh(
        &id,
        "python3 /tmp/server.py >/dev/null 2>&1 & \
         for i in $(seq 100); do test -s /tmp/srv.pid && break; sleep 0.05; done; echo up",
    );
    assert_eq!(ask(&d, &id, "src"), "hello src");
    d.checkpoint(&id, 1, b"listening");
    let f = fork(&d, &id, 3, None);
    let children: Vec<String> = f.children.iter().map(|c| c.sandbox.clone()).collect();
    let netns = |s: &str| d.sh(s, "readlink /proc/self/ns/net").trim().to_string();
    let mut seen: BTreeSet<String> = children.iter().map(|c| netns(c)).collect();
    seen.insert(netns(&id));
    assert_eq!(seen.len(), 4, "network namespaces {seen:?}");
    for (i, c) in children.iter().enumerate() {
        assert_eq!(
            ask(&d, c, &format!("c{i}")),
            format!("hello c{i}"),
            "child {c}"
        );
    }
    // Stopping one child's server stops only that one.
    d.sh(&children[0], "kill $(cat /tmp/srv.pid); sleep 0.2; echo");
    assert_eq!(ask(&d, &children[0], "x"), "refused");
    assert_eq!(ask(&d, &children[1], "y"), "hello y");
    assert_eq!(ask(&d, &id, "src"), "hello src");
}

#[test]
fn bad_fork_requests_get_typed_errors_and_leave_nothing() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    let (code, msg) = error(d.call(fork_request(&id, 2, None)));
    assert_eq!(code, ErrorCode::NotFound, "{msg}");
    assert!(msg.contains("no ready checkpoint"), "{msg}");
    d.checkpoint(&id, 1, b"ctx1");
    for count in [0, 257, u32::MAX] {
        let (code, msg) = error(d.call(fork_request(&id, count, None)));
        assert_eq!(code, ErrorCode::BadRequest, "count {count}: {msg}");
    }
    let (code, msg) = error(d.call(fork_request(&id, 2, Some(7))));
    assert_eq!(code, ErrorCode::NotFound, "{msg}");
    for name in ["c999999-k1", "../../etc", "", "c000001-k1/../x"] {
        let r = d.call(Request::Fork(ForkRequest {
            id: id.clone(),
            prefix: None,
            checkpoint: Some(name.into()),
            count: 1,
            verify: false,
        }));
        let (code, msg) = error(r);
        assert!(
            matches!(code, ErrorCode::NotFound | ErrorCode::BadRequest),
            "{name:?}: {code:?} {msg}"
        );
    }
    let (code, _) = error(d.call(fork_request("sb-000000000000", 1, None)));
    assert_eq!(code, ErrorCode::UnknownSandbox);
    assert_eq!(sandbox_ids(&d), BTreeSet::from([id.clone()]));
    let dirs = sandbox_dirs(&d);
    assert_eq!(dirs, BTreeSet::from([id.clone()]), "{dirs:?}");
    // The source is untouched and still forks.
    assert_eq!(fork(&d, &id, 1, Some(1)).children.len(), 1);
}

/// Group allowed on the daemon socket.
const SOCKET_GID: u32 = 4272;

/// The peer's entry point (see `belayer_tests::peer`).
#[test]
fn peer_child() {
    belayer_tests::peer::child_main();
}

#[test]
fn a_peer_forks_only_its_own_sandboxes_within_its_cap() {
    let d = Daemon::start_options(DaemonOptions {
        socket_gid: Some(SOCKET_GID),
        test_hooks: true,
        config: "max_sandboxes_per_uid = 3\n".into(),
        ..DaemonOptions::default()
    });
    d.image("busybox", &busybox_rootfs());
    let roots = d.create("busybox").id;
    d.checkpoint(&roots, 1, b"root's");
    let who = Identity::nobody(&[SOCKET_GID]);
    let made = run_as(
        &d,
        &who,
        &[Op::Call(Request::CreateSandbox(belayer_ipc::SandboxSpec {
            image: "busybox".into(),
            ..Default::default()
        }))],
    );
    let own = match response(&made[0]) {
        Response::Sandbox(s) => s.id.clone(),
        r => panic!("{r:?}"),
    };
    d.checkpoint(&own, 1, b"peer's");
    let results = run_as(
        &d,
        &who,
        &[
            Op::Call(fork_request(&roots, 1, None)),
            Op::Call(fork_request(&own, 3, None)),
            Op::Call(fork_request(&own, 2, None)),
            Op::Call(Request::ListSandboxes),
        ],
    );
    let (code, _) = error_of(&results[0]);
    assert_eq!(
        code,
        ErrorCode::UnknownSandbox,
        "another's sandbox is unknown"
    );
    let (code, msg) = error_of(&results[1]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{msg}");
    assert!(msg.contains("already holds"), "{msg}");
    let f = match response(&results[2]) {
        Response::Forked(f) => f.clone(),
        r => panic!("{r:?}\n{}", d.log_text()),
    };
    assert_eq!(f.context, b"peer's");
    match response(&results[3]) {
        Response::Sandboxes(v) => {
            let ids: BTreeSet<&str> = v.iter().map(|s| s.id.as_str()).collect();
            let mut want: BTreeSet<&str> = f.children.iter().map(|c| c.sandbox.as_str()).collect();
            want.insert(&own);
            assert_eq!(
                ids, want,
                "the peer owns its children and sees nothing else"
            );
        }
        r => panic!("{r:?}"),
    }
    assert_eq!(sandbox_ids(&d).len(), 4);
}

#[test]
fn a_daemon_killed_during_a_fork_leaves_all_children_or_none_and_no_orphan() {
    let parent = format!("belayer-fork-test-{}-{}", std::process::id(), unique());
    let mut d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: format!("cgroup_parent = \"{parent}\"\n"),
        ..DaemonOptions::default()
    });
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(
        &id,
        "echo base > /root/base; sleep 1000 >/dev/null 2>&1 & echo ok",
    );
    d.checkpoint(&id, 1, b"ctx1");
    let mut outcomes = Vec::new();
    for delay_ms in [0u64, 2, 5, 10, 20, 40, 80, 150, 300, 600] {
        let mut client = d.client();
        let req = fork_request(&id, 4, None);
        let call = std::thread::spawn(move || client.call(req));
        std::thread::sleep(Duration::from_millis(delay_ms));
        d.kill();
        let answered = matches!(call.join().unwrap(), Ok(Response::Forked(_)));
        d.restart();
        let ids = sandbox_ids(&d);
        let children: BTreeSet<String> = ids.iter().filter(|s| **s != id).cloned().collect();
        assert!(ids.contains(&id), "the source was lost at {delay_ms} ms");
        assert!(
            children.is_empty() || children.len() == 4,
            "{} children after a kill at {delay_ms} ms: {children:?}",
            children.len()
        );
        assert!(!answered || children.len() == 4, "answered but lost");
        settle(&format!("orphan dirs at {delay_ms} ms"), || {
            sandbox_dirs(&d) == ids
        });
        settle(&format!("orphan cgroups at {delay_ms} ms"), || {
            sandbox_cgroups(&parent) == ids
        });
        settle(&format!("orphan CRIU at {delay_ms} ms"), || {
            !criu_running(&d)
        });
        settle(&format!("orphan mounts at {delay_ms} ms"), || {
            mounts_under(&d)
                .iter()
                .all(|m| ids.iter().any(|i| m.contains(&format!("/sandboxes/{i}/"))))
        });
        assert!(
            !std::fs::read_dir(d.state_dir.join("forks"))
                .map(|mut e| e.next().is_some())
                .unwrap_or(false),
            "commit markers left at {delay_ms} ms"
        );
        for c in &children {
            assert_eq!(d.sh(c, "cat /root/base"), "base", "child {c}");
            assert_eq!(sleeps(&d, c), vec!["sleep 1000".to_string()]);
            assert!(matches!(
                d.call(Request::RemoveSandbox { id: c.clone() }),
                Response::Done
            ));
        }
        outcomes.push((delay_ms, children.len()));
    }
    eprintln!("(kill delay ms, children kept): {outcomes:?}");
    // The source's ready checkpoint restores, and a fork after all that works.
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, Some(1));
    assert_eq!(d.sh(&id, "cat /root/base"), "base");
    let f = fork(&d, &id, 2, None);
    assert_eq!(f.children.len(), 2);
    drop(d);
    settle("cgroups of the test's parent", || {
        sandbox_cgroups(&parent).is_empty()
    });
}
