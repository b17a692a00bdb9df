//! One connection of the memory server: its requests read one after the other, admitted by
//! the peer's credentials, and answered (attach under a lease, flush, version, register).

use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;

use belayer_ipc::memory::message::{recv_message, send_attached, send_message};
use belayer_ipc::memory::{
    AttachInfo, AttachRequest, MemErrorCode, MemErrorReply, MemRequest, MemResponse, Role,
};
use belayer_ipc::{PeerCred, DEFAULT_MAX_FRAME};
use tracing::{debug, info, warn};

use super::{valid_worker, Shared};
use crate::memory::lease::Holder;

fn error(code: MemErrorCode, message: impl Into<String>) -> MemResponse {
    MemResponse::Error(MemErrorReply {
        code,
        message: message.into(),
    })
}

/// What a request produced: a plain answer, or an attachment to send with descriptors.
enum Outcome {
    Reply(MemResponse),
    Attached(AttachInfo, Vec<usize>),
}

pub(super) fn serve_connection(shared: &Shared, conn: u64, stream: &UnixStream) {
    let peer = match PeerCred::of(stream) {
        Ok(peer) => peer,
        Err(err) => {
            warn!(conn, error = %err, "reading peer credentials failed; closing");
            return;
        }
    };
    if let Err(err) = shared.policy.authorize(stream, &peer) {
        warn!(conn, pid = peer.pid, uid = peer.uid, gid = peer.gid, error = %err, "refusing peer");
        let reply = error(MemErrorCode::PermissionDenied, err.to_string());
        let _ = send_message(stream, 0, reply, &[], DEFAULT_MAX_FRAME);
        return;
    }
    debug!(conn, pid = peer.pid, uid = peer.uid, "peer connected");
    loop {
        let envelope = match recv_message::<MemRequest, _>(stream, DEFAULT_MAX_FRAME, 0) {
            Ok((envelope, _)) => envelope,
            Err(err) if err.is_disconnect() => break,
            Err(err) => {
                let message = belayer_ipc::error_chain(&err);
                warn!(conn, pid = peer.pid, error = %message, "bad frame; answering BadRequest and closing");
                let _ = send_message(
                    stream,
                    0,
                    error(MemErrorCode::BadRequest, message),
                    &[],
                    DEFAULT_MAX_FRAME,
                );
                break;
            }
        };
        let id = envelope.id;
        let sent = match handle(shared, conn, &peer, envelope.body) {
            Outcome::Reply(reply) => send_message(stream, id, reply, &[], DEFAULT_MAX_FRAME),
            Outcome::Attached(info, regions) => {
                let fds: Vec<BorrowedFd<'_>> = regions
                    .iter()
                    .filter_map(|&index| shared.alloc.fd(index, info.mode))
                    .collect();
                let attachment = info.attachment;
                let sent = send_attached(stream, id, info, &fds, DEFAULT_MAX_FRAME);
                if sent.is_err() {
                    shared.state().leases.release(conn, attachment);
                }
                sent
            }
        };
        if let Err(err) = sent {
            debug!(conn, request = id, error = %err, "peer left before the answer was sent");
            break;
        }
    }
    let released = shared.state().leases.release_connection(conn);
    if !released.is_empty() {
        info!(conn, pid = peer.pid, attachments = ?released, "connection closed; leases released");
    }
}

fn handle(shared: &Shared, conn: u64, peer: &PeerCred, request: MemRequest) -> Outcome {
    let reply = match request {
        MemRequest::Ping => MemResponse::Pong(shared.info()),
        MemRequest::Attach(request) => return attach(shared, conn, peer, request),
        MemRequest::Detach { attachment } => {
            if shared.state().leases.release(conn, attachment) {
                info!(conn, attachment, "detached");
                MemResponse::Done
            } else {
                error(
                    MemErrorCode::UnknownAttachment,
                    format!("no attachment {attachment} on this connection"),
                )
            }
        }
        MemRequest::Flush { region } => flush(shared, conn, &region),
        MemRequest::Version => MemResponse::Version {
            version: shared.state().version,
        },
        MemRequest::BumpVersion => {
            let mut state = shared.state();
            if shared.role != Role::Weights {
                error(
                    MemErrorCode::Unsupported,
                    "only a weights server has a version counter to bump",
                )
            } else if !state.leases.writes_anything(conn) {
                error(
                    MemErrorCode::NoLease,
                    "bumping the weights version needs a write lease",
                )
            } else {
                state.version += 1;
                info!(conn, version = state.version, "weights version bumped");
                MemResponse::Version {
                    version: state.version,
                }
            }
        }
        MemRequest::RegisterWorker { worker, uid } => {
            if peer.uid != 0 {
                error(
                    MemErrorCode::PermissionDenied,
                    format!("only root may register workers (peer uid {})", peer.uid),
                )
            } else if !valid_worker(&worker) {
                error(
                    MemErrorCode::BadRequest,
                    format!("worker id {worker:?} is invalid"),
                )
            } else {
                info!(worker = %worker, uid, "worker registered");
                shared.state().workers.insert(worker, uid);
                MemResponse::Done
            }
        }
    };
    Outcome::Reply(reply)
}

fn attach(shared: &Shared, conn: u64, peer: &PeerCred, request: AttachRequest) -> Outcome {
    let refuse = |code, message: String| {
        warn!(conn, pid = peer.pid, uid = peer.uid, worker = %request.worker, ?code, %message, "attach refused");
        Outcome::Reply(error(code, message))
    };
    if !valid_worker(&request.worker) {
        return refuse(
            MemErrorCode::BadRequest,
            format!("worker id {:?} is invalid", request.worker),
        );
    }
    if request.layout_hash != shared.layout_hash {
        return refuse(
            MemErrorCode::LayoutMismatch,
            format!(
                "layout hash {} differs from the server's {}",
                request.layout_hash, shared.layout_hash
            ),
        );
    }
    let placement = shared.alloc.placement();
    let mut indices = Vec::new();
    if request.regions.is_empty() {
        indices.extend(0..placement.regions.len());
    } else {
        for name in &request.regions {
            match placement.regions.iter().position(|r| &r.name == name) {
                Some(index) => indices.push(index),
                None => {
                    return refuse(
                        MemErrorCode::UnknownRegion,
                        format!("no region named {name:?}"),
                    )
                }
            }
        }
        indices.sort_unstable();
        indices.dedup();
    }
    let mut state = shared.state();
    match state.workers.get(&request.worker) {
        Some(&uid) if uid != peer.uid => {
            return refuse(
                MemErrorCode::UnknownWorker,
                format!(
                    "worker {:?} is registered for uid {uid}, not {}",
                    request.worker, peer.uid
                ),
            )
        }
        None if shared.require_registration => {
            return refuse(
                MemErrorCode::UnknownWorker,
                format!("worker {:?} is not registered", request.worker),
            )
        }
        _ => {}
    }
    let attachment = shared.next_attachment.fetch_add(1, Ordering::SeqCst);
    let holder = Holder {
        attachment,
        conn,
        worker: request.worker.clone(),
        mode: request.mode,
    };
    if let Err(conflict) = state.leases.acquire(&indices, &holder) {
        let name = &placement.regions[conflict.region].name;
        return refuse(
            MemErrorCode::LeaseConflict,
            format!(
                "region {name:?} is held {:?} by worker {:?} (attachment {})",
                conflict.mode, conflict.worker, conflict.attachment
            ),
        );
    }
    let info = AttachInfo {
        attachment,
        role: shared.role,
        backend: shared.alloc.backend(),
        layout_hash: shared.layout_hash.clone(),
        version: state.version,
        granularity: placement.granularity,
        total: placement.total,
        mode: request.mode,
        regions: indices
            .iter()
            .map(|&i| placement.regions[i].clone())
            .collect(),
    };
    info!(conn, pid = peer.pid, worker = %request.worker, attachment, mode = ?request.mode,
          regions = indices.len(), "attached");
    Outcome::Attached(info, indices)
}

fn flush(shared: &Shared, conn: u64, region: &str) -> MemResponse {
    let placement = shared.alloc.placement();
    let Some(index) = placement.regions.iter().position(|r| r.name == region) else {
        return error(
            MemErrorCode::UnknownRegion,
            format!("no region named {region:?}"),
        );
    };
    if !matches!(
        placement.regions[index].kind,
        belayer_ipc::memory::RegionKind::KvArena { .. }
    ) {
        return error(
            MemErrorCode::Unsupported,
            format!("region {region:?} is not a kv arena"),
        );
    }
    // Hold the lock while zeroing: no writer can attach halfway through.
    let state = shared.state();
    if let Some(writer) = state.leases.writer_besides(conn, index) {
        return error(
            MemErrorCode::NoLease,
            format!(
                "region {region:?} is being written by worker {:?} (attachment {})",
                writer.worker, writer.attachment
            ),
        );
    }
    match shared.alloc.zero(index) {
        Ok(bytes) => {
            info!(conn, region, bytes, "kv arena flushed");
            MemResponse::Flushed {
                region: region.to_owned(),
                bytes,
            }
        }
        Err(err) => error(MemErrorCode::Internal, belayer_ipc::error_chain(&err)),
    }
}
