//! Capture and install timings for an upper layer holding one 50 MB file and 1000 small
//! files (page cache warm). Run: `cargo bench -p belayer-overlay --bench capture`
//! (`BELAYER_BENCH_DIR=/dev/shm` to measure on tmpfs instead of the temp dir's filesystem).
//! Prints one table row per operation: min / median / max over the iterations, in ms.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use belayer_overlay::{capture_upper, install_upper, tree_digest, InstallLimits};

const ITERATIONS: usize = 7;
const BIG_BYTES: usize = 50 * 1000 * 1000;
const SMALL_FILES: usize = 1000;

fn build_upper(root: &Path, big: bool, small: bool) {
    std::fs::create_dir_all(root).unwrap();
    if big {
        let data: Vec<u8> = (0..BIG_BYTES)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(root.join("big.bin"), data).unwrap();
    }
    if small {
        for i in 0..SMALL_FILES {
            let dir = root.join(format!("d{:02}", i % 20));
            std::fs::create_dir_all(&dir).unwrap();
            let len = 100 + (i * 37) % 4000;
            std::fs::write(
                dir.join(format!("f{i:04}")),
                vec![b'a' + (i % 26) as u8; len],
            )
            .unwrap();
        }
    }
}

struct Row {
    name: &'static str,
    times: Vec<Duration>,
    bytes: u64,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn measure(scratch: &Path, name: &'static str, upper: &Path, rows: &mut Vec<Row>) {
    let mut capture = Row {
        name,
        times: Vec::new(),
        bytes: 0,
    };
    let mut install = Row {
        name,
        times: Vec::new(),
        bytes: 0,
    };
    for i in 0..ITERATIONS {
        let archive: PathBuf = scratch.join(format!("{name}-{i}.tar"));
        let target = scratch.join(format!("{name}-{i}-upper"));
        std::fs::create_dir(&target).unwrap();
        let t = Instant::now();
        let stats = capture_upper(upper, &archive).unwrap();
        capture.times.push(t.elapsed());
        capture.bytes = stats.bytes;
        let t = Instant::now();
        let stats = install_upper(&archive, &target, &InstallLimits::default()).unwrap();
        install.times.push(t.elapsed());
        install.bytes = stats.content_bytes;
        std::fs::remove_file(&archive).unwrap();
        std::fs::remove_dir_all(&target).unwrap();
    }
    let mut digest = Row {
        name,
        times: Vec::new(),
        bytes: 0,
    };
    for _ in 0..3 {
        let t = Instant::now();
        tree_digest(upper, &[]).unwrap();
        digest.times.push(t.elapsed());
    }
    for (row, op) in [
        (capture, "capture"),
        (install, "install"),
        (digest, "tree_digest"),
    ] {
        rows.push(Row {
            name: leak(format!("{op} {}", row.name)),
            ..row
        });
    }
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse. BELAYER_BENCH_DIR picks the
    // filesystem to measure on (default: the system temp dir).
    let scratch = match std::env::var_os("BELAYER_BENCH_DIR") {
        Some(dir) => tempfile::tempdir_in(dir).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    println!("scratch directory: {}", scratch.path().display());
    let cases = [
        ("50MB+1000 files", true, true),
        ("50MB file", true, false),
        ("1000 small files", false, true),
    ];
    let mut rows = Vec::new();
    for (name, big, small) in cases {
        let upper = scratch.path().join(format!("upper-{big}-{small}"));
        build_upper(&upper, big, small);
        // Warm the page cache.
        tree_digest(&upper, &[]).unwrap();
        measure(scratch.path(), name, &upper, &mut rows);
    }
    println!(
        "{:<34} {:>9} {:>9} {:>9} {:>12}",
        "operation", "min ms", "median ms", "max ms", "archive MB"
    );
    for row in &mut rows {
        row.times.sort();
        let median = row.times[row.times.len() / 2];
        println!(
            "{:<34} {:>9.1} {:>9.1} {:>9.1} {:>12.1}",
            row.name,
            ms(row.times[0]),
            ms(median),
            ms(*row.times.last().unwrap()),
            row.bytes as f64 / 1e6
        );
    }
}
