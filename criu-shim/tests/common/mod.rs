//! What the integration tests of this crate share: the CRIU to test with, and processes in a
//! session of their own (so that a dump takes them as a whole tree and a kill of their group
//! reaches all of them).

// Each test file uses some of these.
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use belayer_criu::Criu;

/// The CRIU found as the daemon would find it, or `None` after printing why `test` skips.
pub fn criu_or_skip(test: &str) -> Option<Criu> {
    match Criu::locate(None) {
        Ok(criu) => Some(criu),
        Err(err) => {
            println!("SKIP {test}: {err}");
            None
        }
    }
}

/// Starts `cmd` with its standard streams on `/dev/null`, as the leader of a new session.
pub fn spawn_in_own_session(cmd: &mut Command) -> Child {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid in the forked child before exec; async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

/// One `sleep 1000` in a session of its own (one task, so that every pid its images name is
/// free once it is reaped), given 200 ms to start; and its pid.
pub fn sleeping_task() -> (Child, i32) {
    let child = spawn_in_own_session(Command::new("sleep").arg("1000"));
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(200));
    (child, pid)
}
