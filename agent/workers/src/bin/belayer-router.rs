//! `belayer-router`: the rollout router with token-level context recovery, optionally
//! supervising a main and a shadow worker per GPU; see `belayer_workers::handover`.

use clap::Parser;

/// Command line of `belayer-router`.
#[derive(Debug, Parser)]
#[command(
    name = "belayer-router",
    version,
    about = "Rollout router: routes requests to engines and resumes interrupted ones from their token prefix"
)]
struct Args {
    #[command(flatten)]
    router: belayer_workers::handover::RouterArgs,
}

fn main() {
    belayer_workers::init_logs("warn");
    let args = Args::parse();
    belayer_workers::exit_with(
        belayer_workers::handover::run_router(args.router),
        "belayer-router",
    );
}
