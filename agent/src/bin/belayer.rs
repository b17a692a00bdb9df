//! `belayer`: command-line client of `belayerd`.

use clap::Parser;

fn main() {
    let cli = belayer_agent::cli::Cli::parse();
    // Like any Unix filter, end quietly when the reader of our output goes away
    // (`belayer sandbox ls | head`) instead of panicking in println!. Only for the plain client
    // commands: servers (memory servers, router, engines, an embedded agent) rely on EPIPE.
    use belayer_agent::cli::Command as C;
    if matches!(
        cli.command,
        C::Status
            | C::Image(_)
            | C::Sandbox(_)
            | C::Exec(_)
            | C::Checkpoint(_)
            | C::Restore(_)
            | C::Checkpoints { .. }
            | C::Gc(_)
    ) {
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // A rollout injects failures on purpose: the embedded agent's warnings about them would
    // only bury the progress bars.
    let default = match cli.command {
        belayer_agent::cli::Command::Rollout(_) => "error",
        _ => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
    match belayer_agent::cli::run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            let code = if e
                .downcast_ref::<belayer_agent::cli::DaemonError>()
                .is_some()
            {
                1
            } else if e.downcast_ref::<belayer_ipc::ClientError>().is_some() {
                3
            } else {
                1
            };
            std::process::exit(code);
        }
    }
}
