//! The router's HTTP front: the accept loop, request dispatch (registration, health, slots,
//! `POST /generate` streamed token by token) and a streaming client of it.

use std::io::{BufRead, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::json;

use super::Router;
use crate::handover::engine::parse_generate;
use crate::handover::http;

impl Router {
    /// Serves the router's HTTP API on `listener` until the process exits.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let _ = conn.set_nodelay(true);
            let r = Arc::clone(self);
            std::thread::spawn(move || r.handle(conn));
        }
    }

    fn handle(&self, stream: TcpStream) {
        let req = match http::read_request(&stream) {
            Ok(r) => r,
            Err(e) => {
                let _ = http::respond_error(&stream, 400, &e.to_string());
                return;
            }
        };
        let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
        match (req.method.as_str(), req.path.as_str()) {
            ("POST", "/generate") => self.handle_generate(&stream, &req.body),
            ("POST", "/register") => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Reg {
                    gpu: String,
                    addr: String,
                }
                match serde_json::from_slice::<Reg>(&req.body) {
                    Ok(r) if r.addr.parse::<std::net::SocketAddr>().is_ok() => {
                        let epoch = self.register(&r.gpu, &r.addr);
                        let _ = http::respond_json(&stream, 200, &json!({ "epoch": epoch }));
                    }
                    Ok(r) => {
                        let _ = http::respond_error(
                            &stream,
                            400,
                            &format!("addr {:?} is not host:port", r.addr),
                        );
                    }
                    Err(e) => {
                        let _ = http::respond_error(&stream, 400, &format!("bad body: {e}"));
                    }
                }
            }
            ("POST", "/unregister") => {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Unreg {
                    gpu: String,
                    epoch: u64,
                }
                match serde_json::from_slice::<Unreg>(&req.body) {
                    Ok(u) => match self.unregister(&u.gpu, u.epoch) {
                        Ok(()) => {
                            let _ = http::respond_json(&stream, 200, &json!({ "ok": true }));
                        }
                        Err(e) => {
                            let _ = http::respond_error(&stream, 404, &e.to_string());
                        }
                    },
                    Err(e) => {
                        let _ = http::respond_error(&stream, 400, &format!("bad body: {e}"));
                    }
                }
            }
            ("GET", "/engines") => {
                let c = &self.counters;
                let _ = http::respond_json(
                    &stream,
                    200,
                    &json!({
                        "engines": self.slots(),
                        "alerts": self.alerts(),
                        "resumed": c.resumed.load(Ordering::Relaxed),
                        "fenced_tokens": c.fenced_tokens.load(Ordering::Relaxed),
                        "prefix_records": c.prefix_records.load(Ordering::Relaxed),
                    }),
                );
            }
            _ => {
                let _ = http::respond_error(&stream, 404, "unknown path");
            }
        }
    }

    fn handle_generate(&self, stream: &TcpStream, body: &[u8]) {
        let req = match parse_generate(body) {
            Ok(r) => r,
            Err(e) => {
                let _ = http::respond_error(stream, 400, &e);
                return;
            }
        };
        if req.stream {
            if http::start_stream(stream).is_err() {
                return;
            }
            let mut w = std::io::BufWriter::new(stream);
            let mut sink = |i: usize, t: u32| {
                writeln!(w, "{}", json!({ "index": i, "token": t })).is_ok() && w.flush().is_ok()
            };
            let end = match self.generate(&req, &mut sink) {
                Ok(_) => json!({ "done": true }),
                Err(e) => json!({ "error": e.to_string() }),
            };
            let _ = writeln!(w, "{end}");
            let _ = w.flush();
        } else {
            let mut sink = |_: usize, _: u32| true;
            match self.generate(&req, &mut sink) {
                Ok(out) => {
                    let _ = http::respond_json(stream, 200, &json!({ "output_ids": out }));
                }
                Err(e) => {
                    let _ = http::respond_error(stream, 503, &e.to_string());
                }
            }
        }
    }
}

/// A streaming client of `POST /generate` (tests, benchmark): sends the request and calls
/// `on_token(index, token)` per line; returns the tokens, or the error line's message.
///
/// Errors: transport errors and error answers as strings.
pub fn stream_generate(
    addr: &str,
    input_ids: &[u32],
    max_new_tokens: u32,
    rid: Option<&str>,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<Vec<u32>, String> {
    let mut body = json!({
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens},
        "stream": true,
    });
    if let Some(rid) = rid {
        body["rid"] = json!(rid);
    }
    let (status, mut r) =
        http::post(addr, "/generate", &body, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    let _ = r.get_ref().set_read_timeout(Some(Duration::from_secs(120)));
    if status != 200 {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut r, &mut s);
        return Err(format!("status {status}: {s}"));
    }
    let mut out = Vec::new();
    for line in r.lines() {
        let line = line.map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        if v.get("done").is_some() {
            return Ok(out);
        }
        if let Some(e) = v.get("error") {
            return Err(e.to_string());
        }
        let i = v["index"].as_u64().ok_or("no index")? as usize;
        let t = v["token"].as_u64().ok_or("no token")? as u32;
        if i != out.len() {
            return Err(format!("token index {i}, expected {}", out.len()));
        }
        on_token(i, t);
        out.push(t);
    }
    Err("stream ended without done".to_owned())
}
