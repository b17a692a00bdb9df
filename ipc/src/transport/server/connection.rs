//! One admitted connection on its own thread: wait (idle timeout), read a frame (frame
//! timeout), handle it, write the response (send timeout), again; or an event stream.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::panic::{self, AssertUnwindSafe};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::{debug, error, warn};

use super::admission::Activity;
use super::deadline::{wait_readable, write_all_by};
use super::handler::MAX_REQUEST_FDS;
use super::reply::{send_error, send_response};
use super::transfer::TransferLink;
use super::Shared;
use crate::error_chain;
use crate::frame::{encode_frame, FrameError};
use crate::message::{Envelope, ErrorCode, ErrorReply, Request, Response};
use crate::transport::creds::{Caller, PeerCred};
use crate::transport::is_disconnect;
use crate::transport::wire::{recv_message_by, WireError};

/// An admitted connection, handed to its thread.
pub(crate) struct Connection {
    /// Connection number (log field `conn`).
    pub(crate) id: u64,
    /// The peer, as admitted.
    pub(crate) peer: PeerCred,
    /// The socket.
    pub(crate) stream: UnixStream,
    /// Shared with the census, which may evict the connection while it is idle.
    pub(crate) activity: Arc<Activity>,
}

impl Connection {
    fn error(&self, shared: &Shared, id: u64, code: ErrorCode, message: String) -> bool {
        send_error(
            &self.stream,
            self.id,
            id,
            code,
            message,
            shared.max_frame,
            shared.limits.send_timeout,
        )
    }

    fn respond(&self, shared: &Shared, id: u64, response: Response) -> bool {
        send_response(
            &self.stream,
            self.id,
            id,
            response,
            shared.max_frame,
            shared.limits.send_timeout,
        )
    }
}

/// Serves one connection: request after request until the peer leaves, stays idle past the
/// idle timeout, sends a bad or too slow frame, is evicted, or the server shuts it down.
pub(crate) fn serve_connection(shared: &Shared, conn: &Connection) {
    let limits = shared.limits;
    let peer = conn.peer;
    debug!(
        conn = conn.id,
        pid = peer.pid,
        uid = peer.uid,
        gid = peer.gid,
        "peer connected"
    );
    // With its supplementary groups, which handlers acting with the peer's rights need.
    let caller = match Caller::of(&conn.stream) {
        Ok(caller) => caller,
        Err(err) => {
            warn!(conn = conn.id, error = %error_chain(&err), "reading peer credentials failed; closing");
            return;
        }
    };
    loop {
        // Frames are read exactly (descriptors attached to the next frame stay queued with
        // it), so nothing is buffered here: wait for the next request in the kernel.
        {
            conn.activity.set_idle(shared.now_ms());
            match wait_readable(&conn.stream, limits.idle_timeout) {
                Ok(true) => {}
                Ok(false) => {
                    debug!(
                        conn = conn.id,
                        timeout_s = limits.idle_timeout.as_secs(),
                        "idle timeout; closing"
                    );
                    return;
                }
                Err(err) => {
                    debug!(conn = conn.id, error = %err, "waiting for a request failed; closing");
                    return;
                }
            }
        }
        if !conn.activity.activate() {
            debug!(
                conn = conn.id,
                uid = peer.uid,
                "evicted to make room; closing"
            );
            conn.error(
                shared,
                0,
                ErrorCode::Busy,
                format!(
                    "idle connection closed to make room: the server holds its limit of {} \
                     connections",
                    limits.connections.total
                ),
            );
            return;
        }
        let deadline = Instant::now() + limits.frame_timeout;
        let received = recv_message_by::<Request, _>(
            &conn.stream,
            shared.max_frame,
            MAX_REQUEST_FDS,
            Some(deadline),
        );
        let (envelope, fds) = match received {
            Ok(received) => received,
            Err(WireError::Frame {
                source: FrameError::Closed,
            }) => {
                debug!(conn = conn.id, "peer closed the connection");
                return;
            }
            Err(err) if err.is_disconnect() || is_read_disconnect(&err) => {
                debug!(conn = conn.id, error = %error_chain(&err), "peer reset the connection");
                return;
            }
            Err(WireError::Frame {
                source: FrameError::Read { source },
            }) if source.kind() == std::io::ErrorKind::TimedOut => {
                let timeout_ms = limits.frame_timeout.as_millis() as u64;
                warn!(
                    conn = conn.id,
                    pid = peer.pid,
                    uid = peer.uid,
                    timeout_ms,
                    "request frame not complete in time; closing"
                );
                conn.error(
                    shared,
                    0,
                    ErrorCode::BadRequest,
                    format!("request frame not complete within {timeout_ms} ms"),
                );
                return;
            }
            Err(err) => {
                let message = match &err {
                    WireError::Frame { source } => error_chain(source),
                    WireError::FdPass { source } => error_chain(source),
                };
                warn!(conn = conn.id, pid = peer.pid, uid = peer.uid, error = %message,
                      "bad frame; answering BadRequest and closing");
                conn.error(shared, 0, ErrorCode::BadRequest, message);
                return;
            }
        };
        let id = envelope.id;
        if envelope.body == Request::Subscribe {
            drop(fds);
            // The census lock must be released before the stream starts.
            let admitted = shared.census().subscribe(conn.id);
            match admitted {
                Ok(()) => {
                    stream_events(shared, conn, id);
                    return;
                }
                Err(refusal) => {
                    debug!(conn = conn.id, uid = peer.uid, %refusal, "event stream refused");
                    if !conn.error(shared, id, ErrorCode::Busy, refusal.to_string()) {
                        return;
                    }
                    continue;
                }
            }
        }
        if matches!(envelope.body, Request::Upload(_) | Request::Download(_)) {
            drop(fds);
            if !serve_transfer(shared, conn, &caller, id, envelope.body) {
                return;
            }
            continue;
        }
        if envelope.body == Request::TransferCancel {
            // A cancel that crossed the end of its transfer: nothing left to stop, no answer.
            drop(fds);
            continue;
        }
        let handled = panic::catch_unwind(AssertUnwindSafe(|| {
            shared.handler.handle_call(&caller, envelope.body, fds)
        }));
        let response = handled.unwrap_or_else(|_| {
            error!(conn = conn.id, request = id, "request handler panicked");
            Response::Error(ErrorReply {
                code: ErrorCode::Internal,
                message: "the request handler panicked".to_owned(),
            })
        });
        if !conn.respond(shared, id, response) {
            return;
        }
    }
}

/// Serves one streaming transfer through [`Handler::transfer`](super::Handler::transfer) and
/// writes its final response. Returns whether the connection goes on.
fn serve_transfer(
    shared: &Shared,
    conn: &Connection,
    caller: &Caller,
    id: u64,
    request: Request,
) -> bool {
    let mut link = TransferLink::new(&conn.stream, id, shared.max_frame, shared.limits);
    let handled = panic::catch_unwind(AssertUnwindSafe(|| {
        shared.handler.transfer(caller, request, &mut link)
    }));
    let response = handled.unwrap_or_else(|_| {
        error!(conn = conn.id, request = id, "transfer handler panicked");
        Response::Error(ErrorReply {
            code: ErrorCode::Internal,
            message: "the transfer handler panicked".to_owned(),
        })
    });
    if !link.usable() {
        debug!(
            conn = conn.id,
            request = id,
            "transfer link broken; closing"
        );
        return false;
    }
    conn.respond(shared, id, response) && !link.close_after()
}

/// Whether a receive error is a reset connection surfacing as a read error.
fn is_read_disconnect(err: &WireError) -> bool {
    matches!(err, WireError::Frame { source: FrameError::Read { source } } if is_disconnect(source))
}

/// How often an idle event stream checks whether its peer went away.
const EVENT_IDLE_CHECK: Duration = Duration::from_millis(200);

/// Serves [`Request::Subscribe`] (the subscription slot is taken): answers `Subscribed` (or
/// `Unsupported`), then writes every event of the handler's channel, each by the send
/// deadline, until the peer leaves, sends anything, stops reading, or the channel ends.
fn stream_events(shared: &Shared, conn: &Connection, id: u64) {
    let peer = conn.peer;
    let subscribed = panic::catch_unwind(AssertUnwindSafe(|| shared.handler.subscribe(&peer)));
    let Ok(Some(events)) = subscribed else {
        shared.census().unsubscribe(conn.id);
        conn.error(
            shared,
            id,
            ErrorCode::Unsupported,
            "this server has no event stream".to_owned(),
        );
        return;
    };
    if !conn.respond(shared, id, Response::Subscribed) {
        return;
    }
    let send_timeout = shared.limits.send_timeout;
    debug!(conn = conn.id, pid = peer.pid, "event stream opened");
    loop {
        match events.recv_timeout(EVENT_IDLE_CHECK) {
            Ok(event) => {
                let frame = match encode_frame(&Envelope { id: 0, body: event }, shared.max_frame) {
                    Ok(frame) => frame,
                    Err(err) => {
                        warn!(conn = conn.id, error = %error_chain(&err),
                              "encoding an event failed; skipped");
                        continue;
                    }
                };
                if let Err(err) = write_all_by(&conn.stream, &frame, Instant::now() + send_timeout)
                {
                    if err.kind() == std::io::ErrorKind::TimedOut {
                        warn!(
                            conn = conn.id,
                            pid = peer.pid,
                            uid = peer.uid,
                            timeout_ms = send_timeout.as_millis() as u64,
                            "event subscriber stopped reading; dropping it"
                        );
                    } else {
                        debug!(conn = conn.id, error = %err, "event subscriber left");
                    }
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                if peer_readable(&conn.stream) {
                    debug!(
                        conn = conn.id,
                        "event subscriber closed or sent data; closing the stream"
                    );
                    return;
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                debug!(conn = conn.id, "event source ended; closing the stream");
                return;
            }
        }
    }
}

/// Whether the peer of an event stream closed its side (or sent anything, which a subscriber
/// must not): the socket polls readable or hung up.
fn peer_readable(stream: &UnixStream) -> bool {
    let mut fds = [PollFd::new(stream.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(n) => n > 0,
        Err(_) => true,
    }
}
