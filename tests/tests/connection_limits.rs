//! The real `belayerd` under a flood of idle connections: its threads stay bounded by the
//! connection limit and a normal client is still answered at once.

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use belayer_ipc::{ConnectionLimits, Request, Response};
use belayer_tests::Daemon;

fn threads_of(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("daemon status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: line")
}

#[test]
fn three_thousand_idle_connections_leave_belayerd_answering_with_bounded_threads() {
    let daemon = Daemon::start();
    let pid = daemon.pid().expect("daemon running");
    assert!(matches!(daemon.call(Request::Status), Response::Status(_)));
    let baseline = threads_of(pid);
    let mut peak = baseline;
    let mut idle = Vec::with_capacity(3000);
    let started = Instant::now();
    for i in 0..3000 {
        idle.push(UnixStream::connect(&daemon.socket).expect("connect"));
        if i % 25 == 0 {
            peak = peak.max(threads_of(pid));
        }
    }
    let settle = Instant::now() + Duration::from_secs(2);
    while Instant::now() < settle {
        peak = peak.max(threads_of(pid));
        std::thread::sleep(Duration::from_millis(20));
    }
    let asked = Instant::now();
    let status = daemon.call(Request::Status);
    let answered_in = asked.elapsed();
    peak = peak.max(threads_of(pid));
    eprintln!(
        "belayerd: 3000 idle connections opened in {:?}; threads {baseline} before, peak \
         {peak}; Status answered in {answered_in:?}",
        started.elapsed()
    );
    assert!(matches!(status, Response::Status(_)), "{status:?}");
    assert!(answered_in < Duration::from_secs(5), "{answered_in:?}");
    // One thread per served connection (default limit), 16 more at most while evicted ones
    // end, and a few for the daemon's own background work.
    let bound = baseline + ConnectionLimits::default().connections.total + 16 + 8;
    assert!(
        peak <= bound,
        "belayerd peaked at {peak} threads, over {bound}"
    );
    drop(idle);
    // Once the flood is gone the daemon goes on serving.
    assert!(matches!(daemon.call(Request::Ping), Response::Pong { .. }));
}
