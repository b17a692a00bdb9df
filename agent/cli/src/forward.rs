//! Commands that other Belayer programs serve, kept so that old command lines still work:
//! `belayer bench` runs `belayer-bench`, `belayer memory-server` runs `belayer-memd`,
//! `belayer toy-engine` runs `belayer-toy-engine` and `belayer router` runs `belayer-router`,
//! each from the directory of this binary, replacing this process (`execv`), so signals,
//! stdout and the exit status are the program's own.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

/// A program `belayer` forwards to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    /// `belayer-bench` (takes `--socket` and `--json`).
    Bench,
    /// `belayer-memd` (takes `--socket` and `--json`).
    Memd,
    /// `belayer-toy-engine`.
    ToyEngine,
    /// `belayer-router`.
    Router,
}

impl Program {
    /// File name of the program's binary.
    pub fn file_name(self) -> &'static str {
        match self {
            Program::Bench => "belayer-bench",
            Program::Memd => "belayer-memd",
            Program::ToyEngine => "belayer-toy-engine",
            Program::Router => "belayer-router",
        }
    }

    /// Whether the program takes the global `--socket` and `--json` of `belayer`.
    fn takes_globals(self) -> bool {
        matches!(self, Program::Bench | Program::Memd)
    }
}

/// The path of `name` next to the running binary.
///
/// Errors: the running binary's path cannot be read.
pub fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the belayer binary")?;
    Ok(exe.with_file_name(name))
}

/// The command line `belayer` runs for `program` with `args` (the global `--socket` and
/// `--json` go first where the program takes them, unless `args` names its own socket).
pub fn command(
    program: Program,
    exe: &Path,
    socket: &Path,
    json: bool,
    args: &[OsString],
) -> Command {
    let mut cmd = Command::new(exe);
    if program.takes_globals() {
        let own_socket = args
            .iter()
            .any(|a| a == "--socket" || a.to_string_lossy().starts_with("--socket="));
        if !own_socket {
            cmd.arg("--socket").arg(socket);
        }
        if json {
            cmd.arg("--json");
        }
    }
    cmd.args(args);
    cmd
}

/// Replaces this process with `program`; returns only on failure.
///
/// Errors: the program is not installed next to `belayer`, or cannot be executed.
pub fn exec(program: Program, socket: &Path, json: bool, args: &[OsString]) -> Result<i32> {
    let exe = sibling(program.file_name())?;
    let err = command(program, &exe, socket, json, args).exec();
    Err(err).with_context(|| {
        format!(
            "cannot run {} (it is installed next to belayer; build it with `cargo build --workspace --bins`)",
            exe.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn globals_go_to_the_programs_that_take_them() {
        let args: Vec<OsString> = vec!["capture".into(), "--runs".into(), "3".into()];
        let cmd = command(
            Program::Bench,
            Path::new("/b"),
            Path::new("/s"),
            true,
            &args,
        );
        assert_eq!(
            argv(&cmd),
            ["--socket", "/s", "--json", "capture", "--runs", "3"]
        );
        let cmd = command(
            Program::Router,
            Path::new("/r"),
            Path::new("/s"),
            true,
            &args,
        );
        assert_eq!(argv(&cmd), ["capture", "--runs", "3"]);
        let own: Vec<OsString> = vec!["--socket=/m".into(), "--role".into(), "kv".into()];
        let cmd = command(Program::Memd, Path::new("/m"), Path::new("/s"), false, &own);
        assert_eq!(argv(&cmd), ["--socket=/m", "--role", "kv"]);
    }
}
