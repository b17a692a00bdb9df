//! libbelayer against a real `belayerd` (started by the tests' fixture): the C program
//! `tests/c/cycle.c`, compiled with the system `cc` and linked against `libbelayer.so` (and
//! once against `libbelayer.a`), runs a full cycle; the policy and context calls are checked
//! from Rust; the shared library exports both halves of the ABI.
//!
//! Needs root, CRIU, the busybox image of `scripts/setup.sh`, and `belayerd` built next to
//! the test executable (`cargo build --workspace --bins` first).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr;

use belayer::*;
use belayer_tests::{bin_dir, busybox_rootfs, Daemon};

fn include_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include")
}

/// The freshest build of library file `name`: `cargo test` builds the cdylib/staticlib under
/// `deps/` without copying it up to `target/<profile>/` (only `cargo build` does).
fn library(name: &str) -> PathBuf {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    [bin_dir().join("deps").join(name), bin_dir().join(name)]
        .into_iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| mtime(p))
        .unwrap_or_else(|| panic!("{name} not built under {}", bin_dir().display()))
}

/// Directory of the freshest `libbelayer.so`.
fn lib_dir() -> PathBuf {
    library("libbelayer.so")
        .parent()
        .expect("library dir")
        .to_owned()
}

fn last_error() -> String {
    // SAFETY: never null; valid until the next failing call on this thread.
    unsafe { CStr::from_ptr(belayer_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn compile(out: &Path, extra: &[&str]) {
    compile_program("cycle.c", out, extra);
}

/// Compiles `tests/c/<source>` into `out` with `extra` arguments (libraries).
fn compile_program(source: &str, out: &Path, extra: &[&str]) {
    let status = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(out)
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/c")
                .join(source),
        )
        .arg("-I")
        .arg(include_dir())
        .args(extra)
        .status()
        .expect("run cc");
    assert!(status.success(), "cc {extra:?} failed");
}

#[test]
fn the_shared_library_exports_the_daemon_and_memory_server_functions() {
    let out = Command::new("nm")
        .arg("-D")
        .arg("--defined-only")
        .arg(library("libbelayer.so"))
        .output()
        .expect("nm");
    let text = String::from_utf8_lossy(&out.stdout);
    for f in [
        "belayer_abi_version",
        "belayer_connect",
        "belayer_upload",
        "belayer_download_archive",
        "belayer_maybe_checkpoint",
        "belayer_next_event",
        "belayer_last_error",
        "belayer_mem_connect",
        "belayer_mem_attach",
        "belayer_placeholder_new",
    ] {
        assert!(
            text.lines().any(|l| l.ends_with(&format!(" T {f}"))),
            "{f} not exported:\n{text}"
        );
    }
}

#[test]
fn the_c_program_runs_a_full_cycle() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let lib_dir = lib_dir();
    let exe = dir.path().join("cycle");
    compile(
        &exe,
        &[
            &format!("-L{}", lib_dir.display()),
            "-lbelayer",
            &format!("-Wl,-rpath,{}", lib_dir.display()),
        ],
    );
    // The static library links too (with the system libraries Rust's std needs).
    let static_exe = dir.path().join("cycle-static");
    compile(
        &static_exe,
        &[
            library("libbelayer.a").to_str().unwrap(),
            "-lpthread",
            "-ldl",
            "-lm",
            "-lgcc_s",
        ],
    );
    // cargo puts target/<profile> on LD_LIBRARY_PATH, which beats the rpath: point it at the
    // library that was linked.
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .arg(&daemon.socket)
        .arg(busybox_rootfs())
        .output()
        .expect("run cycle");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cycle failed ({}, library {}):\n{stdout}\n{stderr}\n{}",
        out.status,
        lib_dir.display(),
        daemon.log_text()
    );
    assert!(stdout.contains("cycle ok"), "{stdout}");
    println!("{stdout}");
}

#[test]
fn the_c_transfer_program_copies_both_ways_and_keeps_the_canary() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let lib_dir = lib_dir();
    let exe = dir.path().join("transfer");
    compile_program(
        "transfer.c",
        &exe,
        &[
            &format!("-L{}", lib_dir.display()),
            "-lbelayer",
            &format!("-Wl,-rpath,{}", lib_dir.display()),
        ],
    );
    let scratch = dir.path().join("scratch");
    std::fs::create_dir(&scratch).unwrap();
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .arg(&daemon.socket)
        .arg(busybox_rootfs())
        .arg(&scratch)
        .output()
        .expect("run transfer");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "transfer failed ({}):\n{stdout}\n{stderr}\n{}",
        out.status,
        daemon.log_text()
    );
    assert!(stdout.contains("transfer ok"), "{stdout}");
}

#[test]
fn maybe_checkpoint_follows_the_policy_and_context_round_trips() {
    let daemon = Daemon::start();
    daemon.image("busybox", &busybox_rootfs());
    let sandbox = daemon.create("busybox");
    let socket = CString::new(daemon.socket.to_str().unwrap()).unwrap();
    let id = CString::new(sandbox.id.clone()).unwrap();
    let mut client: BelayerClient = 0;
    let step = BelayerStep {
        step_duration_s: 30.0,
        regen_cost_s: -1.0,
        llm_elapsed_s: 0.0,
        llm_response_s: 20.0,
    };
    let policy = |kind: &CStr| BelayerPolicy {
        kind: kind.as_ptr(),
        failure_p: 0.5,
        failure_rate_per_s: -1.0,
        checkpoint_timeout_s: -1.0,
        cooldown_s: -1.0,
    };
    let mut d = BelayerDecision::default();
    // SAFETY: valid strings, structs and out-pointers; handed-out buffers are freed once.
    unsafe {
        assert_eq!(belayer_connect(socket.as_ptr(), &mut client), BELAYER_OK);
        let never = policy(c"never");
        let rc = belayer_maybe_checkpoint(
            client,
            id.as_ptr(),
            1,
            ptr::null(),
            0,
            &step,
            &never,
            &mut d,
        );
        assert_eq!(rc, BELAYER_OK, "{}", last_error());
        assert!(!d.checkpointed);
        assert_eq!(d.reason, BELAYER_REASON_NEVER);
        assert_eq!(d.regen_cost_s, 30.0);

        // A writing action, then adaptive with p = 0.5 and 60 s to regenerate: checkpoint.
        // (Before any change, the daemon would skip the step as clean.)
        assert_eq!(
            daemon.exec(&sandbox.id, "echo two > /root/state").exit_code,
            0
        );
        let adaptive = policy(c"adaptive");
        let ctx = b"context at 2";
        let rc = belayer_maybe_checkpoint(
            client,
            id.as_ptr(),
            2,
            ctx.as_ptr(),
            ctx.len(),
            &step,
            &adaptive,
            &mut d,
        );
        assert_eq!(rc, BELAYER_OK, "{}", last_error());
        assert!(d.checkpointed, "{d:?}");
        assert_eq!(d.reason, BELAYER_REASON_BENEFIT);
        assert_eq!(d.regen_cost_s, 60.0);
        assert_eq!(d.checkpoint_prefix, 2);
        assert!(d.checkpoint_bytes > 0);
        assert_eq!(daemon.inspect(&sandbox.id).ready_prefix, Some(2));

        // The checkpoint reset C_t; the current policy is kept when none is passed.
        let rc = belayer_maybe_checkpoint(
            client,
            id.as_ptr(),
            3,
            ptr::null(),
            0,
            &step,
            ptr::null(),
            &mut d,
        );
        assert_eq!(rc, BELAYER_OK, "{}", last_error());
        assert_eq!(d.regen_cost_s, 30.0);

        // An invalid policy is the daemon's BadRequest.
        let bad = policy(c"sometimes");
        let rc =
            belayer_maybe_checkpoint(client, id.as_ptr(), 4, ptr::null(), 0, &step, &bad, &mut d);
        assert_eq!(rc, BELAYER_E_BAD_REQUEST);
        assert!(last_error().contains("sometimes"), "{}", last_error());
        let unknown = c"no-such-sandbox";
        let rc = belayer_maybe_checkpoint(
            client,
            unknown.as_ptr(),
            1,
            ptr::null(),
            0,
            &step,
            ptr::null(),
            &mut d,
        );
        assert_eq!(rc, BELAYER_E_UNKNOWN_SANDBOX);

        // Context log: append two boundaries, look both up.
        let traj = c"traj-1";
        let mut record = u64::MAX;
        for (k, text) in [(1u64, &b"first"[..]), (2, &b"second"[..])] {
            let rc = belayer_context_append(
                client,
                traj.as_ptr(),
                k,
                text.as_ptr(),
                text.len(),
                &mut record,
            );
            assert_eq!(rc, BELAYER_OK, "{}", last_error());
        }
        let mut buf = BelayerBuf {
            data: ptr::null_mut(),
            len: 0,
        };
        let mut prefix = 0u64;
        assert_eq!(
            belayer_context_lookup(client, traj.as_ptr(), 1, &mut prefix, &mut buf),
            BELAYER_OK
        );
        assert_eq!(
            (prefix, std::slice::from_raw_parts(buf.data, buf.len)),
            (1, &b"first"[..])
        );
        belayer_buf_free(&mut buf);
        assert_eq!(
            belayer_context_lookup(client, traj.as_ptr(), -1, &mut prefix, &mut buf),
            BELAYER_OK
        );
        assert_eq!(
            (prefix, std::slice::from_raw_parts(buf.data, buf.len)),
            (2, &b"second"[..])
        );
        belayer_buf_free(&mut buf);
        assert_eq!(
            belayer_context_lookup(client, traj.as_ptr(), 9, &mut prefix, &mut buf),
            BELAYER_E_NOT_FOUND
        );
        let hostile = c"../../etc";
        assert_eq!(
            belayer_context_append(client, hostile.as_ptr(), 1, ptr::null(), 0, ptr::null_mut()),
            BELAYER_E_BAD_REQUEST
        );
        // Removed: unknown afterwards, and a new append starts a new log.
        assert_eq!(
            belayer_context_remove(client, traj.as_ptr()),
            BELAYER_OK,
            "{}",
            last_error()
        );
        assert_eq!(
            belayer_context_lookup(client, traj.as_ptr(), -1, &mut prefix, &mut buf),
            BELAYER_E_NOT_FOUND
        );
        assert_eq!(
            belayer_context_remove(client, traj.as_ptr()),
            BELAYER_E_NOT_FOUND
        );
        assert!(last_error().contains("traj-1"), "{}", last_error());
        assert_eq!(
            belayer_context_remove(client, hostile.as_ptr()),
            BELAYER_E_BAD_REQUEST
        );
        let mut again = u64::MAX;
        assert_eq!(
            belayer_context_append(client, traj.as_ptr(), 1, b"x".as_ptr(), 1, &mut again),
            BELAYER_OK
        );
        assert!(again < record, "a new log's first record");
        assert_eq!(belayer_context_remove(client, traj.as_ptr()), BELAYER_OK);
        assert_eq!(belayer_close(client), BELAYER_OK);
    }
}

/// The fenced `c` block of the README section `## Use from C`.
fn readme_c_snippet() -> String {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md");
    let text = std::fs::read_to_string(&readme).expect("README.md");
    let section = &text[text.find("## Use from C").expect("section Use from C")..];
    let start = section.find("```c\n").expect("c block") + 5;
    let end = section[start..].find("```").expect("end of c block");
    section[start..start + end].to_owned()
}

#[test]
fn the_readme_c_snippet_runs() {
    let daemon = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("readme.c");
    std::fs::write(&src, readme_c_snippet()).unwrap();
    let exe = dir.path().join("readme");
    let lib_dir = lib_dir();
    let status = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-I")
        .arg(include_dir())
        .arg(format!("-L{}", lib_dir.display()))
        .arg("-lbelayer")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .status()
        .expect("cc");
    assert!(status.success(), "the README's C snippet does not compile");
    let out = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .env("BELAYER_SOCKET", &daemon.socket)
        .env("BELAYER_TEST_BUSYBOX_ROOTFS", busybox_rootfs())
        .output()
        .expect("run the snippet");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        daemon.log_text()
    );
    assert!(
        stdout.contains("restored k=1, context \"context after step 1\""),
        "{stdout}"
    );
}
