//! `belayer-helper`: the single-threaded helper processes of `belayerd` (sandbox init, action
//! exec). `belayerd` runs it only from a sealed memfd copy; see `belayer_daemon::helper`.

fn main() {
    belayer_daemon::helper::dispatch();
    eprintln!("belayer-helper: run by belayerd only (usage: belayer-helper __belayer-helper <init|exec> ...)");
    std::process::exit(125);
}
