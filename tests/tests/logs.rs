//! The daemon's logs as a file or journald sees them: no ANSI colour codes when stderr is not
//! a terminal, and `--log-format json` (here through `BELAYER_LOG_FORMAT`) writes one JSON
//! object per line with the level, the target and the event's fields. One test in its own
//! binary: it sets an environment variable the daemons it starts inherit.

use belayer_tests::{busybox_rootfs, Daemon};

#[test]
fn logs_have_no_colour_off_a_terminal_and_json_lines_parse() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let sb = d.create("busybox");
    assert_eq!(d.sh(&sb.id, "echo hi"), "hi");
    let text = d.log_text();
    assert!(text.contains("sandbox created"), "{text}");
    assert!(
        !text.contains("\u{1b}["),
        "ANSI codes in a log file:\n{text}"
    );
    drop(d);

    // SAFETY of the test: the only test of this binary, so no thread reads the environment
    // concurrently.
    std::env::set_var("BELAYER_LOG_FORMAT", "json");
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let sb = d.create("busybox");
    assert_eq!(d.sh(&sb.id, "echo hi"), "hi");
    let text = d.log_text();
    let mut created = false;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        assert!(v["level"].is_string() && v["target"].is_string(), "{line}");
        assert!(v["timestamp"].is_string(), "{line}");
        if v["fields"]["message"] == "sandbox created" {
            assert_eq!(v["fields"]["sandbox"], sb.id.as_str(), "{line}");
            created = true;
        }
    }
    assert!(created, "no `sandbox created` event:\n{text}");
    std::env::remove_var("BELAYER_LOG_FORMAT");
}
