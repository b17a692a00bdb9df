//! Writing replies: responses by the send deadline, and the one-shot refusal the accept loop
//! sends without ever blocking.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::sys::socket::{send, MsgFlags};
use tracing::{debug, error};

use super::deadline::write_all_by;
use crate::error_chain;
use crate::frame::encode_frame;
use crate::message::{Envelope, ErrorCode, ErrorReply, Response};

/// Encodes and writes one response by `send_timeout`; a response that cannot be encoded (e.g.
/// over the frame limit) is replaced by an `Internal` error with the same id. Returns whether
/// the connection is still usable.
pub(crate) fn send_response(
    stream: &UnixStream,
    conn: u64,
    id: u64,
    response: Response,
    max_frame: u32,
    send_timeout: Duration,
) -> bool {
    let frame = match encode_frame(&Envelope { id, body: response }, max_frame) {
        Ok(frame) => frame,
        Err(err) => {
            let message = error_chain(&err);
            error!(conn, request = id, error = %message, "encoding the response failed");
            let reply = error_envelope(
                id,
                ErrorCode::Internal,
                format!("the response could not be sent: {message}"),
            );
            match encode_frame(&reply, max_frame) {
                Ok(frame) => frame,
                Err(err) => {
                    error!(conn, request = id, error = %error_chain(&err),
                           "encoding the error reply failed; closing");
                    return false;
                }
            }
        }
    };
    match write_all_by(stream, &frame, Instant::now() + send_timeout) {
        Ok(()) => true,
        Err(err) if err.kind() == std::io::ErrorKind::TimedOut => {
            debug!(
                conn,
                request = id,
                timeout_ms = send_timeout.as_millis() as u64,
                "peer did not read the response in time; closing"
            );
            false
        }
        Err(err) => {
            debug!(conn, request = id, error = %err, "peer left before the response was written");
            false
        }
    }
}

/// Sends an error reply with request id `id` by `send_timeout` (best effort).
pub(crate) fn send_error(
    stream: &UnixStream,
    conn: u64,
    id: u64,
    code: ErrorCode,
    message: String,
    max_frame: u32,
    send_timeout: Duration,
) -> bool {
    send_response(
        stream,
        conn,
        id,
        Response::Error(ErrorReply { code, message }),
        max_frame,
        send_timeout,
    )
}

/// Sends a connection-level error reply (id 0) in one non-blocking `send`, for the accept
/// loop, which must never wait on a peer: a fresh connection's send buffer is empty, so the
/// small frame fits; if it does not, the peer just sees the connection close.
pub(crate) fn refuse_now(stream: &UnixStream, code: ErrorCode, message: String, max_frame: u32) {
    let Ok(frame) = encode_frame(&error_envelope(0, code, message), max_frame) else {
        return;
    };
    let _ = send(
        stream.as_raw_fd(),
        &frame,
        MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
    );
}

fn error_envelope(id: u64, code: ErrorCode, message: String) -> Envelope<Response> {
    Envelope {
        id,
        body: Response::Error(ErrorReply { code, message }),
    }
}
