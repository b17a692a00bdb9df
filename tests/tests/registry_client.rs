//! The daemon's registry client against a real registry (`docker-registry`) holding real
//! images built with umoci and pushed with skopeo.

use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use belayer_daemon::images::registry::{Credentials, Registry, RegistryError, RegistryOptions};
use belayer_tests::oci::{
    self, sha256_digest, standard_test_image, write_index, write_raw_layout, OciImage, PushFormat,
    Tamper,
};
use belayer_tests::registry::{Fault, FaultProxy, FaultRule, TestRegistry};
use sha2::{Digest, Sha256};

/// Size of the standard image's large file here.
const LARGE: u64 = 64 << 20;

/// The standard image, built once for all tests (read-only afterwards).
fn standard() -> &'static OciImage {
    static IMAGE: OnceLock<(tempfile::TempDir, OciImage)> = OnceLock::new();
    let (_, image) = IMAGE.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("belayer-oci-standard-")
            .tempdir_in("/tmp")
            .expect("tempdir");
        let image = standard_test_image(&dir.path().join("layout"), "v1", LARGE);
        (dir, image)
    });
    image
}

fn opts() -> RegistryOptions {
    RegistryOptions {
        retries: 2,
        timeout: Duration::from_secs(10),
        ..RegistryOptions::default()
    }
}

fn connect(reference: &str, creds: Credentials) -> Registry {
    Registry::connect(reference, creds, &opts())
        .unwrap_or_else(|e| panic!("connect {reference}: {e:?}"))
}

fn sha256_of(mut r: impl Read) -> (String, u64) {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let got = r.read(&mut buf).expect("read blob stream");
        if got == 0 {
            break;
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    (format!("sha256:{hex}"), n)
}

fn layers_of(manifest: &[u8]) -> (String, Vec<(String, u64)>) {
    let m: serde_json::Value = serde_json::from_slice(manifest).expect("manifest json");
    let config = m["config"]["digest"].as_str().unwrap().to_string();
    let layers = m["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["digest"].as_str().unwrap().to_string(),
                l["size"].as_u64().unwrap(),
            )
        })
        .collect();
    (config, layers)
}

#[test]
fn pulls_manifest_config_and_layer_streams_of_the_standard_image() {
    let reg = TestRegistry::start();
    let image = standard();
    let pushed = image.push(&reg, "swe/task:v1", None);
    assert_eq!(pushed, image.manifest_digest());

    let mut r = connect(
        &format!("{}/swe/task:v1", reg.addr()),
        Credentials::Anonymous,
    );
    assert_eq!(r.reference(), format!("{}/swe/task:v1", reg.addr()));
    let (bytes, digest) = r.manifest().expect("manifest");
    assert_eq!(digest, pushed);
    assert_eq!(sha256_digest(&bytes), digest);
    assert_eq!(bytes, image.manifest_bytes());

    let (config_digest, layers) = layers_of(&bytes);
    assert_eq!(layers.len(), 6, "{layers:?}");
    let config = r.blob(&config_digest, 1 << 20).expect("config");
    assert_eq!(config, image.config_bytes());
    let config: serde_json::Value = serde_json::from_slice(&config).unwrap();
    assert_eq!(config["config"]["User"], "1000:1000");
    assert_eq!(config["config"]["WorkingDir"], "/data");
    assert_eq!(config["config"]["Cmd"][2], "echo ready");
    assert!(config["config"]["Env"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e == "BELAYER_IMAGE=standard"));

    for (digest, size) in &layers {
        let reader = r.blob_reader(digest, *size).expect("blob_reader");
        let (got, n) = sha256_of(reader);
        assert_eq!(&got, digest);
        assert_eq!(n, *size);
    }
    // The large layer really is large (incompressible): streamed, not buffered.
    assert!(layers.last().unwrap().1 > LARGE, "{layers:?}");

    // A reader dropped half-way stops cleanly and the next one starts afresh.
    let (big, big_size) = layers.last().unwrap().clone();
    let mut half = r.blob_reader(&big, big_size).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    half.read_exact(&mut buf).unwrap();
    drop(half);
    assert_eq!(sha256_of(r.blob_reader(&big, big_size).unwrap()).0, big);

    // Every whiteout kind is in the layers.
    let entries: Vec<String> = (0..layers.len())
        .flat_map(|i| image.layer_entries(i))
        .collect();
    assert!(
        entries.iter().any(|e| e.ends_with("/.wh.gone.txt")),
        "{entries:?}"
    );
    assert!(
        entries.iter().any(|e| e.ends_with("/.wh..wh..opq")),
        "{entries:?}"
    );
}

#[test]
fn pulls_by_digest_and_checks_the_digest() {
    let reg = TestRegistry::start();
    let image = standard();
    let pushed = image.push(&reg, "swe/task:v1", None);
    let by_digest = format!("{}/swe/task@{pushed}", reg.addr());
    let mut r = connect(&by_digest, Credentials::Anonymous);
    assert_eq!(r.reference(), by_digest);
    let (bytes, digest) = r.manifest().expect("manifest by digest");
    assert_eq!(digest, pushed);
    assert_eq!(bytes, image.manifest_bytes());

    // A digest the registry does not have.
    let other = format!("sha256:{}", "0".repeat(64));
    let mut r = connect(
        &format!("{}/swe/task@{other}", reg.addr()),
        Credentials::Anonymous,
    );
    let err = r.manifest().unwrap_err();
    assert!(matches!(err, RegistryError::NotFound { .. }), "{err:?}");
    assert!(err.to_string().contains(&other), "{err}");

    // The registry serves other bytes than the digest names: refused.
    let stored = reg.blob_path(&pushed);
    let mut tampered = std::fs::read(&stored).unwrap();
    tampered.push(b'\n');
    std::fs::write(&stored, &tampered).unwrap();
    let mut r = connect(&by_digest, Credentials::Anonymous);
    match r.manifest().unwrap_err() {
        RegistryError::DigestMismatch {
            expected, actual, ..
        } => {
            assert_eq!(expected, pushed);
            assert_eq!(actual, sha256_digest(&tampered));
        }
        e => panic!("expected DigestMismatch, got {e:?}"),
    }
}

#[test]
fn accepts_docker_schema2_manifests() {
    let reg = TestRegistry::start();
    let pushed = standard().push_as(&reg, "swe/docker:v1", None, PushFormat::DockerV2);
    let mut r = connect(
        &format!("{}/swe/docker:v1", reg.addr()),
        Credentials::Anonymous,
    );
    let (bytes, digest) = r.manifest().expect("docker manifest");
    assert_eq!(digest, pushed);
    let m: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        m["mediaType"],
        "application/vnd.docker.distribution.manifest.v2+json"
    );
    let (config, layers) = layers_of(&bytes);
    r.blob(&config, 1 << 20).expect("docker config");
    let (d, s) = &layers[1];
    assert_eq!(&sha256_of(r.blob_reader(d, *s).unwrap()).0, d);
}

#[test]
fn basic_auth_right_wrong_and_missing_credentials() {
    let reg = TestRegistry::start_with_basic_auth("puller", "s3cret");
    standard().push(&reg, "swe/private:v1", reg.basic_auth());
    let reference = format!("{}/swe/private:v1", reg.addr());

    let basic = |password: &str| Credentials::Basic {
        username: "puller".into(),
        password: password.into(),
    };
    let mut r = connect(&reference, basic("s3cret"));
    let (bytes, _) = r.manifest().expect("manifest with basic auth");
    let (config, _) = layers_of(&bytes);
    r.blob(&config, 1 << 20).expect("config with basic auth");

    for (creds, anonymous) in [(basic("wrong"), false), (Credentials::Anonymous, true)] {
        let err = Registry::connect(&reference, creds, &opts())
            .and_then(|mut r| r.manifest())
            .unwrap_err();
        match &err {
            RegistryError::Unauthorized {
                status,
                anonymous: a,
                ..
            } => {
                assert_eq!(*status, Some(401));
                assert_eq!(*a, anonymous);
            }
            e => panic!("expected Unauthorized, got {e:?}"),
        }
        assert!(err.to_string().contains(&reference), "{err}");
    }

    // A bearer token the registry does not accept.
    let err = Registry::connect(
        &reference,
        Credentials::Bearer {
            token: "nope".into(),
        },
        &opts(),
    )
    .and_then(|mut r| r.manifest())
    .unwrap_err();
    assert!(matches!(err, RegistryError::Unauthorized { .. }), "{err:?}");
}

#[test]
fn unknown_repository_tag_and_blob_are_not_found() {
    let reg = TestRegistry::start();
    standard().push(&reg, "swe/task:v1", None);
    for (reference, named) in [
        (format!("{}/swe/task:nope", reg.addr()), "nope"),
        (format!("{}/swe/absent:v1", reg.addr()), "swe/absent"),
    ] {
        let err = connect(&reference, Credentials::Anonymous)
            .manifest()
            .unwrap_err();
        assert!(matches!(err, RegistryError::NotFound { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(named) && text.contains(&reference), "{text}");
    }
    let mut r = connect(
        &format!("{}/swe/task:v1", reg.addr()),
        Credentials::Anonymous,
    );
    let missing = format!("sha256:{}", "1".repeat(64));
    for err in [
        r.blob(&missing, 100).unwrap_err(),
        r.blob_reader(&missing, 100).err().unwrap(),
    ] {
        match &err {
            RegistryError::NotFound { what, .. } => assert!(what.contains(&missing), "{what}"),
            e => panic!("expected NotFound, got {e:?}"),
        }
    }
}

#[test]
fn stopped_registry_is_unreachable_in_bounded_time() {
    let mut reg = TestRegistry::start();
    standard().push(&reg, "swe/task:v1", None);
    let reference = format!("{}/swe/task:v1", reg.addr());
    let mut r = connect(&reference, Credentials::Anonymous);
    reg.stop();
    let expected = format!("registry {} unreachable for {reference}", reg.addr());

    let start = Instant::now();
    let err = r.manifest().unwrap_err();
    assert!(matches!(err, RegistryError::Unreachable { .. }), "{err:?}");
    assert_eq!(err.to_string(), expected);
    let err = Registry::connect(&reference, Credentials::Anonymous, &opts()).unwrap_err();
    assert!(matches!(err, RegistryError::Unreachable { .. }), "{err:?}");
    assert_eq!(err.to_string(), expected);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn bad_references_digests_and_sizes_are_refused() {
    for bad in ["", "UPPER/Case", "a/b:c:d", "x@sha256:abc"] {
        let err = Registry::connect(bad, Credentials::Anonymous, &opts()).unwrap_err();
        assert!(
            matches!(err, RegistryError::BadReference { .. }),
            "{bad}: {err:?}"
        );
    }
    let reg = TestRegistry::start();
    let image = standard();
    image.push(&reg, "swe/task:v1", None);
    let mut r = connect(&format!("{}/swe/task", reg.addr()), Credentials::Anonymous);
    assert_eq!(r.reference(), format!("{}/swe/task:latest", reg.addr()));
    for bad in ["sha256:../../../v2/_catalog", "md5:00", "sha256:ABCDEF"] {
        let err = r.blob(bad, 10).unwrap_err();
        assert!(matches!(err, RegistryError::BadDigest { .. }), "{err:?}");
        let err = r.blob_reader(bad, 10).err().unwrap();
        assert!(matches!(err, RegistryError::BadDigest { .. }), "{err:?}");
    }
    let (config, layers) = layers_of(&image.manifest_bytes());
    let err = r.blob(&config, 10).unwrap_err();
    assert!(matches!(err, RegistryError::BlobSize { .. }), "{err:?}");
    let (d, s) = &layers[1];
    let err = r.blob_reader(d, s + 1).err().unwrap();
    assert!(matches!(err, RegistryError::BlobSize { .. }), "{err:?}");

    // A layer the registry serves truncated is refused at opening (its length) or at its
    // end (its bytes).
    let path = reg.blob_path(d);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    match r.blob_reader(d, *s) {
        Err(RegistryError::BlobSize { got, .. }) => assert_eq!(got, (bytes.len() / 2) as u64),
        Err(e) => panic!("expected BlobSize, got {e:?}"),
        Ok(mut reader) => {
            let mut out = Vec::new();
            let err = reader.read_to_end(&mut out).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        }
    }
}

/// A manifest whose config is not an image config (an OCI artifact) is not an image.
#[test]
fn refuses_a_manifest_that_is_not_an_image() {
    let reg = TestRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let layer = tar_with_file("hello", b"hi\n");
    let raw = write_raw_layout(
        &layout,
        "img",
        &[layer],
        &oci::minimal_config(&[]),
        Tamper::None,
    );
    // The same blobs under a manifest with a helm chart's config media type.
    let mut m: serde_json::Value = serde_json::from_slice(&raw.manifest).unwrap();
    m["config"]["mediaType"] = "application/vnd.cncf.helm.config.v1+json".into();
    let bytes = serde_json::to_vec(&m).unwrap();
    let digest = oci::put_blob(&layout, &bytes);
    oci::set_tag(
        &layout,
        "chart",
        serde_json::json!({"mediaType": oci::media::MANIFEST, "digest": digest, "size": bytes.len()}),
    );
    let keep = &["--preserve-digests"];
    let pushed = oci::skopeo_push(&layout, "img", &reg, "swe/raw:img", None, keep);
    assert_eq!(pushed, raw.manifest_digest);
    assert_eq!(
        oci::skopeo_push(&layout, "chart", &reg, "swe/raw:chart", None, keep),
        digest
    );

    let mut r = connect(
        &format!("{}/swe/raw:img", reg.addr()),
        Credentials::Anonymous,
    );
    assert_eq!(r.manifest().expect("raw image").1, raw.manifest_digest);
    let mut r = connect(
        &format!("{}/swe/raw:chart", reg.addr()),
        Credentials::Anonymous,
    );
    match r.manifest().unwrap_err() {
        RegistryError::BadManifest { reason, .. } => {
            assert!(reason.contains("not an image config"), "{reason}")
        }
        e => panic!("expected BadManifest, got {e:?}"),
    }
}

#[test]
fn multi_platform_index_resolves_to_linux_amd64() {
    let reg = TestRegistry::start();
    let dir = tempfile::tempdir().unwrap();
    let layout = dir.path().join("layout");
    let image = OciImage::from_rootfs(&layout, "amd", &belayer_tests::busybox_rootfs());
    image.tag_architecture("arm", "arm64");
    let amd = image.manifest_digest();
    let index = write_index(
        &layout,
        "multi",
        &[("arm", "linux", "arm64"), ("amd", "linux", "amd64")],
    );
    write_index(&layout, "armonly", &[("arm", "linux", "arm64")]);
    let all = &["--all", "--preserve-digests"];
    let pushed = oci::skopeo_push(&layout, "multi", &reg, "swe/multi:v1", None, all);
    assert_eq!(pushed, index);
    oci::skopeo_push(&layout, "armonly", &reg, "swe/multi:arm", None, all);

    for reference in [
        format!("{}/swe/multi:v1", reg.addr()),
        format!("{}/swe/multi@{index}", reg.addr()),
    ] {
        let mut r = connect(&reference, Credentials::Anonymous);
        let (bytes, digest) = r.manifest().expect("manifest via index");
        assert_eq!(digest, amd, "{reference}");
        assert_eq!(sha256_digest(&bytes), amd);
        assert_eq!(bytes, image.manifest_bytes());
    }
    let mut r = connect(
        &format!("{}/swe/multi:arm", reg.addr()),
        Credentials::Anonymous,
    );
    match r.manifest().unwrap_err() {
        RegistryError::BadManifest { reason, .. } => {
            assert!(reason.contains("no linux/amd64"), "{reason}")
        }
        e => panic!("expected BadManifest, got {e:?}"),
    }
}

fn proxy(reg: &TestRegistry, path_contains: &str, fault: Fault, times: usize) -> FaultProxy {
    FaultProxy::start(
        reg.addr(),
        FaultRule {
            path_contains: path_contains.to_string(),
            fault,
            times,
        },
    )
}

#[test]
fn server_errors_are_retried_with_backoff_then_reported() {
    let reg = TestRegistry::start();
    let pushed = standard().push(&reg, "swe/task:v1", None);

    // Two 503s, then the registry answers: the pull succeeds (retries = 2).
    let p = proxy(&reg, "/manifests/", Fault::Status(503), 2);
    let mut r = connect(&format!("{}/swe/task:v1", p.addr()), Credentials::Anonymous);
    assert_eq!(r.manifest().expect("manifest after 503s").1, pushed);
    assert_eq!(p.faults(), 2);

    // Always 502: one attempt and two retries, then the status.
    let p = proxy(&reg, "/manifests/", Fault::Status(502), usize::MAX);
    let mut r = connect(&format!("{}/swe/task:v1", p.addr()), Credentials::Anonymous);
    match r.manifest().unwrap_err() {
        RegistryError::Status { status, .. } => assert_eq!(status, 502),
        e => panic!("expected Status, got {e:?}"),
    }
    assert_eq!(p.faults(), 3);

    // Opening a blob stream is retried too.
    let (_, layers) = layers_of(&standard().manifest_bytes());
    let (d, s) = &layers[1];
    let p = proxy(&reg, "/blobs/", Fault::Status(500), 1);
    let mut r = connect(&format!("{}/swe/task:v1", p.addr()), Credentials::Anonymous);
    assert_eq!(&sha256_of(r.blob_reader(d, *s).unwrap()).0, d);
    assert_eq!(p.faults(), 1);
}

#[test]
fn refusals_and_misses_are_not_retried() {
    let reg = TestRegistry::start();
    standard().push(&reg, "swe/task:v1", None);
    for (status, unauthorized) in [(401, true), (403, true), (404, false)] {
        let p = proxy(&reg, "/manifests/", Fault::Status(status), usize::MAX);
        let mut r = connect(&format!("{}/swe/task:v1", p.addr()), Credentials::Anonymous);
        let err = r.manifest().unwrap_err();
        if unauthorized {
            assert!(
                matches!(err, RegistryError::Unauthorized { status: Some(s), .. } if s == status),
                "{err:?}"
            );
        } else {
            assert!(matches!(err, RegistryError::NotFound { .. }), "{err:?}");
        }
        assert_eq!(p.faults(), 1, "http {status} was retried");
    }
}

#[test]
fn a_stalled_registry_times_out_as_unreachable() {
    let reg = TestRegistry::start();
    standard().push(&reg, "swe/task:v1", None);
    let p = proxy(&reg, "/manifests/", Fault::Stall, usize::MAX);
    let reference = format!("{}/swe/task:v1", p.addr());
    let opts = RegistryOptions {
        retries: 1,
        timeout: Duration::from_secs(1),
        ..RegistryOptions::default()
    };
    let mut r = Registry::connect(&reference, Credentials::Anonymous, &opts).unwrap();
    let start = Instant::now();
    let err = r.manifest().unwrap_err();
    assert!(matches!(err, RegistryError::Unreachable { .. }), "{err:?}");
    assert!(err.to_string().contains(&reference), "{err}");
    assert_eq!(p.faults(), 2);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn a_cut_layer_stream_fails_as_io_error_and_a_new_reader_succeeds() {
    let reg = TestRegistry::start();
    standard().push(&reg, "swe/task:v1", None);
    let (_, layers) = layers_of(&standard().manifest_bytes());
    let (big, size) = layers.last().unwrap().clone();
    let p = proxy(&reg, "/blobs/", Fault::CutAfter(1 << 20), 1);
    let mut r = connect(&format!("{}/swe/task:v1", p.addr()), Credentials::Anonymous);
    let mut reader = r.blob_reader(&big, size).unwrap();
    let mut sink = Vec::new();
    let err = reader.read_to_end(&mut sink).unwrap_err();
    assert!(sink.len() < size as usize);
    let inner = err
        .get_ref()
        .and_then(|e| e.downcast_ref::<RegistryError>())
        .unwrap_or_else(|| panic!("no RegistryError inside {err:?}"));
    assert!(
        matches!(
            inner,
            RegistryError::Transport { .. } | RegistryError::BlobSize { .. }
        ),
        "{inner:?}"
    );
    // The failed reader stays failed; a new one streams the whole blob.
    assert!(reader.read(&mut [0u8; 16]).is_err());
    assert_eq!(sha256_of(r.blob_reader(&big, size).unwrap()).0, big);
}

#[test]
fn final_rootfs_is_the_merged_tree_of_the_standard_image() {
    use std::os::unix::fs::MetadataExt;
    let root = standard().final_rootfs();
    let data = root.join("data");
    let names = |d: &str| {
        let mut v: Vec<String> = std::fs::read_dir(data.join(d))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        std::fs::read_to_string(data.join("hello.txt")).unwrap(),
        "hello\n"
    );
    assert!(!data.join("gone.txt").exists() && !data.join("gonedir").exists());
    assert_eq!(names("replaced"), ["new.txt"]);
    assert_eq!(names("opaque"), ["fresh"]);
    assert_eq!(
        std::fs::read_link(data.join("abs")).unwrap(),
        Path::new("/data/hello.txt")
    );
    assert_eq!(
        std::fs::read_link(data.join("dirlink")).unwrap(),
        Path::new("sub/deep")
    );
    assert_eq!(
        std::fs::metadata(data.join("large.bin")).unwrap().len(),
        LARGE
    );
    assert_eq!(
        std::fs::metadata(root.join("home/user/owned"))
            .unwrap()
            .uid(),
        1000
    );
    assert!(root.join("bin/busybox").is_file());
}

/// The hand-written layouts are damaged exactly as asked (for the hostile import tests).
#[test]
fn raw_layouts_are_damaged_as_asked() {
    let layer = tar_with_file("f", b"data\n");
    let real = sha256_digest(&layer);
    for tamper in [
        Tamper::LayerDigest(0),
        Tamper::TruncatedLayer(0),
        Tamper::MissingLayer(0),
        Tamper::LayerSize(0),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let raw = write_raw_layout(dir.path(), "t", std::slice::from_ref(&layer), b"{}", tamper);
        let (digest, size) = &raw.layers[0];
        let blob = std::fs::read(dir.path().join("blobs/sha256").join(&digest[7..])).ok();
        match tamper {
            Tamper::LayerDigest(_) => assert!(*digest != real && blob.unwrap() == layer),
            Tamper::TruncatedLayer(_) => assert_eq!(blob.unwrap().len(), layer.len() / 2),
            Tamper::MissingLayer(_) => assert!(blob.is_none()),
            _ => assert_eq!(*size, layer.len() as u64 + 1),
        }
    }
}

fn tar_with_file(name: &str, data: &[u8]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    b.append_data(&mut h, name, data).unwrap();
    b.into_inner().unwrap()
}
