//! `Upload` and `Download`: the streaming requests the server hands to
//! [`Handler::transfer`](belayer_ipc::Handler::transfer), checked for access like every verb
//! and served by [`sandbox::transfer`](crate::sandbox::transfer).

use belayer_ipc::{Caller, ErrorCode, ErrorReply, Request, Response, TransferLink};

use super::{error, unknown, Agent};
use crate::sandbox;

impl Agent {
    /// Serves one transfer request from `caller` over `link`; returns the final response.
    pub(super) fn transfer(
        &self,
        caller: &Caller,
        request: Request,
        link: &mut TransferLink<'_>,
    ) -> Response {
        let result = match &request {
            Request::Upload(req) => match self.slot_for(caller, &req.id) {
                Some(slot) => sandbox::transfer::upload(&self.rt, &slot, req, link),
                None => return unknown(&req.id),
            },
            Request::Download(req) => match self.slot_for(caller, &req.id) {
                Some(slot) => sandbox::transfer::download(&self.rt, &slot, req, link),
                None => return unknown(&req.id),
            },
            _ => {
                return Response::Error(ErrorReply {
                    code: ErrorCode::BadRequest,
                    message: "not a transfer request".into(),
                })
            }
        };
        match result {
            Ok(info) => Response::Transferred(info),
            Err(e) => {
                tracing::debug!(uid = caller.cred.uid, error = %belayer_ipc::error_chain(&e), "transfer failed");
                error(e.code(), &e)
            }
        }
    }
}
