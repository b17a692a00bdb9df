//! Hostile OCI images through `ImportOci` (hand-written layouts, the client opening the blobs):
//! escaping members, writes through planted symlinks, device nodes, tampered, truncated and
//! missing blobs, a wrong config digest → typed errors, nothing written outside the layer store,
//! nothing half-imported visible; a 10^5-entry layer imports without wedging the daemon; a
//! docker archive (`skopeo copy … docker-archive:`) imports and runs.

use std::fs;
use std::path::Path;

use belayer_ipc::oci_source::SourceSpec;
use belayer_ipc::{ErrorCode, Request, Response};
use belayer_tests::oci_build::{layer_tar, raw_layout, run, Member, OciBuilder, Tamper};
use belayer_tests::{busybox_rootfs, Daemon};

/// A layer with a shell, so a layout that passes every check is a usable image.
fn base_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", busybox_rootfs()).unwrap();
    b.into_inner().unwrap()
}

fn import(d: &Daemon, name: &str, layout: &Path, tag: &str) -> Response {
    let source = SourceSpec::Oci(layout.to_path_buf(), Some(tag.to_string()))
        .open()
        .expect("open the layout");
    d.client().import_oci(name, &source).expect("call")
}

fn hidden_entries(d: &Daemon) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["layers", "images"] {
        for e in fs::read_dir(d.state_dir.join(dir)).unwrap().flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with('.') {
                out.push(format!("{dir}/{n}"));
            }
        }
    }
    out
}

#[test]
fn hostile_layouts_are_refused_with_nothing_left_behind() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let canary = work.path().join("canary");
    fs::create_dir(&canary).unwrap();
    fs::write(canary.join("keep"), "untouched").unwrap();
    let canary_s = canary.display().to_string();
    let d = Daemon::start();
    let base = base_layer();
    let cases: Vec<(&str, Vec<Vec<u8>>, Tamper)> = vec![
        (
            "dotdot",
            vec![
                base.clone(),
                layer_tar(&[Member::RawName(b"../../escaped", b"x")]),
            ],
            Tamper::None,
        ),
        (
            "absolute",
            vec![
                base.clone(),
                layer_tar(&[Member::RawName(b"/tmp/abs-escaped", b"x")]),
            ],
            Tamper::None,
        ),
        (
            "symlink-write-through",
            vec![
                base.clone(),
                layer_tar(&[
                    Member::Symlink("planted", &canary_s),
                    Member::File("planted/pwned", b"pwned"),
                ]),
            ],
            Tamper::None,
        ),
        (
            "symlink-hardlink",
            vec![
                base.clone(),
                layer_tar(&[
                    Member::Symlink("link", &canary_s),
                    Member::Hardlink("stolen", "link/keep"),
                ]),
            ],
            Tamper::None,
        ),
        (
            "device",
            vec![base.clone(), layer_tar(&[Member::CharDevice("mem", 1, 1)])],
            Tamper::None,
        ),
        (
            "whiteout-device-given",
            vec![base.clone(), layer_tar(&[Member::CharDevice("wo", 0, 0)])],
            Tamper::None,
        ),
        (
            "flipped",
            vec![
                base.clone(),
                layer_tar(&[Member::File("f", &[7u8; 100_000])]),
            ],
            Tamper::FlipLayerByte,
        ),
        (
            "truncated",
            vec![
                base.clone(),
                layer_tar(&[Member::File("f", &[9u8; 100_000])]),
            ],
            Tamper::TruncateLayer,
        ),
    ];
    for (name, layers, tamper) in cases {
        let layout = work.path().join(name);
        raw_layout(&layout, "t", &layers, tamper);
        match import(&d, name, &layout, "t") {
            Response::Error(e) => {
                assert_eq!(e.code, ErrorCode::CorruptImage, "{name}: {}", e.message);
                assert!(e.message.contains(name), "{name}: {}", e.message);
            }
            r => panic!("{name}: imported {r:?}"),
        }
        match d.call(Request::ListImages) {
            Response::Images(v) => assert!(v.iter().all(|i| i.name != name), "{name} listed"),
            r => panic!("{r:?}"),
        }
        assert!(
            hidden_entries(&d).is_empty(),
            "{name}: {:?}",
            hidden_entries(&d)
        );
        assert_eq!(
            fs::read_to_string(canary.join("keep")).unwrap(),
            "untouched"
        );
        assert_eq!(
            fs::read_dir(&canary).unwrap().count(),
            1,
            "{name} wrote into the canary"
        );
        assert!(!Path::new("/tmp/abs-escaped").exists());
        assert!(!work.path().join("escaped").exists() && !Path::new("/var/escaped").exists());
    }
    // A manifest naming a blob that is not there: the client cannot open it.
    let layout = work.path().join("missing");
    raw_layout(
        &layout,
        "t",
        &[base.clone(), layer_tar(&[Member::File("f", b"x")])],
        Tamper::MissingLayer,
    );
    let err = SourceSpec::Oci(layout.clone(), Some("t".into()))
        .open()
        .unwrap_err();
    assert!(err.to_string().contains("missing"), "{err}");
    // A config that is not the one the manifest names (the client sends other bytes).
    let layout = work.path().join("config-swap");
    raw_layout(&layout, "t", std::slice::from_ref(&base), Tamper::None);
    let mut source = SourceSpec::Oci(layout.clone(), Some("t".into()))
        .open()
        .unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(&source.config).unwrap();
    cfg["config"]["User"] = serde_json::json!("0:0");
    source.config = serde_json::to_vec(&cfg).unwrap();
    match d.client().import_oci("config-swap", &source).unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::CorruptImage, "{}", e.message),
        r => panic!("imported {r:?}"),
    }
    // Descriptors that do not match the blob list.
    let mut source = SourceSpec::Oci(layout.clone(), Some("t".into()))
        .open()
        .unwrap();
    source.layers[0].fd = 5;
    match d.client().import_oci("bad-fds", &source).unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::BadRequest, "{}", e.message),
        r => panic!("imported {r:?}"),
    }
    assert!(hidden_entries(&d).is_empty(), "{:?}", hidden_entries(&d));
    // The good base alone imports and runs, sharing nothing broken.
    let layout = work.path().join("good");
    raw_layout(&layout, "t", std::slice::from_ref(&base), Tamper::None);
    assert!(matches!(
        import(&d, "good", &layout, "t"),
        Response::Image(_)
    ));
    let sb = d.create("good");
    assert_eq!(d.sh(&sb.id, "echo ok"), "ok");
    d.assert_alive("after the hostile images");
}

#[test]
fn a_layer_of_100_000_entries_imports_and_the_daemon_stays_responsive() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let d = Daemon::start();
    let names: Vec<String> = (0..100_000)
        .map(|i| format!("many/d{}/f{i}", i % 100))
        .collect();
    let mut members = vec![Member::Dir("many")];
    let dirs: Vec<String> = (0..100).map(|i| format!("many/d{i}")).collect();
    members.extend(dirs.iter().map(|d| Member::Dir(d)));
    members.extend(names.iter().map(|n| Member::File(n, b"")));
    let layout = work.path().join("many");
    raw_layout(
        &layout,
        "t",
        &[base_layer(), layer_tar(&members)],
        Tamper::None,
    );
    let started = std::time::Instant::now();
    let sock = d.socket.clone();
    let pinger = std::thread::spawn(move || {
        let mut worst = std::time::Duration::ZERO;
        for _ in 0..20 {
            let t = std::time::Instant::now();
            let mut c = belayer_ipc::Client::connect(&sock).unwrap();
            assert!(matches!(
                c.call(Request::Ping).unwrap(),
                Response::Pong { .. }
            ));
            worst = worst.max(t.elapsed());
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        worst
    });
    match import(&d, "many", &layout, "t") {
        Response::Image(i) => assert_eq!(i.layers[1].entries, 100_101),
        r => panic!("{r:?}"),
    }
    let worst = pinger.join().unwrap();
    println!(
        "10^5-entry layer imported in {:?}; slowest ping meanwhile {worst:?}",
        started.elapsed()
    );
    assert!(
        worst < std::time::Duration::from_secs(1),
        "ping took {worst:?}"
    );
    let sb = d.create("many");
    assert_eq!(d.sh(&sb.id, "ls /many/d7 | wc -l"), "1000");
}

#[test]
fn a_docker_archive_imports_and_runs() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let mut b = OciBuilder::new(
        &work.path().join("layout"),
        "t",
        &work.path().join("scratch"),
    );
    b.busybox_layer();
    b.layer(|root| fs::write(root.join("hello"), "from the archive\n").unwrap());
    b.config(&["--config.env=ARCHIVED=yes", "--config.workingdir=/"]);
    let archive = work.path().join("img.tar");
    run(std::process::Command::new("skopeo")
        .args(["copy", "--quiet"])
        .arg(format!("oci:{}", b.image()))
        .arg(format!("docker-archive:{}:swe/arch:1", archive.display())));
    let d = Daemon::start();
    let out = belayer_tests::cli::belayer_json(
        &d,
        &[
            "image",
            "import",
            "arch",
            &format!("docker-archive:{}", archive.display()),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(info["kind"], "oci");
    assert_eq!(info["layers"].as_array().unwrap().len(), 2);
    let sb = d.create("arch");
    assert_eq!(
        d.sh(&sb.id, "cat /hello; echo $ARCHIVED"),
        "from the archive\nyes"
    );
    // The same image as a layout shares both layers.
    let out = belayer_tests::cli::belayer_json(
        &d,
        &["image", "import", "lay", &format!("oci:{}", b.image())],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ls = belayer_tests::cli::belayer_json(&d, &["image", "ls"]);
    let v: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    let lay = v
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["name"] == "lay")
        .unwrap();
    assert!(
        lay["layers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["images"] == 2),
        "{lay}"
    );
}
