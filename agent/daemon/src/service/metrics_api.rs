//! What the metrics endpoint reads from the agent: live state at scrape time, with the sizes
//! of the on-disk stores cached (see [`StoreSizes`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use belayer_ipc::ServerStats;

use super::Agent;
use crate::metrics::{process_threads, LiveSample};

/// How long a measured size of the blob store is reused before it is measured again.
pub const BLOB_SIZE_TTL: Duration = Duration::from_secs(10);

/// Cached sizes of the stores: the blob store's measured again in the background once older
/// than [`BLOB_SIZE_TTL`] (walking it reads one directory entry per blob, and a sandbox can
/// make many: a scrape never waits for it), the image stores' until an image request changes
/// them.
#[derive(Debug, Default)]
pub(super) struct StoreSizes {
    blobs: Arc<Mutex<BlobUsage>>,
    images: Mutex<Option<ImageSizes>>,
}

/// The last measured `(blobs, bytes)` of the blob store.
#[derive(Debug, Default)]
struct BlobUsage {
    value: (u64, u64),
    measured: Option<Instant>,
    walking: bool,
}

impl StoreSizes {
    /// Forgets the image stores' sizes (an image was imported, pulled or removed).
    pub(super) fn images_changed(&self) {
        *self.images.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct ImageSizes {
    layer_bytes: u64,
    layers: u64,
    images: u64,
}

impl Agent {
    /// The OpenMetrics text of every family, with the socket server's counts from `server`
    /// (`None`: reported as 0).
    pub fn scrape(&self, server: Option<&ServerStats>) -> String {
        self.metrics.encode_with(|| self.live_sample(server))
    }

    fn live_sample(&self, server: Option<&ServerStats>) -> LiveSample {
        let mut sandboxes: Vec<(belayer_ipc::SandboxState, u64)> = Vec::new();
        // The registry's lock only to list the slots: a slot's record is read after.
        let slots: Vec<_> = self.registry().values().cloned().collect();
        for state in slots.iter().map(|slot| slot.record().state) {
            match sandboxes.iter_mut().find(|(s, _)| *s == state) {
                Some((_, n)) => *n += 1,
                None => sandboxes.push((state, 1)),
            }
        }
        let (blobs, blob_bytes) = self.blob_usage();
        let images = self.image_sizes();
        let counts = server.map(|s| s.counts()).unwrap_or_default();
        LiveSample {
            sandboxes,
            blob_bytes,
            blobs,
            layer_bytes: images.layer_bytes,
            layers: images.layers,
            images: images.images,
            threads: process_threads(),
            connections: counts.open,
            subscriptions: counts.subscriptions,
            connections_refused: counts.refused,
            connections_evicted: counts.evicted,
        }
    }

    /// `(blobs, bytes)` of the blob store as last measured (0 before the first measurement
    /// ends); a stale value starts one walk on a thread of its own, never more than one.
    fn blob_usage(&self) -> (u64, u64) {
        let cell = &self.store_sizes.blobs;
        let mut usage = cell.lock().unwrap_or_else(|p| p.into_inner());
        let stale = usage.measured.is_none_or(|t| t.elapsed() >= BLOB_SIZE_TTL);
        if stale && !usage.walking {
            let (cell, dir) = (Arc::clone(cell), self.rt.blobs.dir().to_path_buf());
            let walk = move || {
                let value = belayer_overlay::layer::BlobStore::open(&dir)
                    .and_then(|store| store.usage())
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "metrics: cannot measure the blob store");
                        (0, 0)
                    });
                let mut usage = cell.lock().unwrap_or_else(|p| p.into_inner());
                *usage = BlobUsage {
                    value,
                    measured: Some(Instant::now()),
                    walking: false,
                };
            };
            usage.walking = std::thread::Builder::new()
                .name("metrics-blobs".into())
                .spawn(walk)
                .is_ok();
        }
        usage.value
    }

    /// Images and stored layers, measured again only after an image request changed them.
    fn image_sizes(&self) -> ImageSizes {
        let mut cached = self
            .store_sizes
            .images
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(sizes) = *cached {
            return sizes;
        }
        let layers = self.rt.images.layers().all();
        let sizes = ImageSizes {
            layer_bytes: layers.iter().map(|l| l.bytes).sum(),
            layers: layers.len() as u64,
            images: self.rt.images.all().map(|v| v.len() as u64).unwrap_or(0),
        };
        *cached = Some(sizes);
        sizes
    }
}
