//! libbelayer's calls about sandboxes as a whole against a real `belayerd`: the C program
//! `tests/c/clients.c` (creation with every option, inspection and listing with the
//! configuration, checkpoint listing, restore of a chosen prefix, gc by tag and age, bad
//! options), compiled with the system `cc` and linked against `libbelayer.so`.
//!
//! Needs root, CRIU, the busybox image of `scripts/setup.sh`, and `belayerd` built next to
//! the test executable (`cargo build --workspace --bins` first).

use std::path::{Path, PathBuf};
use std::process::Command;

use belayer_tests::{bin_dir, busybox_rootfs, Daemon};

/// Directory of the freshest `libbelayer.so`: `cargo test` builds it under `deps/` without
/// copying it up to `target/<profile>/` (only `cargo build` does).
fn lib_dir() -> PathBuf {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    [bin_dir().join("deps"), bin_dir()]
        .into_iter()
        .filter(|d| d.join("libbelayer.so").is_file())
        .max_by_key(|d| mtime(&d.join("libbelayer.so")))
        .unwrap_or_else(|| panic!("libbelayer.so not built under {}", bin_dir().display()))
}

#[test]
fn the_c_program_drives_sandboxes_as_a_whole() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let lib_dir = lib_dir();
    let exe = dir.path().join("clients");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(manifest.join("tests/c/clients.c"))
        .arg("-I")
        .arg(manifest.join("include"))
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-lbelayer")
        .arg("-lm")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed");
    // cargo puts target/<profile> on LD_LIBRARY_PATH, which beats the rpath: point it at the
    // library that was linked.
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .arg(&daemon.socket)
        .arg(busybox_rootfs())
        .output()
        .expect("run clients");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "clients.c failed ({}):\n{stdout}\n{stderr}\n{}",
        out.status,
        daemon.log_text()
    );
    assert!(stdout.contains("clients ok"), "{stdout}");
}
