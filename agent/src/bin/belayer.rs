//! `belayer`: command-line client of `belayerd`.

use clap::Parser;

fn main() {
    belayer_agent::helper::dispatch();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BELAYER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = belayer_agent::cli::Cli::parse();
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
