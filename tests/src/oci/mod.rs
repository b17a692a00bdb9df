//! Real OCI images for registry tests, built with `umoci` and pushed with `skopeo`.
//!
//! [`OciImage`] builds an image in an OCI layout one layer per step: the first layer is a
//! copy of a root filesystem, each [`OciImage::layer`] step unpacks the image (as root, so
//! owners are kept), lets the caller change the tree, and `umoci repack`s the difference
//! (deleted entries become `.wh.` whiteouts). [`OciImage::raw_layer`] appends a tar verbatim
//! (umoci never emits an opaque `.wh..wh..opq` whiteout, so one comes this way).
//! [`standard_test_image`] is the canned image of the registry tests; [`write_raw_layout`]
//! writes a layout by hand, optionally damaged ([`Tamper`]), for hostile tests.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

mod layout;

use layout::{blob_file, tag_descriptor};
pub use layout::{
    layer_media_type, media, minimal_config, put_blob, set_tag, sha256_digest, write_index,
    write_raw_layout, RawLayout, Tamper,
};

use crate::registry::TestRegistry;

/// Runs `cmd`, panicking with its output when it fails; returns its stdout.
pub(crate) fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Image configuration set with `umoci config` (empty fields are left as they are).
#[derive(Debug, Clone, Default)]
pub struct ImageConfig {
    /// `KEY=value` entries.
    pub env: Vec<String>,
    /// Working directory.
    pub working_dir: Option<String>,
    /// `user[:group]`, e.g. `1000:1000`.
    pub user: Option<String>,
    /// Command.
    pub cmd: Vec<String>,
    /// Entrypoint.
    pub entrypoint: Vec<String>,
}

/// The manifest format a push writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushFormat {
    /// As in the layout (OCI media types).
    Oci,
    /// Docker schema 2 (`skopeo --format v2s2`).
    DockerV2,
}

/// An image being built in an OCI layout (`layout:tag`).
#[derive(Debug)]
pub struct OciImage {
    layout: PathBuf,
    tag: String,
    work: tempfile::TempDir,
    steps: AtomicUsize,
}

impl OciImage {
    /// Creates `tag` in the layout `layout_dir` (initialized when missing) with one layer: a
    /// copy of `rootfs_dir` (e.g. [`crate::busybox_rootfs`]).
    pub fn from_rootfs(layout_dir: &Path, tag: &str, rootfs_dir: &Path) -> OciImage {
        if !layout_dir.join("index.json").is_file() {
            run(Command::new("umoci")
                .arg("init")
                .arg("--layout")
                .arg(layout_dir));
        }
        let image = OciImage {
            layout: layout_dir.to_path_buf(),
            tag: tag.to_string(),
            work: tempfile::Builder::new()
                .prefix("belayer-oci-")
                .tempdir_in("/tmp")
                .expect("tempdir"),
            steps: AtomicUsize::new(0),
        };
        run(Command::new("umoci")
            .args(["new", "--image"])
            .arg(image.image_arg()));
        image.layer(|rootfs| {
            run(Command::new("cp")
                .arg("-a")
                .arg(format!("{}/.", rootfs_dir.display()))
                .arg(rootfs));
        })
    }

    fn image_arg(&self) -> String {
        format!("{}:{}", self.layout.display(), self.tag)
    }

    fn next_bundle(&self) -> PathBuf {
        let step = self.steps.fetch_add(1, Ordering::Relaxed) + 1;
        self.work.path().join(format!("bundle-{step}"))
    }

    /// Adds one layer: the image is unpacked, `f` changes the tree at the path it gets (the
    /// bundle's `rootfs`), and the difference is repacked as a new layer.
    pub fn layer(self, f: impl FnOnce(&Path)) -> OciImage {
        let bundle = self.next_bundle();
        run(Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(self.image_arg())
            .arg(&bundle));
        f(&bundle.join("rootfs"));
        run(Command::new("umoci")
            .args(["repack", "--image"])
            .arg(self.image_arg())
            .arg(&bundle));
        let _ = std::fs::remove_dir_all(&bundle);
        self
    }

    /// Appends an uncompressed layer tar verbatim (`umoci raw add-layer`; umoci gzips it).
    pub fn raw_layer(self, tar_bytes: &[u8]) -> OciImage {
        let path = self.next_bundle().with_extension("tar");
        std::fs::write(&path, tar_bytes).expect("write layer tar");
        run(Command::new("umoci")
            .args(["raw", "add-layer", "--image"])
            .arg(self.image_arg())
            .arg(&path));
        let _ = std::fs::remove_file(&path);
        self
    }

    /// Sets the image configuration.
    pub fn config(self, cfg: &ImageConfig) -> OciImage {
        let mut cmd = Command::new("umoci");
        cmd.args(["config", "--image"]).arg(self.image_arg());
        for e in &cfg.env {
            cmd.arg(format!("--config.env={e}"));
        }
        if let Some(w) = &cfg.working_dir {
            cmd.arg(format!("--config.workingdir={w}"));
        }
        if let Some(u) = &cfg.user {
            cmd.arg(format!("--config.user={u}"));
        }
        if !cfg.cmd.is_empty() {
            cmd.arg("--clear=config.cmd");
        }
        for c in &cfg.cmd {
            cmd.arg(format!("--config.cmd={c}"));
        }
        if !cfg.entrypoint.is_empty() {
            cmd.arg("--clear=config.entrypoint");
        }
        for c in &cfg.entrypoint {
            cmd.arg(format!("--config.entrypoint={c}"));
        }
        run(&mut cmd);
        self
    }

    /// Tags as `new_tag` a copy of this image whose config says `architecture` (e.g.
    /// `arm64`), for multi-platform indexes ([`write_index`]).
    pub fn tag_architecture(&self, new_tag: &str, architecture: &str) {
        run(Command::new("umoci")
            .args(["config", "--image"])
            .arg(self.image_arg())
            .arg(format!("--architecture={architecture}"))
            .arg(format!("--tag={new_tag}")));
    }

    /// The layout directory.
    pub fn layout(&self) -> &Path {
        &self.layout
    }

    /// The tag in the layout.
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// The manifest descriptor of the tag in `index.json`.
    pub fn descriptor(&self) -> serde_json::Value {
        tag_descriptor(&self.layout, &self.tag)
    }

    /// The manifest's digest (`sha256:<hex>`).
    pub fn manifest_digest(&self) -> String {
        self.descriptor()["digest"]
            .as_str()
            .expect("digest")
            .to_string()
    }

    /// The manifest's bytes as stored in the layout.
    pub fn manifest_bytes(&self) -> Vec<u8> {
        std::fs::read(blob_file(&self.layout, &self.manifest_digest())).expect("manifest blob")
    }

    /// The manifest, parsed.
    pub fn manifest(&self) -> serde_json::Value {
        serde_json::from_slice(&self.manifest_bytes()).expect("manifest json")
    }

    /// The config's bytes.
    pub fn config_bytes(&self) -> Vec<u8> {
        let digest = self.manifest()["config"]["digest"]
            .as_str()
            .expect("config digest")
            .to_string();
        std::fs::read(blob_file(&self.layout, &digest)).expect("config blob")
    }

    /// The layer descriptors (`(digest, size)`), bottom first.
    pub fn layers(&self) -> Vec<(String, u64)> {
        self.manifest()["layers"]
            .as_array()
            .expect("layers")
            .iter()
            .map(|l| {
                (
                    l["digest"].as_str().expect("digest").to_string(),
                    l["size"].as_u64().expect("size"),
                )
            })
            .collect()
    }

    /// Path of blob `digest` in the layout.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        blob_file(&self.layout, digest)
    }

    /// The entry names of layer `index` (bottom first), as `tar -t` lists them.
    pub fn layer_entries(&self, index: usize) -> Vec<String> {
        let (digest, _) = &self.layers()[index];
        let out = Command::new("tar")
            .arg("-tf")
            .arg(self.blob_path(digest))
            .output()
            .expect("tar -t");
        assert!(out.status.success(), "tar -t {digest}: {out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// Unpacks the final image (`umoci unpack`, as root) and returns its `rootfs`: the
    /// expected merged tree. Each call unpacks afresh into a new dir that lives as long as
    /// the image.
    pub fn final_rootfs(&self) -> PathBuf {
        let bundle = self.next_bundle();
        run(Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(self.image_arg())
            .arg(&bundle));
        bundle.join("rootfs")
    }

    /// Pushes the image to `registry` as `repo:tag` with OCI media types; returns the
    /// pushed manifest's digest. `creds`: basic auth `(user, password)`.
    pub fn push(
        &self,
        registry: &TestRegistry,
        repo_tag: &str,
        creds: Option<(&str, &str)>,
    ) -> String {
        self.push_as(registry, repo_tag, creds, PushFormat::Oci)
    }

    /// [`Self::push`] in the given manifest format.
    pub fn push_as(
        &self,
        registry: &TestRegistry,
        repo_tag: &str,
        creds: Option<(&str, &str)>,
        format: PushFormat,
    ) -> String {
        let extra: &[&str] = match format {
            PushFormat::Oci => &["--preserve-digests"],
            PushFormat::DockerV2 => &["--format", "v2s2"],
        };
        skopeo_push(&self.layout, &self.tag, registry, repo_tag, creds, extra)
    }
}

/// `skopeo copy oci:LAYOUT:TAG docker://ADDR/REPO_TAG` (plain HTTP, optional basic auth,
/// `extra` arguments such as `--all`); returns the pushed manifest's digest. Without
/// `--preserve-digests` in `extra`, skopeo may rewrite the manifest (it gzips uncompressed
/// layers): pass it to push a hand-written layout byte for byte.
pub fn skopeo_push(
    layout: &Path,
    tag: &str,
    registry: &TestRegistry,
    repo_tag: &str,
    creds: Option<(&str, &str)>,
    extra: &[&str],
) -> String {
    let digest_file = tempfile::NamedTempFile::new().expect("digest file");
    let mut cmd = Command::new("skopeo");
    cmd.args([
        "--insecure-policy",
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
    ])
    .arg("--digestfile")
    .arg(digest_file.path())
    .args(extra);
    if let Some((u, p)) = creds {
        cmd.arg(format!("--dest-creds={u}:{p}"));
    }
    cmd.arg(format!("oci:{}:{tag}", layout.display()))
        .arg(format!("docker://{}/{repo_tag}", registry.addr()));
    run(&mut cmd);
    std::fs::read_to_string(digest_file.path())
        .expect("digest file")
        .trim()
        .to_string()
}

/// Writes `len` bytes of deterministic pseudo-random (incompressible) data to `path`.
pub fn write_incompressible(path: &Path, len: u64, seed: u64) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    let mut x = seed | 1;
    let mut left = len;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        for word in buf.chunks_mut(8) {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            word.copy_from_slice(&v[..word.len()]);
        }
        let n = left.min(buf.len() as u64) as usize;
        f.write_all(&buf[..n]).expect("write");
        left -= n as u64;
    }
    f.flush().expect("flush");
}

/// The configuration of [`standard_test_image`].
pub fn standard_config() -> ImageConfig {
    ImageConfig {
        env: vec![
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            "BELAYER_IMAGE=standard".to_string(),
        ],
        working_dir: Some("/data".to_string()),
        user: Some("1000:1000".to_string()),
        cmd: vec![
            "/bin/sh".to_string(),
            "-c".to_string(),
            "echo ready".to_string(),
        ],
        entrypoint: Vec::new(),
    }
}

/// Size of the large file when a test does not choose (64 MiB).
pub const STANDARD_LARGE_FILE: u64 = 64 << 20;

/// The canned test image, tagged `tag` in `layout_dir`, six layers bottom first:
/// 0. the busybox test rootfs ([`crate::busybox_rootfs`]);
/// 1. files and dirs under `/data`: `hello.txt`, an executable `run.sh` (0755), `sub/deep/
///    file.txt`, an empty dir `empty`, `/home/user/owned` (uid/gid 1000), and what later
///    layers delete or replace: `gone.txt`, `gonedir/x`, `replaced/{a,b}`,
///    `opaque/{old1,old2}`;
/// 2. symlinks: `/data/rel -> hello.txt`, `/data/abs -> /data/hello.txt`, a dir symlink
///    `/data/dirlink -> sub/deep`, `/data/up -> ../etc/hostname`, a dangling
///    `/data/dangling -> /nonexistent`;
/// 3. deletions (umoci writes `.wh.` whiteouts): `gone.txt` and `gonedir`; and
///    `replaced` emptied and refilled with `new.txt` (umoci 0.4.7 writes one `.wh.` per old
///    entry there, not an opaque whiteout);
/// 4. a raw tar with the opaque whiteout `data/opaque/.wh..wh..opq` and `data/opaque/fresh`;
/// 5. `/data/large.bin`: `large_file_bytes` of incompressible data.
///
/// Config: [`standard_config`] (Env, WorkingDir `/data`, User `1000:1000`, Cmd). Panics if
/// the layers do not hold at least one `.wh.` and one `.wh..wh..opq` entry.
pub fn standard_test_image(layout_dir: &Path, tag: &str, large_file_bytes: u64) -> OciImage {
    let image = OciImage::from_rootfs(layout_dir, tag, &crate::busybox_rootfs())
        .layer(|root| {
            let data = root.join("data");
            for d in ["sub/deep", "empty", "gonedir", "replaced", "opaque"] {
                std::fs::create_dir_all(data.join(d)).expect("mkdir");
            }
            std::fs::write(data.join("hello.txt"), "hello\n").expect("write");
            std::fs::write(data.join("run.sh"), "#!/bin/sh\necho run\n").expect("write");
            std::fs::set_permissions(data.join("run.sh"), std::fs::Permissions::from_mode(0o755))
                .expect("chmod");
            std::fs::write(data.join("sub/deep/file.txt"), "deep\n").expect("write");
            std::fs::write(data.join("gone.txt"), "to be deleted\n").expect("write");
            std::fs::write(data.join("gonedir/x"), "x\n").expect("write");
            std::fs::write(data.join("replaced/a"), "a\n").expect("write");
            std::fs::write(data.join("replaced/b"), "b\n").expect("write");
            std::fs::write(data.join("opaque/old1"), "1\n").expect("write");
            std::fs::write(data.join("opaque/old2"), "2\n").expect("write");
            let home = root.join("home/user");
            std::fs::create_dir_all(&home).expect("mkdir home");
            std::fs::write(home.join("owned"), "mine\n").expect("write");
            for p in [home.as_path(), &home.join("owned")] {
                std::os::unix::fs::chown(p, Some(1000), Some(1000)).expect("chown");
            }
        })
        .layer(|root| {
            let data = root.join("data");
            let link = |target: &str, name: &str| {
                std::os::unix::fs::symlink(target, data.join(name)).expect("symlink")
            };
            link("hello.txt", "rel");
            link("/data/hello.txt", "abs");
            link("sub/deep", "dirlink");
            link("../etc/hostname", "up");
            link("/nonexistent", "dangling");
        })
        .layer(|root| {
            let data = root.join("data");
            std::fs::remove_file(data.join("gone.txt")).expect("rm");
            std::fs::remove_dir_all(data.join("gonedir")).expect("rm -r");
            std::fs::remove_dir_all(data.join("replaced")).expect("rm -r");
            std::fs::create_dir(data.join("replaced")).expect("mkdir");
            std::fs::write(data.join("replaced/new.txt"), "new\n").expect("write");
        })
        .raw_layer(&opaque_layer_tar())
        .layer(|root| write_incompressible(&root.join("data/large.bin"), large_file_bytes, 7))
        .config(&standard_config());
    let entries: BTreeSet<String> = (0..image.layers().len())
        .flat_map(|i| image.layer_entries(i))
        .collect();
    let base = |e: &String| e.rsplit('/').next().unwrap_or(e).to_string();
    assert!(
        entries
            .iter()
            .any(|e| base(e).starts_with(".wh.") && base(e) != ".wh..wh..opq"),
        "no .wh. whiteout in the standard image: {entries:?}"
    );
    assert!(
        entries.iter().any(|e| base(e) == ".wh..wh..opq"),
        "no opaque whiteout in the standard image"
    );
    image
}

/// The uncompressed tar of layer 4 of [`standard_test_image`].
fn opaque_layer_tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: &str, kind: tar::EntryType, mode: u32, data: &[u8]| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data).expect("tar append");
    };
    add("data/", tar::EntryType::Directory, 0o755, b"");
    add("data/opaque/", tar::EntryType::Directory, 0o755, b"");
    add(
        "data/opaque/.wh..wh..opq",
        tar::EntryType::Regular,
        0o644,
        b"",
    );
    add(
        "data/opaque/fresh",
        tar::EntryType::Regular,
        0o644,
        b"fresh\n",
    );
    b.into_inner().expect("tar finish")
}
