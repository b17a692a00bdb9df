//! Requests carrying descriptors: a real server and client on a temporary socket. The
//! descriptor of a request reaches `Handler::handle_call` with the caller's groups; a frame
//! with more than `MAX_REQUEST_FDS` is a bad frame; `Client::import_image` opens its source
//! here and refuses what is neither a directory nor a regular file.

use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use belayer_ipc::{
    encode_frame, send_with_fds, Caller, Client, ClientError, Envelope, ErrorCode, ExecResult,
    Handler, PeerCred, Request, Response, Server, ServerConfig, ServerHandle, MAX_REQUEST_FDS,
};

/// Answers every request with `Exec`: stdout holds what the first descriptor's file holds
/// (or `dir` for a directory), exit code the number of descriptors, signal the number of
/// supplementary groups (-1 when unknown).
struct Reader;

impl Handler for Reader {
    fn handle(&self, _peer: &PeerCred, _request: Request) -> Response {
        Response::Done
    }

    fn handle_call(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        let mut stdout = Vec::new();
        if let Some(fd) = fds.first() {
            let mut file = std::fs::File::from(fd.try_clone().unwrap());
            if file.metadata().unwrap().is_dir() {
                stdout = b"dir".to_vec();
            } else {
                file.rewind().unwrap();
                file.read_to_end(&mut stdout).unwrap();
            }
        }
        if let Request::ImportImage { with_fd, .. } = request {
            stdout.extend_from_slice(if with_fd { b" with_fd" } else { b" path" });
        }
        Response::Exec(ExecResult {
            exit_code: fds.len() as i32,
            signal: Some(caller.groups.as_ref().map_or(-1, |g| g.len() as i32)),
            stdout,
            ..ExecResult::default()
        })
    }
}

fn start() -> (tempfile::TempDir, PathBuf, ServerHandle) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let server = Server::bind(ServerConfig::new(&path)).unwrap();
    let handle = server.spawn(std::sync::Arc::new(Reader)).unwrap();
    (dir, path, handle)
}

fn exec(response: Response) -> ExecResult {
    match response {
        Response::Exec(r) => r,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_descriptor_reaches_the_handler_with_the_callers_groups() {
    let (_dir, path, _server) = start();
    let mut file = tempfile::tempfile().unwrap();
    file.write_all(b"through the request").unwrap();
    let mut client = Client::connect(&path).unwrap();
    let r = exec(
        client
            .call_with_fds(Request::Ping, &[file.as_fd()])
            .unwrap(),
    );
    assert_eq!(r.stdout, b"through the request");
    assert_eq!(r.exit_code, 1);
    let own = belayer_ipc::proc_groups(std::process::id() as i32).unwrap();
    assert_eq!(
        r.signal,
        Some(own.len() as i32),
        "SO_PEERGROUPS reached the handler"
    );
    // The same connection goes on, without descriptors.
    let r = exec(client.call(Request::Ping).unwrap());
    assert_eq!((r.exit_code, r.stdout.as_slice()), (0, &b""[..]));
}

#[test]
fn more_descriptors_than_a_request_takes_is_a_bad_frame() {
    let (_dir, path, _server) = start();
    let stream = std::os::unix::net::UnixStream::connect(&path).unwrap();
    let frame = encode_frame(
        &Envelope {
            id: 7,
            body: Request::Ping,
        },
        belayer_ipc::DEFAULT_MAX_FRAME,
    )
    .unwrap();
    let a = tempfile::tempfile().unwrap();
    let fds = vec![a.as_fd(); MAX_REQUEST_FDS + 1];
    send_with_fds(&stream, &frame, &fds).unwrap();
    let reply = belayer_ipc::read_frame::<Response, _>(&mut &stream, 1 << 20).unwrap();
    assert_eq!(reply.id, 0);
    match reply.body {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest);
            assert!(e.message.contains("fds"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // Others are still served.
    let mut client = Client::connect(&path).unwrap();
    assert_eq!(exec(client.call(Request::Ping).unwrap()).exit_code, 0);
}

#[test]
fn import_image_opens_the_source_here() {
    let (_dir, path, _server) = start();
    let src = tempfile::tempdir().unwrap();
    let mut client = Client::connect(&path).unwrap();
    let r = exec(client.import_image("x", src.path()).unwrap());
    assert_eq!((r.exit_code, r.stdout.as_slice()), (1, &b"dir with_fd"[..]));

    let archive = src.path().join("a.tar");
    std::fs::write(&archive, b"not really a tar").unwrap();
    let r = exec(client.import_image("x", &archive).unwrap());
    assert_eq!(r.stdout, b"not really a tar with_fd");

    for (source, kind) in [
        ("/nonexistent/rootfs", std::io::ErrorKind::NotFound),
        ("/dev/null", std::io::ErrorKind::InvalidInput),
    ] {
        match client.import_image("x", std::path::Path::new(source)) {
            Err(ClientError::OpenSource { path, source: e }) => {
                assert_eq!(path, PathBuf::from(source));
                assert_eq!(e.kind(), kind, "{e}");
            }
            other => panic!("{source}: {other:?}"),
        }
    }
    // Nothing was sent for those: the connection is still in step.
    assert_eq!(exec(client.call(Request::Ping).unwrap()).exit_code, 0);
}
