//! Transfers of host paths through a [`Client`]: [`upload_path`] packs a host file or
//! directory with [`pack`] while it streams, [`download_path`] extracts a sandbox tree with
//! [`unpack`] beneath the host destination while it arrives. Both decide where the tree goes
//! on the side that extracts (the sandbox for uploads, here for downloads), as
//! [`resolve_destination`] says.
//!
//! The host paths are the calling user's own: they are resolved like any program the user runs
//! would ([`Resolution::Host`]), with the user's rights. What arrives from a sandbox is hostile:
//! beneath the destination, the extractor's rules hold (nothing is written through a symlink,
//! nothing lands outside the destination).

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use belayer_ipc::{
    Client, ClientError, DownloadRequest, ErrorReply, Response, TransferInfo, UploadRequest,
};

use crate::name::last_component;
use crate::{
    pack, resolve_destination, resolve_source, unpack, unpack_tree, Resolution, TransferError,
};

/// Why a host transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// Packing or extracting on the host failed (the transfer was cancelled).
    #[error("on the host")]
    Local(#[from] TransferError),
    /// The daemon answered with an error.
    #[error("{:?}: {}", .0.code, .0.message)]
    Daemon(ErrorReply),
    /// The connection failed.
    #[error(transparent)]
    Client(ClientError),
    /// The daemon answered something else than a transfer's outcome.
    #[error("unexpected answer: {0}")]
    Unexpected(String),
}

impl From<ClientError> for HostError {
    fn from(err: ClientError) -> HostError {
        match err {
            ClientError::TransferSource { source, .. }
            | ClientError::TransferSink { source, .. } => {
                match source.into_inner().map(|e| e.downcast::<TransferError>()) {
                    Some(Ok(local)) => HostError::Local(*local),
                    Some(Err(other)) => HostError::Local(TransferError::ReadArchive {
                        source: io::Error::other(other),
                    }),
                    None => HostError::Local(TransferError::ReadArchive {
                        source: io::Error::other("the transfer stream failed"),
                    }),
                }
            }
            other => HostError::Client(other),
        }
    }
}

fn outcome(response: Response) -> Result<TransferInfo, HostError> {
    match response {
        Response::Transferred(info) => Ok(info),
        Response::Error(reply) => Err(HostError::Daemon(reply)),
        other => Err(HostError::Unexpected(
            format!("{other:?}").chars().take(120).collect(),
        )),
    }
}

fn cwd() -> rustix::fd::BorrowedFd<'static> {
    rustix::fs::CWD
}

/// Uploads the host file, directory or symlink `src` to `dest` in sandbox `id` (`dest`: an
/// existing directory takes it under its own name, else it becomes `dest`). `timeout_ms`:
/// the daemon's timeout for the transfer (`None`: its default).
///
/// Errors: [`HostError::Local`] for a source that cannot be opened or read (before any request
/// when it cannot be opened), [`HostError::Daemon`] for the daemon's refusals (unknown
/// sandbox, destination missing, a sandbox out of space), [`HostError::Client`].
pub fn upload_path(
    client: &mut Client,
    id: &str,
    src: &Path,
    dest: &str,
    timeout_ms: Option<u64>,
) -> Result<TransferInfo, HostError> {
    let source = resolve_source(cwd(), src.as_os_str().as_bytes(), Resolution::Host)?;
    let request = UploadRequest {
        id: id.to_owned(),
        dest: dest.to_owned(),
        archive: false,
        timeout_ms,
    };
    let response = client.upload_with(request, |sink| {
        pack(&source, sink).map(drop).map_err(io::Error::other)
    })?;
    outcome(response)
}

/// Uploads the tar stream `tar` into the existing directory `dest` of sandbox `id`, every
/// member under its own name (an arbitrary archive: [`UploadRequest::archive`]).
///
/// Errors: as [`upload_path`].
pub fn upload_archive(
    client: &mut Client,
    id: &str,
    tar: impl io::Read,
    dest: &str,
    timeout_ms: Option<u64>,
) -> Result<TransferInfo, HostError> {
    let request = UploadRequest {
        id: id.to_owned(),
        dest: dest.to_owned(),
        archive: true,
        timeout_ms,
    };
    outcome(client.upload(request, tar)?)
}

/// Downloads `src` of sandbox `id` to the host path `dest` (an existing directory takes it
/// under its own name, else it becomes `dest`, whose parent must exist).
///
/// Errors: [`HostError::Local`] for a destination that cannot be used (before any request) or
/// a member the extractor refuses (the transfer is cancelled; what was extracted before
/// stays), [`HostError::Daemon`], [`HostError::Client`].
pub fn download_path(
    client: &mut Client,
    id: &str,
    src: &str,
    dest: &Path,
    timeout_ms: Option<u64>,
) -> Result<TransferInfo, HostError> {
    let destination =
        resolve_destination(cwd(), dest.as_os_str().as_bytes(), Resolution::Host, true)?;
    let request = DownloadRequest {
        id: id.to_owned(),
        src: src.to_owned(),
        timeout_ms,
    };
    // The packer names the tree after the source's last component: nothing else may come.
    let top = last_component(src.as_bytes()).map(<[u8]>::to_vec);
    let response = client.download_with(request, |stream| {
        match &top {
            Some(top) => unpack_tree(stream, &destination, top),
            None => unpack(stream, &destination, true),
        }
        .map(drop)
        .map_err(io::Error::other)
    })?;
    outcome(response)
}

/// Downloads `src` of sandbox `id` as a tar stream into `out`, unchanged.
///
/// Errors: [`HostError::Daemon`], [`HostError::Client`] (a write error of `out` among them).
pub fn download_archive(
    client: &mut Client,
    id: &str,
    src: &str,
    out: impl io::Write,
    timeout_ms: Option<u64>,
) -> Result<TransferInfo, HostError> {
    let request = DownloadRequest {
        id: id.to_owned(),
        src: src.to_owned(),
        timeout_ms,
    };
    outcome(client.download(request, out)?)
}
