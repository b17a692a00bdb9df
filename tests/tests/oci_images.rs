//! OCI images end to end, against a real registry (Debian's `docker-registry` on loopback),
//! images built with `umoci` and pushed with `skopeo`: pull → create → exec → checkpoint →
//! kill → restore on a multi-layer image with whiteouts, an opaque directory, symlinks and a
//! large file; layers shared between images stored once; the image config applied; registry
//! failures named; a changed image refused at restore.

use std::fs;
use std::path::Path;

use belayer_ipc::{
    ErrorCode, ImageInfo, PullRequest, RegistryCredentials, Request, Response, SandboxSpec,
};
use belayer_tests::oci_build::{layer_tar, listing, run, Member, OciBuilder};
use belayer_tests::registry::TestRegistry;
use belayer_tests::{busybox_rootfs, Daemon};

/// Bytes of the large-file layer.
const BIG: usize = 24 << 20;

/// The standard multi-layer test image in a layout under `work`; returns the builder.
fn standard_image(work: &Path, tag: &str) -> OciBuilder {
    let mut b = OciBuilder::new(&work.join("layout"), tag, &work.join("scratch"));
    // 1: the busybox base, with an unprivileged user.
    b.layer(|root| {
        run(std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", busybox_rootfs().display()))
            .arg(root));
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(
            root.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
        )
        .unwrap();
        fs::write(root.join("etc/group"), "root:x:0:\napp:x:1000:\n").unwrap();
    });
    // 2: files, a tree, symlinks (relative, absolute, to a directory) and a hard link.
    b.layer(|root| {
        let d = root.join("data");
        fs::create_dir_all(d.join("dir-gone/sub")).unwrap();
        fs::create_dir_all(d.join("opq/inner")).unwrap();
        fs::write(d.join("keep.txt"), "keep v1\n").unwrap();
        fs::write(d.join("gone.txt"), "gone\n").unwrap();
        fs::write(d.join("dir-gone/sub/x"), "x\n").unwrap();
        fs::write(d.join("opq/old1"), "old1\n").unwrap();
        fs::write(d.join("opq/inner/old2"), "old2\n").unwrap();
        std::os::unix::fs::symlink("keep.txt", d.join("rel")).unwrap();
        std::os::unix::fs::symlink("/data/keep.txt", d.join("abs")).unwrap();
        std::os::unix::fs::symlink("/data/opq", d.join("dirlink")).unwrap();
        fs::hard_link(d.join("keep.txt"), d.join("hard")).unwrap();
        // The image's user owns its work dir.
        fs::create_dir_all(d.join("work")).unwrap();
        fs::write(d.join("work/old"), "old\n").unwrap();
        for p in [d.join("work"), d.join("work/old")] {
            std::os::unix::fs::chown(&p, Some(1000), Some(1000)).unwrap();
        }
    });
    // 3: deletions (whiteouts, written by umoci) and a changed file.
    b.layer(|root| {
        let d = root.join("data");
        fs::remove_file(d.join("gone.txt")).unwrap();
        fs::remove_dir_all(d.join("dir-gone")).unwrap();
        fs::write(d.join("keep.txt"), "keep v2\n").unwrap();
    });
    // 4: an opaque directory, given verbatim: `data/opq` keeps only its new file.
    b.raw_layer(&layer_tar(&[
        Member::Dir("data"),
        Member::Dir("data/opq"),
        Member::File("data/opq/.wh..wh..opq", b""),
        Member::File("data/opq/new", b"new\n"),
    ]));
    // 5: one large, incompressible file.
    b.layer(|root| {
        let mut big = vec![0u8; BIG];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for chunk in big.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        fs::write(root.join("data/big"), big).unwrap();
    });
    b.config(&[
        "--config.env=GREETING=hello from the image",
        "--config.env=OVERRIDE=image",
        "--config.workingdir=/data",
        "--config.user=app",
        "--config.cmd=/bin/sh",
    ]);
    b
}

fn pull(d: &Daemon, reference: &str, creds: RegistryCredentials) -> Response {
    d.call(Request::PullImage(PullRequest {
        reference: reference.to_string(),
        name: None,
        credentials: creds,
        insecure: false,
    }))
}

fn pulled(d: &Daemon, reference: &str) -> ImageInfo {
    match pull(d, reference, RegistryCredentials::Anonymous) {
        Response::Image(i) => i,
        r => panic!("pull {reference} failed: {r:?}\n{}", d.log_text()),
    }
}

fn error_of(r: Response) -> (ErrorCode, String) {
    match r {
        Response::Error(e) => (e.code, e.message),
        r => panic!("expected an error, got {r:?}"),
    }
}

/// Directory entries of the daemon's layer store that are not published layers.
fn leftovers(d: &Daemon) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["layers", "images"] {
        if let Ok(entries) = fs::read_dir(d.state_dir.join(dir)) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with('.') {
                    out.push(format!("{dir}/{n}"));
                }
            }
        }
    }
    out
}

#[test]
fn pulled_image_runs_checkpoints_and_restores_with_its_layers_and_config() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let registry = TestRegistry::start();
    let image = standard_image(work.path(), "v1");
    let reference = image.push(&registry, "swe/task-123:latest");
    let expected_root = image.unpack(&work.path().join("expected"));

    let d = Daemon::start();
    let info = pulled(&d, &reference);
    assert_eq!(info.name, reference);
    assert_eq!(info.kind, "oci");
    assert_eq!(info.layers.len(), 5, "{info:?}");
    assert!(info.digest.as_deref().unwrap().starts_with("sha256:"));
    let cfg = info.config.clone().unwrap();
    assert_eq!(cfg.user.as_deref(), Some("app"));
    assert_eq!(cfg.user_ids, Some((1000, 1000)));
    assert_eq!(cfg.workdir.as_deref(), Some("/data"));
    assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));

    let sb = d.create_spec(SandboxSpec {
        image: reference.clone(),
        env: vec![("OVERRIDE".into(), "spec".into())],
        ..Default::default()
    });
    assert_eq!(sb.user, Some((1000, 1000)));
    assert_eq!(sb.image_digest, info.digest);
    let id = sb.id.clone();
    // The config: user, working directory, environment (the spec's value wins).
    assert_eq!(d.sh(&id, "id -u; id -g; pwd"), "1000\n1000\n/data");
    assert_eq!(
        d.sh(&id, "echo \"$GREETING|$OVERRIDE\""),
        "hello from the image|spec"
    );
    // The layers: whiteouts, the opaque directory, symlinks, the changed and the large file.
    assert_eq!(
        d.sh(&id, "cat keep.txt rel abs hard dirlink/new"),
        "keep v2\nkeep v2\nkeep v2\nkeep v2\nnew"
    );
    let r = d.exec(&id, "ls gone.txt dir-gone opq/old1 opq/inner 2>&1");
    assert_ne!(r.exit_code, 0, "whited-out entries are visible");
    assert_eq!(d.sh(&id, "ls opq"), "new");
    assert_eq!(
        listing(&d.root(&id), &["data", "etc", "bin"]),
        listing(&expected_root, &["data", "etc", "bin"]),
        "the sandbox's tree is not the image's"
    );
    // Changes of the sandbox, a background process, then a checkpoint, a kill, a restore.
    d.sh(
        &id,
        "echo mine > /tmp/mine && rm work/old && echo w > work/f",
    );
    // The image's user is not root: the image's root-owned files are not its to remove.
    assert_ne!(d.exec(&id, "rm keep.txt").exit_code, 0);
    d.sh(&id, "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = listing(&d.root(&id), &["data", "etc", "bin", "tmp/mine"]);
    assert!(
        before.iter().any(|l| l.starts_with("f data/work/f ")),
        "{before:?}"
    );
    d.checkpoint(&id, 1, b"L_1 of the pulled image");
    d.fail_stop(&id);
    let restored = d.restore(&id);
    assert_eq!(restored.context, b"L_1 of the pulled image");
    let validity = restored.validity.expect("validity");
    assert!(
        validity.fs_matches && validity.processes_match,
        "{validity:?}"
    );
    assert_eq!(
        listing(&d.root(&id), &["data", "etc", "bin", "tmp/mine"]),
        before
    );
    let n1 = d.number(&id, "/tmp/count");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        d.number(&id, "/tmp/count") > n1,
        "the background loop did not come back"
    );
    assert_eq!(
        d.sh(
            &id,
            "id -u; cat /tmp/mine work/f; ls work/old 2>/dev/null || echo none"
        ),
        "1000\nmine\nw\nnone"
    );
}

#[test]
fn images_sharing_a_base_store_it_once_and_rm_drops_unused_layers() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let registry = TestRegistry::start();
    let a = standard_image(work.path(), "a");
    let ref_a = a.push(&registry, "swe/a:1");
    let mut b = OciBuilder::new(
        &work.path().join("layout"),
        "b",
        &work.path().join("scratch"),
    );
    // b: the same five layers (umoci repacks identical trees to identical layers? not
    // guaranteed), so copy a's tag and add one layer on top.
    run(std::process::Command::new("umoci").args(["tag", "--image", &a.image(), "b"]));
    b.layer(|root| fs::write(root.join("data/only-b"), "b\n").unwrap());
    let ref_b = b.push(&registry, "swe/b:1");

    let d = Daemon::start();
    let ia = pulled(&d, &ref_a);
    let ib = pulled(&d, &ref_b);
    assert_eq!(ib.layers.len(), ia.layers.len() + 1);
    let list = match d.call(Request::ListImages) {
        Response::Images(v) => v,
        r => panic!("{r:?}"),
    };
    let shared = list.iter().find(|i| i.name == ref_b).unwrap().layers[0].images;
    assert_eq!(shared, 2, "the base layer is not shared: {list:?}");
    let du = |p: &Path| -> u64 {
        let out = run(std::process::Command::new("du").args(["-sb"]).arg(p));
        out.split_whitespace().next().unwrap().parse().unwrap()
    };
    let stored = du(&d.state_dir.join("layers"));
    let logical = ia.bytes + ib.bytes;
    println!("two images: {logical} bytes of content, layer store {stored} bytes on disk");
    assert!(
        stored < ia.bytes + ib.bytes / 4,
        "layer store {stored} bytes for images of {} + {} bytes",
        ia.bytes,
        ib.bytes
    );
    // A sandbox on b, then rm of a keeps the shared layers; rm of b frees everything.
    let sb = d.create(&ref_b);
    assert_eq!(
        d.sh(&sb.id, "cat /data/only-b /data/keep.txt"),
        "b\nkeep v2"
    );
    let (code, _) = error_of(d.call(Request::RemoveImage {
        name: ref_b.clone(),
    }));
    assert_eq!(code, ErrorCode::InUse);
    assert!(matches!(
        d.call(Request::RemoveImage {
            name: ref_a.clone()
        }),
        Response::Done
    ));
    assert_eq!(d.sh(&sb.id, "cat /data/keep.txt"), "keep v2");
    d.call(Request::RemoveSandbox { id: sb.id.clone() });
    assert!(matches!(
        d.call(Request::RemoveImage { name: ref_b }),
        Response::Done
    ));
    let left: Vec<_> = fs::read_dir(d.state_dir.join("layers/sha256"))
        .unwrap()
        .collect();
    assert!(
        left.is_empty(),
        "layers left after removing every image: {left:?}"
    );
}

#[test]
fn registry_failures_name_the_reference() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let mut b = OciBuilder::new(
        &work.path().join("layout"),
        "t",
        &work.path().join("scratch"),
    );
    b.busybox_layer();
    let d = Daemon::start();

    // Basic auth: right, wrong, none.
    let secured = TestRegistry::start_with_basic_auth("alice", "s3cret");
    let reference = b.push(&secured, "private/img:1");
    let basic = |u: &str, p: &str| RegistryCredentials::Basic {
        username: u.into(),
        password: p.into(),
    };
    let (code, msg) = error_of(pull(&d, &reference, basic("alice", "wrong")));
    assert_eq!(code, ErrorCode::RegistryDenied, "{msg}");
    assert!(msg.contains(&reference), "{msg}");
    let (code, msg) = error_of(pull(&d, &reference, RegistryCredentials::Anonymous));
    assert_eq!(code, ErrorCode::RegistryDenied, "{msg}");
    assert!(matches!(
        pull(&d, &reference, basic("alice", "s3cret")),
        Response::Image(_)
    ));

    // Not found: an unknown tag, an unknown repository.
    let open = TestRegistry::start();
    let present = b.push(&open, "pub/img:1");
    for missing in [
        present.replace(":1", ":nope"),
        format!("{}/no/such:1", open.addr()),
    ] {
        let (code, msg) = error_of(pull(&d, &missing, RegistryCredentials::Anonymous));
        assert_eq!(code, ErrorCode::NotFound, "{msg}");
        assert!(msg.contains(&missing), "{msg}");
    }
    // A manifest naming a blob the registry lost.
    let info = pulled(&d, &present);
    let layer_blob = {
        let m = run(std::process::Command::new("skopeo")
            .args(["inspect", "--raw", "--tls-verify=false"])
            .arg(format!("docker://{present}")));
        let v: serde_json::Value = serde_json::from_str(&m).unwrap();
        v["layers"][0]["digest"].as_str().unwrap().to_string()
    };
    assert!(matches!(
        d.call(Request::RemoveImage { name: info.name }),
        Response::Done
    ));
    // Its layer is also the private image's, stored once: drop that one too, so the pull
    // must fetch the layer again.
    assert!(matches!(
        d.call(Request::RemoveImage {
            name: reference.clone()
        }),
        Response::Done
    ));
    fs::remove_file(open.blob_path(&layer_blob)).unwrap();
    let (code, msg) = error_of(pull(&d, &present, RegistryCredentials::Anonymous));
    assert!(
        matches!(
            code,
            ErrorCode::NotFound | ErrorCode::RegistryUnreachable | ErrorCode::CorruptImage
        ),
        "{code:?}: {msg}"
    );
    assert!(msg.contains(&present), "{msg}");
    // Down.
    let mut down = TestRegistry::start();
    let gone = b.push(&down, "x/y:1");
    down.stop();
    let started = std::time::Instant::now();
    let (code, msg) = error_of(pull(&d, &gone, RegistryCredentials::Anonymous));
    assert_eq!(code, ErrorCode::RegistryUnreachable, "{msg}");
    assert!(msg.contains(&gone), "{msg}");
    assert!(
        started.elapsed().as_secs() < 60,
        "took {:?}",
        started.elapsed()
    );
    assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
    d.assert_alive("after the registry failures");
}

#[test]
fn a_restore_refuses_an_image_whose_digest_changed() {
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let registry = TestRegistry::start();
    let mut one = OciBuilder::new(&work.path().join("l1"), "t", &work.path().join("s1"));
    one.busybox_layer();
    let r1 = one.push(&registry, "img/one:1");
    one.layer(|root| fs::write(root.join("other"), "other\n").unwrap());
    let r2 = one.push(&registry, "img/two:1");

    let mut d = Daemon::start();
    let i1 = pulled(&d, &r1);
    let i2 = pulled(&d, &r2);
    let sb = d.create(&r1);
    d.sh(&sb.id, "echo state > /tmp/f");
    d.checkpoint(&sb.id, 1, b"L_1");
    d.fail_stop(&sb.id);
    // While the daemon is down, the name comes to stand for another image.
    d.kill();
    let dir_of = |name: &str| {
        let h = blake3::hash(name.as_bytes()).to_hex();
        d.state_dir.join("images").join(format!("ref-{}", &h[..32]))
    };
    let (d1, d2) = (dir_of(&r1), dir_of(&r2));
    let mut meta: serde_json::Value =
        serde_json::from_slice(&fs::read(d2.join("image.json")).unwrap()).unwrap();
    meta["name"] = serde_json::json!(r1);
    let kept = d.state_dir.join("kept-image");
    fs::rename(&d1, &kept).unwrap();
    fs::create_dir(&d1).unwrap();
    fs::write(d1.join("image.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
    d.restart();
    let (code, msg) = error_of(d.restore_raw(&sb.id));
    assert_eq!(code, ErrorCode::ImageChanged, "{msg}");
    assert!(
        msg.contains(i1.digest.as_deref().unwrap()) && msg.contains(i2.digest.as_deref().unwrap()),
        "{msg}"
    );
    // The original image back under its name: the restore goes through.
    d.kill();
    fs::remove_dir_all(&d1).unwrap();
    fs::rename(&kept, &d1).unwrap();
    d.restart();
    let restored = d.restore(&sb.id);
    assert_eq!(restored.context, b"L_1");
}

#[test]
fn the_cli_pulls_with_an_auth_file_lists_layers_and_removes() {
    use base64::Engine as _;
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let mut b = OciBuilder::new(
        &work.path().join("layout"),
        "t",
        &work.path().join("scratch"),
    );
    b.busybox_layer();
    let registry = TestRegistry::start_with_basic_auth("bob", "pw-1");
    let reference = b.push(&registry, "cli/img:1");
    let d = Daemon::start();
    let authfile = work.path().join("config.json");
    let auth = base64::engine::general_purpose::STANDARD.encode("bob:pw-1");
    fs::write(
        &authfile,
        serde_json::to_vec(&serde_json::json!({"auths": {registry.addr(): {"auth": auth}}}))
            .unwrap(),
    )
    .unwrap();
    let cli = |args: &[&str]| belayer_tests::cli::belayer_json(&d, args);
    let out = cli(&["image", "pull", &reference, "--name", "mine"]);
    assert!(!out.status.success());
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["error"], "RegistryDenied", "{err}");
    let out = cli(&[
        "image",
        "pull",
        &reference,
        "--name",
        "mine",
        "--authfile",
        authfile.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ls: serde_json::Value = serde_json::from_slice(&cli(&["image", "ls"]).stdout).unwrap();
    let mine = &ls.as_array().unwrap()[0];
    assert_eq!(mine["name"], "mine");
    assert_eq!(mine["source"], reference.as_str());
    assert!(
        mine["layers"][0]["bytes"].as_u64().unwrap() > 1_000_000,
        "{mine}"
    );
    let out = cli(&["image", "rm", "mine"]);
    assert!(out.status.success());
    assert_eq!(
        fs::read_dir(d.state_dir.join("layers/sha256"))
            .unwrap()
            .count(),
        0
    );
}
