//! Overlay mount guards against the real kernel.

use std::fs;
use std::path::Path;

use belayer_overlay::{is_mountpoint, unmount, MountError, OverlayMount};

fn dirs(root: &Path, names: &[&str]) {
    for name in names {
        fs::create_dir_all(root.join(name)).unwrap();
    }
}

#[test]
fn mount_is_undone_on_drop_and_kept_when_leaked() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    dirs(r, &["lower", "upper", "work", "merged", "lower2"]);
    fs::write(r.join("lower/from_lower"), b"lower").unwrap();
    fs::write(r.join("lower2/from_lower2"), b"lower2").unwrap();
    fs::write(
        r.join("lower2/from_lower"),
        b"hidden by the upper lower layer",
    )
    .unwrap();

    let mount = OverlayMount::mount(
        &r.join("lower"),
        &r.join("upper"),
        &r.join("work"),
        &r.join("merged"),
    )
    .unwrap();
    assert_eq!(mount.target(), r.join("merged"));
    assert!(is_mountpoint(&r.join("merged")).unwrap());
    fs::write(r.join("merged/new"), b"upper").unwrap();
    assert_eq!(fs::read(r.join("upper/new")).unwrap(), b"upper");
    assert_eq!(fs::read(r.join("merged/from_lower")).unwrap(), b"lower");
    drop(mount);
    assert!(!is_mountpoint(&r.join("merged")).unwrap());
    assert!(!r.join("merged/new").exists());

    // Several lower layers, top-most first; a leaked mount stays until unmounted.
    let lowers = [r.join("lower"), r.join("lower2")];
    let lowers: Vec<&Path> = lowers.iter().map(|p| p.as_path()).collect();
    let mount = OverlayMount::mount_layers(
        &lowers,
        &r.join("upper"),
        &r.join("work"),
        &r.join("merged"),
    )
    .unwrap();
    assert_eq!(fs::read(r.join("merged/from_lower")).unwrap(), b"lower");
    assert_eq!(fs::read(r.join("merged/from_lower2")).unwrap(), b"lower2");
    let target = mount.leak();
    assert!(is_mountpoint(&target).unwrap());
    assert!(unmount(&target).unwrap());
    assert!(!unmount(&target).unwrap(), "nothing mounted any more");

    // Explicit unmount reports success.
    let mount = OverlayMount::mount(
        &r.join("lower"),
        &r.join("upper"),
        &r.join("work"),
        &r.join("merged"),
    )
    .unwrap();
    mount.unmount().unwrap();
    assert!(!is_mountpoint(&r.join("merged")).unwrap());
}

#[test]
fn mount_errors_carry_paths_step_and_errno() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    dirs(r, &["lower", "upper", "work", "merged"]);
    let err = OverlayMount::mount(
        &r.join("missing"),
        &r.join("upper"),
        &r.join("work"),
        &r.join("merged"),
    )
    .unwrap_err();
    let MountError::Mount(failure) = &err else {
        panic!("unexpected {err:?}");
    };
    assert_eq!(failure.lowers, [r.join("missing")]);
    assert_eq!(failure.upper, r.join("upper"));
    assert_eq!(
        failure.source.errno(),
        Some(rustix::io::Errno::NOENT.raw_os_error())
    );
    assert_eq!(failure.source.call, "fsconfig(lowerdir+)");
    let text = err.to_string();
    assert!(
        text.contains("missing") && text.contains("merged"),
        "{text}"
    );
    assert!(!is_mountpoint(&r.join("merged")).unwrap());

    // Work directory inside the upper directory: refused when the superblock is created.
    fs::create_dir(r.join("upper/work")).unwrap();
    let err = OverlayMount::mount(
        &r.join("lower"),
        &r.join("upper"),
        &r.join("upper/work"),
        &r.join("merged"),
    )
    .unwrap_err();
    let MountError::Mount(failure) = &err else {
        panic!("unexpected {err:?}");
    };
    assert_eq!(failure.source.call, "fsconfig(create)");
    assert_eq!(
        failure.source.errno(),
        Some(rustix::io::Errno::INVAL.raw_os_error())
    );

    assert!(matches!(
        OverlayMount::mount_layers(&[], &r.join("upper"), &r.join("work"), &r.join("merged")),
        Err(MountError::NoLowerLayer { .. })
    ));
    assert!(matches!(
        is_mountpoint(&r.join("nope")),
        Err(MountError::Resolve { .. })
    ));
}
