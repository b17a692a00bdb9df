//! Unit tests of `frame` (one sample of every message: module `samples`).

use std::collections::BTreeSet;
use std::os::unix::net::UnixStream;

mod samples;

use super::*;
use crate::message::*;
use samples::*;

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
    assert_eq!(&bytes[4..6], &[12, 0]);
    assert_eq!(bytes[6], 1);
    assert_eq!(bytes[7], 0);
    assert_eq!(&bytes[8..12], &(payload.len() as u32).to_le_bytes());
    assert_eq!(&bytes[12..16], &crc32fast::hash(payload).to_le_bytes());
}

#[test]
fn context_remove_is_appended_after_the_older_requests() {
    // Protocol 7 added it at the end of `Request`: every older variant keeps its index.
    let envelope = Envelope {
        id: 1,
        body: Request::ContextRemove {
            trajectory: "t@5".to_owned(),
        },
    };
    let bytes = encode_frame(&envelope, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(&bytes[HEADER_LEN..], &[1, 18, 3, b't', b'@', b'5']);
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
