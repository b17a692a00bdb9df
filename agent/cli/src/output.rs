//! How the `belayer` command prints answers: JSON with `--json`, short text otherwise.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use belayer_ipc::{ExecResult, Response, RestoreInfo, SandboxInfo};
use serde_json::json;

/// Prints answers in the chosen style.
#[derive(Debug, Clone, Copy)]
pub struct Printer {
    /// JSON output.
    pub json: bool,
}

fn print_json(v: &serde_json::Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

/// Bytes as text: UTF-8 when valid, else lossy.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

impl Printer {
    /// A newly created sandbox: with `--json` the sandbox as `sandbox inspect --json` prints
    /// it (`id`, `init_pid`, `cgroup`, `limits`, ...), else the bare id.
    pub fn created(&self, info: &SandboxInfo) {
        if self.json {
            print_json(&json!(info));
        } else {
            println!("{}", info.id);
        }
    }

    /// An action's result; returns the exit code for the CLI.
    pub fn exec(&self, r: &ExecResult) -> i32 {
        if self.json {
            print_json(&json!({
                "exit_code": r.exit_code,
                "signal": r.signal,
                "stdout": text(&r.stdout),
                "stderr": text(&r.stderr),
                "truncated": r.truncated,
                "timed_out": r.timed_out,
                "duration_ms": r.duration_ms,
                "infra_fault": r.infra_fault.as_ref().map(|f| json!({
                    "kind": f.kind.as_str(),
                    "pid": f.pid,
                    "signal": f.signal,
                })),
                "dirty": r.dirty,
            }));
        } else {
            let _ = std::io::stdout().write_all(&r.stdout);
            let _ = std::io::stderr().write_all(&r.stderr);
            if r.timed_out {
                eprintln!("belayer: action timed out after {:.0} ms", r.duration_ms);
            }
            if let Some(f) = &r.infra_fault {
                eprintln!(
                    "belayer: infrastructure fault during the action: {} (pid {:?}, signal {:?})",
                    f.kind.as_str(),
                    f.pid,
                    f.signal
                );
            }
        }
        r.exit_code
    }

    /// A fork's answer: one line per child, or JSON with L_K as text (or written to
    /// `context_out`).
    ///
    /// Errors: `context_out` cannot be written.
    pub fn forked(&self, f: &belayer_ipc::ForkInfo, context_out: Option<&Path>) -> Result<()> {
        if let Some(path) = context_out {
            std::fs::write(path, &f.context)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        if self.json {
            let children: Vec<_> = f
                .children
                .iter()
                .map(|c| {
                    json!({
                        "sandbox": c.sandbox,
                        "init_pid": c.init_pid,
                        "timings_ms": c.timings_ms,
                        "validity": c.validity,
                    })
                })
                .collect();
            let mut v = json!({
                "fork": f.fork,
                "source": f.source,
                "checkpoint": f.checkpoint,
                "prefix": f.prefix,
                "children": children,
                "total_ms": f.total_ms,
            });
            match context_out {
                Some(p) => v["context_file"] = json!(p.display().to_string()),
                None => v["context"] = json!(text(&f.context)),
            }
            print_json(&v);
        } else {
            println!(
                "fork {} of {} from {} (k={}): {} children in {:.1} ms",
                f.fork,
                f.source,
                f.checkpoint,
                f.prefix,
                f.children.len(),
                f.total_ms
            );
            for c in &f.children {
                let valid = match &c.validity {
                    Some(v) if v.fs_matches && v.processes_match => "; valid",
                    Some(_) => "; INVALID",
                    None => "",
                };
                println!(
                    "{}\tpid {}\trestored in {:.1} ms{valid}",
                    c.sandbox, c.init_pid, c.timings_ms.total
                );
            }
        }
        Ok(())
    }

    /// A restore; writes the context to `context_out` when given.
    pub fn restored(&self, r: &RestoreInfo, context_out: Option<&Path>) -> Result<()> {
        if let Some(path) = context_out {
            std::fs::write(path, &r.context)
                .with_context(|| format!("writing {}", path.display()))?;
        }
        if self.json {
            let mut v = json!({
                "sandbox": r.sandbox,
                "prefix": r.prefix.unwrap_or(0),
                "restarted_from_base": r.prefix.is_none(),
                "init_pid": r.init_pid,
                "timings_ms": r.timings_ms,
                "validity": r.validity,
                "inodes_kept": r.inodes_kept,
                "dropped_prefixes": r.dropped_prefixes,
            });
            match context_out {
                Some(p) => v["context_file"] = json!(p.display().to_string()),
                None => v["context"] = json!(text(&r.context)),
            }
            print_json(&v);
        } else {
            match r.prefix {
                Some(k) => println!(
                    "restored {} at prefix k={} in {:.1} ms (pid {}; {})",
                    r.sandbox,
                    k,
                    r.timings_ms.total,
                    r.init_pid,
                    if r.inodes_kept {
                        "upper snapshot: inode numbers kept"
                    } else {
                        "upper layer materialized: new inode numbers"
                    }
                ),
                None => println!(
                    "no ready checkpoint: {} restarted from its base image (k=0) in {:.1} ms",
                    r.sandbox, r.timings_ms.total
                ),
            }
            if !r.dropped_prefixes.is_empty() {
                println!(
                    "dropped the later checkpoints of prefixes {:?}",
                    r.dropped_prefixes
                );
            }
            if context_out.is_none() && !r.context.is_empty() {
                println!("context: {}", text(&r.context));
            }
        }
        Ok(())
    }

    /// A failed command (after its text on stderr): with `--json`, `{"error", "message"}` on
    /// stdout, `error` being the daemon's code (`NotFound`, `UnknownSandbox`, ...), or
    /// `Unreachable` (no daemon answered) or `Client` (anything else on this side).
    pub fn failed(&self, code: Option<belayer_ipc::ErrorCode>, unreachable: bool, message: &str) {
        if self.json {
            let error = match (code, unreachable) {
                (Some(code), _) => json!(code),
                (None, true) => json!("Unreachable"),
                (None, false) => json!("Client"),
            };
            print_json(&json!({ "error": error, "message": message }));
        }
    }

    /// Any other answer.
    pub fn response(&self, r: Response) {
        if self.json {
            let v = match &r {
                Response::Pong { version } => json!({ "version": version }),
                Response::Image(i) => json!(i),
                Response::Images(v) => json!(v),
                Response::Sandbox(s) => json!(s),
                Response::Sandboxes(v) => json!(v),
                Response::Exec(e) => json!(e),
                Response::Checkpoint(c) => json!(c),
                Response::Checkpoints(v) => json!(v),
                Response::Restored(r) => json!(r),
                Response::Forked(f) => json!(f),
                Response::Gc { removed, bytes } => json!({ "removed": removed, "bytes": bytes }),
                Response::Status(s) => json!(s),
                Response::Done => json!({ "ok": true }),
                Response::Error(e) => {
                    json!({ "error": format!("{:?}", e.code), "message": e.message })
                }
                Response::MaybeCheckpoint(m) => json!(m),
                Response::Context(c) => json!(c),
                Response::Subscribed => json!({ "subscribed": true }),
                Response::TransferReady { chunk_bytes } => json!({ "chunk_bytes": chunk_bytes }),
                Response::DownloadChunk { data } => json!({ "chunk_bytes": data.len() }),
                Response::Transferred(t) => json!(t),
            };
            print_json(&v);
            return;
        }
        match r {
            Response::Pong { version } => println!("belayerd {version}"),
            Response::Image(i) => {
                println!(
                    "{}\t{}\t{} layers\t{} bytes\t{}",
                    i.name,
                    i.kind,
                    i.layers.len().max(1),
                    i.bytes,
                    i.digest.as_deref().unwrap_or("-")
                );
            }
            Response::Images(v) => {
                println!("NAME\tKIND\tLAYERS\tBYTES\tDIGEST");
                let mut unique = std::collections::HashMap::new();
                for i in &v {
                    println!(
                        "{}\t{}\t{}\t{}\t{}",
                        i.name,
                        i.kind,
                        i.layers.len().max(1),
                        i.bytes,
                        i.digest.as_deref().unwrap_or("-")
                    );
                    for l in &i.layers {
                        unique.insert(l.diff_id.clone(), l.bytes);
                    }
                }
                if !unique.is_empty() {
                    let stored: u64 = unique.values().sum();
                    println!("layer store: {} layers, {stored} bytes", unique.len());
                }
            }
            Response::Sandbox(s) => {
                println!("id:           {}", s.id);
                println!("image:        {}", s.image);
                println!("state:        {}", s.state);
                println!("instance:     {}", s.instance);
                println!(
                    "init pid:     {}",
                    s.init_pid.map_or("-".into(), |p| p.to_string())
                );
                println!("pids:         {:?}", s.pids);
                println!("cgroup:       {}", s.cgroup);
                println!(
                    "ready prefix: {}",
                    s.ready_prefix.map_or("-".into(), |k| k.to_string())
                );
                println!("tag:          {}", s.tag.as_deref().unwrap_or("-"));
                println!("workdir:      {}", s.workdir.as_deref().unwrap_or("/"));
                let limit = |v: Option<u64>| v.map_or("unlimited".into(), |v| v.to_string());
                println!("memory max:   {}", limit(s.limits.memory_max));
                println!("pids max:     {}", limit(s.limits.pids_max));
                println!(
                    "cpus:         {}",
                    s.limits.cpus.map_or("unlimited".into(), |c| c.to_string())
                );
                println!("disk max:     {}", limit(s.limits.disk_max));
                if let Some(u) = &s.userns {
                    println!("userns:       {} {:?}", u.mode, u.uid_map);
                }
                for (k, v) in &s.env {
                    println!("env:          {k}={v}");
                }
            }
            Response::Sandboxes(v) => {
                println!("ID\tSTATE\tIMAGE\tREADY\tPIDS");
                for s in v {
                    let ready = s.ready_prefix.map_or("-".into(), |k| k.to_string());
                    println!(
                        "{}\t{}\t{}\t{}\t{}",
                        s.id,
                        s.state,
                        s.image,
                        ready,
                        s.pids.len()
                    );
                }
            }
            Response::Checkpoint(c) => println!(
                "checkpoint {} of {} at k={}: {} bytes, frozen {:.1} ms, total {:.1} ms",
                c.checkpoint,
                c.sandbox,
                c.prefix,
                c.bytes,
                c.timings_ms.frozen_total,
                c.timings_ms.total
            ),
            Response::Checkpoints(v) => {
                println!("CHECKPOINT\tPREFIX\tBYTES\tFROZEN_MS\tCREATED_MS\tPARENT\tREADY");
                for c in v {
                    println!(
                        "{}\t{}\t{}\t{:.1}\t{}\t{}\t{}",
                        c.checkpoint,
                        c.prefix,
                        c.bytes,
                        c.timings_ms.frozen_total,
                        c.created_unix_ms,
                        c.parent.as_deref().unwrap_or("-"),
                        if c.ready { "ready" } else { "" }
                    );
                }
            }
            Response::Gc { removed, bytes } => {
                println!("removed {removed} checkpoints ({bytes} bytes)")
            }
            Response::Status(s) => {
                println!("belayerd {} (protocol {})", s.version, s.protocol);
                println!("criu:      {}", s.criu);
                println!("cgroups:   {}", s.cgroup);
                println!("sandboxes: {}", s.sandboxes);
                println!("tracer:    {}", s.tracer);
            }
            Response::Done => {}
            Response::Exec(e) => {
                let _ = self.exec(&e);
            }
            Response::Restored(r) => {
                let _ = self.restored(&r, None);
            }
            Response::Forked(f) => {
                let _ = self.forked(&f, None);
            }
            Response::Error(e) => eprintln!("error: {:?}: {}", e.code, e.message),
            Response::MaybeCheckpoint(m) => println!(
                "decision at k={}: {} ({})",
                m.decision.step,
                if m.checkpointed {
                    "checkpointed"
                } else {
                    "skipped"
                },
                m.decision.reason
            ),
            Response::Context(c) => println!(
                "context of {} at k={}: {} bytes, record {}",
                c.trajectory,
                c.prefix,
                c.context.len(),
                c.record
            ),
            Response::Subscribed => println!("subscribed"),
            Response::TransferReady { .. } | Response::DownloadChunk { .. } => {}
            Response::Transferred(t) => println!("copied {} entries ({} bytes)", t.files, t.bytes),
        }
    }
}
