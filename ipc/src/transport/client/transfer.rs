//! Streaming transfers on the blocking [`Client`]: [`Client::upload_with`] /
//! [`Client::upload`] send a tar stream in [`Request::UploadChunk`] frames,
//! [`Client::download_with`] / [`Client::download`] read one from [`Response::DownloadChunk`]
//! frames (see [`Request::Upload`] and [`Request::Download`] for the exchange).
//!
//! A source or consumer that fails mid-way cancels the transfer ([`Request::TransferCancel`])
//! and reads the daemon's final answer, so the connection stays usable; a broken socket makes
//! the client [`Broken`](ClientError::Broken) like any failed call.

use std::io::{self, Read, Write};

use super::{Client, ClientError, NoSigPipe};
use crate::frame::{encode_frame, read_frame, FrameError};
use crate::message::{DownloadRequest, Envelope, Request, Response, UploadRequest};
use crate::transport::is_disconnect;
use crate::transport::server::chunk_bytes;

fn brief(response: &Response) -> String {
    format!("{response:?}").chars().take(120).collect()
}

impl Client {
    /// Writes one request frame with id `id`; a write failure breaks the client.
    fn send_frame(&mut self, id: u64, request: Request) -> Result<(), ClientError> {
        let frame = encode_frame(&Envelope { id, body: request }, self.max_frame)
            .map_err(|source| ClientError::Send { id, source })?;
        NoSigPipe(&self.stream).write_all(&frame).map_err(|err| {
            self.broken = true;
            if is_disconnect(&err) {
                ClientError::ClosedByServer { id }
            } else {
                ClientError::Send {
                    id,
                    source: FrameError::Write { source: err },
                }
            }
        })
    }

    /// Reads one response frame of request `id`; a failure breaks the client.
    fn recv_frame(&mut self, id: u64) -> Result<Response, ClientError> {
        let envelope = read_frame::<Response, _>(&mut &self.stream, self.max_frame);
        let result = match envelope {
            Ok(e) if e.id == id => Ok(e.body),
            Ok(e) if e.id == 0 && matches!(e.body, Response::Error(_)) => {
                self.broken = true;
                return Ok(e.body);
            }
            Ok(e) => Err(ClientError::IdMismatch {
                expected: id,
                got: e.id,
            }),
            Err(FrameError::Closed) => Err(ClientError::ClosedByServer { id }),
            Err(FrameError::Read { source }) if is_disconnect(&source) => {
                Err(ClientError::ClosedByServer { id })
            }
            Err(source) => Err(ClientError::Receive { id, source }),
        };
        if result.is_err() {
            self.broken = true;
        }
        result
    }

    /// Reads responses of transfer `id` until its final one, dropping download chunks.
    fn final_response(&mut self, id: u64) -> Result<Response, ClientError> {
        loop {
            match self.recv_frame(id)? {
                Response::DownloadChunk { .. } => continue,
                other => return Ok(other),
            }
        }
    }

    /// Uploads the tar stream `fill` writes ([`Request::Upload`] with `request`): `fill` is
    /// called once the daemon is ready, with a writer that sends the bytes in chunks. Returns
    /// the daemon's final answer: [`Response::Transferred`], or an error reply (before `fill`
    /// runs when the upload cannot start).
    ///
    /// Errors: [`ClientError::TransferSource`] when `fill` fails (the transfer is cancelled;
    /// the connection stays usable), [`ClientError::TransferUnexpected`], and those of
    /// [`call`](Client::call).
    pub fn upload_with<F>(
        &mut self,
        request: UploadRequest,
        fill: F,
    ) -> Result<Response, ClientError>
    where
        F: FnOnce(&mut UploadSink<'_>) -> io::Result<()>,
    {
        let id = self.next_request_id()?;
        self.send_frame(id, Request::Upload(request))?;
        let chunk = match self.recv_frame(id)? {
            Response::TransferReady { chunk_bytes: n } => {
                (n as usize).clamp(1, chunk_bytes(self.max_frame))
            }
            other @ Response::Error(_) => return Ok(other),
            other => {
                self.broken = true;
                return Err(ClientError::TransferUnexpected {
                    id,
                    answer: brief(&other),
                });
            }
        };
        let mut sink = UploadSink {
            client: self,
            id,
            chunk,
            buf: Vec::with_capacity(chunk),
            failed: None,
        };
        let filled = fill(&mut sink).and_then(|()| sink.flush());
        let failed = sink.failed.take();
        if let Some(err) = failed {
            return self.answer_after_close(id, err);
        }
        match filled {
            Ok(()) => match self.send_frame(id, Request::UploadChunk { data: Vec::new() }) {
                Ok(()) => self.final_response(id),
                Err(err) => self.answer_after_close(id, err),
            },
            Err(source) => match self.send_frame(id, Request::TransferCancel) {
                Ok(()) => {
                    self.final_response(id)?;
                    Err(ClientError::TransferSource { id, source })
                }
                Err(err) => self.answer_after_close(id, err),
            },
        }
    }

    /// After sending on transfer `id` failed with `err`: the server may have answered and
    /// closed (a transfer past its deadline, a stream it refused), and its answer waits in the
    /// receive queue. Returns that error answer, else `err`; the client stays broken.
    fn answer_after_close(&mut self, id: u64, err: ClientError) -> Result<Response, ClientError> {
        let written = matches!(
            err,
            ClientError::ClosedByServer { .. }
                | ClientError::Send {
                    source: FrameError::Write { .. },
                    ..
                }
        );
        if !written {
            self.broken = true;
            return Err(err);
        }
        let answer = self.final_response(id);
        self.broken = true;
        match answer {
            Ok(reply @ Response::Error(_)) => Ok(reply),
            _ => Err(err),
        }
    }

    /// Uploads the tar stream read from `tar` (see [`upload_with`](Client::upload_with)).
    ///
    /// Errors: as [`upload_with`](Client::upload_with); a read error of `tar` is
    /// [`ClientError::TransferSource`].
    pub fn upload(
        &mut self,
        request: UploadRequest,
        mut tar: impl Read,
    ) -> Result<Response, ClientError> {
        self.upload_with(request, |sink| io::copy(&mut tar, sink).map(drop))
    }

    /// Downloads a tar stream ([`Request::Download`] with `request`): `consume` reads it from
    /// the reader it is given (end of stream when the daemon's final answer arrives). Returns
    /// the final answer: [`Response::Transferred`], or an error reply (the stream read so far
    /// is then incomplete).
    ///
    /// Errors: [`ClientError::TransferSink`] when `consume` fails and the daemon did not
    /// (the transfer is cancelled; the connection stays usable),
    /// [`ClientError::TransferUnexpected`], and those of [`call`](Client::call).
    pub fn download_with<F>(
        &mut self,
        request: DownloadRequest,
        consume: F,
    ) -> Result<Response, ClientError>
    where
        F: FnOnce(&mut DownloadSource<'_>) -> io::Result<()>,
    {
        let id = self.next_request_id()?;
        self.send_frame(id, Request::Download(request))?;
        let mut source = DownloadSource {
            client: self,
            id,
            buf: Vec::new(),
            pos: 0,
            done: None,
            failed: None,
        };
        let consumed = consume(&mut source);
        let (done, failed) = (source.done.take(), source.failed.take());
        if let Some(err) = failed {
            return Err(err);
        }
        match (consumed, done) {
            (Ok(()), Some(last)) => Ok(last),
            (Ok(()), None) => self.final_response(id),
            (Err(source), Some(Response::Transferred(_))) => {
                Err(ClientError::TransferSink { id, source })
            }
            (Err(_), Some(last)) => Ok(last),
            (Err(source), None) => {
                self.send_frame(id, Request::TransferCancel)?;
                self.final_response(id)?;
                Err(ClientError::TransferSink { id, source })
            }
        }
    }

    /// Downloads a tar stream into `out` (see [`download_with`](Client::download_with)).
    ///
    /// Errors: as [`download_with`](Client::download_with); a write error of `out` is
    /// [`ClientError::TransferSink`].
    pub fn download(
        &mut self,
        request: DownloadRequest,
        mut out: impl Write,
    ) -> Result<Response, ClientError> {
        self.download_with(request, |source| {
            io::copy(source, &mut out)?;
            out.flush()
        })
    }
}

/// The writer of an upload's stream (see [`Client::upload_with`]): bytes go out in chunks of
/// the size the daemon asked for.
#[derive(Debug)]
pub struct UploadSink<'a> {
    client: &'a mut Client,
    id: u64,
    chunk: usize,
    buf: Vec<u8>,
    /// The connection failed: the error of the call.
    failed: Option<ClientError>,
}

impl UploadSink<'_> {
    fn send_buf(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(self.chunk));
        if let Err(err) = self
            .client
            .send_frame(self.id, Request::UploadChunk { data })
        {
            let shown = io::Error::new(io::ErrorKind::BrokenPipe, err.to_string());
            self.failed = Some(err);
            return Err(shown);
        }
        Ok(())
    }
}

impl Write for UploadSink<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        if self.failed.is_some() {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the upload failed",
            ));
        }
        let n = bytes.len().min(self.chunk - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == self.chunk {
            self.send_buf()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send_buf()
    }
}

/// The reader of a download's stream (see [`Client::download_with`]).
#[derive(Debug)]
pub struct DownloadSource<'a> {
    client: &'a mut Client,
    id: u64,
    buf: Vec<u8>,
    pos: usize,
    /// The final answer, once read (the stream has ended).
    done: Option<Response>,
    /// The connection failed: the error of the call.
    failed: Option<ClientError>,
}

impl Read for DownloadSource<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done.is_some() {
                return Ok(0);
            }
            if self.failed.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the download failed",
                ));
            }
            match self.client.recv_frame(self.id) {
                Ok(Response::DownloadChunk { data }) => {
                    self.buf = data;
                    self.pos = 0;
                }
                Ok(last @ (Response::Transferred(_) | Response::Error(_))) => {
                    self.done = Some(last);
                    return Ok(0);
                }
                Ok(other) => {
                    self.client.broken = true;
                    self.failed = Some(ClientError::TransferUnexpected {
                        id: self.id,
                        answer: brief(&other),
                    });
                }
                Err(err) => self.failed = Some(err),
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
