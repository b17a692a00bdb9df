//! File transfer across a sandbox's life: a large tree round trip with content digests, the
//! checkpoint policy seeing an upload as a change (and a download as none), restored
//! sandboxes, sandboxes in the host's user namespace, and sandboxes that are not running.

use std::fs;
use std::path::Path;

use belayer_ipc::{DecisionReason, ErrorCode, MaybeCheckpointResult, SandboxSpec, UsernsMode};
use belayer_tests::policy::ask_unless_clean;
use belayer_tests::{busybox_rootfs, Daemon};
use belayer_transfer::host::{download_path, upload_path, HostError};

fn started() -> (Daemon, String) {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    (d, id)
}

/// blake3 of every regular file under `root`, by relative path.
fn digests(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let ty = e.file_type().unwrap();
            if ty.is_dir() {
                stack.push(e.path());
            } else if ty.is_file() {
                let rel = e.path().strip_prefix(root).unwrap().display().to_string();
                out.push((
                    rel,
                    blake3::hash(&fs::read(e.path()).unwrap())
                        .to_hex()
                        .to_string(),
                ));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn a_large_tree_round_trips_with_equal_digests() {
    let (d, id) = started();
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("data");
    // 64 MiB: 48 files of 1 MiB over 6 directories, one of 16 MiB, and small ones.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect()
    };
    for dir in 0..6 {
        let sub = src.join(format!("d{dir}/nested"));
        fs::create_dir_all(&sub).unwrap();
        for f in 0..8 {
            fs::write(sub.join(format!("f{f}.bin")), noise(1 << 20)).unwrap();
            fs::write(src.join(format!("d{dir}/small{f}")), noise(f * 37)).unwrap();
        }
    }
    fs::write(src.join("big.bin"), noise(16 << 20)).unwrap();
    let total: u64 = digests(&src).len() as u64;

    let up = upload_path(&mut c, &id, &src, "/root/data", None).unwrap();
    assert!(up.bytes >= 64 << 20, "{up:?}");
    let out = tempfile::tempdir().unwrap();
    let down = download_path(&mut c, &id, "/root/data", &out.path().join("data"), None).unwrap();
    assert_eq!(down.bytes, up.bytes);
    assert_eq!(digests(&out.path().join("data")), digests(&src));
    assert_eq!(total, 6 * 16 + 1);
    // Inside, the same bytes.
    let inside = d.sh(&id, "cat /root/data/big.bin | md5sum | cut -d' ' -f1");
    let outside = std::process::Command::new("md5sum")
        .arg(src.join("big.bin"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&outside.stdout).starts_with(&inside));
}

fn ask(d: &Daemon, id: &str, prefix: u64) -> MaybeCheckpointResult {
    ask_unless_clean(d, id, prefix, Vec::new())
}

#[test]
fn an_upload_is_a_change_for_the_policy_and_restored_sandboxes_transfer_too() {
    let (d, id) = started();
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    let f = host.path().join("tests.py");
    fs::write(&f, b"def test(): pass\n").unwrap();
    assert_eq!(ask(&d, &id, 1).decision.reason, DecisionReason::Clean);
    // A download reads only: still clean.
    download_path(
        &mut c,
        &id,
        "/etc/passwd",
        &host.path().join("passwd"),
        None,
    )
    .unwrap();
    assert_eq!(ask(&d, &id, 2).decision.reason, DecisionReason::Clean);
    // An upload changes the sandbox: the policy checkpoints.
    upload_path(&mut c, &id, &f, "/root/tests.py", None).unwrap();
    let r = ask(&d, &id, 3);
    assert!(r.checkpointed, "{r:?}");
    assert_eq!(ask(&d, &id, 4).decision.reason, DecisionReason::Clean);

    // Lost by a failure, restored with the checkpoint: the file is there, and transfers work
    // on the restored instance.
    d.fail_stop(&id);
    let (code, _) = match upload_path(&mut c, &id, &f, "/root/again.py", None) {
        Err(HostError::Daemon(r)) => (r.code, r.message),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        code,
        ErrorCode::InvalidState,
        "a failed sandbox refuses transfers"
    );
    assert_eq!(d.restore(&id).prefix, Some(3));
    assert_eq!(d.sh(&id, "cat /root/tests.py"), "def test(): pass");
    upload_path(&mut c, &id, &f, "/root/again.py", None).unwrap();
    download_path(
        &mut c,
        &id,
        "/root/again.py",
        &host.path().join("back.py"),
        None,
    )
    .unwrap();
    assert_eq!(
        fs::read(host.path().join("back.py")).unwrap(),
        fs::read(&f).unwrap()
    );
    assert!(
        ask(&d, &id, 5).checkpointed,
        "the upload after the restore counts"
    );
}

#[test]
fn sandboxes_in_the_host_user_namespace_transfer_as_root() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            userns: Some(UsernsMode::Host),
            ..Default::default()
        })
        .id;
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    fs::write(host.path().join("f"), b"host userns").unwrap();
    upload_path(&mut c, &id, &host.path().join("f"), "/root/f", None).unwrap();
    assert_eq!(
        d.sh(&id, "cat /root/f; stat -c ' %u' /root/f"),
        "host userns 0"
    );
    download_path(&mut c, &id, "/root/f", &host.path().join("g"), None).unwrap();
    assert_eq!(fs::read(host.path().join("g")).unwrap(), b"host userns");
}
