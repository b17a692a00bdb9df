//! The daemon core as the server sees it: the [`Handler`] seam.

use std::os::fd::OwnedFd;
use std::sync::mpsc::Receiver;

use super::transfer::TransferLink;
use crate::message::{ErrorCode, ErrorReply, Event, Request, Response};
use crate::transport::creds::{Caller, PeerCred};

/// Most descriptors one request frame may carry; a frame with more is a bad frame (its
/// descriptors are closed, `BadRequest`, connection closed). `ImportImage` carries one,
/// `ImportOci` one per layer file of an OCI layout; peers other than root hold at most 64
/// connections together, so they can make the daemon hold at most 4096 such descriptors.
pub const MAX_REQUEST_FDS: usize = 64;

/// The daemon core as the server sees it: one request in, one response out.
///
/// Called on the connection's thread; requests of one connection are handled one after the
/// other, requests of different connections concurrently. A panic in `handle` is caught and
/// answered with [`ErrorCode::Internal`](crate::ErrorCode::Internal). A running `handle` is
/// never cut short by the server's timeouts.
pub trait Handler: Send + Sync + 'static {
    /// Answers `request` from the (already admitted) peer `peer`.
    fn handle(&self, peer: &PeerCred, request: Request) -> Response;

    /// Answers `request` from `caller` together with the descriptors attached to its frame
    /// (`SCM_RIGHTS`, close-on-exec, at most [`MAX_REQUEST_FDS`]). This is what the server
    /// calls; the default closes the descriptors and answers with [`handle`](Self::handle),
    /// so only handlers of requests that carry descriptors (or that act with the caller's
    /// supplementary groups) implement it.
    fn handle_call(&self, caller: &Caller, request: Request, fds: Vec<OwnedFd>) -> Response {
        drop(fds);
        self.handle(&caller.cred, request)
    }

    /// Opens an event stream for [`Request::Subscribe`] from `peer`: every [`Event`] sent on
    /// the returned channel is written to the connection until the peer closes it, stops
    /// reading for longer than the send timeout, the sender side is dropped, or the server
    /// shuts down. `None` (the default) answers the request with
    /// [`ErrorCode::Unsupported`](crate::ErrorCode::Unsupported). Called only when the peer
    /// is within the subscription quota.
    fn subscribe(&self, peer: &PeerCred) -> Option<Receiver<Event>> {
        let _ = peer;
        None
    }

    /// Serves a streaming transfer ([`Request::Upload`] or [`Request::Download`]) from
    /// `caller`: reads upload chunks from and writes download chunks to `link`, and returns
    /// the final response, which the server writes unless the link broke (then it closes the
    /// connection). The default answers [`ErrorCode::Unsupported`]. A panic is caught and
    /// answered like one in [`handle`](Self::handle).
    fn transfer(&self, caller: &Caller, request: Request, link: &mut TransferLink<'_>) -> Response {
        let _ = (caller, request, link);
        Response::Error(ErrorReply {
            code: ErrorCode::Unsupported,
            message: "this server does not transfer files".to_owned(),
        })
    }
}
