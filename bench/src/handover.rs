//! `belayer-bench handover`: N concurrent streaming requests through the router, kill -9 of
//! the main worker at a random token position, over many trials; p50/p99 of kill → detection
//! and kill → first resumed token, tokens regenerated and token mismatches against the
//! failure-free sequence, for Belayer (shadow + token-level recovery) and the conventional
//! baseline (health-check timeout, restart from scratch, regenerate from the start).
//!
//! The unhealthy window is 0 here so that back-to-back trials never mark the GPU unhealthy.

use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Serialize;

use belayer_workers::handover::engine::{reference, weights_bytes};
use belayer_workers::handover::router::{stream_generate, Router, RouterConfig};
use belayer_workers::handover::workers::{Pool, PoolConfig};

/// Arguments of `belayer-bench handover`.
#[derive(Debug, Clone, Args)]
pub struct HandoverBenchArgs {
    /// Trials with shadow workers.
    #[arg(long, default_value_t = 100)]
    pub trials: usize,
    /// Trials of the conventional baseline.
    #[arg(long, default_value_t = 10)]
    pub baseline_trials: usize,
    /// Concurrent streaming requests per trial.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Tokens per request.
    #[arg(long, default_value_t = 64)]
    pub tokens: u32,
    /// Engine token delay, ms.
    #[arg(long, default_value_t = 2)]
    pub token_ms: u64,
    /// Scale of the baseline's 30 s health-check timeout.
    #[arg(long, default_value_t = 0.01)]
    pub time_scale: f64,
    /// Seed of the kill positions.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// p50 and p99, ms.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    Percentiles {
        p50: at(0.5),
        p99: at(0.99),
    }
}

/// Results of one mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeResult {
    /// Trials run.
    pub trials: usize,
    /// Tokens (over all trials and requests) that differ from the failure-free sequence.
    pub token_mismatches: usize,
    /// Kill → detection, ms.
    pub detect_ms: Percentiles,
    /// Kill → first token delivered after detection, ms.
    pub first_token_ms: Percentiles,
    /// Tokens generated again (duplicates skipped by the router), total.
    pub tokens_regenerated: u64,
}

/// The benchmark's output.
#[derive(Debug, Clone, Serialize)]
pub struct HandoverBenchResult {
    /// Belayer trials.
    pub trials: usize,
    /// Belayer token mismatches.
    pub token_mismatches: usize,
    /// Belayer kill → detection.
    pub detect_ms: Percentiles,
    /// Belayer kill → first resumed token.
    pub first_token_ms: Percentiles,
    /// Belayer tokens regenerated.
    pub tokens_regenerated: u64,
    /// The conventional baseline.
    pub baseline: ModeResult,
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

fn run_mode(args: &HandoverBenchArgs, shadow: bool, trials: usize) -> Result<ModeResult> {
    let dir = tempfile_dir()?;
    let router = Router::new(RouterConfig {
        resume: shadow,
        wait_ms: 60_000,
        ..RouterConfig::default()
    })?;
    let weights_len = 1 << 20;
    let pool = Pool::start(
        &router,
        PoolConfig {
            bin_dir: belayer_workers::bin_dir().context("locating the Belayer binaries")?,
            gpus: 1,
            dir: dir.path.clone(),
            token_ms: args.token_ms,
            shadow,
            heartbeat_timeout_ms: 500,
            baseline_timeout_ms: (30_000.0 * args.time_scale).max(1.0) as u64,
            unhealthy_window_ms: 0,
            weights_bytes: weights_len,
            device: belayer_ipc::memory::Backend::Host,
            on_handover: None,
        },
    )?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    {
        let r = Arc::clone(&router);
        std::thread::spawn(move || r.serve(listener));
    }
    let weights = weights_bytes(weights_len);
    let mut seed = args.seed.max(1);
    let (mut detect, mut first, mut mismatches) = (Vec::new(), Vec::new(), 0usize);
    let regen0 = router.counters.regenerated_tokens.load(Ordering::Relaxed);
    for trial in 0..trials {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(pool.main_pid(0).is_some() && (!shadow || pool.shadow_ready(0))) {
            if Instant::now() > deadline {
                bail!("worker pool did not recover before trial {trial}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let failures_before = pool.failures().len();
        let kill_at = 1 + (xorshift(&mut seed) % (args.tokens as u64 - 1)) as usize;
        let seen = Arc::new(AtomicUsize::new(0));
        let arrivals = Arc::new(Mutex::new(Vec::<Instant>::new()));
        let clients: Vec<_> = (0..args.concurrency)
            .map(|c| {
                let prompt = vec![trial as u32, c as u32, 7];
                let (addr, seen, arrivals, n) = (
                    addr.clone(),
                    Arc::clone(&seen),
                    Arc::clone(&arrivals),
                    args.tokens,
                );
                std::thread::spawn(move || {
                    let mut on = |_: usize, _: u32| {
                        if c == 0 {
                            seen.fetch_add(1, Ordering::SeqCst);
                        }
                        if let Ok(mut a) = arrivals.lock() {
                            a.push(Instant::now());
                        }
                    };
                    (
                        prompt.clone(),
                        stream_generate(&addr, &prompt, n, None, &mut on),
                    )
                })
            })
            .collect();
        while seen.load(Ordering::SeqCst) < kill_at {
            std::thread::sleep(Duration::from_micros(200));
        }
        let pid = pool.main_pid(0).context("no main worker")?;
        let killed = Instant::now();
        kill(Pid::from_raw(pid), Signal::SIGKILL).context("kill -9 main worker")?;
        for c in clients {
            let (prompt, got) = c.join().map_err(|_| anyhow::anyhow!("client panicked"))?;
            let want = reference(&weights, &prompt, args.tokens as usize);
            match got {
                Ok(got) => {
                    mismatches += want.iter().zip(&got).filter(|(a, b)| a != b).count()
                        + want.len().abs_diff(got.len());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "client failed");
                    mismatches += want.len();
                }
            }
        }
        // The monitor records a failure once its new shadow is prepared, which may be after
        // the clients finished.
        let deadline = Instant::now() + Duration::from_secs(30);
        let f = loop {
            if let Some(f) = pool.failures().get(failures_before) {
                break f.clone();
            }
            if Instant::now() > deadline {
                bail!("trial {trial}: the kill was not detected");
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        detect.push((f.detected - killed).as_secs_f64() * 1e3);
        let arrivals = arrivals.lock().map(|a| a.clone()).unwrap_or_default();
        if let Some(t) = arrivals.iter().filter(|t| **t > f.detected).min() {
            first.push((*t - killed).as_secs_f64() * 1e3);
        }
    }
    let regen = router.counters.regenerated_tokens.load(Ordering::Relaxed) - regen0;
    drop(pool);
    Ok(ModeResult {
        trials,
        token_mismatches: mismatches,
        detect_ms: percentiles(detect),
        first_token_ms: percentiles(first),
        tokens_regenerated: regen,
    })
}

struct TempDir {
    path: std::path::PathBuf,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

fn tempfile_dir() -> Result<TempDir> {
    let path = std::env::temp_dir().join(format!(
        "belayer-handover-{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
            ^ (std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0))
    ));
    std::fs::create_dir_all(&path).with_context(|| format!("{}", path.display()))?;
    Ok(TempDir { path })
}

/// Runs the benchmark and prints a table or JSON; returns the exit code.
///
/// Errors: starting the workers, a trial without detection.
pub fn run(args: &HandoverBenchArgs, json: bool) -> Result<i32> {
    if args.tokens < 2 || args.concurrency == 0 {
        bail!("--tokens must be ≥ 2 and --concurrency ≥ 1");
    }
    let belayer = run_mode(args, true, args.trials)?;
    let baseline = run_mode(args, false, args.baseline_trials)?;
    let r = HandoverBenchResult {
        trials: belayer.trials,
        token_mismatches: belayer.token_mismatches,
        detect_ms: belayer.detect_ms,
        first_token_ms: belayer.first_token_ms,
        tokens_regenerated: belayer.tokens_regenerated,
        baseline,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{:<12} {:>6} {:>10} {:>10} {:>10} {:>12} {:>12} {:>11}",
            "mode",
            "trials",
            "mismatch",
            "detect p50",
            "detect p99",
            "1st tok p50",
            "1st tok p99",
            "regenerated"
        );
        for (name, m) in [("belayer", &belayer), ("conventional", &r.baseline)] {
            println!(
                "{:<12} {:>6} {:>10} {:>10.1} {:>10.1} {:>12.1} {:>12.1} {:>11}",
                name,
                m.trials,
                m.token_mismatches,
                m.detect_ms.p50,
                m.detect_ms.p99,
                m.first_token_ms.p50,
                m.first_token_ms.p99,
                m.tokens_regenerated
            );
        }
    }
    Ok(
        if r.token_mismatches == 0 && r.baseline.token_mismatches == 0 {
            0
        } else {
            1
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_a_sample() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!(p.p50, 51.0);
        assert_eq!(p.p99, 99.0);
        assert_eq!(percentiles(Vec::new()).p50, 0.0);
    }
}
