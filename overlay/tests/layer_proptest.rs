//! Random upper layers (nested directories, empty, small, staged and sparse files,
//! whiteouts, opaque directories, hardlink groups, hostile symlinks, xattrs, odd modes,
//! owners and times, fifos) survive capture into the blob store (plain and zstd) and
//! materialization into an empty directory: the restored tree has the same canonical
//! digest, the same layer digest, and sparse files keep their data extents.

mod common;
mod layer_common;

use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{lchown, symlink, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use belayer_overlay::layer::{layer_digest, BlobStore, EntryKind, LayerManifest};
use belayer_overlay::InstallLimits;
use common::{assert_same_tree, set_mtime};
use layer_common::{
    allocated_bytes, bpath, capture, data_extents, hardlink_entries, materialize, mkfifo,
    mknod_char, no_racy_window, noise, setxattr,
};
use proptest::prelude::*;

/// What one generated entry is.
#[derive(Debug, Clone)]
enum Kind {
    Dir {
        opaque: bool,
    },
    Empty,
    Small(Vec<u8>),
    /// More than [`belayer_overlay::layer::INLINE_MAX_BYTES`]: goes through staging.
    Large {
        len: usize,
        seed: u64,
    },
    /// `set_len(size)` then a few writes at offsets (offset, length, byte).
    Sparse {
        size: u64,
        writes: Vec<(u64, u16, u8)>,
    },
    Symlink(Vec<u8>),
    Whiteout,
    Fifo,
    /// Another name of an earlier non-directory (picked among those created so far).
    Hardlink(usize),
}

#[derive(Debug, Clone)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, u32),
    /// (trusted namespace?, name number, value).
    xattrs: Vec<(bool, u8, Vec<u8>)>,
}

#[derive(Debug, Clone)]
struct Node {
    /// Parent, among the directories created so far (the root included).
    parent: usize,
    name: Vec<u8>,
    long_name: bool,
    kind: Kind,
    meta: Meta,
}

#[derive(Debug, Clone)]
struct Spec {
    root: Meta,
    nodes: Vec<Node>,
    compression: Option<i32>,
    verify: bool,
}

fn meta_strategy() -> impl Strategy<Value = Meta> {
    (
        prop::sample::select(vec![
            0o644, 0o755, 0o000, 0o777, 0o4755, 0o2755, 0o1777, 0o7777, 0o6711, 0o400, 0o1000,
        ]),
        prop::sample::select(vec![0u32, 1, 1000, 65534, 123_456, 4_294_967_294]),
        prop::sample::select(vec![0u32, 5, 1000, 65534, 2_000_000_000]),
        (-2_000_000_000i64..4_000_000_000, 0u32..1_000_000_000),
        prop::collection::vec(
            (
                any::<bool>(),
                0u8..4,
                prop::collection::vec(any::<u8>(), 0..48),
            ),
            0..3,
        ),
    )
        .prop_map(|(mode, uid, gid, mtime, xattrs)| Meta {
            mode,
            uid,
            gid,
            mtime,
            xattrs,
        })
}

fn kind_strategy() -> impl Strategy<Value = Kind> {
    let targets: Vec<Vec<u8>> = vec![
        b"sibling".to_vec(),
        b"../../x".to_vec(),
        b"../../../../../../etc/shadow".to_vec(),
        b"/etc/passwd".to_vec(),
        b"/".to_vec(),
        b"nowhere/missing".to_vec(),
        b".".to_vec(),
        b"caf\xe9 \n=\\".to_vec(),
        vec![b't'; 1000],
    ];
    prop_oneof![
        4 => any::<bool>().prop_map(|opaque| Kind::Dir { opaque }),
        2 => Just(Kind::Empty),
        5 => prop::collection::vec(any::<u8>(), 1..3000).prop_map(Kind::Small),
        1 => ((256usize << 10) + 1..(700usize << 10), any::<u64>())
            .prop_map(|(len, seed)| Kind::Large { len, seed }),
        2 => (
            (1u64 << 20)..(64u64 << 20),
            prop::collection::vec((any::<u64>(), 1u16..5000, any::<u8>()), 0..4)
        )
            .prop_map(|(size, writes)| Kind::Sparse { size, writes }),
        3 => prop::sample::select(targets).prop_map(Kind::Symlink),
        2 => Just(Kind::Whiteout),
        1 => Just(Kind::Fifo),
        3 => any::<usize>().prop_map(Kind::Hardlink),
    ]
}

fn node_strategy() -> impl Strategy<Value = Node> {
    let names: Vec<Vec<u8>> = vec![
        b"a".to_vec(),
        b"file".to_vec(),
        b"with space".to_vec(),
        b"new\nline".to_vec(),
        b"caf\xe9".to_vec(),
        b"-dash".to_vec(),
        b".hidden".to_vec(),
        b"...".to_vec(),
        b"x=y".to_vec(),
        b"back\\slash".to_vec(),
    ];
    (
        any::<usize>(),
        prop::sample::select(names),
        prop::bool::weighted(0.1),
        kind_strategy(),
        meta_strategy(),
    )
        .prop_map(|(parent, name, long_name, kind, meta)| Node {
            parent,
            name,
            long_name,
            kind,
            meta,
        })
}

fn spec_strategy() -> impl Strategy<Value = Spec> {
    (
        meta_strategy(),
        prop::collection::vec(node_strategy(), 0..28),
        prop::sample::select(vec![None, Some(1), Some(3)]),
        any::<bool>(),
    )
        .prop_map(|(root, nodes, compression, verify)| Spec {
            root,
            nodes,
            compression,
            verify,
        })
}

/// What was built, for the checks after the restore.
#[derive(Default)]
struct Built {
    sparse: Vec<(PathBuf, u64)>,
}

/// The element of `slice` that `raw` (any usize) stands for, scaled to its length.
fn pick<T>(raw: usize, slice: &[T]) -> &T {
    &slice[((slice.len() as u128 * raw as u128) >> usize::BITS) as usize]
}

fn xattr_name(trusted: bool, n: u8) -> String {
    format!("{}.k{n}", if trusted { "trusted" } else { "user" })
}

/// Owner, attributes, mode and time, in the order a restore applies them (a chown clears
/// setuid/setgid, so it comes first). `user.*` attributes only exist on files and
/// directories.
fn apply_meta(path: &Path, meta: &Meta, is_symlink: bool, user_ok: bool) {
    lchown(path, Some(meta.uid), Some(meta.gid)).unwrap();
    for (trusted, n, value) in &meta.xattrs {
        if *trusted || user_ok {
            setxattr(path, &xattr_name(*trusted, *n), value);
        }
    }
    if !is_symlink {
        fs::set_permissions(path, fs::Permissions::from_mode(meta.mode)).unwrap();
    }
}

fn build(root: &Path, spec: &Spec) -> Built {
    let mut built = Built::default();
    // Directories (relative path bytes) and linkable non-directories created so far.
    let mut dirs: Vec<Vec<u8>> = vec![Vec::new()];
    let mut linkable: Vec<Vec<u8>> = Vec::new();
    // Entries whose metadata is applied once everything exists: (path, meta, kind).
    let mut metas: Vec<(PathBuf, Meta, bool, bool)> = Vec::new();
    for (i, node) in spec.nodes.iter().enumerate() {
        let parent = pick(node.parent, &dirs).clone();
        let mut name = node.name.clone();
        name.extend_from_slice(format!("-{i}").as_bytes());
        if node.long_name && parent.len() + 300 < 4000 {
            let pad = 255 - name.len();
            name.splice(0..0, std::iter::repeat_n(b'L', pad));
        }
        let rel = if parent.is_empty() {
            name
        } else {
            [parent.as_slice(), b"/", name.as_slice()].concat()
        };
        let path = root.join(bpath(&rel));
        match &node.kind {
            Kind::Dir { opaque } => {
                fs::create_dir(&path).unwrap();
                if *opaque {
                    setxattr(&path, "trusted.overlay.opaque", b"y");
                }
                dirs.push(rel.clone());
                metas.push((path, node.meta.clone(), false, true));
                continue;
            }
            Kind::Empty => {
                File::create(&path).unwrap();
            }
            Kind::Small(data) => fs::write(&path, data).unwrap(),
            Kind::Large { len, seed } => fs::write(&path, noise(*len, *seed)).unwrap(),
            Kind::Sparse { size, writes } => {
                let file = File::create(&path).unwrap();
                file.set_len(*size).unwrap();
                for (offset, len, byte) in writes {
                    let len = u64::from(*len).min(*size);
                    let offset = offset % (size - len + 1);
                    file.write_all_at(&vec![*byte | 1; len as usize], offset)
                        .unwrap();
                }
                built
                    .sparse
                    .push((PathBuf::from(std::ffi::OsStr::from_bytes(&rel)), *size));
            }
            Kind::Symlink(target) => {
                symlink(bpath(target), &path).unwrap();
                metas.push((path, node.meta.clone(), true, false));
                linkable.push(rel);
                continue;
            }
            Kind::Whiteout => mknod_char(&path, 0, 0),
            Kind::Fifo => mkfifo(&path, 0o644),
            Kind::Hardlink(which) => {
                if linkable.is_empty() {
                    mkfifo(&path, 0o600);
                } else {
                    let target = root.join(bpath(pick::<Vec<u8>>(*which, &linkable)));
                    fs::hard_link(target, &path).unwrap();
                    // Metadata belongs to the shared inode: set it once, through the
                    // first name.
                    continue;
                }
            }
        }
        let user_ok = matches!(
            node.kind,
            Kind::Empty | Kind::Small(_) | Kind::Large { .. } | Kind::Sparse { .. }
        );
        metas.push((path, node.meta.clone(), false, user_ok));
        linkable.push(rel);
    }
    for (path, meta, is_symlink, user_ok) in &metas {
        apply_meta(path, meta, *is_symlink, *user_ok);
    }
    apply_meta(root, &spec.root, false, true);
    // Times last: every name exists, so no directory mtime moves afterwards.
    for (path, meta, _, _) in &metas {
        set_mtime(path, meta.mtime.0, i64::from(meta.mtime.1));
    }
    set_mtime(root, spec.root.mtime.0, i64::from(spec.root.mtime.1));
    built
}

fn check_round_trip(spec: &Spec) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let upper = dir.path().join("upper");
    fs::create_dir(&upper).unwrap();
    let built = build(&upper, spec);
    let store = BlobStore::open(&dir.path().join("store"))
        .unwrap()
        .with_compression(spec.compression);

    let (manifest, stats) = capture(&upper, None, &store, &no_racy_window()).unwrap();
    prop_assert_eq!(stats.entries, manifest.entries.len() as u64);
    prop_assert_eq!(stats.reused, 0);
    prop_assert_eq!(stats.bytes_read, stats.data_bytes);
    prop_assert_eq!(stats.data_bytes, manifest.data_bytes());
    prop_assert_eq!(stats.new_blobs, manifest.blobs().len() as u64);
    for id in manifest.blobs() {
        prop_assert!(store.contains(&id));
        store.verify(&id).unwrap();
    }
    prop_assert_eq!(
        LayerManifest::decode(&manifest.encode()).unwrap(),
        manifest.clone()
    );
    let limits = InstallLimits::default();
    prop_assert_eq!(
        layer_digest(&upper, &limits).unwrap(),
        manifest.content_digest()
    );

    let target = dir.path().join("target");
    let (installed, rekeyed) = materialize(&manifest, &store, &target, spec.verify).unwrap();
    prop_assert_eq!(installed.entries, manifest.entries.len() as u64);
    prop_assert_eq!(installed.content_bytes, manifest.data_bytes());
    assert_same_tree(&upper, &target, &[]);
    prop_assert_eq!(
        layer_digest(&target, &limits).unwrap(),
        manifest.content_digest()
    );
    prop_assert_eq!(rekeyed.content_digest(), manifest.content_digest());
    // Opaque markers (left out of the tree digest) came back.
    for e in &manifest.entries {
        if let Some((_, v)) = e
            .xattrs
            .iter()
            .find(|(n, _)| n == b"trusted.overlay.opaque")
        {
            let got =
                layer_common::getxattr(&target.join(bpath(&e.path)), "trusted.overlay.opaque");
            prop_assert_eq!(got.as_deref(), Some(v.as_slice()));
        }
    }
    // Sparse files keep their layout: same data extents, few allocated blocks.
    for (rel, size) in &built.sparse {
        let (a, b) = (upper.join(rel), target.join(rel));
        prop_assert_eq!(fs::metadata(&b).unwrap().len(), *size);
        prop_assert_eq!(data_extents(&a), data_extents(&b), "{}", rel.display());
        prop_assert!(
            allocated_bytes(&b) <= 128 << 10,
            "{}: {} bytes allocated for {} bytes of size",
            rel.display(),
            allocated_bytes(&b),
            size
        );
    }

    // The restored layer captured against the re-keyed manifest: everything is taken over.
    let (again, again_stats) = capture(&target, Some(&rekeyed), &store, &no_racy_window()).unwrap();
    prop_assert_eq!(again.content_digest(), manifest.content_digest());
    prop_assert_eq!(
        again_stats.reused + hardlink_entries(&again),
        again_stats.entries
    );
    prop_assert_eq!(again_stats.bytes_read, 0);
    prop_assert_eq!(again_stats.new_blobs, 0);
    prop_assert!(again.removed.is_empty());
    // Whiteouts stay 0:0 character devices, hardlink groups stay groups.
    for e in &again.entries {
        let meta = fs::symlink_metadata(target.join(bpath(&e.path))).unwrap();
        match &e.kind {
            EntryKind::Whiteout { major, minor } => {
                prop_assert_eq!((*major, *minor, meta.rdev()), (0, 0, 0));
            }
            EntryKind::Hardlink { target: first } => {
                let first = fs::symlink_metadata(target.join(bpath(first))).unwrap();
                prop_assert_eq!(first.ino(), meta.ino());
            }
            _ => {}
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_layers_round_trip(spec in spec_strategy()) {
        check_round_trip(&spec)?;
    }
}

/// A fixed layer with one of everything, so every kind is covered whatever the random
/// cases draw.
#[test]
fn one_of_everything_round_trips() {
    let meta = |mode, mtime| Meta {
        mode,
        uid: 4_294_967_294,
        gid: 77,
        mtime,
        xattrs: vec![(true, 1, b"t".to_vec()), (false, 2, vec![0, 255, b'\n'])],
    };
    let node = |parent: usize, name: &[u8], kind, mode| Node {
        parent,
        name: name.to_vec(),
        long_name: false,
        kind,
        meta: meta(mode, (-5, 999_999_999)),
    };
    // `pick` scales the raw number to the length: 0 is the first element.
    let spec = Spec {
        root: meta(0o751, (1_700_000_000, 1)),
        nodes: vec![
            node(0, b"d", Kind::Dir { opaque: true }, 0o1777),
            node(0, b"empty", Kind::Empty, 0o000),
            node(0, b"small", Kind::Small(b"hello".to_vec()), 0o4755),
            node(
                0,
                b"large",
                Kind::Large {
                    len: 300 << 10,
                    seed: 9,
                },
                0o2711,
            ),
            node(
                0,
                b"sparse",
                Kind::Sparse {
                    size: 40 << 20,
                    writes: vec![(0, 10, 1), (20 << 20, 4096, 2), (u64::MAX, 100, 3)],
                },
                0o600,
            ),
            node(0, b"abs", Kind::Symlink(b"/etc/passwd".to_vec()), 0o777),
            node(0, b"up", Kind::Symlink(b"../../x".to_vec()), 0o777),
            node(0, b"wh", Kind::Whiteout, 0o000),
            node(0, b"fifo", Kind::Fifo, 0o640),
            node(0, b"link", Kind::Hardlink(0), 0),
            node(0, b"link2", Kind::Hardlink(usize::MAX / 2), 0),
        ],
        compression: Some(3),
        verify: true,
    };
    check_round_trip(&spec).unwrap();
    let spec = Spec {
        compression: None,
        verify: false,
        ..spec
    };
    check_round_trip(&spec).unwrap();
}
