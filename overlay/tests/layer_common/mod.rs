//! Helpers shared by the layer (manifest + blob store) integration tests.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use belayer_overlay::layer::{
    capture_layer, materialize_layer, BlobStore, EntryKind, Extent, LayerCaptureOptions,
    LayerManifest, LayerStats, MaterializeOptions,
};
use belayer_overlay::{CaptureError, InstallError, InstallStats};
use rustix::fs::{FileType, Mode, SeekFrom, XattrFlags, CWD};

/// Captures `upper` against `base` and seals it, holding a store lease throughout (as the
/// checkpoint path does).
pub fn capture(
    upper: &Path,
    base: Option<&LayerManifest>,
    store: &BlobStore,
    opts: &LayerCaptureOptions,
) -> Result<(LayerManifest, LayerStats), CaptureError> {
    let _lease = store.lease().expect("lease");
    capture_layer(upper, base, store, opts)?.seal()
}

/// Capture options with no racy window: every entry whose key is unchanged is reused.
pub fn no_racy_window() -> LayerCaptureOptions {
    LayerCaptureOptions {
        racy_window: Duration::ZERO,
        ..LayerCaptureOptions::default()
    }
}

/// Materializes `manifest` into `target` (created here, must not exist).
pub fn materialize(
    manifest: &LayerManifest,
    store: &BlobStore,
    target: &Path,
    verify: bool,
) -> Result<(InstallStats, LayerManifest), InstallError> {
    std::fs::create_dir(target).unwrap();
    let opts = MaterializeOptions {
        verify_blobs: verify,
        ..MaterializeOptions::default()
    };
    materialize_layer(manifest, store, target, &opts)
}

/// Sets an extended attribute without following a symlink.
pub fn setxattr(path: &Path, name: &str, value: &[u8]) {
    rustix::fs::lsetxattr(path, name, value, XattrFlags::empty())
        .unwrap_or_else(|e| panic!("lsetxattr {} {name}: {e}", path.display()));
}

/// Reads an extended attribute without following a symlink.
pub fn getxattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 65536];
    match rustix::fs::lgetxattr(path, name, &mut buf[..]) {
        Ok(n) => {
            buf.truncate(n);
            Some(buf)
        }
        Err(_) => None,
    }
}

/// Creates a character device `major:minor` (0:0 is an overlay whiteout).
pub fn mknod_char(path: &Path, major: u32, minor: u32) {
    rustix::fs::mknodat(
        CWD,
        path,
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o600),
        rustix::fs::makedev(major, minor),
    )
    .unwrap();
}

/// Creates a fifo with `mode`.
pub fn mkfifo(path: &Path, mode: u32) {
    rustix::fs::mknodat(CWD, path, FileType::Fifo, Mode::from_raw_mode(mode), 0).unwrap();
}

/// Data extents of the file at `path` as the kernel reports them (`SEEK_DATA`/`SEEK_HOLE`).
pub fn data_extents(path: &Path) -> Vec<Extent> {
    let file = std::fs::File::open(path).unwrap();
    let size = file.metadata().unwrap().len();
    let mut out = Vec::new();
    let mut offset = 0u64;
    while offset < size {
        let data = match rustix::fs::seek(file.as_fd(), SeekFrom::Data(offset)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => panic!("SEEK_DATA {}: {e}", path.display()),
        };
        let hole = rustix::fs::seek(file.as_fd(), SeekFrom::Hole(data))
            .unwrap()
            .min(size);
        out.push(Extent {
            offset: data,
            len: hole - data,
        });
        offset = hole;
    }
    out
}

/// Allocated bytes of the file at `path` (`st_blocks` × 512).
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).unwrap().blocks() * 512
}

/// `path` from raw bytes.
pub fn bpath(bytes: &[u8]) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(bytes))
}

/// Number of hardlink entries (never counted as reused: they are re-derived each time).
pub fn hardlink_entries(manifest: &LayerManifest) -> u64 {
    manifest
        .entries
        .iter()
        .filter(|e| matches!(e.kind, EntryKind::Hardlink { .. }))
        .count() as u64
}

/// The manifest entry at `path`.
pub fn entry<'a>(
    manifest: &'a LayerManifest,
    path: &str,
) -> &'a belayer_overlay::layer::LayerEntry {
    manifest
        .entries
        .iter()
        .find(|e| e.path == path.as_bytes())
        .unwrap_or_else(|| panic!("no entry {path:?}"))
}

/// Deterministic pseudo-random bytes (xorshift), fast enough for multi-MiB files.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}
