//! A minimal, strict HTTP/1.1 subset over std TCP for the loopback-only engine and router APIs.
//!
//! One request per connection (`Connection: close`), bodies framed by `Content-Length` only (no
//! chunked request bodies), request head ≤ [`MAX_HEAD`] bytes, body ≤ [`MAX_BODY`] bytes.
//! Streaming responses are newline-delimited JSON written until the connection closes, so no
//! chunked encoding is needed either. std TCP instead of an HTTP crate: the subset is a few
//! dozen lines, needs no async runtime, and every peer is on 127.0.0.1.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Largest request or response head accepted, bytes.
pub const MAX_HEAD: usize = 16 * 1024;
/// Largest request body accepted, bytes.
pub const MAX_BODY: usize = 4 * 1024 * 1024;

/// Why a request could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Reading from the socket failed.
    #[error("reading the http message failed")]
    Read {
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The head is not HTTP/1.x or is malformed.
    #[error("malformed http head: {what}")]
    Malformed {
        /// What was wrong.
        what: String,
    },
    /// The head or the body is larger than allowed.
    #[error("http {part} larger than {limit} bytes")]
    TooLarge {
        /// `head` or `body`.
        part: &'static str,
        /// The limit, bytes.
        limit: usize,
    },
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Path, e.g. `/generate`.
    pub path: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

fn read_head<R: BufRead>(r: &mut R) -> Result<Vec<String>, HttpError> {
    let mut lines = Vec::new();
    let mut total = 0;
    loop {
        let mut line = String::new();
        let n = r
            .by_ref()
            .take((MAX_HEAD - total + 1) as u64)
            .read_line(&mut line)
            .map_err(|source| HttpError::Read { source })?;
        total += n;
        if total > MAX_HEAD {
            return Err(HttpError::TooLarge {
                part: "head",
                limit: MAX_HEAD,
            });
        }
        if n == 0 {
            return Err(HttpError::Malformed {
                what: "connection closed inside the head".to_owned(),
            });
        }
        let line = line.trim_end_matches(['\r', '\n']).to_owned();
        if line.is_empty() {
            if lines.is_empty() {
                continue;
            }
            return Ok(lines);
        }
        lines.push(line);
    }
}

fn content_length(headers: &[String]) -> Result<usize, HttpError> {
    let mut len = 0;
    for h in headers {
        let Some((name, value)) = h.split_once(':') else {
            return Err(HttpError::Malformed {
                what: format!("header line {h:?}"),
            });
        };
        if name.trim().eq_ignore_ascii_case("content-length") {
            len = value.trim().parse().map_err(|_| HttpError::Malformed {
                what: format!("content-length {value:?}"),
            })?;
        }
        if name.trim().eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::Malformed {
                what: "transfer-encoding is not supported".to_owned(),
            });
        }
    }
    if len > MAX_BODY {
        return Err(HttpError::TooLarge {
            part: "body",
            limit: MAX_BODY,
        });
    }
    Ok(len)
}

/// Reads one request from `stream` (with a 10 s read timeout for the head and body).
///
/// Errors: [`HttpError::Read`], [`HttpError::Malformed`], [`HttpError::TooLarge`].
pub fn read_request(stream: &TcpStream) -> Result<Request, HttpError> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut r = BufReader::new(stream);
    let head = read_head(&mut r)?;
    let mut parts = head[0].split(' ');
    let (Some(method), Some(path), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed {
            what: format!("request line {:?}", head[0]),
        });
    };
    if !version.starts_with("HTTP/1.") || !path.starts_with('/') {
        return Err(HttpError::Malformed {
            what: format!("request line {:?}", head[0]),
        });
    }
    let len = content_length(&head[1..])?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .map_err(|source| HttpError::Read { source })?;
    let _ = stream.set_read_timeout(None);
    Ok(Request {
        method: method.to_owned(),
        path: path.to_owned(),
        body,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// Writes a complete JSON response with `status`.
///
/// Errors: the socket's write error.
pub fn respond_json(
    mut stream: &TcpStream,
    status: u16,
    body: &serde_json::Value,
) -> std::io::Result<()> {
    let body = body.to_string();
    write!(
        stream,
        "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    )?;
    stream.flush()
}

/// Writes `{"error": message}` with `status`.
///
/// Errors: the socket's write error.
pub fn respond_error(stream: &TcpStream, status: u16, message: &str) -> std::io::Result<()> {
    respond_json(stream, status, &serde_json::json!({ "error": message }))
}

/// Writes the head of a streaming (newline-delimited JSON, read until close) 200 response.
///
/// Errors: the socket's write error.
pub fn start_stream(mut stream: &TcpStream) -> std::io::Result<()> {
    stream.write_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n",
    )?;
    stream.flush()
}

/// Sends a `POST path` with a JSON body and returns the response status and a reader positioned
/// at the body.
///
/// Errors: connecting, writing, reading, or [`HttpError::Malformed`] for a bad status line.
pub fn post(
    addr: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(u16, BufReader<TcpStream>), HttpError> {
    let stream = addr
        .parse::<std::net::SocketAddr>()
        .map_err(|_| HttpError::Malformed {
            what: format!("address {addr:?}"),
        })
        .and_then(|a| {
            TcpStream::connect_timeout(&a, timeout).map_err(|source| HttpError::Read { source })
        })?;
    let body = body.to_string();
    let mut w = &stream;
    write!(
        w,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|source| HttpError::Read { source })?;
    let _ = stream.set_read_timeout(Some(timeout));
    let mut r = BufReader::new(stream);
    let head = read_head(&mut r)?;
    let status = head[0]
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|_| head[0].starts_with("HTTP/1."))
        .ok_or_else(|| HttpError::Malformed {
            what: format!("status line {:?}", head[0]),
        })?;
    Ok((status, r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn roundtrip(raw: &'static [u8]) -> Result<Request, HttpError> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(raw).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            s
        });
        let (s, _) = l.accept().unwrap();
        let r = read_request(&s);
        drop(t.join());
        r
    }

    #[test]
    fn parses_post_with_body() {
        let r = roundtrip(b"POST /generate HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/generate");
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn refuses_bad_heads() {
        assert!(matches!(
            roundtrip(b"GARBAGE\r\n\r\n"),
            Err(HttpError::Malformed { .. })
        ));
        assert!(matches!(
            roundtrip(b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"),
            Err(HttpError::Malformed { .. })
        ));
        assert!(matches!(
            roundtrip(b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n"),
            Err(HttpError::TooLarge { .. })
        ));
        assert!(matches!(
            roundtrip(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            Err(HttpError::Malformed { .. })
        ));
    }
}
