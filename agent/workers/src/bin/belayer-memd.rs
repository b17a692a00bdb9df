//! `belayer-memd`: a memory server owning model weights or the KV-cache arena (paper: "State
//! isolation"); see `belayer_workers::memory::cli`.

use clap::Parser;

/// Command line of `belayer-memd`.
#[derive(Debug, Parser)]
#[command(
    name = "belayer-memd",
    version,
    about = "Memory server: owns model weights or the KV-cache arena and hands region descriptors to workers"
)]
struct Args {
    #[command(flatten)]
    server: belayer_workers::memory::cli::MemoryServerArgs,
}

fn main() {
    belayer_workers::init_logs("warn");
    let args = Args::parse();
    belayer_workers::exit_with(
        belayer_workers::memory::cli::run(args.server),
        "belayer-memd",
    );
}
