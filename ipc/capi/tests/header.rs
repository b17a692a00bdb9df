//! The checked-in `include/belayer.h` must be what cbindgen generates from the sources today.
//! `BELAYER_BLESS=1 cargo test -p belayer-capi --test header` rewrites it.

use std::path::{Path, PathBuf};

fn generate() -> String {
    let capi = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(capi.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(capi.join("src/lib.rs"))
        .generate()
        .expect("cbindgen");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("utf-8 header")
}

fn header_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include/belayer.h")
}

#[test]
fn checked_in_header_matches_the_sources() {
    let generated = generate();
    let path = header_path();
    if std::env::var_os("BELAYER_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write header");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is stale: regenerate it with `BELAYER_BLESS=1 cargo test -p belayer-capi --test header`",
        path.display()
    );
}

#[test]
fn header_declares_the_abi_version_and_every_exported_function() {
    let generated = generate();
    assert!(generated.contains("#define BELAYER_ABI_VERSION 1"));
    for f in [
        "belayer_abi_version",
        "belayer_last_error",
        "belayer_connect",
        "belayer_exec",
        "belayer_exec_with",
        "belayer_checkpoint",
        "belayer_maybe_checkpoint",
        "belayer_restore",
        "belayer_context_append",
        "belayer_context_lookup",
        "belayer_context_remove",
        "belayer_subscribe",
        "belayer_next_event",
        "belayer_mem_connect",
        "belayer_placeholder_new",
    ] {
        assert!(
            generated.contains(&format!("{f}(")),
            "{f} missing from the header"
        );
    }
}
