//! Image imports with the client's own rights: a member of the socket group (an unprivileged
//! uid) imports only what it can read itself, and images carry no device nodes (those under
//! the source's top-level `/dev` are dropped). The daemon runs with `--socket-gid`; the peer
//! is this test binary or the `belayer` CLI, re-executed in a forked child that drops to
//! uid/gid 65534 with the socket group as a supplementary group before it execs.

use std::os::fd::AsFd;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use belayer_ipc::{ErrorCode, Request, Response};
use belayer_tests::peer::{error_of, response, run_as, Op, Outcome};
use belayer_tests::{bin, busybox_rootfs, python_rootfs, Daemon, Identity};

const NOBODY: u32 = 65534;
/// Group allowed on the daemon socket.
const SOCKET_GID: u32 = 4271;
/// Group that can read the `grouped/etc` fixture.
const READ_GID: u32 = 4272;

fn peer(groups: &[u32]) -> Identity {
    Identity::nobody(groups)
}

/// The peer's entry point (see `belayer_tests::peer`).
#[test]
fn peer_child() {
    belayer_tests::peer::child_main();
}

fn path_import(name: &str, path: &Path) -> Op {
    Op::Call(Request::ImportImage {
        name: name.into(),
        source: path.display().to_string(),
        with_fd: false,
    })
}

fn fd_import(name: &str, path: &Path) -> Op {
    Op::ImportFd {
        name: name.into(),
        path: path.to_path_buf(),
    }
}

/// A world-readable copy of the busybox image (its `/root` is 0700 in the cache) at
/// `dir/name`.
fn readable_busybox(dir: &Path, name: &str) -> PathBuf {
    let dst = dir.join(name);
    let status = Command::new("cp")
        .arg("-a")
        .arg(busybox_rootfs())
        .arg(&dst)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::set_permissions(dst.join("root"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o755)).unwrap();
    dst
}

fn fixtures() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("belayer-peer-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn mknod(path: &Path, block: bool, major: u32, minor: u32) {
    let kind = if block {
        nix::sys::stat::SFlag::S_IFBLK
    } else {
        nix::sys::stat::SFlag::S_IFCHR
    };
    nix::sys::stat::mknod(
        path,
        kind,
        nix::sys::stat::Mode::from_bits_truncate(0o666),
        nix::sys::stat::makedev(major.into(), minor.into()),
    )
    .unwrap();
}

/// Every file below `dir` whose content contains `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let out = Command::new("grep")
        .args(["-rlsF", "--"])
        .arg(String::from_utf8_lossy(needle).as_ref())
        .arg(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .collect()
}

fn image_names(d: &Daemon) -> Vec<String> {
    match d.call(Request::ListImages) {
        Response::Images(v) => v.into_iter().map(|i| i.name).collect(),
        r => panic!("{r:?}"),
    }
}

fn no_import_leftovers(d: &Daemon) {
    let leftovers: Vec<_> = std::fs::read_dir(d.state_dir.join("images"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn a_group_member_imports_only_what_it_can_read() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    d.image("busybox", &busybox_rootfs());
    let fx = fixtures();
    let canary = b"CANARY-root-only-7f3a";

    // Root-only directory and archive.
    let secret_dir = readable_busybox(fx.path(), "secret-dir");
    std::fs::write(secret_dir.join("canary"), canary).unwrap();
    std::fs::set_permissions(&secret_dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let secret_tar = fx.path().join("secret.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&secret_dir)
        .arg("-cf")
        .arg(&secret_tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::set_permissions(&secret_tar, std::fs::Permissions::from_mode(0o600)).unwrap();

    // Readable, but with a root-only file inside.
    let mixed = readable_busybox(fx.path(), "mixed");
    std::fs::write(mixed.join("root/secret"), canary).unwrap();
    std::fs::set_permissions(
        mixed.join("root/secret"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();

    // Readable only through a supplementary group.
    let grouped = readable_busybox(fx.path(), "grouped");
    std::os::unix::fs::chown(grouped.join("etc"), Some(0), Some(READ_GID)).unwrap();
    std::fs::set_permissions(grouped.join("etc"), std::fs::Permissions::from_mode(0o750)).unwrap();

    // Another sandbox's root, through /proc.
    let root_sb = d.create("busybox");
    d.sh(
        &root_sb.id,
        &format!("printf {} > /root/sandbox-canary", "SANDBOX-CANARY-91c2"),
    );
    let proc_root = PathBuf::from(format!("/proc/{}/root", root_sb.init_pid.unwrap()));

    let member = peer(&[SOCKET_GID, READ_GID]);
    let results = run_as(
        &d,
        &member,
        &[
            fd_import("secret-dir", &secret_dir),
            path_import("secret-dir", &secret_dir),
            fd_import("secret-tar", &secret_tar),
            path_import("secret-tar", &secret_tar),
            fd_import("mixed", &mixed),
            fd_import("grouped", &grouped),
            fd_import("other-sandbox", &proc_root),
            path_import("other-sandbox", &proc_root),
            path_import("root", Path::new("/")),
        ],
    );
    for (i, what) in [(0, "secret-dir"), (2, "secret.tar"), (6, "root")] {
        match &results[i] {
            Outcome::ClientError(e) => assert!(
                e.contains("cannot open image source") && e.contains("Permission denied"),
                "{what}: {e}"
            ),
            other => panic!("{what}: the peer must not even open it: {other:?}"),
        }
    }
    for i in [1, 3, 7, 8] {
        let (code, message) = error_of(&results[i]);
        assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
        assert!(message.contains("root only"), "{message}");
    }
    let (code, message) = error_of(&results[4]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    assert!(
        message.contains("as uid 65534") && message.contains("root/secret"),
        "the error names the unreadable entry: {message}"
    );
    match response(&results[5]) {
        Response::Image(info) => {
            assert_eq!((info.name.as_str(), info.owner_uid), ("grouped", NOBODY));
        }
        other => panic!("a tree readable through a supplementary group imports: {other:?}"),
    }

    // Without that group the daemon's reader is refused inside the tree, not the peer's open.
    let results = run_as(&d, &peer(&[SOCKET_GID]), &[fd_import("grouped2", &grouped)]);
    let (code, message) = error_of(&results[0]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    assert!(message.contains("etc"), "{message}");

    let mut names = image_names(&d);
    names.sort();
    assert_eq!(names, ["busybox", "grouped"]);
    no_import_leftovers(&d);
    let images = d.state_dir.join("images");
    assert!(files_containing(&images, canary).is_empty());
    assert!(files_containing(&images, b"SANDBOX-CANARY-91c2").is_empty());
    // The daemon keeps serving, root's sandbox untouched.
    assert_eq!(
        d.sh(&root_sb.id, "cat /root/sandbox-canary"),
        "SANDBOX-CANARY-91c2"
    );
}

/// A copy of the busybox image with extra entries made by `extra`.
fn busybox_with(fx: &Path, name: &str, extra: impl FnOnce(&Path)) -> PathBuf {
    let dir = readable_busybox(fx, name);
    extra(&dir);
    dir
}

#[test]
fn device_nodes_are_refused_in_images_except_under_dev() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    let fx = fixtures();

    // Refused early in a stream with megabytes still to come: the refusal is the answer (not
    // the broken pipe of the walk behind it), for root and for a group member alike.
    let early = busybox_with(fx.path(), "early", |p| {
        std::fs::create_dir(p.join("aaa")).unwrap();
        mknod(&p.join("aaa/sda"), true, 8, 0);
        std::fs::create_dir(p.join("zzz")).unwrap();
        std::fs::write(p.join("zzz/big"), vec![1u8; 8 << 20]).unwrap();
    });
    let member_results = run_as(&d, &peer(&[SOCKET_GID]), &[fd_import("early", &early)]);
    let root_result = d.call(Request::ImportImage {
        name: "early".into(),
        source: early.display().to_string(),
        with_fd: false,
    });
    for (who, (code, message)) in [
        ("member", error_of(&member_results[0])),
        ("root", error_of(&Outcome::Response(Box::new(root_result)))),
    ] {
        assert_eq!(code, ErrorCode::BadRequest, "{who}: {message}");
        assert!(message.contains("aaa/sda"), "{who}: {message}");
    }

    let with_disk = busybox_with(fx.path(), "disk", |p| {
        mknod(&p.join("root/sda"), true, 8, 0)
    });
    let import = |name: &str, p: &Path| {
        d.call(Request::ImportImage {
            name: name.into(),
            source: p.display().to_string(),
            with_fd: false,
        })
    };
    match import("disk", &with_disk) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
            assert!(
                e.message.contains("root/sda") && e.message.contains("block device 8:0"),
                "{}",
                e.message
            );
        }
        r => panic!("a block device in an image must be refused: {r:?}"),
    }
    // The same as an archive.
    let tar = fx.path().join("disk.tar");
    assert!(Command::new("tar")
        .arg("-C")
        .arg(&with_disk)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap()
        .success());
    match import("disk-tar", &tar) {
        Response::Error(e) => assert!(e.message.contains("root/sda"), "{}", e.message),
        r => panic!("{r:?}"),
    }

    let whiteout = busybox_with(fx.path(), "whiteout", |p| {
        mknod(&p.join("etc/gone"), false, 0, 0)
    });
    match import("whiteout", &whiteout) {
        Response::Error(e) => assert!(
            e.message.contains("etc/gone") && e.message.contains("whiteout"),
            "{}",
            e.message
        ),
        r => panic!("{r:?}"),
    }

    let with_dev = busybox_with(fx.path(), "devnodes", |p| {
        mknod(&p.join("dev/sda"), true, 8, 0);
        mknod(&p.join("dev/null"), false, 1, 3);
        std::fs::create_dir(p.join("dev/pts")).unwrap();
        symlink("/proc/self/fd", p.join("dev/fd")).unwrap();
        nix::unistd::mkfifo(
            &p.join("run/fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
    });
    match import("devnodes", &with_dev) {
        Response::Image(info) => assert_eq!(info.dropped_devices, 2, "{info:?}"),
        r => panic!("{r:?}\n{}", d.log_text()),
    }
    let rootfs = d.state_dir.join("images/devnodes/rootfs");
    assert!(std::fs::symlink_metadata(rootfs.join("dev/sda")).is_err());
    assert!(rootfs.join("dev/pts").is_dir());
    let sb = d.create("devnodes");
    assert_ne!(d.exec(&sb.id, "test -e /dev/sda").exit_code, 0);
    d.sh(&sb.id, "echo x > /dev/null && test -p /run/fifo");
    assert!(
        d.log_text()
            .contains("image imported without its /dev nodes"),
        "the drop is logged"
    );
    let names = image_names(&d);
    assert_eq!(names, ["devnodes"]);
    no_import_leftovers(&d);
}

#[test]
fn the_debootstrap_image_imports_with_its_dev_nodes_dropped() {
    let d = Daemon::start();
    let rootfs = python_rootfs();
    let out = Command::new("find")
        .arg(rootfs.join("dev"))
        .args(["(", "-type", "b", "-o", "-type", "c", ")"])
        .output()
        .unwrap();
    let nodes = String::from_utf8_lossy(&out.stdout).lines().count() as u64;
    // README usage: `belayer image import py <rootfs>` as root.
    let out = Command::new(bin("belayer"))
        .arg("--socket")
        .arg(&d.socket)
        .args(["--json", "image", "import", "py"])
        .arg(&rootfs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["dropped_devices"], nodes);
    assert_eq!(info["owner_uid"], 0);
    let sb = d.create("py");
    assert_eq!(d.sh(&sb.id, "python3 -c 'print(6*7)'"), "42");
    // The path form of root still works too.
    d.image("py2", &rootfs);
}

fn belayer_as(d: &Daemon, who: Option<&Identity>, args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(bin("belayer"));
    cmd.arg("--socket").arg(&d.socket).arg("--json").args(args);
    if let Some(who) = who {
        who.apply(&mut cmd);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn the_cli_imports_for_root_and_for_a_group_member() {
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    let fx = fixtures();
    let readable = readable_busybox(fx.path(), "readable");
    let secret = busybox_with(fx.path(), "secret", |p| {
        std::fs::write(p.join("etc/secret"), b"CANARY-cli-5e").unwrap();
        std::fs::set_permissions(p.join("etc/secret"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
    });
    let member = peer(&[SOCKET_GID]);

    let busybox = busybox_rootfs();
    let (code, _, err) = belayer_as(
        &d,
        None,
        &["image", "import", "bb", busybox.to_str().unwrap()],
    );
    assert_eq!(code, 0, "root: {err}");

    let (code, out, err) = belayer_as(
        &d,
        Some(&member),
        &["image", "import", "mine", readable.to_str().unwrap()],
    );
    assert_eq!(code, 0, "group member: {err}");
    let info: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(info["owner_uid"], NOBODY);

    // The cached busybox has a root-only /root: the member may not read it, nor may the image.
    let (code, _, err) = belayer_as(
        &d,
        Some(&member),
        &["image", "import", "x", busybox.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("root"), "{err}");
    let (code, _, err) = belayer_as(
        &d,
        Some(&member),
        &["image", "import", "y", secret.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("etc/secret"), "{err}");

    let (code, _, err) = belayer_as(&d, Some(&member), &["image", "rm", "bb"]);
    assert_eq!(code, 1, "{err}");
    let (code, out, err) = belayer_as(&d, Some(&member), &["sandbox", "create", "--image", "mine"]);
    assert_eq!(code, 0, "{err}");
    let created: serde_json::Value = serde_json::from_str(&out).unwrap();
    let own = created["id"].as_str().unwrap().to_string();
    let (code, out, err) = belayer_as(
        &d,
        Some(&member),
        &["exec", &own, "--", "cat /etc/hostname || hostname"],
    );
    assert_eq!(code, 0, "{err} {out}");
    let (code, _, _) = belayer_as(&d, Some(&member), &["image", "rm", "mine"]);
    assert_eq!(code, 1, "in use by its sandbox");
    let (code, _, err) = belayer_as(&d, Some(&member), &["sandbox", "rm", &own]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = belayer_as(&d, Some(&member), &["image", "rm", "mine"]);
    assert_eq!(code, 0, "its own image: {err}");
    let mut names = image_names(&d);
    names.sort();
    assert_eq!(names, ["bb"]);
    assert!(files_containing(&d.state_dir.join("images"), b"CANARY-cli-5e").is_empty());
}

#[test]
fn descriptors_only_ride_on_the_request_that_takes_one() {
    let d = Daemon::start();
    let file = tempfile::tempfile().unwrap();
    let mut c = d.client();
    for (request, fds) in [
        (Request::Ping, 1),
        (
            Request::ImportImage {
                name: "x".into(),
                source: "/".into(),
                with_fd: true,
            },
            0,
        ),
    ] {
        let fds: Vec<_> = (0..fds).map(|_| file.as_fd()).collect();
        match c.call_with_fds(request, &fds).unwrap() {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message);
                assert!(e.message.contains("descriptors"), "{}", e.message);
            }
            r => panic!("{r:?}"),
        }
    }
    assert!(image_names(&d).is_empty());
    assert!(matches!(
        c.call(Request::Ping).unwrap(),
        Response::Pong { .. }
    ));
}

#[test]
fn an_image_a_peer_imported_serves_only_that_peer() {
    // Image names are the importer's to choose: a peer's image must not stand in for one that
    // root or another peer expects under that name.
    let d = Daemon::start_with_socket_gid(SOCKET_GID);
    let fx = fixtures();
    let tree = readable_busybox(fx.path(), "own");
    std::fs::write(tree.join("marker"), "peer-made").unwrap();
    let create = |name: &str| {
        Op::Call(Request::CreateSandbox(belayer_ipc::SandboxSpec {
            image: name.into(),
            ..Default::default()
        }))
    };
    let results = run_as(
        &d,
        &peer(&[SOCKET_GID]),
        &[fd_import("python", &tree), create("python")],
    );
    match response(&results[0]) {
        Response::Image(info) => assert_eq!(info.owner_uid, NOBODY),
        other => panic!("{other:?}"),
    }
    let own = match response(&results[1]) {
        Response::Sandbox(s) => s,
        other => panic!("the importer uses its own image: {other:?}"),
    };
    assert_eq!(d.sh(&own.id, "cat /marker"), "peer-made");

    let other = Identity {
        uid: NOBODY - 1,
        gid: NOBODY - 1,
        groups: vec![SOCKET_GID],
    };
    let results = run_as(&d, &other, &[create("python")]);
    let (code, message) = error_of(&results[0]);
    assert_eq!(code, ErrorCode::PermissionDenied, "{message}");
    assert!(message.contains("imported by uid 65534"), "{message}");

    match d.call(Request::CreateSandbox(belayer_ipc::SandboxSpec {
        image: "python".into(),
        ..Default::default()
    })) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
            assert!(
                e.message.contains("only root's images are shared"),
                "{}",
                e.message
            );
        }
        other => panic!("root got a sandbox of a peer's image: {other:?}"),
    }
    // A restore checks again that the image under that name still serves the sandbox's
    // owner (here its metadata is rewritten to name another owner).
    let meta_path = d.state_dir.join("images/python/image.json");
    let meta = std::fs::read_to_string(&meta_path).unwrap();
    let mut forged: serde_json::Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(forged["owner_uid"], NOBODY, "{meta}");
    forged["owner_uid"] = serde_json::json!(NOBODY - 1);
    std::fs::write(&meta_path, serde_json::to_vec_pretty(&forged).unwrap()).unwrap();
    d.fail_stop(&own.id);
    match d.restore_raw(&own.id) {
        Response::Error(e) => {
            assert_eq!(e.code, ErrorCode::PermissionDenied, "{}", e.message);
            assert!(e.message.contains("belongs to uid 65533"), "{}", e.message);
        }
        other => panic!("restored onto another peer's image: {other:?}"),
    }
    std::fs::write(&meta_path, meta).unwrap();
    d.restore(&own.id);
    // Root's own images serve everyone.
    d.image("busybox", &busybox_rootfs());
    let results = run_as(&d, &other, &[create("busybox")]);
    assert!(matches!(response(&results[0]), Response::Sandbox(_)));
}
