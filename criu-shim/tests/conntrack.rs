//! The dump of a tree in a network namespace of its own, dumped bare (`--empty-ns net`, as a
//! sandbox with a private user namespace is), with the real CRIU, as root: the namespace's
//! conntrack entries are in the images when it has any, and a namespace without any is not
//! looked for in the host-wide conntrack table, a walk of every bucket inside the frozen window
//! (the CRIU that `scripts/setup.sh` builds, with `scripts/criu-patches`; its dump log says so).
//! Skips (printing why) when no usable CRIU, `unshare`, `ip`, `iptables` or `python3` is found.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_criu::{Criu, DumpRequest};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

mod common;

/// Sends one UDP datagram to 127.0.0.1:9 (a conntrack entry, once a rule asks for tracking).
const SEND_UDP: &str = "python3 -c 'import socket; \
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b\"x\", (\"127.0.0.1\", 9))'";

fn missing_tool() -> Option<&'static str> {
    ["unshare", "ip", "iptables", "python3"]
        .into_iter()
        .find(|tool| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

/// Dumps (leaving it running) a `sleep` in a fresh network namespace with `lo` up and a rule
/// that tracks connections, after `traffic` ran in it; returns the images dir's conntrack
/// image size (0 when absent) and the dump log.
fn dump_in_own_netns(criu: &Criu, dir: &Path, traffic: &str) -> (u64, String) {
    let images = dir.join("images");
    std::fs::create_dir_all(&images).unwrap();
    let ready = dir.join("ready");
    let script = format!(
        "ip link set lo up && iptables -A INPUT -m conntrack --ctstate NEW -j ACCEPT && \
         {traffic} && : > {ready} && exec sleep 1000",
        ready = ready.display()
    );
    let mut child =
        common::spawn_in_own_session(Command::new("unshare").args(["-n", "sh", "-c", &script]));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the namespace's set-up failed"
        );
        assert!(Instant::now() < deadline, "the namespace was not set up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // `sleep` replaced the shell once it runs: wait for the exec.
    let pid = child.id() as i32;
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != "sleep\n" {
        assert!(Instant::now() < deadline, "sleep did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
    let work = dir.join("work");
    let dumped = criu.dump(
        &DumpRequest::new(pid, &images, &work)
            .leave_running(true)
            .empty_netns(true),
    );
    let _ = kill(Pid::from_raw(-pid), Signal::SIGKILL);
    let _ = child.wait();
    let log = std::fs::read_to_string(work.join(belayer_criu::DUMP_LOG)).unwrap_or_default();
    if let Err(e) = dumped {
        panic!("dump failed: {e}\n{log}");
    }
    let ct: u64 = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("netns-ct-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    (ct, log)
}

#[test]
fn conntrack_entries_are_dumped_and_an_empty_table_is_not_walked() {
    let Some(criu) = common::criu_or_skip("conntrack") else {
        return;
    };
    if let Some(tool) = missing_tool() {
        println!("SKIP conntrack: no {tool}");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (with_entry, log) = dump_in_own_netns(&criu, &tmp.path().join("entry"), SEND_UDP);
    assert!(
        with_entry > 0,
        "the namespace's conntrack entry is not in the images\n{log}"
    );
    let (without, log) = dump_in_own_netns(&criu, &tmp.path().join("none"), "true");
    assert_eq!(
        without, 0,
        "conntrack entries dumped from an empty namespace"
    );
    assert!(
        log.contains("No conntrack entries in this netns"),
        "the dump looked for conntrack entries of an empty namespace (a CRIU without \
         scripts/criu-patches? run scripts/setup.sh)\n{}",
        log.lines()
            .filter(|l| l.contains("net:"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
