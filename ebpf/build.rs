//! Builds the BPF programs of `bpf/` with clang into `$OUT_DIR`: `tracer.bpf.o` (the sandbox
//! tracer) and `devices.bpf.o` (the cgroup v2 device allow-list).
//!
//! `vmlinux.h` (the kernel's types, for CO-RE) is generated into `$OUT_DIR` from the running
//! kernel's BTF with `bpftool btf dump file /sys/kernel/btf/vmlinux format c`; the relocations
//! recorded by clang let the object load on other kernels with BTF. Overrides:
//! `BELAYER_CLANG` (the clang binary), `BELAYER_BPFTOOL`, `BELAYER_BTF` (a BTF file other than
//! `/sys/kernel/btf/vmlinux`), `BELAYER_VMLINUX_H` (use this header instead of generating one).
//! clang, bpftool and libbpf's headers come from the project set-up (`scripts/setup.sh`:
//! Debian packages clang, llvm, bpftool, libbpf-dev).

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    for src in SOURCES {
        println!("cargo:rerun-if-changed=bpf/{src}.bpf.c");
    }
    // Headers the sources include (`#include "x.h"`, beside them).
    for header in ["fds.h", "file_activity.h"] {
        println!("cargo:rerun-if-changed=bpf/{header}");
    }
    for var in [
        "BELAYER_CLANG",
        "BELAYER_BPFTOOL",
        "BELAYER_BTF",
        "BELAYER_VMLINUX_H",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let include = out.join("include");
    std::fs::create_dir_all(&include).expect("create $OUT_DIR/include");
    let header = include.join("vmlinux.h");
    match std::env::var_os("BELAYER_VMLINUX_H") {
        Some(given) => {
            std::fs::copy(&given, &header).unwrap_or_else(|e| {
                fail(&format!(
                    "cannot copy BELAYER_VMLINUX_H={}: {e}",
                    Path::new(&given).display()
                ))
            });
        }
        None if !header.exists() => generate_vmlinux_h(&header),
        None => {}
    }
    let clang = std::env::var("BELAYER_CLANG").unwrap_or_else(|_| "clang".into());
    let arch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86",
        Ok("aarch64") => "arm64",
        Ok("riscv64") => "riscv",
        Ok("powerpc64") => "powerpc",
        Ok("s390x") => "s390",
        Ok(other) => fail(&format!("unsupported target architecture {other} for BPF")),
        Err(_) => "x86",
    };
    for src in SOURCES {
        compile(
            &clang,
            arch,
            &include,
            &Path::new("bpf").join(format!("{src}.bpf.c")),
            &out.join(format!("{src}.bpf.o")),
        );
    }
}

/// The programs of `bpf/`: `bpf/<name>.bpf.c` is built into `$OUT_DIR/<name>.bpf.o`.
const SOURCES: &[&str] = &["tracer", "devices"];

fn compile(clang: &str, arch: &str, include: &Path, src: &Path, object: &Path) {
    let status = Command::new(clang)
        .args([
            "-O2",
            "-g",
            "-target",
            "bpf",
            "-Wall",
            "-Wno-unused-function",
        ])
        .arg(format!("-D__TARGET_ARCH_{arch}"))
        .arg("-I")
        .arg(include)
        .arg("-c")
        .arg(src)
        .arg("-o")
        .arg(object)
        .status()
        .unwrap_or_else(|e| {
            fail(&format!(
                "cannot run `{clang}` ({e}): clang is needed to build the BPF programs; \
                 run scripts/setup.sh (Debian: apt-get install clang llvm libbpf-dev bpftool) \
                 or set BELAYER_CLANG"
            ))
        });
    if !status.success() {
        fail(&format!(
            "`{clang}` failed to compile {} ({status})",
            src.display()
        ));
    }
}

fn generate_vmlinux_h(header: &Path) {
    let bpftool = std::env::var("BELAYER_BPFTOOL").unwrap_or_else(|_| "bpftool".into());
    let btf = std::env::var("BELAYER_BTF").unwrap_or_else(|_| "/sys/kernel/btf/vmlinux".into());
    if !Path::new(&btf).exists() {
        fail(&format!(
            "no kernel BTF at {btf}: set BELAYER_BTF to a BTF file or BELAYER_VMLINUX_H to a \
             vmlinux.h generated elsewhere (bpftool btf dump file <btf> format c)"
        ));
    }
    let output = Command::new(&bpftool)
        .args(["btf", "dump", "file", &btf, "format", "c"])
        .output()
        .unwrap_or_else(|e| {
            fail(&format!(
                "cannot run `{bpftool}` ({e}): bpftool generates vmlinux.h; run \
                 scripts/setup.sh (Debian: apt-get install bpftool) or set BELAYER_VMLINUX_H"
            ))
        });
    if !output.status.success() {
        fail(&format!(
            "`{bpftool} btf dump file {btf} format c` failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let tmp = header.with_extension("h.tmp");
    std::fs::write(&tmp, &output.stdout).expect("write vmlinux.h");
    std::fs::rename(&tmp, header).expect("rename vmlinux.h");
}

fn fail(message: &str) -> ! {
    eprintln!("error: belayer-ebpf build: {message}");
    std::process::exit(1);
}
