//! A blob as a blocking [`std::io::Read`]: a task on the registry's runtime reads the HTTP
//! body and sends its chunks through a bounded channel; the reader takes them on the
//! caller's thread. At most [`CHANNEL_CHUNKS`] chunks wait in memory, so a layer of any size
//! streams in constant memory while the network and the caller's unpacking overlap.

use std::io::{self, Read};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::error::RegistryError;
use super::transport::map_reqwest;

/// Chunks (as the connection delivers them, typically up to 16 KiB) buffered between the
/// network task and the reader.
pub(crate) const CHANNEL_CHUNKS: usize = 32;

/// The registry's tokio runtime: one worker thread that drives requests and blob streams.
/// Dropped without waiting (`shutdown_background`), so dropping it never blocks or panics.
#[derive(Debug)]
pub(crate) struct Runtime(Option<tokio::runtime::Runtime>);

impl Runtime {
    /// Starts the runtime.
    pub(crate) fn new() -> io::Result<Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("belayer-registry")
            .enable_io()
            .enable_time()
            .build()
            .map(|rt| Runtime(Some(rt)))
    }

    /// The runtime (present until drop).
    pub(crate) fn get(&self) -> &tokio::runtime::Runtime {
        self.0.as_ref().expect("runtime present until drop")
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

enum Msg {
    Data(Bytes),
    End,
}

/// Names for the errors of a stream.
pub(crate) struct StreamContext {
    pub(crate) registry: String,
    pub(crate) reference: String,
    pub(crate) digest: String,
}

/// Starts the network task for `resp` (a 200 answer for a blob of `size` bytes) and returns
/// the reader.
pub(crate) fn spawn(
    rt: &Arc<Runtime>,
    resp: reqwest::Response,
    size: u64,
    ctx: StreamContext,
) -> BlobReader {
    let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
    let task = rt.get().spawn(pump(resp, size, tx, ctx));
    BlobReader {
        rx,
        buf: Bytes::new(),
        state: State::Open,
        task,
        _rt: Arc::clone(rt),
    }
}

/// Sends the body's chunks, then `End`, or one error: a transport failure, more bytes than
/// `size`, or fewer.
async fn pump(
    mut resp: reqwest::Response,
    size: u64,
    tx: mpsc::Sender<io::Result<Msg>>,
    ctx: StreamContext,
) {
    let size_error = |got: u64| RegistryError::BlobSize {
        reference: ctx.reference.clone(),
        digest: ctx.digest.clone(),
        expected: size.to_string(),
        got,
    };
    let mut got = 0u64;
    let last = loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                got = got.saturating_add(chunk.len() as u64);
                if got > size {
                    break Err(io::Error::new(io::ErrorKind::InvalidData, size_error(got)));
                }
                if tx.send(Ok(Msg::Data(chunk))).await.is_err() {
                    return;
                }
            }
            Ok(None) if got < size => {
                break Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    size_error(got),
                ));
            }
            Ok(None) => break Ok(Msg::End),
            Err(e) => {
                let kind = if e.is_timeout() {
                    io::ErrorKind::TimedOut
                } else {
                    io::ErrorKind::ConnectionAborted
                };
                break Err(io::Error::new(
                    kind,
                    map_reqwest(&ctx.registry, &ctx.reference, e),
                ));
            }
        }
    };
    let _ = tx.send(last).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Open,
    Done,
    Failed,
}

/// A blob body as a blocking reader (see [`super::Registry::blob_reader`]). Must not be read
/// from inside an async runtime (it blocks the thread). Dropping it stops the download.
pub(crate) struct BlobReader {
    rx: mpsc::Receiver<io::Result<Msg>>,
    buf: Bytes,
    state: State,
    task: JoinHandle<()>,
    /// Keeps the runtime (and so the task) alive as long as the reader.
    _rt: Arc<Runtime>,
}

impl Read for BlobReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        loop {
            if !self.buf.is_empty() {
                let n = out.len().min(self.buf.len());
                out[..n].copy_from_slice(&self.buf.split_to(n));
                return Ok(n);
            }
            match self.state {
                State::Done => return Ok(0),
                State::Failed => {
                    return Err(io::Error::other("the blob stream failed earlier"));
                }
                State::Open => {}
            }
            match self.rx.blocking_recv() {
                Some(Ok(Msg::Data(chunk))) => self.buf = chunk,
                Some(Ok(Msg::End)) => self.state = State::Done,
                Some(Err(e)) => {
                    self.state = State::Failed;
                    return Err(e);
                }
                None => {
                    self.state = State::Failed;
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the blob stream stopped before its end",
                    ));
                }
            }
        }
    }
}

impl Drop for BlobReader {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for BlobReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobReader")
            .field("buffered", &self.buf.len())
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}
