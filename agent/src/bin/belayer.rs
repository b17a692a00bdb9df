//! `belayer`: command-line client of `belayerd`.

use clap::Parser;

fn main() {
    belayer_agent::helper::dispatch();
    // Like any Unix filter, end quietly when the reader of our output goes away
    // (`belayer sandbox ls | head`) instead of panicking in println!.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = belayer_agent::cli::Cli::parse();
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
