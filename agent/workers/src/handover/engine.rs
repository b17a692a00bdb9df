//! `belayer-toy-engine`: a small deterministic language model serving an SGLang-shaped
//! `/generate` API, with the worker side of the handover (heartbeat, standby, takeover).
//!
//! Model: the next token is `blake3(window ‖ tail) mod VOCAB`, where `tail` is the last
//! [`CONTEXT`] tokens of prompt + output and `window` is [`WINDOW`] bytes of the weights region
//! at an offset chosen by the tail, read from the weights memory server. So a request resumed
//! with prompt + generated prefix continues exactly as the uninterrupted one would. Every
//! token is also written into the request's block of the KV arena (KV server).
//!
//! Main mode: attaches weights (read lease) and the KV arena (write lease), maps its
//! placeholder buffer, binds 127.0.0.1:0, prints `ready port=P pid=X` and serves; a scheduler
//! thread refreshes the heartbeat file's mtime every [`HEARTBEAT_EVERY`].
//!
//! Standby mode (`--standby --flag FILE`, the shadow worker): attaches weights (read) and the
//! KV arena (read), unmaps its placeholder, binds its listener, prints `standby port=P pid=X`
//! and only polls the flag file every [`FLAG_POLL`]. When the flag appears it runs steps 1–3 of
//! the handover: (1) flag seen; (2) health check (both memory servers' owners alive and
//! answering) and KV flush (after the failed worker's write lease is gone); (3) placeholder
//! remapped, KV re-attached with a write lease; then it prints `ready port=P pid=X
//! health_ms=.. flush_ms=.. remap_ms=..` and serves.
//!
//! API: `POST /generate` `{"input_ids": [u32], "sampling_params": {"max_new_tokens": N},
//! "stream": bool}`; streaming answers newline-delimited `{"index": i, "token": t}` lines then
//! `{"done": true}`; non-streaming answers `{"output_ids": [...]}`. `GET /health`.

use std::io::{BufRead, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use belayer_ipc::memory::{Backend, Layout, LeaseMode, Mapping, MemClient, Placeholder};
use clap::Args;
use serde::Deserialize;

use super::http;

/// Vocabulary size of the toy model.
pub const VOCAB: u32 = 32_000;
/// Tokens of context the next token depends on.
pub const CONTEXT: usize = 4;
/// Bytes of weights read per token.
pub const WINDOW: usize = 256;
/// Weights region name in the weights layout.
pub const WEIGHTS_REGION: &str = "weights";
/// Heartbeat refresh period.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(10);
/// Standby flag poll period.
pub const FLAG_POLL: Duration = Duration::from_millis(2);
/// Largest `max_new_tokens` accepted.
pub const MAX_NEW_TOKENS: u32 = 1 << 20;

/// Arguments of `belayer-toy-engine`.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Socket of the weights memory server.
    #[arg(long)]
    pub weights_socket: PathBuf,
    /// Layout file of the weights server (one region named `weights`).
    #[arg(long)]
    pub weights_layout: PathBuf,
    /// Socket of the KV memory server.
    #[arg(long)]
    pub kv_socket: PathBuf,
    /// Layout file of the KV server (a `[kv]` arena).
    #[arg(long)]
    pub kv_layout: PathBuf,
    /// Worker id given to the memory servers.
    #[arg(long, default_value = "toy")]
    pub worker: String,
    /// Heartbeat file whose mtime the scheduling loop refreshes.
    #[arg(long)]
    pub heartbeat: Option<PathBuf>,
    /// Delay per generated token, ms.
    #[arg(long, default_value_t = 2)]
    pub token_ms: u64,
    /// Placeholder buffer size, bytes (stands for CUDA-graph buffers).
    #[arg(long, default_value_t = 1 << 20)]
    pub placeholder_bytes: u64,
    /// Fill the weights region with the deterministic weights before serving (engine start
    /// from scratch).
    #[arg(long)]
    pub load_weights: bool,
    /// Device of the placeholder buffer and of the handover health check: `host` or `cuda:N`
    /// (must match the memory servers' backend).
    #[arg(long, default_value = "host", value_parser = crate::memory::parse_device)]
    pub device: Backend,
    /// Start as a standby shadow worker.
    #[arg(long, requires = "flag")]
    pub standby: bool,
    /// Handover flag file polled in standby.
    #[arg(long)]
    pub flag: Option<PathBuf>,
}

/// The deterministic weights of `len` bytes.
pub fn weights_bytes(len: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len as usize];
    blake3::Hasher::new()
        .update(b"belayer-toy-weights")
        .finalize_xof()
        .fill(&mut bytes);
    bytes
}

fn tail_bytes(context: &[u32]) -> [u8; CONTEXT * 4] {
    let mut tail = [0u8; CONTEXT * 4];
    let start = context.len().saturating_sub(CONTEXT);
    for (i, t) in context[start..].iter().enumerate() {
        tail[i * 4..i * 4 + 4].copy_from_slice(&t.to_le_bytes());
    }
    tail
}

/// Offset of the weights window read for `context` in a region of `len` bytes.
pub fn window_offset(context: &[u32], len: u64) -> u64 {
    let h = blake3::hash(&tail_bytes(context));
    let mut o = [0u8; 8];
    o.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(o) % (len - WINDOW as u64 + 1)
}

/// The next token given the weights window and the context.
pub fn next_token(window: &[u8], context: &[u32]) -> u32 {
    let mut h = blake3::Hasher::new();
    h.update(window);
    h.update(&tail_bytes(context));
    let mut t = [0u8; 4];
    t.copy_from_slice(&h.finalize().as_bytes()[..4]);
    u32::from_le_bytes(t) % VOCAB
}

/// The reference generation (no engine): `n` tokens after `prompt` with weights `weights`.
pub fn reference(weights: &[u8], prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let off = window_offset(&ctx, weights.len() as u64) as usize;
        let t = next_token(&weights[off..off + WINDOW], &ctx);
        ctx.push(t);
        out.push(t);
    }
    out
}

/// A `/generate` request body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    /// Prompt token ids.
    pub input_ids: Vec<u32>,
    /// Sampling parameters.
    #[serde(default)]
    pub sampling_params: SamplingParams,
    /// Stream tokens as they are generated.
    #[serde(default)]
    pub stream: bool,
    /// Request id (router only; optional).
    #[serde(default)]
    pub rid: Option<String>,
}

/// Sampling parameters (only greedy decoding exists in the toy model).
#[derive(Debug, Clone, Deserialize)]
pub struct SamplingParams {
    /// Tokens to generate.
    #[serde(default = "default_max_new")]
    pub max_new_tokens: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_new_tokens: default_max_new(),
        }
    }
}

fn default_max_new() -> u32 {
    16
}

/// Parses and checks a `/generate` body.
///
/// Errors: a message for bad JSON, an empty prompt, or `max_new_tokens` out of range.
pub fn parse_generate(body: &[u8]) -> std::result::Result<GenerateRequest, String> {
    let req: GenerateRequest =
        serde_json::from_slice(body).map_err(|e| format!("bad /generate body: {e}"))?;
    if req.input_ids.is_empty() {
        return Err("input_ids is empty".to_owned());
    }
    if req.sampling_params.max_new_tokens > MAX_NEW_TOKENS {
        return Err(format!(
            "max_new_tokens {} exceeds {MAX_NEW_TOKENS}",
            req.sampling_params.max_new_tokens
        ));
    }
    Ok(req)
}

struct Engine {
    weights: Mapping,
    weights_len: u64,
    kv: Mutex<Mapping>,
    kv_block: u64,
    kv_blocks: u64,
    token_delay: Duration,
}

impl Engine {
    fn step(&self, ctx: &[u32]) -> Result<u32> {
        let off = window_offset(ctx, self.weights_len);
        let mut window = [0u8; WINDOW];
        self.weights
            .read(WEIGHTS_REGION, off, &mut window)
            .context("reading weights")?;
        Ok(next_token(&window, ctx))
    }

    fn write_kv(&self, prompt: &[u32], index: usize, token: u32) -> Result<()> {
        let h = blake3::hash(&tail_bytes(prompt));
        let mut b = [0u8; 8];
        b.copy_from_slice(&h.as_bytes()[..8]);
        let block = u64::from_le_bytes(b) % self.kv_blocks;
        let off = block * self.kv_block + (index as u64 * 4) % self.kv_block.max(4);
        let mut kv = self
            .kv
            .lock()
            .map_err(|_| anyhow::anyhow!("kv lock poisoned"))?;
        kv.write(
            belayer_ipc::memory::layout::DEFAULT_KV_NAME,
            off.min(self.kv_block * self.kv_blocks - 4),
            &token.to_le_bytes(),
        )
        .context("writing kv block")
    }

    fn serve(self: &Arc<Self>, stream: TcpStream) {
        let req = match http::read_request(&stream) {
            Ok(r) => r,
            Err(e) => {
                let _ = http::respond_error(&stream, 400, &e.to_string());
                return;
            }
        };
        match (req.method.as_str(), req.path.as_str()) {
            ("GET", "/health") => {
                let _ = http::respond_json(
                    &stream,
                    200,
                    &serde_json::json!({ "pid": std::process::id() }),
                );
            }
            ("POST", "/generate") => match parse_generate(&req.body) {
                Ok(g) => {
                    if let Err(e) = self.generate(&stream, g) {
                        tracing::debug!(error = %e, "generate ended early");
                    }
                }
                Err(e) => {
                    let _ = http::respond_error(&stream, 400, &e);
                }
            },
            _ => {
                let _ = http::respond_error(&stream, 404, "unknown path");
            }
        }
    }

    fn generate(&self, stream: &TcpStream, g: GenerateRequest) -> Result<()> {
        let mut ctx = g.input_ids.clone();
        let n = g.sampling_params.max_new_tokens as usize;
        if g.stream {
            http::start_stream(stream)?;
        }
        let mut out = Vec::with_capacity(n);
        let mut w = std::io::BufWriter::new(stream);
        for i in 0..n {
            if !self.token_delay.is_zero() {
                std::thread::sleep(self.token_delay);
            }
            let t = self.step(&ctx)?;
            self.write_kv(&g.input_ids, i, t)?;
            ctx.push(t);
            if g.stream {
                writeln!(w, "{}", serde_json::json!({ "index": i, "token": t }))?;
                w.flush()?;
            } else {
                out.push(t);
            }
        }
        if g.stream {
            writeln!(w, "{}", serde_json::json!({ "done": true }))?;
            w.flush()?;
        } else {
            drop(w);
            http::respond_json(stream, 200, &serde_json::json!({ "output_ids": out }))?;
        }
        Ok(())
    }
}

fn touch(path: &Path) {
    let now = std::time::SystemTime::now();
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => {
            let _ = f.set_modified(now);
        }
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "heartbeat refresh failed"),
    }
}

fn connect(socket: &Path) -> Result<MemClient> {
    MemClient::connect(socket)
        .with_context(|| format!("connecting to memory server {}", socket.display()))
}

fn load_layout(path: &Path) -> Result<Layout> {
    Layout::load(path).with_context(|| format!("layout {}", path.display()))
}

/// Fills the weights region of the server at `socket` with [`weights_bytes`] (write lease,
/// released again) and bumps its version; returns the bytes written.
///
/// Errors: connecting, attaching or writing.
pub fn load_weights(socket: &Path, layout: &Layout, worker: &str) -> Result<u64> {
    let mut c = connect(socket)?;
    let mut m = c
        .attach_layout(worker, layout, LeaseMode::Exclusive)
        .context("attaching weights for loading")?;
    let len = m
        .region(WEIGHTS_REGION)
        .map(|r| r.size)
        .context("weights layout has no region `weights`")?;
    m.write(WEIGHTS_REGION, 0, &weights_bytes(len))
        .context("writing weights")?;
    c.detach(m).context("detaching weights")?;
    Ok(len)
}

/// Runs the engine until killed; returns the exit code.
pub fn run(args: EngineArgs) -> Result<i32> {
    let wl = load_layout(&args.weights_layout)?;
    let kl = load_layout(&args.kv_layout)?;
    let kv_spec = kl.kv.clone().context("kv layout has no [kv] arena")?;
    if args.load_weights {
        load_weights(&args.weights_socket, &wl, &args.worker)?;
    }
    let mut wc = connect(&args.weights_socket)?;
    let weights = wc
        .attach_layout(&args.worker, &wl, LeaseMode::Read)
        .context("attaching weights")?;
    let weights_len = weights
        .region(WEIGHTS_REGION)
        .map(|r| r.size)
        .context("weights layout has no region `weights`")?;
    if weights_len < WINDOW as u64 {
        bail!("weights region is smaller than {WINDOW} bytes");
    }
    let mut kc = connect(&args.kv_socket)?;
    let mut placeholder =
        Placeholder::new(args.device, args.placeholder_bytes).context("placeholder buffer")?;
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    let port = listener.local_addr().context("local address")?.port();
    let pid = std::process::id();
    let mut stdout = std::io::stdout();
    let kv = if args.standby {
        let standby_kv = kc
            .attach_layout(&args.worker, &kl, LeaseMode::Read)
            .context("attaching kv (standby)")?;
        placeholder.unmap().context("unmapping placeholder")?;
        writeln!(stdout, "standby port={port} pid={pid}")?;
        stdout.flush()?;
        let flag = args.flag.clone().context("--standby needs --flag")?;
        while !flag.exists() {
            std::thread::sleep(FLAG_POLL);
        }
        // (2) health check: the GPU (a lightweight CUDA operation), memory servers alive and
        // answering; KV flush.
        let t = Instant::now();
        if let Backend::Cuda { device } = args.device {
            belayer_ipc::memory::cuda::health_check(device).context("gpu health check")?;
        }
        wc.owner_alive().context("weights server owner")?;
        kc.owner_alive().context("kv server owner")?;
        wc.ping().context("weights server ping")?;
        kc.ping().context("kv server ping")?;
        let health_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        kc.detach(standby_kv).context("detaching standby kv")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        let kv = loop {
            match kc.attach_layout(&args.worker, &kl, LeaseMode::Write) {
                Ok(m) => break m,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "kv write lease still held; retrying");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e).context("attaching kv for serving"),
            }
        };
        let mut kv = kv;
        kv.zero(&kv_spec.name).context("flushing kv arena")?;
        let flush_ms = t.elapsed().as_secs_f64() * 1e3;
        // (3) remap placeholders.
        let t = Instant::now();
        placeholder.remap().context("remapping placeholder")?;
        let remap_ms = t.elapsed().as_secs_f64() * 1e3;
        writeln!(
            stdout,
            "ready port={port} pid={pid} health_ms={health_ms:.3} flush_ms={flush_ms:.3} remap_ms={remap_ms:.3}"
        )?;
        stdout.flush()?;
        kv
    } else {
        let kv = kc
            .attach_layout(&args.worker, &kl, LeaseMode::Write)
            .context("attaching kv")?;
        writeln!(stdout, "ready port={port} pid={pid}")?;
        stdout.flush()?;
        kv
    };
    if let Some(hb) = args.heartbeat.clone() {
        touch(&hb);
        std::thread::spawn(move || loop {
            touch(&hb);
            std::thread::sleep(HEARTBEAT_EVERY);
        });
    }
    let engine = Arc::new(Engine {
        weights,
        weights_len,
        kv: Mutex::new(kv),
        kv_block: kv_spec.block_size,
        kv_blocks: kv_spec.block_count,
        token_delay: Duration::from_millis(args.token_ms),
    });
    let _keep = (wc, kc, placeholder);
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let _ = conn.set_nodelay(true);
        let e = Arc::clone(&engine);
        std::thread::spawn(move || e.serve(conn));
    }
    Ok(0)
}

/// Reads lines from an engine's stdout until one starting with `prefix`; returns its
/// `key=value` fields.
///
/// Errors: end of output before such a line.
pub fn read_status_line<R: BufRead>(
    r: &mut R,
    prefix: &str,
) -> Result<std::collections::HashMap<String, String>> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            bail!("engine exited before printing `{prefix}`");
        }
        if line.starts_with(prefix) {
            return Ok(line
                .split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resumed_generation_equals_uninterrupted() {
        let w = weights_bytes(64 * 1024);
        let prompt = [1, 2, 3];
        let full = reference(&w, &prompt, 40);
        let mut p2 = prompt.to_vec();
        p2.extend_from_slice(&full[..17]);
        let rest = reference(&w, &p2, 23);
        assert_eq!(&full[17..], &rest[..]);
        assert!(full.iter().all(|t| *t < VOCAB));
    }

    #[test]
    fn generate_bodies_are_checked() {
        assert!(parse_generate(b"{").is_err());
        assert!(parse_generate(br#"{"input_ids": []}"#).is_err());
        assert!(parse_generate(br#"{"input_ids": [1], "bogus": 1}"#).is_err());
        let g = parse_generate(
            br#"{"input_ids": [1], "sampling_params": {"max_new_tokens": 5}, "stream": true}"#,
        )
        .unwrap();
        assert_eq!(g.sampling_params.max_new_tokens, 5);
        assert!(g.stream);
    }
}
