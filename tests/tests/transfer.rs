//! File transfer (`Upload`, `Download`) against a real daemon and sandbox: round trips of files
//! and directories, `docker cp` destination rules, and hostile content on both sides (symlinks
//! at host paths as destinations and members, `..` and absolute members, hard links and
//! devices, a full disk, a helper the sandbox stops or kills) that never touches a canary on
//! the host.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use belayer_ipc::{
    Client, ClientError, DownloadRequest, ErrorCode, Request, Response, SandboxSpec, UploadRequest,
};
use belayer_tests::{busybox_rootfs, Daemon};
use belayer_transfer::host::{download_path, upload_archive, upload_path, HostError};

fn started() -> (Daemon, String) {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d.create("busybox").id;
    (d, id)
}

/// A host directory holding one canary file; [`Canary::check`] proves nothing touched it.
struct Canary {
    dir: tempfile::TempDir,
}

impl Canary {
    fn new() -> Canary {
        let dir = tempfile::Builder::new()
            .prefix("belayer-canary-")
            .tempdir_in("/tmp")
            .unwrap();
        fs::write(dir.path().join("canary"), b"untouched").unwrap();
        Canary { dir }
    }

    fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("canary")
    }

    fn check(&self) {
        let names: Vec<_> = fs::read_dir(self.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["canary"], "something appeared next to the canary");
        let meta = fs::symlink_metadata(self.file()).unwrap();
        assert!(meta.is_file() && meta.nlink() == 1);
        assert_eq!(fs::read(self.file()).unwrap(), b"untouched");
    }
}

fn daemon_error(r: Result<belayer_ipc::TransferInfo, HostError>) -> (ErrorCode, String) {
    match r {
        Err(HostError::Daemon(reply)) => (reply.code, reply.message),
        other => panic!("expected a daemon error, got {other:?}"),
    }
}

fn tar_of(members: &[(&str, tar::EntryType, &[u8], &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, kind, data, link) in members {
        let mut h = tar::Header::new_gnu();
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_cksum();
        b.append(&h, *data).unwrap();
    }
    b.into_inner().unwrap()
}

#[test]
fn files_and_directories_round_trip_with_docker_cp_destinations() {
    let (d, id) = started();
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    fs::write(src.join("a.txt"), b"alpha\n").unwrap();
    fs::write(src.join("sub/b.bin"), vec![0xa5u8; 300_000]).unwrap();
    symlink("a.txt", src.join("link")).unwrap();

    // An existing directory takes the tree under its own name.
    let info = upload_path(&mut c, &id, &src, "/root", None).unwrap();
    assert_eq!(info.bytes, 6 + 300_000);
    assert_eq!(d.sh(&id, "cat /root/src/a.txt"), "alpha");
    assert_eq!(d.sh(&id, "readlink /root/src/link"), "a.txt");
    // Owned by the sandbox's root.
    assert_eq!(d.sh(&id, "stat -c %u:%g /root/src/sub/b.bin"), "0:0");
    // A missing name becomes the tree; a file is replaced.
    upload_path(&mut c, &id, &src, "/root/renamed", None).unwrap();
    assert_eq!(d.sh(&id, "cat /root/renamed/a.txt"), "alpha");
    upload_path(
        &mut c,
        &id,
        &src.join("a.txt"),
        "/root/renamed/sub/b.bin",
        None,
    )
    .unwrap();
    assert_eq!(d.sh(&id, "cat /root/renamed/sub/b.bin"), "alpha");
    // A trailing slash needs a directory; a missing parent is NotFound.
    let (code, _) = daemon_error(upload_path(&mut c, &id, &src, "/root/nope/", None));
    assert_eq!(code, ErrorCode::NotFound);
    let (code, _) = daemon_error(upload_path(&mut c, &id, &src, "/no/such/dir", None));
    assert_eq!(code, ErrorCode::NotFound);

    // Download: into an existing host directory, or as a new name.
    let out = tempfile::tempdir().unwrap();
    download_path(&mut c, &id, "/root/src", out.path(), None).unwrap();
    assert_eq!(fs::read(out.path().join("src/a.txt")).unwrap(), b"alpha\n");
    assert_eq!(
        fs::read(out.path().join("src/sub/b.bin")).unwrap(),
        vec![0xa5u8; 300_000]
    );
    assert_eq!(
        fs::read_link(out.path().join("src/link")).unwrap(),
        Path::new("a.txt")
    );
    download_path(
        &mut c,
        &id,
        "/root/src/a.txt",
        &out.path().join("one"),
        None,
    )
    .unwrap();
    assert_eq!(fs::read(out.path().join("one")).unwrap(), b"alpha\n");
    match download_path(&mut c, &id, "/root/missing", &out.path().join("x"), None) {
        Err(HostError::Daemon(r)) => assert_eq!(r.code, ErrorCode::NotFound, "{}", r.message),
        other => panic!("{other:?}"),
    }
    // The connection is still in step.
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
    d.assert_alive("after transfers");
}

#[test]
fn sandbox_symlinks_at_host_paths_never_lead_an_upload_out() {
    let (d, id) = started();
    let canary = Canary::new();
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    let file = host.path().join("canary");
    fs::write(&file, b"pwned").unwrap();
    let cdir = canary.dir().display().to_string();
    // Absolute host paths and `../..` chains, as destination and as destination parent.
    d.sh(
        &id,
        &format!(
            "ln -s {cdir} /root/abs && ln -s ../../../../../../..{cdir} /root/up && \
             ln -s {cdir}/canary /root/absfile && mkdir -p {cdir}-not && ln -s /proc/self/root /root/magic"
        ),
    );
    // The destination symlink resolves inside the sandbox, where the host path does not
    // exist: the upload replaces the link.
    upload_path(&mut c, &id, &file, "/root/abs", None).unwrap();
    assert_eq!(d.sh(&id, "cat /root/abs"), "pwned");
    upload_path(&mut c, &id, &file, "/root/absfile", None).unwrap();
    assert_eq!(d.sh(&id, "test -L /root/absfile || echo file"), "file");
    // Through the link as a parent: no such directory inside the sandbox.
    for dest in ["/root/up/canary", "/root/up/"] {
        let (code, message) = daemon_error(upload_path(&mut c, &id, &file, dest, None));
        assert_eq!(code, ErrorCode::NotFound, "{dest}: {message}");
    }
    // A magic link on the way is refused.
    let (code, message) = daemon_error(upload_path(&mut c, &id, &file, "/root/magic/tmp/x", None));
    assert_eq!(code, ErrorCode::TransferFailed, "{message}");
    assert!(message.contains("symbolic links"), "{message}");
    canary.check();
    d.assert_alive("after hostile destinations");
}

#[test]
fn hostile_archives_are_refused_member_by_member() {
    use tar::EntryType::{Block, Char, Directory, Fifo, Link, Regular, Symlink};
    let (d, id) = started();
    let canary = Canary::new();
    let mut c = d.client();
    let cdir = canary.dir().display().to_string();
    d.sh(&id, "mkdir -p /root/t");
    let up = format!("../../../../../../..{cdir}/canary");
    let abs = format!("{cdir}/canary");
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a symlink member as a parent",
            tar_of(&[
                ("a", Symlink, b"", &cdir),
                ("a/canary", Regular, b"pwned", ""),
            ]),
        ),
        ("a `..` member", tar_of(&[(&up, Regular, b"pwned", "")])),
        (
            "an absolute member",
            tar_of(&[(&abs, Regular, b"pwned", "")]),
        ),
        (
            "a hard link to a host path",
            tar_of(&[("h", Link, b"", &abs)]),
        ),
        ("a hard link climbing out", tar_of(&[("h", Link, b"", &up)])),
        ("a character device", tar_of(&[("null", Char, b"", "")])),
        ("a block device", tar_of(&[("disk", Block, b"", "")])),
        ("a fifo", tar_of(&[("fifo", Fifo, b"", "")])),
        (
            "a directory member through a symlink",
            tar_of(&[("b", Symlink, b"", "/"), ("b/etc/", Directory, b"", "")]),
        ),
    ];
    for (what, tar) in cases {
        let r = upload_archive(&mut c, &id, tar.as_slice(), "/root/t", None);
        let (code, message) = daemon_error(r);
        assert_eq!(code, ErrorCode::TransferFailed, "{what}: {message}");
        assert!(
            message.contains("refused") || message.contains("parent"),
            "{what}: {message}"
        );
    }
    canary.check();
    // The symlink members were created, as links, and nothing went through them.
    assert_eq!(d.sh(&id, "readlink /root/t/a"), cdir);
    assert_eq!(d.sh(&id, "ls /etc | wc -l"), d.sh(&id, "ls /etc | wc -l"));
    // An arbitrary archive needs an existing directory.
    let tar = tar_of(&[("f", Regular, b"x", "")]);
    let (code, _) = daemon_error(upload_archive(
        &mut c,
        &id,
        tar.as_slice(),
        "/root/new",
        None,
    ));
    assert_eq!(code, ErrorCode::NotFound);
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
}

#[test]
fn downloads_of_hostile_trees_stay_beneath_the_host_destination() {
    let (d, id) = started();
    let canary = Canary::new();
    let mut c = d.client();
    let cdir = canary.dir().display().to_string();
    d.sh(
        &id,
        &format!(
            "mkdir -p /root/d/sub && echo data > /root/d/f && ln /root/d/f /root/d/hard && \
             ln -s {cdir}/canary /root/d/abs && ln -s ../../../../../../..{cdir}/canary /root/d/up && \
             ln -s {cdir} /root/d/dirlink && mkfifo /root/d/fifo"
        ),
    );
    let out = tempfile::tempdir().unwrap();
    let info = download_path(&mut c, &id, "/root/d", out.path(), None).unwrap();
    assert_eq!(info.skipped, 1, "the fifo is left out");
    let got = out.path().join("d");
    assert_eq!(fs::read_link(got.join("abs")).unwrap(), canary.file());
    assert!(fs::read_link(got.join("up")).is_ok());
    assert_eq!(
        fs::metadata(got.join("f")).unwrap().ino(),
        fs::metadata(got.join("hard")).unwrap().ino()
    );
    assert!(!got.join("fifo").exists());
    canary.check();
    // The sandbox turns the links into a file and a directory and downloads again over the
    // first copy: the host links are replaced, never written through.
    d.sh(
        &id,
        "rm /root/d/abs /root/d/dirlink && echo pwned > /root/d/abs && mkdir /root/d/dirlink && \
         echo pwned > /root/d/dirlink/canary",
    );
    download_path(&mut c, &id, "/root/d", out.path(), None).unwrap();
    assert_eq!(fs::read(got.join("abs")).unwrap(), b"pwned\n");
    assert_eq!(fs::read(got.join("dirlink/canary")).unwrap(), b"pwned\n");
    assert!(!fs::symlink_metadata(got.join("dirlink"))
        .unwrap()
        .is_symlink());
    canary.check();
    // A host destination that is a symlink to the canary's directory is the user's own
    // path: it is followed, and the tree goes inside it under its own name only.
    let link = out.path().join("to-canary");
    symlink(canary.dir(), &link).unwrap();
    download_path(&mut c, &id, "/root/d/f", &link.join("new"), None).unwrap();
    assert_eq!(fs::read(canary.dir().join("new")).unwrap(), b"data\n");
    fs::remove_file(canary.dir().join("new")).unwrap();
    canary.check();
    // The same download twice to one host path: the first brings a link to the canary's
    // directory, the second a file the sandbox wrote. The destination's last component is
    // never followed, so the file replaces the link; with a trailing `/` it is refused.
    d.sh(&id, &format!("ln -s {cdir} /root/results"));
    let results = out.path().join("results");
    download_path(&mut c, &id, "/root/results", &results, None).unwrap();
    assert_eq!(fs::read_link(&results).unwrap(), canary.dir());
    d.sh(&id, "rm /root/results && echo pwned > /root/results");
    let mut slash = results.clone().into_os_string();
    slash.push("/");
    assert!(download_path(&mut c, &id, "/root/results", Path::new(&slash), None).is_err());
    download_path(&mut c, &id, "/root/results", &results, None).unwrap();
    assert_eq!(fs::read(&results).unwrap(), b"pwned\n");
    canary.check();
}

#[test]
fn a_sandbox_out_of_disk_gets_a_typed_error_and_keeps_working() {
    let d = Daemon::start();
    d.image("busybox", &busybox_rootfs());
    let id = d
        .create_spec(SandboxSpec {
            image: "busybox".into(),
            disk_max: Some(8 << 20),
            ..Default::default()
        })
        .id;
    let mut c = d.client();
    let host = tempfile::tempdir().unwrap();
    let big = host.path().join("big");
    fs::write(&big, vec![1u8; 24 << 20]).unwrap();
    let (code, message) = daemon_error(upload_path(&mut c, &id, &big, "/root/big", None));
    assert_eq!(code, ErrorCode::NoSpace, "{message}");
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
    d.sh(&id, "rm -f /root/big");
    fs::write(&big, b"small").unwrap();
    upload_path(&mut c, &id, &big, "/root/big", None).unwrap();
    assert_eq!(d.sh(&id, "cat /root/big"), "small");
    d.assert_alive("after a full disk");
}

/// Starts a background job in the sandbox that sends `signal` to every process whose command
/// line is the unpacking helper's (`__belayer-helper` and `unpack`: the builtin's child is the
/// only one the sandbox can see; an exec helper, such as the one of the action starting this
/// job, has no `unpack`), and returns once it runs; it hunts until the sandbox goes. The
/// patterns are split so that the job's own command line does not match.
fn hunt_unpackers(d: &Daemon, id: &str, signal: &str) {
    d.sh(
        id,
        &format!(
            "(while true; do for p in /proc/[0-9]*; do \
               if grep -q '__bel''ayer-helper' $p/cmdline 2>/dev/null && \
                  grep -q 'unp''ack' $p/cmdline 2>/dev/null; then \
                 kill -{signal} ${{p#/proc/}}; fi; \
             done; done) >/dev/null 2>&1 </dev/null &"
        ),
    );
}

/// Uploads a stream that stalls after its first megabyte for `pause`, then sends 32 MiB more.
fn slow_upload(
    c: &mut Client,
    id: &str,
    timeout_ms: u64,
    pause: Duration,
) -> Result<Response, ClientError> {
    let request = UploadRequest {
        id: id.to_owned(),
        dest: "/root/slow".into(),
        archive: false,
        timeout_ms: Some(timeout_ms),
    };
    c.upload_with(request, |sink| {
        let mut h = tar::Header::new_gnu();
        h.set_path("slow").unwrap();
        h.set_size(33 << 20);
        h.set_mode(0o644);
        h.set_cksum();
        sink.write_all(h.as_bytes())?;
        sink.write_all(&vec![0u8; 1 << 20])?;
        sink.flush()?;
        std::thread::sleep(pause);
        for _ in 0..32 {
            sink.write_all(&vec![0u8; 1 << 20])?;
        }
        Ok(())
    })
}

#[test]
fn an_unpacker_the_sandbox_stops_or_kills_ends_the_transfer_in_time() {
    let (d, id) = started();
    let mut c = d.client();
    hunt_unpackers(&d, &id, "STOP");
    let t0 = Instant::now();
    let r = slow_upload(&mut c, &id, 3000, Duration::from_millis(1500)).unwrap();
    match r {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::TransferTimedOut, "{}", e.message),
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    d.assert_alive("after a stopped unpacker");

    let (d, id) = started();
    let mut c = d.client();
    hunt_unpackers(&d, &id, "KILL");
    match slow_upload(&mut c, &id, 30_000, Duration::from_millis(1500)).unwrap() {
        Response::Error(e) => assert_eq!(e.code, ErrorCode::TransferFailed, "{}", e.message),
        other => panic!("{other:?}"),
    }
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
    assert!(
        d.inspect(&id).state == belayer_ipc::SandboxState::Running,
        "a kill by the sandbox itself is no fault"
    );
}

/// Uploads, without a timeout, a 4 KiB file whose header comes before its data, the data once
/// the unpacker is stopped: the whole stream fits in the daemon's pipe.
fn small_stalled_upload(c: &mut Client, id: &str) -> Result<Response, ClientError> {
    let request = UploadRequest {
        id: id.to_owned(),
        dest: "/root/small".into(),
        archive: false,
        timeout_ms: None,
    };
    c.upload_with(request, |sink| {
        let mut h = tar::Header::new_gnu();
        h.set_path("small").unwrap();
        h.set_size(4096);
        h.set_mode(0o644);
        h.set_cksum();
        sink.write_all(h.as_bytes())?;
        sink.flush()?;
        // The data only once the sandbox's hunter has stopped the unpacker (seen from the host),
        // however slowly it sweeps `/proc` on a loaded machine.
        wait_for_stopped_unpacker(id, Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(300));
        sink.write_all(&[7u8; 4096])
    })
}

/// Waits (at most `limit`) until a process of sandbox `id`'s cgroup running the helper
/// (`__belayer-helper` in its command line) is stopped (`State: T`).
fn wait_for_stopped_unpacker(id: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let helpers = helpers();
        let stopped = helpers
            .iter()
            .any(|h| h.cgroup.contains(id) && h.unpacker && h.state.starts_with("State:\tT"));
        if stopped {
            return;
        }
        if Instant::now() >= deadline {
            let seen: Vec<String> = helpers
                .iter()
                .map(|h| format!("{}: {} {:?}", h.pid, h.state, h.cgroup.lines().last()))
                .collect();
            panic!("no stopped unpacker of {id} within {limit:?}; helpers: {seen:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A process running the helper, as the host sees it.
struct Helper {
    pid: String,
    /// Its `State:` line.
    state: String,
    cgroup: String,
    /// `unpack` is in its command line.
    unpacker: bool,
}

/// Every process with `__belayer-helper` in its command line.
fn helpers() -> Vec<Helper> {
    fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let cmdline = fs::read(p.join("cmdline")).ok()?;
            if !cmdline.windows(16).any(|w| w == b"__belayer-helper") {
                return None;
            }
            let status = fs::read_to_string(p.join("status")).unwrap_or_default();
            Some(Helper {
                pid: e.file_name().to_string_lossy().into_owned(),
                state: status
                    .lines()
                    .find(|l| l.starts_with("State:"))
                    .unwrap_or("")
                    .to_string(),
                cgroup: fs::read_to_string(p.join("cgroup")).unwrap_or_default(),
                unpacker: cmdline.windows(6).any(|w| w == b"unpack"),
            })
        })
        .collect()
}

#[test]
fn a_client_that_leaves_while_its_stopped_unpacker_finishes_releases_the_sandbox() {
    let (d, id) = started();
    hunt_unpackers(&d, &id, "STOP");
    let mut c = d
        .client()
        .with_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    // No timeout: only the client's leaving can end the transfer. The stream is whole (the
    // pipe holds it), the stopped unpacker never answers, the client gives up and goes.
    let r = small_stalled_upload(&mut c, &id);
    assert!(r.is_err(), "{r:?}");
    drop(c);
    // The transfer was aborted and the verb lock released: an action runs.
    let t0 = Instant::now();
    assert_eq!(d.sh(&id, "echo free"), "free");
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
    d.assert_alive("after a client left a stopped unpacker");
}

#[test]
fn a_stopped_unpacker_of_a_whole_small_stream_times_out_without_a_timeout() {
    let (d, id) = started();
    hunt_unpackers(&d, &id, "STOP");
    let mut c = d
        .client()
        .with_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    // No timeout, and the client waits: the stall bound ends it (the stream fits in the pipe,
    // so no write of the daemon ever stalls).
    let t0 = Instant::now();
    let r = small_stalled_upload(&mut c, &id);
    match r {
        Ok(Response::Error(e)) => assert_eq!(e.code, ErrorCode::TransferTimedOut, "{}", e.message),
        other => panic!("{other:?}"),
    }
    // The daemon's stall bound (`sandbox::transfer::STALL`) is 30 s.
    assert!(t0.elapsed() < Duration::from_secs(45), "{:?}", t0.elapsed());
    assert_eq!(d.sh(&id, "echo free"), "free");
    d.assert_alive("after a stopped unpacker of a small stream");
}

#[test]
fn a_client_that_cancels_or_vanishes_mid_upload_leaves_the_daemon_serving() {
    let (d, id) = started();
    let mut c = d.client();
    let request = UploadRequest {
        id: id.clone(),
        dest: "/root/x".into(),
        archive: false,
        timeout_ms: None,
    };
    // A source that fails: the transfer is cancelled, the connection stays in step.
    let r = c.upload_with(request.clone(), |sink| {
        sink.write_all(&[0u8; 1000])?;
        Err(std::io::Error::other("the source broke"))
    });
    assert!(
        matches!(r, Err(ClientError::TransferSource { .. })),
        "{r:?}"
    );
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
    // A client that goes away mid-stream.
    {
        let mut gone = d.client();
        let _ = gone.upload_with(request.clone(), |sink| {
            sink.write_all(&[0u8; 4096])?;
            sink.flush()?;
            Err(std::io::Error::other("stop"))
        });
        drop(gone);
    }
    let mut raw = d.client();
    // Send the start of a stream and vanish without ending it.
    let _ = std::thread::spawn(move || {
        let _ = raw.upload_with(
            UploadRequest {
                id: String::new(),
                dest: "/".into(),
                archive: true,
                timeout_ms: None,
            },
            |_| Ok(()),
        );
    })
    .join();
    let host = tempfile::tempdir().unwrap();
    fs::write(host.path().join("f"), b"after").unwrap();
    upload_path(&mut c, &id, &host.path().join("f"), "/root/f", None).unwrap();
    assert_eq!(d.sh(&id, "cat /root/f"), "after");
    // A download whose consumer fails is cancelled the same way.
    let r = c.download_with(
        DownloadRequest {
            id: id.clone(),
            src: "/bin".into(),
            timeout_ms: None,
        },
        |_| Err(std::io::Error::other("host disk full")),
    );
    assert!(matches!(r, Err(ClientError::TransferSink { .. })), "{r:?}");
    assert!(matches!(c.call(Request::Ping), Ok(Response::Pong { .. })));
    d.assert_alive("after aborted transfers");
}
