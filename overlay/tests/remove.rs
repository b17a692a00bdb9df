//! Hostile trees against the bounded removal and the bounded walker, on the real kernel (as
//! root): a 30 000-deep chain on a 256 KiB stack with 64 fds, 10^5 files in one directory,
//! symlinks out of the tree, a tmpfs and a bind mount inside it, directories of mode 000
//! (overlayfs's `work/work` among them, and without the capabilities that let root ignore
//! modes), and the walker's depth limit.

use std::ffi::CString;
use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use belayer_overlay::layer::{
    capture_layer, materialize_layer, BlobStore, LayerCaptureOptions, MaterializeOptions,
};
use belayer_overlay::{
    metadata_fingerprint, remove_dir_all, remove_tree, remove_tree_with, tree_digest, CaptureError,
    DigestError, InstallLimits, OverlayMount, RemoveError, RemoveOptions, MAX_WALK_DEPTH,
};
use rustix::fs::{Mode, OFlags, CWD};

const CHILD_ENV: &str = "BELAYER_REMOVE_TEST_CHILD";

/// Makes a chain of `depth` directories named `name` below `root` (one fd at a time).
fn chain(root: &Path, name: &str, depth: usize) {
    let name = CString::new(name).unwrap();
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut fd: OwnedFd = rustix::fs::openat(CWD, root, flags, Mode::empty()).unwrap();
    for _ in 0..depth {
        rustix::fs::mkdirat(&fd, name.as_c_str(), Mode::from_raw_mode(0o755)).unwrap();
        fd = rustix::fs::openat(&fd, name.as_c_str(), flags, Mode::empty()).unwrap();
    }
}

/// A mount undone (lazily) on drop.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

fn tmpfs(target: &Path) -> Mounted {
    rustix::mount::mount(
        "tmpfs",
        target,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        c"size=1m",
    )
    .unwrap();
    Mounted(target.to_path_buf())
}

/// Runs this test binary again for test `name` with `CHILD_ENV=arg`; asserts it passed
/// and echoes its output.
fn run_child(name: &str, arg: &Path) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, arg)
        .output()
        .unwrap();
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "child failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn removes_a_30000_deep_chain_on_a_small_stack_with_64_fds() {
    const NAME: &str = "removes_a_30000_deep_chain_on_a_small_stack_with_64_fds";
    if let Some(dir) = std::env::var_os(CHILD_ENV) {
        // The child: few fds, and the work on a thread with a small stack.
        let dir = PathBuf::from(dir);
        let limit = rustix::process::Rlimit {
            current: Some(64),
            maximum: Some(64),
        };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, limit).unwrap();
        let worker = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                // The walker keeps its fds bounded too: a tree of the deepest capturable
                // depth is digested with 64 fds.
                let t = Instant::now();
                tree_digest(&dir.join("walkable"), &[]).unwrap();
                eprintln!(
                    "digest of a {MAX_WALK_DEPTH}-deep chain with RLIMIT_NOFILE 64: {:?}",
                    t.elapsed()
                );
                // So do capture and materialize of that tree.
                let store = BlobStore::open(&dir.join("blobs")).unwrap();
                let layer = capture_layer(
                    &dir.join("walkable"),
                    None,
                    &store,
                    &LayerCaptureOptions::default(),
                )
                .unwrap();
                let (manifest, _) = layer.seal().unwrap();
                fs::create_dir(dir.join("restored")).unwrap();
                let t = Instant::now();
                materialize_layer(
                    &manifest,
                    &store,
                    &dir.join("restored"),
                    &MaterializeOptions::default(),
                )
                .unwrap();
                eprintln!(
                    "materialize of a {MAX_WALK_DEPTH}-deep layer with RLIMIT_NOFILE 64: {:?}",
                    t.elapsed()
                );
                let t = Instant::now();
                let stats = remove_tree(&dir.join("deep")).unwrap();
                let elapsed = t.elapsed();
                eprintln!(
                    "removal of a 30000-deep chain (256 KiB stack, RLIMIT_NOFILE 64): \
                     {elapsed:?}, {} entries, {} bytes, {} flattened",
                    stats.entries, stats.bytes, stats.flattened
                );
                assert_eq!(stats.entries, 30_001);
                assert!(stats.flattened >= 30_000 / 32 - 1);
            })
            .unwrap();
        worker.join().unwrap();
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("deep")).unwrap();
    fs::create_dir(dir.path().join("walkable")).unwrap();
    chain(&dir.path().join("deep"), "d", 30_000);
    chain(&dir.path().join("walkable"), "d", MAX_WALK_DEPTH);
    run_child(NAME, dir.path());
    assert!(!dir.path().join("deep").exists());
    assert_eq!(
        tree_digest(&dir.path().join("restored"), &[]).unwrap(),
        tree_digest(&dir.path().join("walkable"), &[]).unwrap()
    );
    for tree in ["walkable", "restored"] {
        remove_tree(&dir.path().join(tree)).unwrap();
    }
}

#[test]
fn removes_100000_files_in_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let wide = dir.path().join("wide");
    fs::create_dir(&wide).unwrap();
    for i in 0..100_000 {
        fs::File::create(wide.join(format!("file-{i:06}"))).unwrap();
    }
    fs::write(wide.join("data"), vec![7u8; 1 << 20]).unwrap();
    let t = Instant::now();
    let stats = remove_tree(&wide).unwrap();
    eprintln!(
        "removal of 100000 files in one directory: {:?}, {} entries, {} bytes",
        t.elapsed(),
        stats.entries,
        stats.bytes
    );
    assert_eq!(stats.entries, 100_002);
    assert!(stats.bytes >= 1 << 20, "{stats:?}");
    assert!(!wide.exists());
}

#[test]
fn symlinks_are_removed_never_followed() {
    let dir = tempfile::tempdir().unwrap();
    let canary = dir.path().join("canary");
    fs::create_dir(&canary).unwrap();
    fs::write(canary.join("precious"), b"keep").unwrap();
    fs::create_dir(canary.join("sub")).unwrap();
    let tree = dir.path().join("tree");
    fs::create_dir_all(tree.join("a/b/c")).unwrap();
    symlink(&canary, tree.join("to-canary")).unwrap();
    symlink(canary.join("precious"), tree.join("a/to-file")).unwrap();
    symlink("../../../canary", tree.join("a/b/up")).unwrap();
    symlink("..", tree.join("a/b/c/dotdot")).unwrap();
    symlink("/", tree.join("a/b/c/slash")).unwrap();
    symlink("/proc/self/cwd", tree.join("a/magic")).unwrap();
    symlink("loop", tree.join("loop")).unwrap();
    // A deep part below the flattening depth, with links too.
    chain(&tree.join("a"), "x", 10);
    let opts = RemoveOptions {
        max_open_dirs: 3,
        ..RemoveOptions::default()
    };
    let stats = remove_tree_with(&tree, &opts).unwrap();
    assert!(stats.flattened > 0);
    assert!(!tree.exists());
    assert_eq!(fs::read(canary.join("precious")).unwrap(), b"keep");
    assert!(canary.join("sub").is_dir());

    // A symlink as the root is removed itself; `..` as the last component is refused.
    let link = dir.path().join("link");
    symlink(&canary, &link).unwrap();
    assert_eq!(remove_tree(&link).unwrap().entries, 1);
    assert!(fs::symlink_metadata(&link).is_err());
    assert!(matches!(
        remove_tree(&canary.join("sub/..")),
        Err(RemoveError::InvalidPath { .. })
    ));
    assert!(canary.join("precious").exists());

    // A missing root is NotFound through the io::Error drop-in, as with std.
    let missing = remove_dir_all(dir.path().join("missing")).unwrap_err();
    assert_eq!(missing.kind(), std::io::ErrorKind::NotFound);
    assert!(missing
        .get_ref()
        .and_then(|e| e.downcast_ref::<RemoveError>())
        .is_some());
}

#[test]
fn a_mount_inside_is_not_descended() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    fs::create_dir_all(tree.join("a/mnt")).unwrap();
    fs::create_dir_all(tree.join("z/keep")).unwrap();
    fs::write(tree.join("a/file"), b"x").unwrap();
    let mounted = tmpfs(&tree.join("a/mnt"));
    fs::write(tree.join("a/mnt/inside"), b"tmpfs content").unwrap();
    match remove_tree(&tree) {
        Err(RemoveError::Mount { path }) => assert_eq!(path, tree.join("a/mnt")),
        other => panic!("{other:?}"),
    }
    let err = remove_dir_all(&tree).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::CrossesDevices, "{err}");
    assert_eq!(
        fs::read(tree.join("a/mnt/inside")).unwrap(),
        b"tmpfs content"
    );

    // The root itself a mount point: nothing is removed.
    match remove_tree(&tree.join("a/mnt")) {
        Err(RemoveError::Mount { path }) => assert_eq!(path, tree.join("a/mnt")),
        other => panic!("{other:?}"),
    }
    assert!(tree.join("a/mnt/inside").exists());

    // A bind-mounted file (same filesystem, another mount) is refused too.
    drop(mounted);
    fs::write(dir.path().join("host-file"), b"host").unwrap();
    fs::write(tree.join("a/bound"), b"").unwrap();
    let bound = {
        rustix::mount::mount_bind(dir.path().join("host-file"), tree.join("a/bound")).unwrap();
        Mounted(tree.join("a/bound"))
    };
    match remove_tree(&tree) {
        Err(RemoveError::Mount { path }) => assert_eq!(path, tree.join("a/bound")),
        other => panic!("{other:?}"),
    }
    drop(bound);
    assert_eq!(fs::read(dir.path().join("host-file")).unwrap(), b"host");

    // A mount below the flattening depth: found after its ancestor moved to the top.
    fs::create_dir_all(tree.join("z")).unwrap();
    chain(&tree.join("z"), "d", 6);
    let deep = tree.join("z/d/d/d/d/d/d");
    let mut mounted = tmpfs(&deep);
    fs::write(deep.join("inside"), b"deep tmpfs").unwrap();
    let opts = RemoveOptions {
        max_open_dirs: 3,
        ..RemoveOptions::default()
    };
    match remove_tree_with(&tree, &opts) {
        Err(RemoveError::Mount { path }) => {
            // z/d/d/d/d/d/d with 3 open levels: d (at z/d/d) and d (at .belayer-rm-0/d/d)
            // were moved to the top, so the mount sits at .belayer-rm-1/d/d.
            let rel = path.strip_prefix(&tree).unwrap();
            assert_eq!(rel, Path::new(".belayer-rm-1/d/d"), "{}", path.display());
            assert_eq!(fs::read(path.join("inside")).unwrap(), b"deep tmpfs");
            // The mount moved with its ancestor.
            mounted.0 = path;
        }
        other => panic!("{other:?}"),
    }
    drop(mounted);
    remove_tree(&tree).unwrap();
    assert!(!tree.exists());
}

#[test]
fn mode_000_directories_and_the_overlay_work_dir() {
    let dir = tempfile::tempdir().unwrap();
    let inst = dir.path().join("inst");
    for d in ["lower", "upper", "work", "merged"] {
        fs::create_dir_all(inst.join(d)).unwrap();
    }
    let mount = OverlayMount::mount(
        &inst.join("lower"),
        &inst.join("upper"),
        &inst.join("work"),
        &inst.join("merged"),
    )
    .unwrap();
    fs::create_dir_all(inst.join("merged/x/y")).unwrap();
    fs::write(inst.join("merged/x/y/f"), b"f").unwrap();
    mount.unmount().unwrap();
    let work_work = inst.join("work/work");
    assert_eq!(
        fs::metadata(&work_work).unwrap().permissions().mode() & 0o777,
        0,
        "overlayfs leaves work/work at mode 000"
    );
    // More closed directories, files inside.
    fs::create_dir_all(inst.join("upper/closed/inner")).unwrap();
    fs::write(inst.join("upper/closed/inner/f"), b"f").unwrap();
    for d in ["upper/closed/inner", "upper/closed", "upper/x"] {
        fs::set_permissions(inst.join(d), fs::Permissions::from_mode(0o000)).unwrap();
    }
    remove_tree(&inst).unwrap();
    assert!(!inst.exists());

    // Without the capabilities that let root ignore modes, the owner opens them up.
    fs::create_dir_all(inst.join("a/b/c")).unwrap();
    fs::write(inst.join("a/b/c/f"), b"f").unwrap();
    fs::write(inst.join("a/b/g"), b"g").unwrap();
    chain(&inst.join("a/b"), "deep", 5);
    for d in ["a/b/c", "a/b/deep/deep/deep", "a/b", "a"] {
        fs::set_permissions(inst.join(d), fs::Permissions::from_mode(0o000)).unwrap();
    }
    let inst2 = inst.clone();
    std::thread::spawn(move || {
        use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
        let mut caps = capabilities(None).unwrap();
        caps.effective
            .remove(CapabilitySet::DAC_OVERRIDE | CapabilitySet::DAC_READ_SEARCH);
        set_capabilities(None, caps).unwrap();
        assert!(
            fs::read_dir(inst2.join("a")).is_err(),
            "mode 000 must refuse this thread"
        );
        let opts = RemoveOptions {
            max_open_dirs: 3,
            ..RemoveOptions::default()
        };
        remove_tree_with(&inst2, &opts).unwrap();
    })
    .join()
    .unwrap();
    assert!(!inst.exists());
}

#[test]
fn the_walker_stops_at_its_depth_limit_with_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("tree");
    fs::create_dir(&tree).unwrap();
    chain(&tree, "d", MAX_WALK_DEPTH + 1);
    match tree_digest(&tree, &[]) {
        Err(DigestError::TooDeep { path, max }) => {
            assert_eq!(max, MAX_WALK_DEPTH);
            assert_eq!(
                path.strip_prefix(&tree).unwrap().components().count(),
                MAX_WALK_DEPTH + 1
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        metadata_fingerprint(&tree, 1 << 20),
        Err(DigestError::TooDeep { .. })
    ));

    // Capture of a 30 000-deep chain fails cleanly (its paths could never be restored).
    let upper = dir.path().join("upper");
    fs::create_dir(&upper).unwrap();
    chain(&upper, "d", 30_000);
    let store = BlobStore::open(&dir.path().join("blobs")).unwrap();
    let t = Instant::now();
    match capture_layer(&upper, None, &store, &LayerCaptureOptions::default()) {
        Err(CaptureError::PathTooLong { .. } | CaptureError::TooDeep { .. }) => {}
        other => panic!("{other:?}"),
    }
    eprintln!("capture of a 30000-deep chain refused in {:?}", t.elapsed());
    remove_tree(&upper).unwrap();
    remove_tree(&tree).unwrap();

    // A directory with more names than the capture may hold is refused while listed.
    let wide = dir.path().join("wide");
    fs::create_dir(&wide).unwrap();
    for i in 0..300 {
        fs::File::create(wide.join(format!("f{i}"))).unwrap();
    }
    let opts = LayerCaptureOptions {
        limits: InstallLimits {
            max_entries: 100,
            ..InstallLimits::default()
        },
        ..LayerCaptureOptions::default()
    };
    match capture_layer(&wide, None, &store, &opts) {
        Err(CaptureError::TooManyEntries { max, .. }) => assert_eq!(max, 100),
        other => panic!("{other:?}"),
    };
}
