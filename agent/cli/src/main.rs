//! `belayer`: the command-line client of `belayerd` (see the `belayer_cli` library).

use belayer_cli::args::{Cli, Command};
use belayer_cli::client::DaemonError;
use clap::Parser;

fn main() {
    let cli = Cli::parse();
    // Like any Unix filter, end quietly when the reader of our output goes away
    // (`belayer sandbox ls | head`) instead of panicking in println!.
    if !matches!(cli.command, Command::Rollout(_)) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // A rollout injects failures on purpose: warnings about them would only bury the
    // progress bars.
    let default = match cli.command {
        Command::Rollout(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        // Colour only on a terminal (never in a file, a pipe or journald), unless NO_COLOR.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    let printer = belayer_cli::output::Printer { json: cli.json };
    match belayer_cli::run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            let daemon = e.downcast_ref::<DaemonError>();
            let unreachable =
                daemon.is_none() && e.downcast_ref::<belayer_ipc::ClientError>().is_some();
            printer.failed(daemon.map(|d| d.code), unreachable, &format!("{e:#}"));
            std::process::exit(if unreachable { 3 } else { 1 });
        }
    }
}
