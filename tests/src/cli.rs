//! The `belayer` command line built next to the tests, run against a test daemon.

use std::process::{Command, Output};

use crate::{bin, Daemon};

/// Runs `belayer --socket <d's socket> --json <args>` and returns its output (stdout: the JSON
/// answer, stderr: messages; the exit status as the CLI sets it).
pub fn belayer_json(d: &Daemon, args: &[&str]) -> Output {
    Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .arg("--json")
        .args(args)
        .output()
        .unwrap()
}
