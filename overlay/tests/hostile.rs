//! Hostile archives, built by hand with the tar crate: each must fail with its precise
//! error, and nothing outside the install target may be touched.

mod common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use belayer_overlay::{install_upper, InstallError, InstallLimits};
use common::names;
use tar::{Builder, EntryType, Header};

/// An archive under construction; headers take names verbatim (no tar-crate checks).
struct Hostile {
    builder: Builder<Vec<u8>>,
}

fn header(kind: EntryType, name: &[u8], size: u64) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(if kind == EntryType::Directory {
        0o755
    } else {
        0o644
    });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_size(size);
    let field = &mut h.as_old_mut().name;
    let n = name.len().min(field.len());
    field[..n].copy_from_slice(&name[..n]);
    h
}

impl Hostile {
    fn new() -> Self {
        Self {
            builder: Builder::new(Vec::new()),
        }
    }

    fn raw(mut self, mut h: Header, data: &[u8]) -> Self {
        h.set_cksum();
        self.builder.append(&h, data).unwrap();
        self
    }

    fn pax(mut self, records: &[(&str, &[u8])]) -> Self {
        self.builder
            .append_pax_extensions(records.iter().copied())
            .unwrap();
        self
    }

    fn root(self) -> Self {
        self.raw(header(EntryType::Directory, b"./", 0), b"")
    }

    fn dir(self, name: &str) -> Self {
        self.raw(header(EntryType::Directory, name.as_bytes(), 0), b"")
    }

    fn file(self, name: &str, data: &[u8]) -> Self {
        self.raw(
            header(EntryType::Regular, name.as_bytes(), data.len() as u64),
            data,
        )
    }

    fn link(self, kind: EntryType, name: &str, target: &str) -> Self {
        let mut h = header(kind, name.as_bytes(), 0);
        let field = &mut h.as_old_mut().linkname;
        field[..target.len()].copy_from_slice(target.as_bytes());
        self.raw(h, b"")
    }

    fn device(self, kind: EntryType, name: &str, major: u32, minor: u32) -> Self {
        let mut h = header(kind, name.as_bytes(), 0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.raw(h, b"")
    }

    fn finish(self) -> Vec<u8> {
        self.builder.into_inner().unwrap()
    }
}

/// A scratch area: `target/` (empty install target), `outside/` (must stay empty), the
/// archive beside them.
struct Scratch {
    _dir: tempfile::TempDir,
    root: PathBuf,
    target: PathBuf,
    outside: PathBuf,
}

impl Scratch {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let target = root.join("target");
        let outside = root.join("outside");
        fs::create_dir(&target).unwrap();
        fs::create_dir(&outside).unwrap();
        Self {
            _dir: dir,
            root,
            target,
            outside,
        }
    }

    fn install_with(&self, archive: Vec<u8>, limits: &InstallLimits) -> Result<(), InstallError> {
        let path = self.root.join("archive.tar");
        fs::write(&path, archive).unwrap();
        let result = install_upper(&path, &self.target, limits).map(|_| ());
        // Whatever happened, nothing appeared beside the target.
        assert_eq!(names(&self.root), ["archive.tar", "outside", "target"]);
        assert!(names(&self.outside).is_empty(), "outside touched");
        result
    }

    fn install(&self, archive: Vec<u8>) -> Result<(), InstallError> {
        self.install_with(archive, &InstallLimits::default())
    }
}

fn assert_name_rejected(name: &str, expected_reason: &str) {
    let s = Scratch::new();
    let err = s
        .install(Hostile::new().root().file(name, b"x").finish())
        .unwrap_err();
    match err {
        InstallError::InvalidName { path, reason } => {
            assert_eq!(path, Path::new(name));
            assert_eq!(reason, expected_reason);
        }
        other => panic!("{name:?}: unexpected {other:?}"),
    }
    assert!(names(&s.target).is_empty());
}

#[test]
fn parent_escapes_and_absolute_paths_are_rejected() {
    assert_name_rejected("../escape", "`..` component");
    assert_name_rejected("../outside/escape", "`..` component");
    assert_name_rejected("a/../../escape", "`..` component");
    assert_name_rejected("/abs/path", "absolute path");
    assert_name_rejected("a//b", "empty component");
    assert_name_rejected("a/./b", "`.` component");
    assert!(!Path::new("/abs/path").exists());
}

#[test]
fn a_symlinked_parent_is_never_followed() {
    let canary = tempfile::Builder::new()
        .prefix("belayer-canary")
        .tempdir()
        .unwrap();
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .link(EntryType::Symlink, "evil", canary.path().to_str().unwrap())
        .file("evil/pwned", b"gotcha")
        .finish();
    match s.install(archive).unwrap_err() {
        InstallError::ResolveParent { path, source } => {
            assert_eq!(path, Path::new("evil/pwned"));
            assert_eq!(source.call, "openat2");
            assert_eq!(source.errno(), Some(libc_eloop()));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(names(canary.path()).is_empty(), "canary touched");
    // The symlink itself was installed as a symlink, nothing more.
    assert_eq!(names(&s.target), ["evil"]);
    assert!(fs::symlink_metadata(s.target.join("evil"))
        .unwrap()
        .file_type()
        .is_symlink());

    // The same through a relative symlink pointing up and out of the target.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .link(EntryType::Symlink, "up", "../outside")
        .file("up/pwned", b"gotcha")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::ResolveParent { .. })
    ));
}

fn libc_eloop() -> i32 {
    rustix::io::Errno::LOOP.raw_os_error()
}

#[test]
fn a_parent_that_is_not_a_directory_is_rejected() {
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .file("f", b"x")
        .file("f/child", b"y")
        .finish();
    match s.install(archive).unwrap_err() {
        InstallError::ResolveParent { source, .. } => {
            assert_eq!(
                source.errno(),
                Some(rustix::io::Errno::NOTDIR.raw_os_error())
            )
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn hardlinks_must_point_at_earlier_members_inside() {
    type Check = fn(&InstallError) -> bool;
    let cases: [(&str, Check); 5] = [
        (
            "/etc/shadow",
            |e| matches!(e, InstallError::InvalidLinkTarget { reason, .. } if *reason == "absolute path"),
        ),
        (
            "../outside/x",
            |e| matches!(e, InstallError::InvalidLinkTarget { reason, .. } if *reason == "`..` component"),
        ),
        ("missing", |e| {
            matches!(e, InstallError::HardlinkTargetMissing { .. })
        }),
        // Through a symlink to /etc: `s/shadow` was never installed.
        ("s/shadow", |e| {
            matches!(e, InstallError::HardlinkTargetMissing { .. })
        }),
        ("d", |e| {
            matches!(e, InstallError::HardlinkTargetMissing { .. })
        }),
    ];
    for (target, check) in cases {
        let s = Scratch::new();
        let archive = Hostile::new()
            .root()
            .link(EntryType::Symlink, "s", "/etc")
            .dir("d/")
            .link(EntryType::Link, "h", target)
            .finish();
        let err = s.install(archive).unwrap_err();
        assert!(check(&err), "{target}: unexpected {err:?}");
        assert!(!s.target.join("h").exists());
    }
    // A hardlink to an earlier member is fine.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .file("a", b"shared")
        .link(EntryType::Link, "b", "a")
        .finish();
    s.install(archive).unwrap();
    let (a, b) = (
        fs::metadata(s.target.join("a")).unwrap(),
        fs::metadata(s.target.join("b")).unwrap(),
    );
    assert_eq!(a.ino(), b.ino());
}

#[test]
fn device_nodes_other_than_whiteouts_are_rejected() {
    for (kind, major, minor, kind_name) in [
        (EntryType::Char, 1, 3, "character"),
        (EntryType::Char, 0, 1, "character"),
        (EntryType::Block, 8, 0, "block"),
        (EntryType::Block, 0, 0, "block"),
    ] {
        let s = Scratch::new();
        let archive = Hostile::new()
            .root()
            .device(kind, "dev", major, minor)
            .finish();
        match s.install(archive).unwrap_err() {
            InstallError::ForbiddenDevice {
                path,
                kind,
                major: ma,
                minor: mi,
            } => {
                assert_eq!(path, Path::new("dev"));
                assert_eq!((kind, ma, mi), (kind_name, major, minor));
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(names(&s.target).is_empty());
    }
    // A whiteout (0:0 character device) and a fifo are fine.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .device(EntryType::Char, "wh", 0, 0)
        .raw(header(EntryType::Fifo, b"fifo", 0), b"")
        .finish();
    s.install(archive).unwrap();
    let wh = fs::symlink_metadata(s.target.join("wh")).unwrap();
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
    assert!(fs::symlink_metadata(s.target.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
}

#[test]
fn over_long_names_are_rejected() {
    let s = Scratch::new();
    let component = "c".repeat(256);
    let archive = Hostile::new()
        .root()
        .pax(&[("path", component.as_bytes())])
        .file("placeholder", b"x")
        .finish();
    match s.install(archive).unwrap_err() {
        InstallError::ComponentTooLong { len, max, .. } => assert_eq!((len, max), (256, 255)),
        other => panic!("unexpected {other:?}"),
    }

    let s = Scratch::new();
    let long = ["p"; 2049].join("/");
    let archive = Hostile::new()
        .root()
        .pax(&[("path", long.as_bytes())])
        .file("placeholder", b"x")
        .finish();
    match s.install(archive).unwrap_err() {
        InstallError::NameTooLong { len, max, .. } => assert_eq!((len, max), (4097, 4096)),
        other => panic!("unexpected {other:?}"),
    }

    // A GNU long name block over the limit is refused before it is read.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .raw(
            header(EntryType::GNULongName, b"././@LongLink", 5000),
            &[b'n'; 5000],
        )
        .file("placeholder", b"x")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::ExtensionTooLarge {
            size: 5000,
            max: 4097,
            ..
        })
    ));

    // A PAX path with a NUL byte.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .pax(&[("path", b"a\0b")])
        .file("placeholder", b"x")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::InvalidName {
            reason: "NUL byte",
            ..
        })
    ));
}

#[test]
fn limits_are_enforced_with_distinct_errors() {
    let archive = || {
        Hostile::new()
            .root()
            .file("a", &[1; 100])
            .file("b", &[2; 100])
            .file("c", &[3; 100])
            .finish()
    };
    let limits = InstallLimits {
        max_entries: 3,
        ..InstallLimits::default()
    };
    match Scratch::new().install_with(archive(), &limits).unwrap_err() {
        InstallError::TooManyEntries { path, max } => {
            assert_eq!((path, max), (PathBuf::from("c"), 3))
        }
        other => panic!("unexpected {other:?}"),
    }
    let limits = InstallLimits {
        max_total_bytes: 250,
        ..InstallLimits::default()
    };
    match Scratch::new().install_with(archive(), &limits).unwrap_err() {
        InstallError::TotalBytesExceeded { path, total, max } => {
            assert_eq!((path, total, max), (PathBuf::from("c"), 300, 250))
        }
        other => panic!("unexpected {other:?}"),
    }
    let limits = InstallLimits {
        max_file_bytes: 99,
        ..InstallLimits::default()
    };
    match Scratch::new().install_with(archive(), &limits).unwrap_err() {
        InstallError::FileTooLarge { path, size, max } => {
            assert_eq!((path, size, max), (PathBuf::from("a"), 100, 99))
        }
        other => panic!("unexpected {other:?}"),
    }
    // A declared size far beyond the data is refused before anything is written.
    let s = Scratch::new();
    let mut big = header(EntryType::Regular, b"huge", 0);
    big.set_size(1 << 40);
    let mut bytes = Hostile::new().root().finish();
    big.set_cksum();
    bytes.truncate(bytes.len() - 1024);
    bytes.extend_from_slice(big.as_bytes());
    bytes.extend_from_slice(&[0; 1024]);
    assert!(matches!(
        s.install(bytes),
        Err(InstallError::FileTooLarge { .. })
    ));
    assert!(names(&s.target).is_empty());
}

#[test]
fn unsupported_members_and_records_are_rejected() {
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .raw(header(EntryType::GNUSparse, b"sparse", 0), b"")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::UnsupportedEntry { kind: 'S', .. })
    ));
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .raw(header(EntryType::XGlobalHeader, b"global", 0), b"")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::UnsupportedEntry { kind: 'g', .. })
    ));
    for key in ["size", "GNU.sparse.map"] {
        let s = Scratch::new();
        let archive = Hostile::new()
            .root()
            .pax(&[(key, b"1")])
            .file("f", b"x")
            .finish();
        match s.install(archive).unwrap_err() {
            InstallError::UnsupportedExtension { key: k, .. } => assert_eq!(k, key),
            other => panic!("unexpected {other:?}"),
        }
    }
    let s = Scratch::new();
    let mut symlink_with_data = header(EntryType::Symlink, b"l", 4);
    symlink_with_data.as_old_mut().linkname[..1].copy_from_slice(b"t");
    let archive = Hostile::new()
        .root()
        .raw(symlink_with_data, b"data")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::UnexpectedData { size: 4, .. })
    ));
    let s = Scratch::new();
    let archive = Hostile::new().file(".", b"").finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::RootNotDirectory { .. })
    ));
    // A PAX header claiming more than the extension limit is refused before it is read.
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .raw(header(EntryType::XHeader, b"pax", 64 << 20), b"")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::ExtensionTooLarge { .. })
    ));
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .raw(header(EntryType::XHeader, b"pax", 5), b"1 a=b")
        .file("f", b"x")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::MalformedExtension { .. })
    ));
}

#[test]
fn forbidden_xattrs_are_rejected() {
    for (key, reason) in [
        ("SCHILY.xattr.system.evil", "namespace not allowed"),
        ("SCHILY.xattr.other.x", "namespace not allowed"),
        ("BELAYER.xattrhex.7a", "namespace not allowed"),
        ("BELAYER.xattrhex.zz", "malformed hex name"),
    ] {
        let s = Scratch::new();
        let archive = Hostile::new()
            .root()
            .pax(&[(key, b"v")])
            .file("f", b"x")
            .finish();
        match s.install(archive).unwrap_err() {
            InstallError::ForbiddenXattr { reason: r, .. } => assert_eq!(r, reason, "{key}"),
            other => panic!("{key}: unexpected {other:?}"),
        }
        assert!(names(&s.target).is_empty());
    }
    let s = Scratch::new();
    let big = vec![0u8; 65537];
    let archive = Hostile::new()
        .root()
        .pax(&[("SCHILY.xattr.user.big", &big)])
        .file("f", b"x")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::ForbiddenXattr {
            reason: "value larger than 64 KiB",
            ..
        })
    ));
}

#[test]
fn duplicates_are_never_overwritten() {
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .file("a", b"first")
        .file("a", b"second")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::DuplicateEntry { .. })
    ));
    assert_eq!(fs::read(s.target.join("a")).unwrap(), b"first");
    let s = Scratch::new();
    let archive = Hostile::new()
        .root()
        .link(EntryType::Symlink, "a", "/etc/passwd")
        .file("a", b"x")
        .finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::DuplicateEntry { .. })
    ));
    let s = Scratch::new();
    let archive = Hostile::new().root().root().finish();
    assert!(matches!(
        s.install(archive),
        Err(InstallError::DuplicateEntry { .. })
    ));
}

#[test]
fn truncated_archives_and_busy_targets_are_rejected() {
    let full = Hostile::new().root().file("f", &[9; 4096]).finish();
    // Cut inside the content of `f`.
    let s = Scratch::new();
    let err = s.install(full[..512 * 2 + 1000].to_vec()).unwrap_err();
    assert!(
        matches!(
            err,
            InstallError::ArchiveTruncated { expected: 4096, .. }
                | InstallError::ReadArchive { .. }
        ),
        "{err:?}"
    );
    // Cut at a member boundary, before the end-of-archive marker.
    let s = Scratch::new();
    let err = s.install(full[..full.len() - 1024].to_vec()).unwrap_err();
    assert!(
        matches!(err, InstallError::MissingEndOfArchive { .. }),
        "{err:?}"
    );
    // Extension headers with no member after them.
    let s = Scratch::new();
    let mut dangling = Hostile::new().root().pax(&[("mtime", b"1.5")]).finish();
    dangling.truncate(dangling.len() - 1024);
    dangling.extend_from_slice(&[0; 1024]);
    assert!(matches!(
        s.install(dangling),
        Err(InstallError::MisplacedExtension { .. })
    ));
    // The target must be empty.
    let s = Scratch::new();
    fs::write(s.target.join("existing"), b"keep").unwrap();
    let path = s.root.join("archive.tar");
    fs::write(&path, &full).unwrap();
    assert!(matches!(
        install_upper(&path, &s.target, &InstallLimits::default()),
        Err(InstallError::TargetNotEmpty { .. })
    ));
    assert_eq!(fs::read(s.target.join("existing")).unwrap(), b"keep");
}

#[test]
fn metadata_of_accepted_members_is_applied() {
    let s = Scratch::new();
    let mut file = header(EntryType::Regular, b"d/suid", 3);
    file.set_mode(0o4755);
    file.set_uid(4242);
    file.set_gid(4343);
    let mut dir = header(EntryType::Directory, b"d/", 0);
    dir.set_mode(0o500);
    let archive = Hostile::new()
        .root()
        .raw(dir, b"")
        .pax(&[("mtime", b"-1.250000000"), ("SCHILY.xattr.user.k", b"v\nw")])
        .raw(file, b"abc")
        .finish();
    s.install(archive).unwrap();
    let meta = fs::metadata(s.target.join("d/suid")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o4755);
    assert_eq!((meta.uid(), meta.gid()), (4242, 4343));
    assert_eq!((meta.mtime(), meta.mtime_nsec()), (-2, 750_000_000));
    let mut value = [0u8; 8];
    let n = rustix::fs::getxattr(s.target.join("d/suid"), "user.k", &mut value[..]).unwrap();
    assert_eq!(&value[..n], b"v\nw");
    let d = fs::metadata(s.target.join("d")).unwrap();
    assert_eq!((d.mode() & 0o7777, d.mtime()), (0o500, 1_700_000_000));
}
