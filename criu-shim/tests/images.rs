//! The image decoder and path check against real dumps (real CRIU, as root) of trees in the
//! caller's mount namespace: unlinked open files, a deleted cwd, a unix socket; then the same
//! images checked after the dump's directories were replaced by symbolic links, and after
//! hostile damage to the images themselves.
//!
//! Each test skips (with a printed reason) only when no usable CRIU is found.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use belayer_criu::{
    validate_restore_paths, Criu, DumpRequest, PathOp, UnsafeImagePath, UnsafeKind,
};

fn criu_or_skip(test: &str) -> Option<Criu> {
    match Criu::locate(None) {
        Ok(criu) => Some(criu),
        Err(err) => {
            println!("SKIP {test}: {err}");
            None
        }
    }
}

/// A `sh -c script` session leader with stdio on /dev/null and no inherited fds; killed and
/// reaped on drop. The script must create `ready` in its cwd (`dir`) when set up.
struct Tree {
    child: Child,
}

impl Tree {
    fn spawn(dir: &Path, script: &str) -> Tree {
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: runs in the forked child before exec; setsid and close_range are
        // async-signal-safe and touch no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close_range(3, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC as i32);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn tree");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !dir.join("ready").exists() {
            assert!(Instant::now() < deadline, "tree never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The last step of the script (exec) may still be running.
        std::thread::sleep(Duration::from_millis(100));
        Tree { child }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        // SAFETY: kill(2) of this test's own session; no memory involved.
        unsafe {
            libc::kill(-self.pid(), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// Dumps `tree` (left running) into a fresh images dir under `dir`.
fn dump(criu: &Criu, dir: &Path, tree: &Tree) -> PathBuf {
    let images = dir.join("images");
    std::fs::create_dir(&images).unwrap();
    let req = DumpRequest::new(tree.pid(), &images, dir.join("work")).leave_running(true);
    criu.dump(&req).expect("dump");
    images
}

fn unsafe_kind(r: Result<belayer_criu::ImagePathReport, UnsafeImagePath>) -> (PathOp, UnsafeKind) {
    match r {
        Err(UnsafeImagePath::Unsafe { op, kind, .. }) => (op, kind),
        r => panic!("expected a refusal, got {r:?}"),
    }
}

#[test]
fn ghost_files_are_decoded_and_checked_beneath_the_root() {
    let Some(criu) = criu_or_skip("ghost_files_are_decoded_and_checked_beneath_the_root") else {
        return;
    };
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = t.path();
    std::fs::create_dir_all(dir.join("d/sub")).unwrap();
    std::fs::create_dir(dir.join("canary")).unwrap();
    let tree = Tree::spawn(
        dir,
        "echo one > d/f; echo two > d/sub/g; exec 3<d/f 4<d/sub/g; rm d/f d/sub/g
         touch ready; exec sleep 1000",
    );
    let images = dump(&criu, dir, &tree);
    drop(tree);
    let shown = dir.display().to_string();

    let report = validate_restore_paths(&images, Path::new("/")).unwrap();
    assert_eq!(report.mounts, 0, "no mount namespace in a host dump");
    assert_eq!(
        report.ghosts,
        vec![
            format!("{shown}/d/f.cr.1.ghost"),
            format!("{shown}/d/sub/g.cr.2.ghost")
        ]
    );
    assert!(report.files >= 3, "{report:?}");
    assert!(report.lookups > 0);

    // The parent gone: CRIU creates the ghost in the deepest existing ancestor.
    std::fs::remove_dir(dir.join("d/sub")).unwrap();
    let report = validate_restore_paths(&images, Path::new("/")).unwrap();
    assert_eq!(report.ghosts[1], format!("{shown}/d/g.cr.2.ghost"));

    // The parent replaced by links: absolute, climbing, relative; each refused.
    std::fs::rename(dir.join("d"), dir.join("d.old")).unwrap();
    for target in [
        dir.join("canary").display().to_string(),
        format!("{}{}", "../".repeat(12), dir.join("canary").display()),
        "canary".into(),
    ] {
        std::os::unix::fs::symlink(&target, dir.join("d")).unwrap();
        let (op, kind) = unsafe_kind(validate_restore_paths(&images, Path::new("/")));
        assert_eq!(op, PathOp::CreateGhost);
        assert_eq!(
            kind,
            UnsafeKind::Symlink {
                at: format!("{shown}/d")
            },
            "{target}"
        );
        std::fs::remove_file(dir.join("d")).unwrap();
    }
    // The name CRIU creates already exists.
    std::fs::rename(dir.join("d.old"), dir.join("d")).unwrap();
    std::fs::write(dir.join("d/f.cr.1.ghost"), "x").unwrap();
    let (_, kind) = unsafe_kind(validate_restore_paths(&images, Path::new("/")));
    assert!(matches!(kind, UnsafeKind::Exists { .. }), "{kind:?}");
    assert_eq!(std::fs::read_dir(dir.join("canary")).unwrap().count(), 0);
}

#[test]
fn deleted_cwd_and_unix_socket_are_checked() {
    let Some(criu) = criu_or_skip("deleted_cwd_and_unix_socket_are_checked") else {
        return;
    };
    if !Path::new("/usr/bin/python3").exists() {
        println!("SKIP deleted_cwd_and_unix_socket_are_checked: no python3");
        return;
    }
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = t.path();
    let tree = Tree::spawn(
        dir,
        "exec python3 -c \"
import os, socket, time
os.makedirs('p/c'); os.makedirs('s')
sk = socket.socket(socket.AF_UNIX); sk.bind('s/x.sock'); sk.listen(1)
os.chdir('p/c'); os.rmdir('../c')
open('../../ready', 'w').close()
time.sleep(1000)
\"",
    );
    let images = dump(&criu, dir, &tree);
    drop(tree);
    let shown = dir.display().to_string();
    let report = validate_restore_paths(&images, Path::new("/")).unwrap();
    assert_eq!(
        report.ghosts,
        vec![format!("{shown}/p/c")],
        "a ghost dir keeps its name"
    );
    assert_eq!(report.unix_sockets, 1);

    // Without a mount namespace CRIU binds from its own root: no link may be followed.
    std::fs::rename(dir.join("s"), dir.join("s.old")).unwrap();
    std::os::unix::fs::symlink("s.old", dir.join("s")).unwrap();
    let (op, kind) = unsafe_kind(validate_restore_paths(&images, Path::new("/")));
    assert_eq!(op, PathOp::BindSocket);
    assert_eq!(
        kind,
        UnsafeKind::Symlink {
            at: format!("{shown}/s")
        }
    );
    std::fs::remove_file(dir.join("s")).unwrap();
    std::fs::rename(dir.join("s.old"), dir.join("s")).unwrap();

    std::fs::rename(dir.join("p"), dir.join("p.old")).unwrap();
    std::os::unix::fs::symlink(dir.join("s"), dir.join("p")).unwrap();
    let (op, kind) = unsafe_kind(validate_restore_paths(&images, Path::new("/")));
    assert_eq!(op, PathOp::CreateGhost);
    assert_eq!(
        kind,
        UnsafeKind::Symlink {
            at: format!("{shown}/p")
        }
    );
}

#[test]
fn damaged_images_are_errors_not_panics() {
    let Some(criu) = criu_or_skip("damaged_images_are_errors_not_panics") else {
        return;
    };
    let t = tempfile::tempdir_in("/var/tmp").unwrap();
    let dir = t.path();
    let tree = Tree::spawn(
        dir,
        "echo x > f; exec 3<f; rm f; touch ready; exec sleep 1000",
    );
    let images = dump(&criu, dir, &tree);
    drop(tree);
    validate_restore_paths(&images, Path::new("/")).unwrap();
    for name in ["files.img", "remap-fpath.img", "ghost-file-1.img"] {
        let path = images.join(name);
        let orig = std::fs::read(&path).unwrap();
        // Every truncation, and every byte flipped, of the first 256 bytes.
        for i in 0..orig.len().min(256) {
            std::fs::write(&path, &orig[..i]).unwrap();
            let _ = validate_restore_paths(&images, Path::new("/"));
            let mut bad = orig.clone();
            bad[i] ^= 0xff;
            std::fs::write(&path, &bad).unwrap();
            let _ = validate_restore_paths(&images, Path::new("/"));
        }
        std::fs::write(&path, &orig).unwrap();
    }
    std::fs::write(images.join("files.img"), b"garbage!").unwrap();
    assert!(matches!(
        validate_restore_paths(&images, Path::new("/")),
        Err(UnsafeImagePath::DecodeImage { .. })
    ));
    assert!(matches!(
        validate_restore_paths(&images, Path::new("/nonexistent/root")),
        Err(UnsafeImagePath::OpenRoot { .. })
    ));
}
