//! Talking to `belayerd`: connecting, one request, an image import, and the error an answer
//! carries.

use anyhow::{Context, Result};
use belayer_ipc::{Client, Request, Response};

/// A daemon error answer, carried to `main` to pick the exit code.
#[derive(Debug, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct DaemonError {
    /// Code.
    pub code: belayer_ipc::ErrorCode,
    /// Message.
    pub message: String,
}

/// Sends `req`, turning an error answer into [`DaemonError`].
pub fn call(client: &mut Client, req: Request) -> Result<Response> {
    answer(client.call(req).context("talking to belayerd")?)
}

/// A daemon's answer: an error reply becomes a [`DaemonError`].
pub fn answer(response: Response) -> Result<Response> {
    match response {
        Response::Error(e) => Err(DaemonError {
            code: e.code,
            message: e.message,
        }
        .into()),
        r => Ok(r),
    }
}

/// Imports the directory or archive at `path` as image `name`, passing it as a descriptor
/// opened here with this process's rights ([`Client::import_image`]); an error reply becomes
/// a [`DaemonError`].
pub fn import_image(client: &mut Client, name: &str, path: &std::path::Path) -> Result<Response> {
    let response = client.import_image(name, path).map_err(|e| match e {
        open @ belayer_ipc::ClientError::OpenSource { .. } => anyhow::Error::new(open),
        other => anyhow::Error::new(other).context("talking to belayerd"),
    })?;
    answer(response)
}

/// Connects to the daemon.
pub fn connect(socket: &std::path::Path) -> Result<Client> {
    Client::connect(socket).with_context(|| {
        format!(
            "cannot reach belayerd at {} (is it running? see `belayerd --help`)",
            socket.display()
        )
    })
}
