//! Prometheus metrics of the agent: the metric families, what records into them, and the
//! OpenMetrics text a scrape returns ([`http`] serves it).
//!
//! Counters and histograms are recorded where the event happens (the protocol handler, the
//! tracer's fault callback); gauges of live state (sandboxes by state, store sizes, threads,
//! connections) are set from a [`LiveSample`] taken at scrape time. Every label value comes
//! from a closed set (sandbox states, error codes, decision reasons, fault kinds), so a
//! client or a sandbox cannot grow the number of series. See `docs/metrics.md` for every
//! family, its unit and its labels.
//!
//! `prometheus-client` (the Prometheus project's Rust client) does the encoding: names,
//! `HELP`/`TYPE`/`UNIT` lines, escaping, histogram buckets and the `# EOF` marker.

pub mod http;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

use belayer_ipc::{
    CheckpointInfo, DecisionReason, ErrorCode, ExecResult, RestoreInfo, SandboxState,
};

/// One label: name and value.
type Label = [(&'static str, String); 1];

fn label(name: &'static str, value: impl Into<String>) -> Label {
    [(name, value.into())]
}

/// The `kind` labels of `belayer_infra_faults_total`: the tracer's
/// ([`belayer_ebpf::Fault::kind`]) and `init_gone` (the reaper found a sandbox's init gone
/// without a tracer event).
pub const FAULT_KINDS: [&str; 5] = [
    "init_exited",
    "external_kill",
    "oom",
    "cgroup_empty",
    "init_gone",
];

/// The Content-Type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Live state read at scrape time (see [`Metrics::encode`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LiveSample {
    /// Sandboxes per state; states absent count 0.
    pub sandboxes: Vec<(SandboxState, u64)>,
    /// Bytes of the upper-layer blob store on disk, and its number of blobs.
    pub blob_bytes: u64,
    /// Number of blobs in the store.
    pub blobs: u64,
    /// Content bytes of the image layer store, and its number of layers.
    pub layer_bytes: u64,
    /// Number of stored image layers.
    pub layers: u64,
    /// Number of images.
    pub images: u64,
    /// Threads of the daemon process.
    pub threads: u64,
    /// Socket connections served now.
    pub connections: u64,
    /// Event streams held now.
    pub subscriptions: u64,
    /// Socket connections refused since the socket was bound.
    pub connections_refused: u64,
    /// Idle socket connections evicted since the socket was bound.
    pub connections_evicted: u64,
}

/// Outcome label of an action: `ok` (exit 0), `nonzero_exit`, `signaled`, `timed_out`,
/// `infra_fault` (a fault outside the sandbox's own doing hit it), or the error code of a
/// refused or failed request.
pub fn action_outcome(result: Result<&ExecResult, ErrorCode>) -> String {
    match result {
        Ok(r) if r.infra_fault.is_some() => "infra_fault".into(),
        Ok(r) if r.timed_out => "timed_out".into(),
        Ok(r) if r.signal.is_some() => "signaled".into(),
        Ok(r) if r.exit_code == 0 => "ok".into(),
        Ok(_) => "nonzero_exit".into(),
        Err(code) => code_name(code),
    }
}

/// The label value of an error code: its Rust name (`CheckpointFailed`, `UnknownSandbox`, …).
pub fn code_name(code: ErrorCode) -> String {
    format!("{code:?}")
}

/// Every metric family of the agent. Cheap to share: each metric is an `Arc` inside.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    actions: Family<Label, Counter>,
    action_seconds: Histogram,
    checkpoints: Family<Label, Counter>,
    checkpoints_skipped: Family<Label, Counter>,
    frozen_seconds: Histogram,
    checkpoint_seconds: Histogram,
    checkpoint_bytes: Histogram,
    restores: Family<Label, Counter>,
    restore_seconds: Histogram,
    infra_faults: Family<Label, Counter>,
    image_pulls: Family<Label, Counter>,
    sandboxes: Family<Label, Gauge>,
    blob_bytes: Gauge,
    blobs: Gauge,
    layer_bytes: Gauge,
    layers: Gauge,
    images: Gauge,
    threads: Gauge,
    connections: Gauge,
    subscriptions: Gauge,
    connections_refused: Counter,
    connections_evicted: Counter,
    /// Scrapes one at a time: the gauges and the counters copied from [`LiveSample`] are set
    /// and encoded together.
    scrape: std::sync::Mutex<()>,
}

/// Bucket bounds (seconds) of the frozen window: 1 ms to 30 s.
const FROZEN_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Bucket bounds (seconds) of whole checkpoints and restores: 5 ms to 5 min.
const TOTAL_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];
/// Bucket bounds (seconds) of actions: 10 ms to 1 h.
const ACTION_BUCKETS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

impl Metrics {
    /// The families, registered under the `belayer_` prefix, with a `belayer_build_info`
    /// of `version`, `protocol` and `criu`.
    pub fn new(version: &str, protocol: u16, criu: &str) -> Metrics {
        let mut registry = Registry::with_prefix("belayer");
        registry.register(
            "build",
            "Build of the agent",
            Info::new(vec![
                ("version", version.to_string()),
                ("protocol", protocol.to_string()),
                ("criu", criu.to_string()),
            ]),
        );
        let m = Metrics {
            registry,
            actions: Family::default(),
            action_seconds: Histogram::new(ACTION_BUCKETS),
            checkpoints: Family::default(),
            checkpoints_skipped: Family::default(),
            frozen_seconds: Histogram::new(FROZEN_BUCKETS),
            checkpoint_seconds: Histogram::new(TOTAL_BUCKETS),
            // 4 KiB to 16 GiB, ×4.
            checkpoint_bytes: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(4096.0, 4.0, 12),
            ),
            restores: Family::default(),
            restore_seconds: Histogram::new(TOTAL_BUCKETS),
            infra_faults: Family::default(),
            image_pulls: Family::default(),
            sandboxes: Family::default(),
            blob_bytes: Gauge::default(),
            blobs: Gauge::default(),
            layer_bytes: Gauge::default(),
            layers: Gauge::default(),
            images: Gauge::default(),
            threads: Gauge::default(),
            connections: Gauge::default(),
            subscriptions: Gauge::default(),
            connections_refused: Counter::default(),
            connections_evicted: Counter::default(),
            scrape: std::sync::Mutex::new(()),
        };
        m.zero_known_series();
        m.register_all()
    }

    /// Creates the series every node has at 0 (successes, skip reasons, fault kinds), so that
    /// rates over them exist before the first event.
    fn zero_known_series(&self) {
        let _ = self.actions.get_or_create(&label("outcome", "ok"));
        let _ = self.checkpoints.get_or_create(&label("result", "taken"));
        let _ = self.restores.get_or_create(&label("outcome", "ok"));
        let _ = self.image_pulls.get_or_create(&label("outcome", "ok"));
        for reason in DecisionReason::ALL {
            let _ = self
                .checkpoints_skipped
                .get_or_create(&label("reason", reason.as_str()));
        }
        for kind in FAULT_KINDS {
            let _ = self.infra_faults.get_or_create(&label("kind", kind));
        }
    }

    fn register_all(mut self) -> Metrics {
        let r = &mut self.registry;
        r.register("actions", "Actions run, by outcome", self.actions.clone());
        r.register_with_unit(
            "action_duration",
            "Wall time of actions that ran",
            Unit::Seconds,
            self.action_seconds.clone(),
        );
        r.register(
            "checkpoints",
            "Checkpoints attempted, by result (taken, or the error code)",
            self.checkpoints.clone(),
        );
        r.register(
            "checkpoints_skipped",
            "Checkpoints the policy decided against, by reason",
            self.checkpoints_skipped.clone(),
        );
        r.register_with_unit(
            "checkpoint_frozen",
            "Frozen window of taken checkpoints (freeze to thaw)",
            Unit::Seconds,
            self.frozen_seconds.clone(),
        );
        r.register_with_unit(
            "checkpoint_duration",
            "Total time of taken checkpoints (freeze to publication)",
            Unit::Seconds,
            self.checkpoint_seconds.clone(),
        );
        r.register_with_unit(
            "checkpoint_size",
            "Bytes stored per taken checkpoint",
            Unit::Bytes,
            self.checkpoint_bytes.clone(),
        );
        r.register(
            "restores",
            "Restores attempted, by outcome (ok, or the error code)",
            self.restores.clone(),
        );
        r.register_with_unit(
            "restore_duration",
            "Total time of successful restores",
            Unit::Seconds,
            self.restore_seconds.clone(),
        );
        r.register(
            "infra_faults",
            "Infrastructure faults the sandbox tracer saw, by kind",
            self.infra_faults.clone(),
        );
        r.register(
            "image_pulls",
            "Image pulls and OCI imports, by outcome",
            self.image_pulls.clone(),
        );
        r.register("sandboxes", "Sandboxes by state", self.sandboxes.clone());
        r.register_with_unit(
            "blob_store",
            "Bytes of the checkpoint blob store on disk",
            Unit::Bytes,
            self.blob_bytes.clone(),
        );
        r.register(
            "blobs",
            "Blobs in the checkpoint blob store",
            self.blobs.clone(),
        );
        r.register_with_unit(
            "image_layers",
            "Content bytes of the image layer store",
            Unit::Bytes,
            self.layer_bytes.clone(),
        );
        r.register(
            "image_layer_count",
            "Stored image layers",
            self.layers.clone(),
        );
        r.register("images", "Images in the store", self.images.clone());
        r.register(
            "threads",
            "Threads of the agent process",
            self.threads.clone(),
        );
        r.register(
            "connections",
            "Socket connections served now",
            self.connections.clone(),
        );
        r.register(
            "event_streams",
            "Event subscriptions held now",
            self.subscriptions.clone(),
        );
        r.register(
            "connections_refused",
            "Socket connections refused (policy or quota) since the socket was bound",
            self.connections_refused.clone(),
        );
        r.register(
            "connections_evicted",
            "Idle socket connections evicted for newcomers since the socket was bound",
            self.connections_evicted.clone(),
        );
        self
    }

    /// Records one action: its outcome, and its duration when it ran.
    pub fn action(&self, result: Result<&ExecResult, ErrorCode>) {
        self.actions
            .get_or_create(&label("outcome", action_outcome(result)))
            .inc();
        if let Ok(r) = result {
            self.action_seconds.observe(r.duration_ms / 1e3);
        }
    }

    /// Records one checkpoint attempt: its timings and bytes when taken, its error code when
    /// not.
    pub fn checkpoint(&self, result: Result<&CheckpointInfo, ErrorCode>) {
        match result {
            Ok(info) => {
                self.checkpoints
                    .get_or_create(&label("result", "taken"))
                    .inc();
                self.frozen_seconds
                    .observe(info.timings_ms.frozen_total / 1e3);
                self.checkpoint_seconds.observe(info.timings_ms.total / 1e3);
                self.checkpoint_bytes.observe(info.bytes as f64);
            }
            Err(code) => {
                self.checkpoints
                    .get_or_create(&label("result", code_name(code)))
                    .inc();
            }
        }
    }

    /// Records a checkpoint the policy skipped, by its reason.
    pub fn checkpoint_skipped(&self, reason: DecisionReason) {
        self.checkpoints_skipped
            .get_or_create(&label("reason", reason.as_str()))
            .inc();
    }

    /// Records one restore: its total time when it succeeded, its error code when not.
    pub fn restore(&self, result: Result<&RestoreInfo, ErrorCode>) {
        let outcome = match result {
            Ok(info) => {
                self.restore_seconds.observe(info.timings_ms.total / 1e3);
                "ok".to_string()
            }
            Err(code) => code_name(code),
        };
        self.restores
            .get_or_create(&label("outcome", outcome))
            .inc();
    }

    /// Records a sandbox instance lost to an infrastructure fault of `kind` (the first one
    /// seen), one of [`FAULT_KINDS`]; called once per instance.
    pub fn infra_fault(&self, kind: &'static str) {
        self.infra_faults.get_or_create(&label("kind", kind)).inc();
    }

    /// Records an image pull or OCI import: `ok` or its error code.
    pub fn image_pull(&self, outcome: Result<(), ErrorCode>) {
        let outcome = match outcome {
            Ok(()) => "ok".to_string(),
            Err(code) => code_name(code),
        };
        self.image_pulls
            .get_or_create(&label("outcome", outcome))
            .inc();
    }

    /// The OpenMetrics text of every family, the gauges set from `live` first.
    pub fn encode(&self, live: &LiveSample) -> String {
        self.encode_with(|| live.clone())
    }

    /// The OpenMetrics text of every family, the gauges set from the sample `sample` takes;
    /// one scrape at a time, so that a slow scrape never sets older values over a newer
    /// one's.
    pub fn encode_with(&self, sample: impl FnOnce() -> LiveSample) -> String {
        let _one = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let live = &sample();
        for state in SandboxState::ALL {
            let n = live
                .sandboxes
                .iter()
                .filter(|(s, _)| *s == state)
                .map(|(_, n)| *n)
                .sum::<u64>();
            self.sandboxes
                .get_or_create(&label("state", state.as_str()))
                .set(gauge(n));
        }
        for (g, v) in [
            (&self.blob_bytes, live.blob_bytes),
            (&self.blobs, live.blobs),
            (&self.layer_bytes, live.layer_bytes),
            (&self.layers, live.layers),
            (&self.images, live.images),
            (&self.threads, live.threads),
            (&self.connections, live.connections),
            (&self.subscriptions, live.subscriptions),
        ] {
            g.set(gauge(v));
        }
        // The server's own totals only grow: add what is new since the last scrape.
        for (c, v) in [
            (&self.connections_refused, live.connections_refused),
            (&self.connections_evicted, live.connections_evicted),
        ] {
            c.inc_by(v.saturating_sub(c.get()));
        }
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

fn gauge(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Threads of this process (`Threads:` of `/proc/self/status`; 0 when unreadable).
pub fn process_threads() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|n| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
