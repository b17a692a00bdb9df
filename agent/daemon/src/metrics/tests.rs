//! The families' text: names, labels, histogram sums, and gauges set from a live sample.

use super::*;
use belayer_ipc::{CheckpointTimings, ExecResult};

fn exec(exit_code: i32, duration_ms: f64) -> ExecResult {
    ExecResult {
        exit_code,
        signal: None,
        stdout: Vec::new(),
        stderr: Vec::new(),
        truncated: false,
        timed_out: false,
        duration_ms,
        infra_fault: None,
        dirty: None,
    }
}

#[test]
fn recorded_events_and_live_state_appear_in_the_text() {
    let m = Metrics::new("0.1.0", 10, "4.2");
    m.action(Ok(&exec(0, 250.0)));
    m.action(Ok(&exec(3, 10.0)));
    m.action(Err(ErrorCode::UnknownSandbox));
    let info = CheckpointInfo {
        sandbox: "s".into(),
        prefix: 1,
        checkpoint: "c".into(),
        bytes: 10_000,
        context_digest: String::new(),
        timings_ms: CheckpointTimings {
            frozen_total: 20.0,
            total: 80.0,
            ..Default::default()
        },
        created_unix_ms: 0,
        ..Default::default()
    };
    m.checkpoint(Ok(&info));
    m.checkpoint(Err(ErrorCode::CheckpointFailed));
    m.checkpoint_skipped(DecisionReason::Clean);
    m.infra_fault("oom");
    let text = m.encode(&LiveSample {
        sandboxes: vec![(SandboxState::Running, 3), (SandboxState::Failed, 1)],
        layer_bytes: 1 << 20,
        threads: 7,
        connections_refused: 5,
        ..Default::default()
    });
    for line in [
        "belayer_build_info{version=\"0.1.0\",protocol=\"10\",criu=\"4.2\"} 1",
        "belayer_actions_total{outcome=\"ok\"} 1",
        "belayer_actions_total{outcome=\"nonzero_exit\"} 1",
        "belayer_actions_total{outcome=\"UnknownSandbox\"} 1",
        "belayer_action_duration_seconds_count 2",
        "belayer_checkpoints_total{result=\"taken\"} 1",
        "belayer_checkpoints_total{result=\"CheckpointFailed\"} 1",
        "belayer_checkpoints_skipped_total{reason=\"clean\"} 1",
        "belayer_checkpoint_frozen_seconds_sum 0.02",
        "belayer_checkpoint_size_bytes_sum 10000.0",
        "belayer_infra_faults_total{kind=\"oom\"} 1",
        "belayer_sandboxes{state=\"running\"} 3",
        "belayer_sandboxes{state=\"checkpointing\"} 0",
        "belayer_sandboxes{state=\"failed\"} 1",
        "belayer_image_layers_bytes 1048576",
        "belayer_threads 7",
        "belayer_connections_refused_total 5",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    assert!(text.ends_with("# EOF\n"));
    // Server totals are copied, not added twice.
    let again = m.encode(&LiveSample {
        connections_refused: 5,
        ..Default::default()
    });
    assert!(again
        .lines()
        .any(|l| l == "belayer_connections_refused_total 5"));
}
