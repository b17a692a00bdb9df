//! `belayer-toy-engine`: the deterministic reference engine (main or standby shadow worker);
//! see `belayer_workers::handover::engine`.

use clap::Parser;

/// Command line of `belayer-toy-engine`.
#[derive(Debug, Parser)]
#[command(
    name = "belayer-toy-engine",
    version,
    about = "Deterministic reference LLM engine with weights and KV blocks in memory servers"
)]
struct Args {
    #[command(flatten)]
    engine: belayer_workers::handover::engine::EngineArgs,
}

fn main() {
    belayer_workers::init_logs("warn");
    let args = Args::parse();
    belayer_workers::exit_with(
        belayer_workers::handover::engine::run(args.engine),
        "belayer-toy-engine",
    );
}
