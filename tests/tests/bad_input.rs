//! Bad input gets typed errors and disturbs nothing: malformed frames, unknown ids, restore
//! without a checkpoint, a corrupted checkpoint.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use belayer_ipc::{ErrorCode, ExecRequest, Request, Response, PROTOCOL_VERSION};
use belayer_tests::{busybox_rootfs, Daemon};

fn expect_error(r: Response, code: ErrorCode) -> String {
    match r {
        Response::Error(e) => {
            assert_eq!(e.code, code, "{}", e.message);
            e.message
        }
        r => panic!("expected {code:?}, got {r:?}"),
    }
}

#[test]
fn malformed_frames_close_only_their_connection() {
    let d = Daemon::start();
    let mut good = d.client();
    for garbage in [
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        [
            b"BLYR".as_slice(),
            &[99, 0, 1, 0],
            &[0, 0, 0, 0],
            &[0, 0, 0, 0],
        ]
        .concat(), // bad version
        [
            b"BLYR".as_slice(),
            &[PROTOCOL_VERSION as u8, 0, 1, 0],
            &u32::MAX.to_le_bytes(),
            &[0, 0, 0, 0],
        ]
        .concat(), // oversized
        [
            b"BLYR".as_slice(),
            &[PROTOCOL_VERSION as u8, 0, 1, 0],
            &4u32.to_le_bytes(),
            &[1, 2, 3, 4],
            b"abcd",
        ]
        .concat(), // CRC
    ] {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        s.write_all(&garbage).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer); // the server answers (or not) and closes
        assert!(matches!(
            good.call(Request::Ping).unwrap(),
            Response::Pong { .. }
        ));
    }
}

#[test]
fn unknown_ids_and_names() {
    let d = Daemon::start();
    expect_error(
        d.call(Request::InspectSandbox {
            id: "sb-000000000000".into(),
        }),
        ErrorCode::UnknownSandbox,
    );
    expect_error(
        d.call(Request::Restore {
            id: "nope".into(),
            verify: false,
            prefix: None,
        }),
        ErrorCode::UnknownSandbox,
    );
    expect_error(
        d.call(Request::Exec(ExecRequest {
            id: "nope".into(),
            argv: vec!["true".into()],
            ..Default::default()
        })),
        ErrorCode::UnknownSandbox,
    );
    expect_error(
        d.call(Request::CreateSandbox(belayer_ipc::SandboxSpec {
            image: "missing".into(),
            ..Default::default()
        })),
        ErrorCode::UnknownImage,
    );
    expect_error(
        d.call(Request::ImportImage {
            name: "../evil".into(),
            source: "/".into(),
            with_fd: false,
        }),
        ErrorCode::BadRequest,
    );
}

#[test]
fn restore_without_checkpoint_restarts_from_base_image() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo dirty > /dirty");
    d.fail_stop(&id);
    let r = d.restore(&id);
    assert_eq!(r.prefix, None, "no ready checkpoint → k = 0");
    assert!(r.context.is_empty());
    assert_eq!(d.inspect(&id).state, "running");
    assert!(
        d.exec(&id, "test -e /dirty").exit_code != 0,
        "fresh sandbox from the base image"
    );
}

#[test]
fn corrupted_checkpoint_is_refused_and_nothing_is_disturbed() {
    // Restores that materialize F_k from blobs (a restore from the upper snapshot reads no
    // blob: `tests/upper_snapshot.rs`).
    let d = Daemon::start_options(belayer_tests::DaemonOptions {
        test_hooks: true,
        config: "upper_snapshots = false\n".into(),
        ..Default::default()
    });
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.sh(&id, "echo v1 > /v");
    let c = d.checkpoint(&id, 1, b"L1");
    // Flip one byte of the layer manifest F_k.
    let layer = d
        .state_dir
        .join("sandboxes")
        .join(&id)
        .join("checkpoints")
        .join(&c.checkpoint)
        .join("upper.layer");
    let original = std::fs::read(&layer).unwrap();
    let mut bytes = original.clone();
    bytes[20] ^= 0x01;
    std::fs::write(&layer, bytes).unwrap();
    d.sh(&id, "echo v2 > /v");
    let pids = d.inspect(&id).pids;
    let msg = expect_error(d.restore_raw(&id), ErrorCode::CorruptCheckpoint);
    assert!(msg.contains("upper.layer"), "{msg}");
    assert_untouched(&d, &id, &pids);

    // Flip one byte of a blob the layer refers to (the content of /v): found while it is
    // copied into the fresh instance, before the running one is touched.
    std::fs::write(&layer, original).unwrap();
    d.corrupt_blob(b"v1\n");
    let msg = expect_error(d.restore_raw(&id), ErrorCode::CorruptCheckpoint);
    assert!(msg.contains("corrupt"), "{msg}");
    assert_untouched(&d, &id, &pids);
    // Other sandboxes are unaffected.
    let other = d.create("busybox").id;
    assert_eq!(d.sh(&other, "echo ok"), "ok");
}

fn assert_untouched(d: &Daemon, id: &str, pids: &[i32]) {
    let info = d.inspect(id);
    assert_eq!(info.state, "running");
    assert_eq!(info.pids, pids);
    assert_eq!(d.sh(id, "cat /v"), "v2");
}

#[test]
fn actions_on_a_failed_sandbox_are_refused() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    d.fail_stop(&id);
    expect_error(
        d.call(Request::Exec(ExecRequest {
            id: id.clone(),
            argv: vec!["true".into()],
            ..Default::default()
        })),
        ErrorCode::InvalidState,
    );
    expect_error(d.checkpoint_raw(&id, 1, b"", None), ErrorCode::InvalidState);
}
