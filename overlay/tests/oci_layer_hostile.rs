//! Hostile image layers: each must fail with its precise error and leave everything outside
//! the target as it was; random layers drawn from whiteout-heavy names never write outside
//! the target and end in success or an error. Needs root.

mod oci_common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use belayer_overlay::InstallError;
use oci_common::{listing, names, unpack, xattr, Layer, Scratch};
use proptest::prelude::*;
use tar::EntryType;

fn eloop() -> Option<i32> {
    Some(rustix::io::Errno::LOOP.raw_os_error())
}

fn invalid_name(name: &str, expected: &str) {
    let s = Scratch::new();
    match s.unpack(Layer::new().root().file(name, b"x").finish()) {
        Err(InstallError::InvalidName { path, reason }) => {
            assert_eq!(path, Path::new(name));
            assert_eq!(reason, expected);
        }
        other => panic!("{name}: unexpected {other:?}"),
    }
}

#[test]
fn escaping_names_are_refused() {
    invalid_name("../x", "`..` component");
    invalid_name("../outside/keep", "`..` component");
    invalid_name("a/../../x", "`..` component");
    invalid_name("/abs", "absolute path");
    invalid_name("/tmp/.wh.x", "absolute path");
    invalid_name("../.wh.x", "`..` component");
    assert!(!Path::new("/abs").exists());
}

#[test]
fn symlinked_parents_are_never_followed() {
    let s = Scratch::new();
    let layer = Layer::new()
        .symlink("a", s.canary())
        .file("a/pwned", b"gotcha")
        .finish();
    match s.unpack(layer).unwrap_err() {
        InstallError::ResolveParent { path, source } => {
            assert_eq!(path, Path::new("a/pwned"));
            assert_eq!(source.errno(), eloop());
        }
        other => panic!("unexpected {other:?}"),
    }
    // Deeper, through a parent the layer never listed, a whiteout and an opaque marker.
    for member in [
        "a/b/c/pwned",
        "a/.wh.keep",
        "a/.wh..wh..opq",
        "a/b/.wh..wh..opq",
    ] {
        let s = Scratch::new();
        let layer = Layer::new()
            .symlink("a", s.canary())
            .file(member, b"")
            .finish();
        match s.unpack(layer) {
            Err(InstallError::ResolveParent { path, source }) => {
                assert_eq!(path, Path::new(member));
                assert_eq!(source.errno(), eloop());
            }
            other => panic!("{member}: unexpected {other:?}"),
        }
        assert_eq!(xattr(&s.outside, "trusted.overlay.opaque"), None);
    }
    // A relative symlink up and out of the target.
    let s = Scratch::new();
    let layer = Layer::new()
        .symlink("up", "../outside")
        .file("up/keep", b"overwritten")
        .finish();
    assert!(matches!(
        s.unpack(layer),
        Err(InstallError::ResolveParent { .. })
    ));
}

#[test]
fn hardlinks_reach_only_earlier_members() {
    let cases: &[(&str, &str)] = &[
        ("s/keep", "hardlink-missing"),
        ("etc/shadow", "hardlink-missing"),
        ("/etc/shadow", "absolute path"),
        ("../outside/keep", "`..` component"),
    ];
    for (target, expected) in cases {
        let s = Scratch::new();
        let layer = Layer::new()
            .symlink("s", s.canary())
            .hardlink("h", target)
            .finish();
        match (s.unpack(layer), *expected) {
            (Err(InstallError::HardlinkTargetMissing { path, .. }), "hardlink-missing") => {
                assert_eq!(path, Path::new("h"))
            }
            (Err(InstallError::InvalidLinkTarget { reason, .. }), r) if reason == r => {}
            (other, _) => panic!("{target}: unexpected {other:?}"),
        }
        assert_eq!(fs::metadata(s.outside.join("keep")).unwrap().nlink(), 1);
    }
    // A hardlink whose own parent is the symlink.
    let s = Scratch::new();
    let layer = Layer::new()
        .file("f", b"f")
        .symlink("s", s.canary())
        .hardlink("s/h", "f")
        .finish();
    assert!(matches!(
        s.unpack(layer),
        Err(InstallError::ResolveParent { .. })
    ));
    // Hardlinks to whiteouts, aufs bookkeeping and themselves.
    for (layer, expected) in [
        (
            Layer::new().file(".wh.a", b"").hardlink("h", "a"),
            "a whiteout",
        ),
        (
            Layer::new()
                .file(".wh..wh.plnk/1", b"")
                .hardlink("h", ".wh..wh.plnk/1"),
            "a whiteout or aufs name",
        ),
        (
            Layer::new().file(".wh.a", b"").hardlink("h", ".wh.a"),
            "a whiteout or aufs name",
        ),
        (
            Layer::new().file("h", b"").hardlink("h", "h"),
            "the member itself",
        ),
    ] {
        let s = Scratch::new();
        match s.unpack(layer.finish()) {
            Err(InstallError::InvalidLinkTarget { path, reason, .. }) => {
                assert_eq!((path.as_path(), reason), (Path::new("h"), expected))
            }
            other => panic!("{expected}: unexpected {other:?}"),
        }
    }
}

#[test]
fn device_nodes_are_refused() {
    for (kind, major, minor, kind_name) in [
        (EntryType::Char, 1, 3, "character"),
        (EntryType::Block, 8, 0, "block"),
        (EntryType::Char, 0, 0, "character"),
    ] {
        let s = Scratch::new();
        let layer = Layer::new()
            .dir("dev/")
            .device(kind, "dev/node", major, minor)
            .finish();
        match s.unpack(layer) {
            Err(InstallError::DeviceInLayer {
                path,
                kind,
                major: got_major,
                minor: got_minor,
            }) => {
                assert_eq!(path, Path::new("dev/node"));
                assert_eq!((kind, got_major, got_minor), (kind_name, major, minor));
            }
            other => panic!("{major}:{minor}: unexpected {other:?}"),
        }
        assert_eq!(listing(&s.target), ["dev/"]);
    }
}

#[test]
fn malformed_whiteouts_are_refused() {
    for (name, expected) in [
        (".wh.", "empty name"),
        ("d/.wh.", "empty name"),
        ("d/.wh...", "`..` name"),
        (".wh..", "`.` name"),
        (".wh.x/y", "a whiteout name used as a parent directory"),
    ] {
        let s = Scratch::new();
        match s.unpack(Layer::new().file(name, b"").finish()) {
            Err(InstallError::InvalidWhiteout { path, reason }) => {
                assert_eq!((path.as_path(), reason), (Path::new(name), expected))
            }
            other => panic!("{name}: unexpected {other:?}"),
        }
        assert!(names(&s.target).is_empty());
    }
}

#[test]
fn members_and_whiteouts_never_share_a_name() {
    let cases = [
        (Layer::new().file("a", b"a").file(".wh.a", b""), ".wh.a"),
        (Layer::new().file(".wh.a", b"").file("a", b"a"), "a"),
        (Layer::new().file(".wh.a", b"").dir("a/"), "a/"),
        (
            Layer::new().dir("d/").file("d/x", b"").file(".wh.d", b""),
            ".wh.d",
        ),
        (Layer::new().file("d/x", b"").file(".wh.d", b""), ".wh.d"),
        (Layer::new().file(".wh.d", b"").file("d/x", b""), "d/x"),
        (
            Layer::new().file(".wh.d", b"").file("d/.wh.x", b""),
            "d/.wh.x",
        ),
        (
            Layer::new().file(".wh.d", b"").file("d/.wh..wh..opq", b""),
            "d/.wh..wh..opq",
        ),
        (
            Layer::new().file("d/.wh..wh..opq", b"").file(".wh.d", b""),
            ".wh.d",
        ),
    ];
    for (layer, expected) in cases {
        let s = Scratch::new();
        match s.unpack(layer.finish()) {
            Err(InstallError::WhiteoutConflict { path }) => assert_eq!(path, Path::new(expected)),
            other => panic!("{expected}: unexpected {other:?}"),
        }
    }
    // The same whiteout twice is one whiteout.
    let s = Scratch::new();
    let stats = s
        .unpack(Layer::new().file(".wh.a", b"").file(".wh.a", b"").finish())
        .unwrap();
    assert_eq!(stats.whiteouts, 2);
    assert_eq!(listing(&s.target), ["a c 0:0"]);
}

#[test]
fn overlay_attributes_truncation_and_busy_targets_are_refused() {
    for key in [
        "SCHILY.xattr.trusted.overlay.redirect",
        "SCHILY.xattr.trusted.overlay.opaque",
    ] {
        let s = Scratch::new();
        let layer = Layer::new().pax(&[(key, b"/etc")]).dir("d/").finish();
        match s.unpack(layer) {
            Err(InstallError::ForbiddenXattr { path, name, reason }) => {
                assert_eq!(path, Path::new("d/"));
                assert_eq!(name, key.trim_start_matches("SCHILY.xattr."));
                assert_eq!(reason, "overlay attribute in an image layer");
            }
            other => panic!("{key}: unexpected {other:?}"),
        }
    }
    let full = Layer::new().dir("d/").file("d/f", &[7; 600]).finish();
    let s = Scratch::new();
    match s.unpack(full[..full.len() - 1024].to_vec()) {
        Err(InstallError::MissingEndOfArchive { path, .. }) => {
            assert_eq!(path, Path::new("layer.tar"))
        }
        other => panic!("unexpected {other:?}"),
    }
    let s = Scratch::new();
    assert!(matches!(
        s.unpack(full[..512 * 3].to_vec()),
        Err(InstallError::ArchiveTruncated { .. } | InstallError::ReadArchive { .. })
    ));
    let s = Scratch::new();
    fs::write(s.target.join("existing"), b"x").unwrap();
    assert!(matches!(
        unpack(&full, &s.target),
        Err(InstallError::TargetNotEmpty { .. })
    ));
}

#[test]
fn limits_count_skipped_and_created_entries() {
    use belayer_overlay::{install_oci_layer, InstallLimits, LayerOptions};
    let options = LayerOptions {
        limits: InstallLimits {
            max_entries: 3,
            ..InstallLimits::default()
        },
    };
    for layer in [
        Layer::new().file("a/b/c/d", b""),
        Layer::new()
            .file(".wh..wh.plnk/1", b"")
            .file(".wh..wh.plnk/2", b"")
            .file(".wh..wh.plnk/3", b"")
            .file(".wh..wh.plnk/4", b""),
    ] {
        let s = Scratch::new();
        let result = install_oci_layer(
            &layer.finish()[..],
            Path::new("layer.tar"),
            &s.target,
            &options,
        );
        assert!(
            matches!(result, Err(InstallError::TooManyEntries { max: 3, .. })),
            "{result:?}"
        );
    }
}

/// One member of a random layer.
#[derive(Debug, Clone)]
enum Kind {
    Dir,
    File,
    Symlink(usize),
    Hardlink(String),
    Device(u32),
}

/// A parent directory: mostly a plain name (a `.wh.` parent or `..` fails the whole layer).
fn parent() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        24 => prop::sample::select(&["a", "b"][..]),
        1 => prop::sample::select(&[".wh.a", ".wh..wh.plnk", ".."][..]),
    ]
}

/// A last name component: plain, whiteout, opaque marker, aufs, or (rarely) invalid.
fn last() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        12 => prop::sample::select(&["a", "b"][..]),
        8 => prop::sample::select(&[".wh.a", ".wh.b"][..]),
        4 => prop::sample::select(&[".wh..wh..opq", ".wh..wh.plnk"][..]),
        1 => prop::sample::select(&[".wh.", "..", ".wh.."][..]),
    ]
}

/// Parent directories mostly plain, the last component often a whiteout form.
fn name() -> impl Strategy<Value = String> {
    (prop::collection::vec(parent(), 0..3), last()).prop_map(|(mut c, last)| {
        c.push(last);
        c.join("/")
    })
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        3 => Just(Kind::Dir),
        3 => Just(Kind::File),
        2 => (0..4usize).prop_map(Kind::Symlink),
        2 => name().prop_map(Kind::Hardlink),
        1 => (0..2u32).prop_map(Kind::Device),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_layers_never_write_outside(members in prop::collection::vec((name(), kind()), 0..16)) {
        let s = Scratch::new();
        let targets = [s.canary().to_owned(), "../outside".to_owned(), "a".to_owned(), "/".to_owned()];
        let mut layer = Layer::new();
        for (name, kind) in &members {
            layer = match kind {
                Kind::Dir => layer.dir(&format!("{name}/")),
                Kind::File => layer.file(name, b"data"),
                Kind::Symlink(t) => layer.symlink(name, &targets[*t]),
                Kind::Hardlink(t) => layer.hardlink(name, t),
                Kind::Device(minor) => layer.device(EntryType::Char, name, 0, *minor),
            };
        }
        // Succeeds or fails with an error, never panics; `unpack` checks the outside.
        let result = s.unpack(layer.finish());
        if result.is_ok() {
            for line in listing(&s.target) {
                prop_assert!(!line.contains(".wh."), "a .wh. name was created: {line}");
            }
        }
        // Every device node in the target is a whiteout.
        let mut stack = vec![s.target.clone()];
        while let Some(dir) = stack.pop() {
            for entry in fs::read_dir(&dir).unwrap() {
                let entry = entry.unwrap();
                let meta = fs::symlink_metadata(entry.path()).unwrap();
                if meta.is_dir() {
                    stack.push(entry.path());
                }
                if meta.file_type().is_char_device() || meta.file_type().is_block_device() {
                    prop_assert!(meta.file_type().is_char_device() && meta.rdev() == 0);
                }
            }
        }
    }
}
