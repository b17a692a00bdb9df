//! Streaming transfers through a real server and client on a temporary socket: the
//! [`TransferLink`] a handler sees (chunks in, chunks out), cancellation from either side, and
//! clients that stall, vanish or break step mid-transfer.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use belayer_ipc::{
    encode_frame, read_frame, Caller, Chunk, Client, ClientError, ConnectionLimits,
    DownloadRequest, Envelope, ErrorCode, ErrorReply, Handler, PeerCred, Request, Response, Server,
    ServerConfig, ServerHandle, TransferInfo, TransferLink, UploadRequest, DEFAULT_MAX_FRAME,
};

/// Keeps the last upload and serves it back as the download; records how each transfer ended.
#[derive(Default)]
struct Store {
    data: Mutex<Vec<u8>>,
    ends: Mutex<Vec<String>>,
}

impl Store {
    fn ended(&self, how: String) {
        self.ends.lock().unwrap().push(how);
    }

    /// How the next transfer ended (waits for it), forgetting it.
    fn last_end(&self) -> String {
        for _ in 0..200 {
            if let Some(e) = self.ends.lock().unwrap().pop() {
                return e;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no transfer ended")
    }
}

fn failed(message: String) -> Response {
    Response::Error(ErrorReply {
        code: ErrorCode::TransferFailed,
        message,
    })
}

impl Handler for Store {
    fn handle(&self, _peer: &PeerCred, request: Request) -> Response {
        match request {
            Request::Ping => Response::Pong {
                version: "test".into(),
            },
            _ => Response::Done,
        }
    }

    fn transfer(
        &self,
        _caller: &Caller,
        request: Request,
        link: &mut TransferLink<'_>,
    ) -> Response {
        match request {
            Request::Upload(_) => {
                if let Err(e) = link.ready() {
                    self.ended(e.to_string());
                    return failed(e.to_string());
                }
                let mut got = Vec::new();
                loop {
                    match link.recv_chunk(None) {
                        Ok(Chunk::Data(bytes)) => got.extend(bytes),
                        Ok(Chunk::End) => break,
                        Err(e) => {
                            self.ended(e.to_string());
                            return failed(e.to_string());
                        }
                    }
                }
                let bytes = got.len() as u64;
                *self.data.lock().unwrap() = got;
                self.ended("uploaded".into());
                Response::Transferred(TransferInfo {
                    bytes,
                    ..Default::default()
                })
            }
            Request::Download(req) => {
                let data = self.data.lock().unwrap().clone();
                let pause = req.timeout_ms.map(Duration::from_millis);
                for piece in data.chunks(link.chunk_bytes()) {
                    if let Some(p) = pause {
                        std::thread::sleep(p);
                    }
                    if let Err(e) = link.send_chunk(piece) {
                        self.ended(e.to_string());
                        return failed(e.to_string());
                    }
                }
                self.ended("downloaded".into());
                Response::Transferred(TransferInfo {
                    bytes: data.len() as u64,
                    ..Default::default()
                })
            }
            _ => failed("not a transfer".into()),
        }
    }
}

struct Running {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
    store: Arc<Store>,
    _handle: ServerHandle,
}

fn start(configure: impl FnOnce(ServerConfig) -> ServerConfig) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("belayer.sock");
    let server = Server::bind(configure(ServerConfig::new(&path))).unwrap();
    let store = Arc::new(Store::default());
    let handle = server.spawn(store.clone()).unwrap();
    Running {
        _dir: dir,
        path,
        store,
        _handle: handle,
    }
}

fn upload_request() -> UploadRequest {
    UploadRequest {
        id: "sb-1".into(),
        dest: "/root".into(),
        archive: true,
        timeout_ms: None,
    }
}

fn download_request(pause_ms: Option<u64>) -> DownloadRequest {
    DownloadRequest {
        id: "sb-1".into(),
        src: "/root".into(),
        timeout_ms: pause_ms,
    }
}

fn assert_pong(c: &mut Client) {
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
}

#[test]
fn streams_larger_than_a_frame_go_both_ways_in_chunks() {
    let r = start(|c| c.max_frame(64 << 10));
    let mut c = Client::connect(&r.path).unwrap().with_max_frame(64 << 10);
    let data: Vec<u8> = (0..5_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    match c.upload(upload_request(), data.as_slice()).unwrap() {
        Response::Transferred(t) => assert_eq!(t.bytes, data.len() as u64),
        other => panic!("{other:?}"),
    }
    let mut back = Vec::new();
    match c.download(download_request(None), &mut back).unwrap() {
        Response::Transferred(t) => assert_eq!(t.bytes, data.len() as u64),
        other => panic!("{other:?}"),
    }
    assert_eq!(back, data);
    assert_pong(&mut c);
}

#[test]
fn either_side_can_cancel_and_the_connection_stays_in_step() {
    let r = start(|c| c);
    let mut c = Client::connect(&r.path).unwrap();
    let err = c
        .upload_with(upload_request(), |sink| {
            sink.write_all(&[1u8; 3 << 20])?;
            Err(std::io::Error::other("source broke"))
        })
        .unwrap_err();
    assert!(matches!(err, ClientError::TransferSource { .. }), "{err:?}");
    assert!(r.store.last_end().contains("cancelled"));
    assert_pong(&mut c);

    c.upload(upload_request(), &[2u8; 4 << 20][..]).unwrap();
    let err = c
        .download_with(download_request(Some(5)), |source| {
            let mut first = [0u8; 100];
            source.read_exact(&mut first)?;
            Err(std::io::Error::other("host disk full"))
        })
        .unwrap_err();
    assert!(matches!(err, ClientError::TransferSink { .. }), "{err:?}");
    assert!(r.store.last_end().contains("cancelled"));
    assert_pong(&mut c);
}

/// Raw frames on a fresh connection.
fn raw(path: &std::path::Path, frames: &[(u64, Request)]) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for (id, req) in frames {
        s.write_all(
            &encode_frame(
                &Envelope {
                    id: *id,
                    body: req.clone(),
                },
                DEFAULT_MAX_FRAME,
            )
            .unwrap(),
        )
        .unwrap();
    }
    s
}

fn next(s: &mut UnixStream) -> Option<Envelope<Response>> {
    read_frame::<Response, _>(s, DEFAULT_MAX_FRAME).ok()
}

#[test]
fn clients_that_stall_vanish_or_break_step_end_the_transfer() {
    let r =
        start(|c| c.limits(ConnectionLimits::default().idle_timeout(Duration::from_millis(300))));
    // Stalls after the start: the link reports it and the connection closes unanswered.
    let mut s = raw(&r.path, &[(1, Request::Upload(upload_request()))]);
    assert!(matches!(
        next(&mut s).map(|e| e.body),
        Some(Response::TransferReady { .. })
    ));
    assert!(next(&mut s).is_none(), "closed without an answer");
    assert!(
        r.store.last_end().contains("sent nothing"),
        "{}",
        r.store.last_end()
    );

    // Another request in the middle: answered with the error, then closed.
    r.store.ends.lock().unwrap().clear();
    let mut s = raw(
        &r.path,
        &[
            (1, Request::Upload(upload_request())),
            (1, Request::UploadChunk { data: vec![1; 10] }),
            (1, Request::Ping),
        ],
    );
    assert!(matches!(
        next(&mut s).map(|e| e.body),
        Some(Response::TransferReady { .. })
    ));
    match next(&mut s).map(|e| e.body) {
        Some(Response::Error(e)) => assert!(e.message.contains("Ping"), "{}", e.message),
        other => panic!("{other:?}"),
    }
    assert!(next(&mut s).is_none());

    // A chunk of another id.
    let mut s = raw(
        &r.path,
        &[
            (5, Request::Upload(upload_request())),
            (6, Request::UploadChunk { data: vec![1; 10] }),
        ],
    );
    next(&mut s);
    match next(&mut s).map(|e| e.body) {
        Some(Response::Error(e)) => assert!(e.message.contains("id 6"), "{}", e.message),
        other => panic!("{other:?}"),
    }

    // Vanishes mid-upload.
    r.store.ends.lock().unwrap().clear();
    drop(raw(
        &r.path,
        &[
            (1, Request::Upload(upload_request())),
            (1, Request::UploadChunk { data: vec![1; 10] }),
        ],
    ));
    assert!(
        r.store.last_end().contains("went away"),
        "{}",
        r.store.last_end()
    );

    // A stray cancel outside a transfer is ignored; the next request is answered.
    let mut s = raw(&r.path, &[(1, Request::TransferCancel), (2, Request::Ping)]);
    let e = next(&mut s).unwrap();
    assert_eq!(e.id, 2);
    assert!(matches!(e.body, Response::Pong { .. }));

    // A chunk outside a transfer is a BadRequest of the handler.
    let mut c = Client::connect(&r.path).unwrap();
    assert!(matches!(
        c.call(Request::UploadChunk { data: vec![] }),
        Ok(Response::Done)
    ));
}
