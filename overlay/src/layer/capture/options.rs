//! What a layer capture may do ([`LayerCaptureOptions`], [`INLINE_MAX_BYTES`]) and what it
//! did ([`LayerStats`]).

use std::time::Duration;

use crate::tree::InstallLimits;

/// Files up to this many data bytes are read into memory and hashed in the frozen window;
/// larger ones are copied into a staging file and hashed after the thaw.
pub const INLINE_MAX_BYTES: u64 = 256 << 10;

/// Options of [`capture_layer`](super::capture_layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerCaptureOptions {
    /// Bounds on entries and data; the capture fails with a typed error rather than produce
    /// a manifest that [`materialize_layer`](crate::layer::materialize_layer) with the same limits
    /// would refuse.
    pub limits: InstallLimits,
    /// Entries whose ctime falls within this window before the base manifest's capture time
    /// are read again even when their key is equal (a change in the same clock tick as the
    /// capture could leave the ctime unchanged; the idea of git's "racy clean" entries).
    pub racy_window: Duration,
}

impl Default for LayerCaptureOptions {
    /// Default limits; racy window of two ticks of the coarse clock the kernel stamps file
    /// times with (`clock_getres(CLOCK_REALTIME_COARSE)`: 8 ms at 250 Hz), at least 2 ms.
    /// A change after the capture gets a ctime at most one tick behind the real time, so
    /// an entry whose ctime is more than a tick older than the capture cannot be changed
    /// without its ctime moving.
    fn default() -> Self {
        let res = rustix::time::clock_getres(rustix::time::ClockId::RealtimeCoarse);
        let tick = Duration::new(
            res.tv_sec.max(0) as u64,
            res.tv_nsec.clamp(0, 999_999_999) as u32,
        );
        LayerCaptureOptions {
            limits: InstallLimits::default(),
            racy_window: (tick * 2).max(Duration::from_millis(2)),
        }
    }
}

/// What a capture did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Entries in the manifest.
    pub entries: u64,
    /// Entries taken over from the base manifest without being opened.
    pub reused: u64,
    /// Regular files whose data was read.
    pub files_read: u64,
    /// Data bytes read (or copied to staging) by this capture: the delta.
    pub bytes_read: u64,
    /// Data bytes of the whole layer (holes excluded).
    pub data_bytes: u64,
    /// Blobs added to the store.
    pub new_blobs: u64,
    /// Bytes the store grew by.
    pub new_blob_bytes: u64,
    /// Paths of the base manifest that are gone.
    pub removed: u64,
    /// Unix-domain socket files skipped (a process that binds again after restore
    /// recreates its socket file).
    pub skipped_sockets: u64,
    /// Time of the walk and reads ([`capture_layer`](super::capture_layer)), microseconds.
    pub capture_us: u64,
    /// Time of [`PendingLayer::seal`](super::PendingLayer::seal), microseconds.
    pub seal_us: u64,
}
