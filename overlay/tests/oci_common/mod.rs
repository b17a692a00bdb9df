//! Helpers of the image-layer tests: a tar builder that writes names verbatim (no tar-crate
//! checks), a scratch area with a directory that must stay untouched, a listing of a tree,
//! and a user namespace fd for idmapped mounts.
#![allow(dead_code)]

use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use belayer_overlay::{install_oci_layer, InstallError, LayerOptions, LayerStats};
use tar::{Builder, EntryType, Header};

/// A layer under construction.
pub struct Layer {
    builder: Builder<Vec<u8>>,
}

pub fn header(kind: EntryType, name: &[u8], size: u64, mode: u32) -> Header {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1_700_000_000);
    h.set_size(size);
    let field = &mut h.as_old_mut().name;
    assert!(
        name.len() <= field.len(),
        "name too long for the test builder"
    );
    field[..name.len()].copy_from_slice(name);
    h
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Self {
        Self {
            builder: Builder::new(Vec::new()),
        }
    }

    pub fn raw(mut self, mut h: Header, data: &[u8]) -> Self {
        h.set_cksum();
        self.builder.append(&h, data).unwrap();
        self
    }

    pub fn pax(mut self, records: &[(&str, &[u8])]) -> Self {
        self.builder
            .append_pax_extensions(records.iter().copied())
            .unwrap();
        self
    }

    pub fn root(self) -> Self {
        self.dir("./")
    }

    pub fn dir(self, name: &str) -> Self {
        self.dir_mode(name, 0o755)
    }

    pub fn dir_mode(self, name: &str, mode: u32) -> Self {
        self.raw(header(EntryType::Directory, name.as_bytes(), 0, mode), b"")
    }

    pub fn file(self, name: &str, data: &[u8]) -> Self {
        self.raw(
            header(
                EntryType::Regular,
                name.as_bytes(),
                data.len() as u64,
                0o644,
            ),
            data,
        )
    }

    pub fn link(self, kind: EntryType, name: &str, target: &str) -> Self {
        let mut h = header(kind, name.as_bytes(), 0, 0o777);
        let field = &mut h.as_old_mut().linkname;
        field[..target.len()].copy_from_slice(target.as_bytes());
        self.raw(h, b"")
    }

    pub fn symlink(self, name: &str, target: &str) -> Self {
        self.link(EntryType::Symlink, name, target)
    }

    pub fn hardlink(self, name: &str, target: &str) -> Self {
        self.link(EntryType::Link, name, target)
    }

    pub fn device(self, kind: EntryType, name: &str, major: u32, minor: u32) -> Self {
        let mut h = header(kind, name.as_bytes(), 0, 0o644);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.raw(h, b"")
    }

    pub fn finish(self) -> Vec<u8> {
        self.builder.into_inner().unwrap()
    }
}

/// Unpacks `layer` into `target`.
pub fn unpack(layer: &[u8], target: &Path) -> Result<LayerStats, InstallError> {
    install_oci_layer(
        layer,
        Path::new("layer.tar"),
        target,
        &LayerOptions::default(),
    )
}

/// A scratch area: `target/` (empty install target) and `outside/` (holding one file,
/// `outside/keep`, which must stay as it is).
pub struct Scratch {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    pub target: PathBuf,
    pub outside: PathBuf,
}

impl Default for Scratch {
    fn default() -> Self {
        Self::new()
    }
}

impl Scratch {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let target = root.join("target");
        let outside = root.join("outside");
        fs::create_dir(&target).unwrap();
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), b"keep").unwrap();
        Self {
            _dir: dir,
            root,
            target,
            outside,
        }
    }

    /// The canary directory as an absolute symlink target.
    pub fn canary(&self) -> &str {
        self.outside.to_str().unwrap()
    }

    /// Unpacks `layer` and checks that nothing beside the target changed.
    pub fn unpack(&self, layer: Vec<u8>) -> Result<LayerStats, InstallError> {
        let result = unpack(&layer, &self.target);
        self.assert_outside_untouched();
        result
    }

    pub fn assert_outside_untouched(&self) {
        assert_eq!(names(&self.root), ["outside", "target"]);
        assert_eq!(names(&self.outside), ["keep"], "outside touched");
        assert_eq!(fs::read(self.outside.join("keep")).unwrap(), b"keep");
        for path in [&self.outside, &self.outside.join("keep")] {
            let attrs = xattr_names(path);
            assert!(attrs.is_empty(), "attributes set outside: {attrs:?}");
        }
    }
}

/// Names directly inside `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Extended attribute names of `path` (not following a symlink).
pub fn xattr_names(path: &Path) -> Vec<String> {
    let mut buf = vec![0u8; 4096];
    let n = rustix::fs::llistxattr(path, &mut buf[..]).unwrap();
    buf[..n]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

/// The value of attribute `name` of `path` (not following a symlink), if set.
pub fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    match rustix::fs::lgetxattr(path, name, &mut buf[..]) {
        Ok(n) => Some(buf[..n].to_vec()),
        Err(rustix::io::Errno::NODATA) => None,
        Err(e) => panic!("lgetxattr {}: {e}", path.display()),
    }
}

/// Every entry below `root` (not following symlinks), sorted, one line each:
/// `path/` for a directory, `path=content` for a regular file, `path -> target` for a
/// symlink, `path c major:minor` for a character device, `path ?` otherwise.
pub fn listing(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in fs::read_dir(root.join(&rel)).unwrap() {
            let entry = entry.unwrap();
            let rel = rel.join(entry.file_name());
            let path = root.join(&rel);
            let meta = fs::symlink_metadata(&path).unwrap();
            let ty = meta.file_type();
            let shown = rel.display();
            out.push(if ty.is_dir() {
                stack.push(rel.clone());
                format!("{shown}/")
            } else if ty.is_file() {
                format!(
                    "{shown}={}",
                    String::from_utf8_lossy(&fs::read(&path).unwrap())
                )
            } else if ty.is_symlink() {
                format!("{shown} -> {}", fs::read_link(&path).unwrap().display())
            } else if ty.is_char_device() {
                let rdev = meta.rdev();
                format!(
                    "{shown} c {}:{}",
                    rustix::fs::major(rdev),
                    rustix::fs::minor(rdev)
                )
            } else {
                format!("{shown} ?")
            });
        }
    }
    out.sort();
    out
}

/// A user namespace mapping ids 0..65536 to host ids 100000..165536, as an open nsfs fd
/// (the namespace lives as long as the fd). Made by an `unshare --user` child, whose maps
/// this process writes.
pub fn userns_fd() -> OwnedFd {
    let mut child = std::process::Command::new("unshare")
        .args(["--user", "sleep", "30"])
        .spawn()
        .unwrap();
    let pid = child.id();
    let own = fs::read_link("/proc/self/ns/user").unwrap();
    let ns_path = format!("/proc/{pid}/ns/user");
    let started = Instant::now();
    while fs::read_link(&ns_path).ok().as_ref() == Some(&own) || fs::read_link(&ns_path).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "unshare never entered its namespace"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    fs::write(format!("/proc/{pid}/uid_map"), "0 100000 65536\n").unwrap();
    fs::write(format!("/proc/{pid}/gid_map"), "0 100000 65536\n").unwrap();
    let fd = OwnedFd::from(fs::File::open(&ns_path).unwrap());
    child.kill().unwrap();
    child.wait().unwrap();
    fd
}
