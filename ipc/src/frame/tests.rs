//! Unit tests of `frame`.

use std::collections::BTreeSet;
use std::os::unix::net::UnixStream;

use super::*;
use crate::message::*;

fn sandbox_info(id: &str) -> SandboxInfo {
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
    }
}

fn checkpoint_info() -> CheckpointInfo {
    CheckpointInfo {
        sandbox: "sb-1".to_owned(),
        prefix: 3,
        checkpoint: "sb-1-3".to_owned(),
        bytes: 1 << 20,
        context_digest: "ab".repeat(32),
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

fn image_info() -> ImageInfo {
    ImageInfo {
        name: "base".to_owned(),
        bytes: 123_456,
        created_unix_ms: 1_700_000_000_002,
        owner_uid: 1000,
        dropped_devices: 6,
        skipped_sockets: 1,
    }
}

/// Index of each request variant; the match makes a new variant a compile error here.
fn request_variant(request: &Request) -> usize {
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
    }
}
const REQUEST_VARIANTS: usize = 18;

fn response_variant(response: &Response) -> usize {
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
    }
}
const RESPONSE_VARIANTS: usize = 16;

fn all_requests() -> Vec<Request> {
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
    ]
}

fn all_responses() -> Vec<Response> {
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
        Response::Restored(RestoreInfo {
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
        }),
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
    ]
}

fn all_events() -> Vec<Event> {
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

fn round_trip<M: Message + PartialEq + fmt::Debug + Clone>(body: M, id: u64) {
    let envelope = Envelope { id, body };
    let bytes = encode_frame(&envelope, DEFAULT_MAX_FRAME).expect("encode");
    assert_eq!(&bytes[0..4], b"BLYR");
    assert_eq!(bytes[6], M::KIND.byte());
    let (decoded, used) = decode_frame::<M>(&bytes, DEFAULT_MAX_FRAME).expect("decode");
    assert_eq!(used, bytes.len());
    assert_eq!(decoded, envelope);
}

#[test]
fn every_request_response_and_event_round_trips() {
    let requests = all_requests();
    let seen: BTreeSet<usize> = requests.iter().map(request_variant).collect();
    assert_eq!(
        seen.len(),
        REQUEST_VARIANTS,
        "a request variant lacks a sample"
    );
    for (i, request) in requests.into_iter().enumerate() {
        round_trip(request, i as u64 + 1);
    }
    let responses = all_responses();
    let seen: BTreeSet<usize> = responses.iter().map(response_variant).collect();
    assert_eq!(
        seen.len(),
        RESPONSE_VARIANTS,
        "a response variant lacks a sample"
    );
    for (i, response) in responses.into_iter().enumerate() {
        round_trip(response, u64::MAX - i as u64);
    }
    for event in all_events() {
        round_trip(event, 0);
    }
}

#[test]
fn header_layout_is_little_endian() {
    let envelope = Envelope {
        id: 7,
        body: Request::Ping,
    };
    let bytes = encode_frame(&envelope, DEFAULT_MAX_FRAME).unwrap();
    let payload = &bytes[HEADER_LEN..];
    assert_eq!(&bytes[4..6], &[6, 0]);
    assert_eq!(bytes[6], 1);
    assert_eq!(bytes[7], 0);
    assert_eq!(&bytes[8..12], &(payload.len() as u32).to_le_bytes());
    assert_eq!(&bytes[12..16], &crc32fast::hash(payload).to_le_bytes());
}

#[test]
fn several_frames_back_to_back_are_read_in_order() {
    let mut stream = Vec::new();
    let requests = all_requests();
    for (i, request) in requests.iter().enumerate() {
        let envelope = Envelope {
            id: i as u64,
            body: request.clone(),
        };
        write_frame(&mut stream, &envelope, DEFAULT_MAX_FRAME).unwrap();
    }
    let mut reader = stream.as_slice();
    for (i, request) in requests.iter().enumerate() {
        let envelope: Envelope<Request> = read_frame(&mut reader, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(envelope.id, i as u64);
        assert_eq!(&envelope.body, request);
    }
    assert!(matches!(
        read_frame::<Request, _>(&mut reader, DEFAULT_MAX_FRAME),
        Err(FrameError::Closed)
    ));
}

fn sample_frame() -> Vec<u8> {
    let envelope = Envelope {
        id: 42,
        body: all_responses().swap_remove(5),
    };
    encode_frame(&envelope, DEFAULT_MAX_FRAME).unwrap()
}

#[test]
fn every_single_bit_flip_in_the_payload_is_caught_by_the_crc() {
    let frame = sample_frame();
    for byte in HEADER_LEN..frame.len() {
        for bit in 0..8 {
            let mut corrupt = frame.clone();
            corrupt[byte] ^= 1 << bit;
            match decode_frame::<Response>(&corrupt, DEFAULT_MAX_FRAME) {
                Err(FrameError::CrcMismatch { expected, actual }) => {
                    assert_ne!(expected, actual)
                }
                other => panic!("flip of byte {byte} bit {bit}: {other:?}"),
            }
        }
    }
}

#[test]
fn truncation_at_every_offset_is_reported() {
    let frame = sample_frame();
    assert!(matches!(
        decode_frame::<Response>(&frame[..0], DEFAULT_MAX_FRAME),
        Err(FrameError::Closed)
    ));
    for cut in 1..frame.len() {
        match decode_frame::<Response>(&frame[..cut], DEFAULT_MAX_FRAME) {
            Err(FrameError::Truncated {
                expected,
                got,
                part,
            }) => {
                assert!(got < expected, "cut {cut}");
                let want = if cut < HEADER_LEN {
                    "header"
                } else {
                    "payload"
                };
                assert_eq!(part, want, "cut {cut}");
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

#[test]
fn bad_header_fields_give_typed_errors() {
    let frame = sample_frame();

    let mut bad = frame.clone();
    bad[0..4].copy_from_slice(b"HTTP");
    assert!(matches!(
        decode_frame::<Response>(&bad, DEFAULT_MAX_FRAME),
        Err(FrameError::BadMagic { got }) if &got == b"HTTP"
    ));

    let mut bad = frame.clone();
    bad[4..6].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
    assert!(matches!(
        decode_frame::<Response>(&bad, DEFAULT_MAX_FRAME),
        Err(FrameError::UnsupportedVersion { got, supported: PROTOCOL_VERSION })
            if got == PROTOCOL_VERSION + 1
    ));

    for kind in [0u8, 6, 255] {
        let mut bad = frame.clone();
        bad[6] = kind;
        assert!(matches!(
            decode_frame::<Response>(&bad, DEFAULT_MAX_FRAME),
            Err(FrameError::UnknownKind { got }) if got == kind
        ));
    }

    let mut bad = frame.clone();
    bad[7] = 0x80;
    assert!(matches!(
        decode_frame::<Response>(&bad, DEFAULT_MAX_FRAME),
        Err(FrameError::NonzeroFlags { got: 0x80 })
    ));

    assert!(matches!(
        decode_frame::<Request>(&frame, DEFAULT_MAX_FRAME),
        Err(FrameError::UnexpectedKind {
            expected: Kind::Request,
            got: Kind::Response
        })
    ));
}

#[test]
fn oversized_length_is_refused_from_the_header_alone() {
    let header = Header {
        kind: Kind::Request,
        len: u32::MAX,
        crc: 0,
    };
    // Only the header: the error must come before any attempt to read the payload.
    let bytes = header.to_bytes();
    match decode_frame::<Request>(&bytes, DEFAULT_MAX_FRAME) {
        Err(FrameError::TooLarge { len, max }) => {
            assert_eq!(len, u64::from(u32::MAX));
            assert_eq!(max, DEFAULT_MAX_FRAME);
        }
        other => panic!("{other:?}"),
    }
    let envelope = Envelope {
        id: 1,
        body: Response::Exec(ExecResult {
            stdout: vec![7; 2048],
            ..ExecResult::default()
        }),
    };
    assert!(matches!(
        encode_frame(&envelope, 1024),
        Err(FrameError::TooLarge { max: 1024, .. })
    ));
    let bytes = encode_frame(&envelope, DEFAULT_MAX_FRAME).unwrap();
    assert!(matches!(
        decode_frame::<Response>(&bytes, 1024),
        Err(FrameError::TooLarge { max: 1024, .. })
    ));
}

/// Builds a frame with a correct header and CRC around arbitrary payload bytes.
fn frame_around(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let header = Header {
        kind,
        len: payload.len() as u32,
        crc: crc32fast::hash(payload),
    };
    let mut frame = header.to_bytes().to_vec();
    frame.extend_from_slice(payload);
    frame
}

#[test]
fn undecodable_payloads_give_decode_errors() {
    // id 1, then variant index 200: no such request.
    let frame = frame_around(Kind::Request, &[1, 200]);
    assert!(matches!(
        decode_frame::<Request>(&frame, DEFAULT_MAX_FRAME),
        Err(FrameError::Decode {
            kind: Kind::Request,
            ..
        })
    ));
    // A string claiming 1 GiB inside a tiny payload: refused by the byte limit.
    let mut payload = vec![1, 3]; // id 1, RemoveImage
    payload.push(253); // varint u64 marker
    payload.extend_from_slice(&(1u64 << 30).to_le_bytes());
    let frame = frame_around(Kind::Request, &payload);
    assert!(matches!(
        decode_frame::<Request>(&frame, DEFAULT_MAX_FRAME),
        Err(FrameError::Decode { .. })
    ));
    // A valid envelope followed by garbage.
    let mut payload = bincode::serde::encode_to_vec(
        Envelope {
            id: 1,
            body: Request::Ping,
        },
        bincode::config::standard(),
    )
    .unwrap();
    payload.extend_from_slice(&[0, 0, 0]);
    let frame = frame_around(Kind::Request, &payload);
    assert!(matches!(
        decode_frame::<Request>(&frame, DEFAULT_MAX_FRAME),
        Err(FrameError::TrailingBytes { trailing: 3 })
    ));
}

#[test]
fn large_max_frames_decode_large_payloads() {
    let envelope = Envelope {
        id: 9,
        body: Response::Exec(ExecResult {
            stdout: vec![b'x'; 17 << 20],
            ..ExecResult::default()
        }),
    };
    let max = 32 << 20;
    let bytes = encode_frame(&envelope, max).unwrap();
    let (decoded, _) = decode_frame::<Response>(&bytes, max).unwrap();
    assert_eq!(decoded, envelope);
}

#[test]
fn events_travel_over_a_socket_pair() {
    let (mut a, mut b) = UnixStream::pair().unwrap();
    for event in all_events() {
        send_event(&mut a, &event, DEFAULT_MAX_FRAME).unwrap();
    }
    drop(a);
    for event in all_events() {
        assert_eq!(recv_event(&mut b, DEFAULT_MAX_FRAME).unwrap(), event);
    }
    assert!(matches!(
        recv_event(&mut b, DEFAULT_MAX_FRAME),
        Err(FrameError::Closed)
    ));
}

#[test]
fn kind_bytes_round_trip() {
    for kind in [
        Kind::Request,
        Kind::Response,
        Kind::Event,
        Kind::MemRequest,
        Kind::MemResponse,
    ] {
        assert_eq!(Kind::from_byte(kind.byte()), Some(kind));
    }
    assert_eq!(Kind::from_byte(0), None);
}
