//! One sample of every message variant, and the variant indices that make a new variant a
//! compile error until it has a sample.

use crate::frame::PROTOCOL_VERSION;
use crate::message::*;

pub(super) fn sandbox_info(id: &str) -> SandboxInfo {
    SandboxInfo {
        id: id.to_owned(),
        image: "base".to_owned(),
        state: crate::SandboxState::Running,
        init_pid: Some(4242),
        pids: vec![4242, 4243],
        cgroup: "/belayer/sb-1".to_owned(),
        ready_prefix: Some(3),
        instance: 1,
        tag: Some("rollout-7".to_owned()),
        created_unix_ms: 1_700_000_000_000,
        userns: Some(UsernsInfo {
            mode: "private".to_owned(),
            uid_map: vec![[0, 1 << 30, 65536]],
            gid_map: vec![[0, 1 << 30, 65536]],
        }),
        limits: SandboxLimits {
            memory_max: Some(512 << 20),
            pids_max: Some(256),
            cpus: Some(1.5),
            disk_max: None,
        },
        env: vec![("LANG".to_owned(), "C".to_owned())],
        workdir: Some("/work".to_owned()),
        user: Some((1000, 1000)),
        image_digest: Some(format!("sha256:{}", "ab".repeat(32))),
    }
}

pub(super) fn checkpoint_info() -> CheckpointInfo {
    CheckpointInfo {
        sandbox: "sb-1".to_owned(),
        prefix: 3,
        checkpoint: "sb-1-3".to_owned(),
        bytes: 1 << 20,
        context_digest: "ab".repeat(32),
        parent: Some("sb-1-2".to_owned()),
        ready: true,
        timings_ms: CheckpointTimings {
            freeze: 1.5,
            fs_capture: 2.5,
            upper_snapshot: 3.5,
            criu_dump: 30.0,
            publish: 0.25,
            frozen_total: 34.0,
            total: 40.0,
        },
        created_unix_ms: 1_700_000_000_001,
    }
}

pub(super) fn image_info() -> ImageInfo {
    ImageInfo {
        name: "base".to_owned(),
        bytes: 123_456,
        created_unix_ms: 1_700_000_000_002,
        owner_uid: 1000,
        dropped_devices: 6,
        skipped_sockets: 1,
        digest: Some(format!("sha256:{}", "cd".repeat(32))),
        source: "localhost:5000/swe/task:1".to_owned(),
        kind: "oci".to_owned(),
        layers: vec![crate::LayerInfo {
            diff_id: format!("sha256:{}", "ef".repeat(32)),
            bytes: 4096,
            entries: 12,
            images: 2,
        }],
        config: Some(crate::ImageConfig {
            env: vec![("A".to_owned(), "1".to_owned())],
            workdir: Some("/w".to_owned()),
            user: Some("app".to_owned()),
            user_ids: Some((1000, 1000)),
            entrypoint: vec![],
            cmd: vec!["sh".to_owned()],
        }),
    }
}

/// Index of each request variant; the match makes a new variant a compile error here.
pub(super) fn request_variant(request: &Request) -> usize {
    match request {
        Request::Ping => 0,
        Request::ImportImage { .. } => 1,
        Request::ListImages => 2,
        Request::RemoveImage { .. } => 3,
        Request::CreateSandbox(_) => 4,
        Request::ListSandboxes => 5,
        Request::InspectSandbox { .. } => 6,
        Request::RemoveSandbox { .. } => 7,
        Request::Exec(_) => 8,
        Request::Checkpoint(_) => 9,
        Request::Restore { .. } => 10,
        Request::ListCheckpoints { .. } => 11,
        Request::Gc { .. } => 12,
        Request::Status => 13,
        Request::MaybeCheckpoint(_) => 14,
        Request::ContextAppend { .. } => 15,
        Request::ContextLookup { .. } => 16,
        Request::Subscribe => 17,
        Request::ContextRemove { .. } => 18,
        Request::Upload(_) => 19,
        Request::UploadChunk { .. } => 20,
        Request::TransferCancel => 21,
        Request::Download(_) => 22,
        Request::PullImage(_) => 23,
        Request::ImportOci(_) => 24,
        Request::RestoreCheckpoint { .. } => 25,
        Request::Fork(_) => 26,
    }
}
pub(super) const REQUEST_VARIANTS: usize = 27;

pub(super) fn response_variant(response: &Response) -> usize {
    match response {
        Response::Pong { .. } => 0,
        Response::Image(_) => 1,
        Response::Images(_) => 2,
        Response::Sandbox(_) => 3,
        Response::Sandboxes(_) => 4,
        Response::Exec(_) => 5,
        Response::Checkpoint(_) => 6,
        Response::Checkpoints(_) => 7,
        Response::Restored(_) => 8,
        Response::Gc { .. } => 9,
        Response::Status(_) => 10,
        Response::Done => 11,
        Response::Error(_) => 12,
        Response::MaybeCheckpoint(_) => 13,
        Response::Context(_) => 14,
        Response::Subscribed => 15,
        Response::TransferReady { .. } => 16,
        Response::DownloadChunk { .. } => 17,
        Response::Transferred(_) => 18,
        Response::Forked(_) => 19,
    }
}
pub(super) const RESPONSE_VARIANTS: usize = 20;

pub(super) fn all_requests() -> Vec<Request> {
    vec![
        Request::Ping,
        Request::ImportImage {
            name: "base".to_owned(),
            source: "/srv/images/base.tar.zst".to_owned(),
            with_fd: true,
        },
        Request::ListImages,
        Request::RemoveImage {
            name: "base".to_owned(),
        },
        Request::CreateSandbox(SandboxSpec {
            image: "base".to_owned(),
            memory_max: Some(512 << 20),
            pids_max: None,
            env: vec![("PATH".to_owned(), "/usr/bin".to_owned())],
            tag: Some("rollout-7".to_owned()),
            cpus: Some(1.5),
            userns: Some(crate::UsernsMode::Host),
            disk_max: Some(10 << 30),
            workdir: Some("/srv/task".to_owned()),
            user: Some("1000:1000".to_owned()),
        }),
        Request::ListSandboxes,
        Request::InspectSandbox {
            id: "sb-1".to_owned(),
        },
        Request::RemoveSandbox {
            id: "sb-1".to_owned(),
        },
        Request::Exec(ExecRequest {
            id: "sb-1".to_owned(),
            argv: vec!["echo hi".to_owned()],
            cwd: Some("/tmp".to_owned()),
            timeout_ms: Some(5_000),
            env: vec![],
            output_limit: Some(4096),
            stdin: Vec::new(),
            merge_stderr: false,
        }),
        Request::Exec(ExecRequest {
            id: "sb-1".to_owned(),
            argv: vec!["cat".to_owned(), "-".to_owned()],
            cwd: None,
            timeout_ms: None,
            env: vec![("LANG".to_owned(), "C".to_owned())],
            output_limit: None,
            stdin: vec![0, 1, 0xff, b'\n', 0],
            merge_stderr: true,
        }),
        Request::Checkpoint(CheckpointRequest {
            id: "sb-1".to_owned(),
            prefix: 3,
            context: vec![0, 1, 2, 255],
            fault: Some(TestFault {
                at: FailPoint::DuringCriuDump,
                kill_daemon: true,
            }),
        }),
        Request::Restore {
            id: "sb-1".to_owned(),
            verify: true,
            prefix: None,
        },
        Request::Restore {
            id: "sb-1".to_owned(),
            verify: false,
            prefix: Some(2),
        },
        Request::ListCheckpoints {
            id: "sb-1".to_owned(),
        },
        Request::Gc {
            older_than_s: Some(3600),
            tag: None,
        },
        Request::Status,
        Request::MaybeCheckpoint(MaybeCheckpointRequest {
            id: "sb-1".to_owned(),
            prefix: 4,
            context: vec![1, 2, 3],
            step_duration_s: 12.5,
            regen_cost_s: None,
            llm_elapsed_s: 0.0,
            llm_response_s: Some(10.0),
            policy: Some(PolicySpec {
                kind: Some("adaptive".to_owned()),
                failure_p: Some(0.05),
                failure_rate_per_s: None,
                checkpoint_timeout_s: Some(10.0),
                cooldown_s: None,
                ..Default::default()
            }),
        }),
        Request::ContextAppend {
            trajectory: "t-1".to_owned(),
            prefix: 4,
            context: vec![0xff; 8],
        },
        Request::ContextLookup {
            trajectory: "t-1".to_owned(),
            prefix: None,
        },
        Request::Subscribe,
        Request::ContextRemove {
            trajectory: "t-1@5001".to_owned(),
        },
        Request::Upload(UploadRequest {
            id: "sb-1".to_owned(),
            dest: "/root/work".to_owned(),
            archive: false,
            timeout_ms: Some(60_000),
        }),
        Request::UploadChunk {
            data: vec![0, 1, 0xff],
        },
        Request::UploadChunk { data: Vec::new() },
        Request::TransferCancel,
        Request::Download(DownloadRequest {
            id: "sb-1".to_owned(),
            src: "/var/log".to_owned(),
            timeout_ms: None,
        }),
        Request::PullImage(crate::PullRequest {
            reference: "localhost:5000/swe/task:1".to_owned(),
            name: None,
            credentials: crate::RegistryCredentials::Basic {
                username: "u".to_owned(),
                password: "p".to_owned(),
            },
            insecure: true,
        }),
        Request::ImportOci(crate::OciImportRequest {
            name: "task".to_owned(),
            source: "oci:/layouts/task:1".to_owned(),
            manifest: Some(b"{}".to_vec()),
            config: b"{}".to_vec(),
            layers: vec![crate::BlobRange {
                fd: 0,
                offset: 512,
                len: 1024,
            }],
        }),
        Request::RestoreCheckpoint {
            id: "sb-1".to_owned(),
            verify: true,
            checkpoint: "c000004-k2".to_owned(),
        },
        Request::Fork(crate::ForkRequest {
            id: "sb-1".to_owned(),
            prefix: Some(2),
            checkpoint: None,
            count: 8,
            verify: true,
        }),
    ]
}

fn restore_info() -> RestoreInfo {
    RestoreInfo {
        sandbox: "sb-1".to_owned(),
        prefix: Some(3),
        context: vec![9; 100],
        init_pid: 777,
        timings_ms: RestoreTimings {
            teardown: 1.0,
            verify: 2.0,
            fs_install: 3.0,
            mount: 0.5,
            criu_restore: 4.0,
            total: 10.0,
        },
        validity: Some(crate::message::RestoreValidity {
            fs_matches: true,
            processes_match: true,
            expected_processes: vec!["1 sh".to_owned()],
            restored_processes: vec!["1 sh".to_owned()],
        }),
        inodes_kept: true,
        dropped_prefixes: vec![4, 5],
    }
}

pub(super) fn all_responses() -> Vec<Response> {
    vec![
        Response::Pong {
            version: "0.1.0".to_owned(),
        },
        Response::Image(image_info()),
        Response::Images(vec![image_info(), image_info()]),
        Response::Sandbox(sandbox_info("sb-1")),
        Response::Sandboxes(vec![sandbox_info("sb-1"), sandbox_info("sb-2")]),
        Response::Exec(ExecResult {
            exit_code: 137,
            signal: Some(9),
            stdout: b"out".to_vec(),
            stderr: vec![0xff; 10],
            truncated: true,
            timed_out: true,
            duration_ms: 5000.25,
            infra_fault: Some(crate::message::InfraFault {
                kind: crate::message::InfraFaultKind::ExternalKill,
                pid: Some(42),
                signal: Some(9),
            }),
            dirty: Some(true),
        }),
        Response::Checkpoint(checkpoint_info()),
        Response::Checkpoints(vec![checkpoint_info()]),
        Response::Restored(restore_info()),
        Response::Gc {
            removed: 2,
            bytes: 4096,
        },
        Response::Status(StatusInfo {
            version: "0.1.0".to_owned(),
            protocol: PROTOCOL_VERSION,
            criu: "Version: 4.1.1".to_owned(),
            cgroup: "hybrid".to_owned(),
            sandboxes: 3,
            tracer: "bpf".to_owned(),
        }),
        Response::Done,
        Response::Error(ErrorReply {
            code: ErrorCode::UnknownSandbox,
            message: "no sandbox sb-9".to_owned(),
        }),
        Response::Error(ErrorReply {
            code: ErrorCode::RestoreTimedOut,
            message: "criu restore killed after its 60s time limit".to_owned(),
        }),
        Response::MaybeCheckpoint(MaybeCheckpointResult {
            checkpointed: true,
            decision: DecisionInfo {
                step: 4,
                checkpoint: true,
                reason: crate::DecisionReason::Benefit,
                p: 0.05,
                regen_cost_s: 50.0,
                c_s: 0.3,
                elapsed_llm_s: 0.0,
                q: 0.9,
                benefit: 2.5,
                visible_cost: 0.03,
            },
            checkpoint: Some(checkpoint_info()),
        }),
        Response::Context(ContextEntry {
            trajectory: "t-1".to_owned(),
            prefix: 4,
            context: vec![7; 5],
            record: 12,
            digest: "cd".repeat(32),
        }),
        Response::Subscribed,
        Response::TransferReady {
            chunk_bytes: 1 << 20,
        },
        Response::DownloadChunk { data: vec![7; 512] },
        Response::Transferred(TransferInfo {
            files: 3,
            bytes: 4096,
            skipped: 1,
            changed: 0,
            duration_ms: 12.5,
        }),
        Response::Error(ErrorReply {
            code: ErrorCode::NoSpace,
            message: "no space left while writing \"big\"".to_owned(),
        }),
        Response::Forked(crate::ForkInfo {
            fork: "fk-0123456789ab".to_owned(),
            source: "sb-1".to_owned(),
            checkpoint: "c000004-k2".to_owned(),
            prefix: 2,
            context: vec![7; 50],
            children: vec![restore_info(), RestoreInfo::default()],
            total_ms: 88.5,
        }),
    ]
}

pub(super) fn all_events() -> Vec<Event> {
    vec![
        Event::SandboxFailed {
            id: "sb-1".to_owned(),
            reason: "init killed by signal 9".to_owned(),
        },
        Event::CheckpointReady {
            id: "sb-1".to_owned(),
            prefix: 4,
        },
    ]
}
