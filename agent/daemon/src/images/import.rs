//! Importing an image from a descriptor, with the rights of whoever asked.
//!
//! - A **directory** is streamed as a tar ([`belayer_overlay::archive_tree`]: no symlink is
//!   ever followed, the root is opened again as `.`) through a pipe into
//!   [`belayer_overlay::install_image`]. For a non-root caller the walk runs in the `tree`
//!   helper ([`crate::helper::tree`]), a child process that drops to the caller's uid, gid and
//!   supplementary groups before it reads anything, so every `openat` below the directory is
//!   checked against the caller's rights: an entry the caller may not read fails the import
//!   (nothing is imported, the error names the entry). For root it runs on a thread.
//! - A **regular file** is a tar archive (plain, gzip or zstd by magic bytes) read with
//!   `pread` (the client's file offset is never moved) straight into the installer: the
//!   client opened it, so reading it needs no further rights. Files of procfs and sysfs are
//!   refused (some of their files check the reader's credentials at read time).
//! - Anything else is refused.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Seek};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use belayer_ipc::ImageInfo;
use belayer_overlay::{install_image, ImageOptions, ImageStats, InstallLimits};
use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

use super::{valid_name, ImageError, ImageKind, ImageMeta, ImageStore};
use crate::helper::HELPER_ARG;
use crate::sys;

/// Credentials a source is read with: the peer's, from `SO_PEERCRED` and `SO_PEERGROUPS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
}

impl Credentials {
    /// Root with no supplementary groups (the daemon's own rights).
    pub fn root() -> Credentials {
        Credentials {
            uid: 0,
            gid: 0,
            groups: Vec::new(),
        }
    }
}

/// An open image source.
#[derive(Debug)]
pub struct ImportSource {
    /// A directory or a regular file, opened by (or for) the caller.
    pub fd: OwnedFd,
    /// How the caller names it (recorded in the metadata and used in messages; never opened).
    pub label: String,
}

impl ImportSource {
    /// Opens the host path `path` with the daemon's own rights (root-only requests):
    /// `O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK`, following symlinks.
    ///
    /// Errors: [`ImageError::Source`].
    pub fn open_host_path(path: &Path) -> Result<ImportSource, ImageError> {
        let flags = OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
        let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(|e| ImageError::Source {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        Ok(ImportSource {
            fd,
            label: path.display().to_string(),
        })
    }
}

/// Longest label recorded, in bytes.
const MAX_LABEL_BYTES: usize = 4096;

/// Bytes of helper report read back.
const MAX_REPORT_BYTES: u64 = 64 << 10;

impl ImageStore {
    /// Imports `source` as image `name`, owned by `owner_uid`, reading it with `reader`'s
    /// credentials (a directory through the `tree` helper, the binary `helper_exe`, unless
    /// `reader` is root).
    ///
    /// Errors: [`ImageError::InvalidName`], [`ImageError::AlreadyExists`],
    /// [`ImageError::Source`] (not a directory or regular file, procfs/sysfs file),
    /// [`ImageError::ReadTree`] (an entry the reader may not read), [`ImageError::Unpack`]
    /// (device node outside `/dev`, whiteout, hostile or truncated stream),
    /// [`ImageError::Decompress`], [`ImageError::NoShell`], [`ImageError::Helper`],
    /// [`ImageError::Store`]. Nothing is left behind on error.
    pub fn import(
        &self,
        name: &str,
        source: ImportSource,
        reader: &Credentials,
        owner_uid: u32,
        helper_exe: &Path,
    ) -> Result<ImageInfo, ImageError> {
        if !valid_name(name) {
            return Err(ImageError::InvalidName(name.to_string()));
        }
        let final_dir = self.image_dir(name);
        if final_dir.exists() {
            return Err(ImageError::AlreadyExists(name.to_string()));
        }
        // The label is the client's text: no control characters into logs and metadata.
        let mut label: String = source
            .label
            .chars()
            .map(|c| if c.is_control() { '?' } else { c })
            .collect();
        if label.len() > MAX_LABEL_BYTES {
            let mut end = MAX_LABEL_BYTES;
            while !label.is_char_boundary(end) {
                end -= 1;
            }
            label.truncate(end);
        }
        let label_path = PathBuf::from(&label);
        let kind = rustix::fs::fstat(&source.fd)
            .map(|st| FileType::from_raw_mode(st.st_mode))
            .map_err(|e| ImageError::Source {
                path: label_path.clone(),
                source: e.into(),
            })?;
        let tmp = self.dir().join(format!(".import-{}", sys::random_hex(8)));
        let rootfs = tmp.join("rootfs");
        let store_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ImageError::Store { path, source }
        };
        fs::create_dir_all(&rootfs).map_err(store_err(&rootfs))?;
        let result = (|| {
            let (stats, skipped_sockets, digest) = match kind {
                FileType::Directory => {
                    unpack_dir(source.fd, &label_path, &rootfs, reader, helper_exe)?
                }
                FileType::RegularFile => {
                    let (stats, digest) = unpack_file(source.fd, &label_path, &rootfs)?;
                    (stats, 0, digest)
                }
                other => {
                    return Err(ImageError::Source {
                        path: label_path.clone(),
                        source: io::Error::new(
                            io::ErrorKind::InvalidInput,
                            format!("a {other:?} is neither a directory nor a regular file"),
                        ),
                    })
                }
            };
            if !has_shell(&rootfs) {
                return Err(ImageError::NoShell(label_path.clone()));
            }
            let meta = ImageMeta {
                name: name.to_string(),
                bytes: stats.content_bytes,
                created_unix_ms: sys::now_unix_ms(),
                source: label.clone(),
                owner_uid,
                dropped_devices: stats.dropped_devices,
                skipped_sockets,
                kind: ImageKind::Flat,
                digest: Some(digest),
                layers: Vec::new(),
                config: None,
            };
            let json = serde_json::to_vec_pretty(&meta).unwrap_or_default();
            fs::write(tmp.join("image.json"), json).map_err(store_err(&tmp))?;
            {
                let _pins = self.lock();
                if final_dir.exists() {
                    return Err(ImageError::AlreadyExists(name.to_string()));
                }
                fs::rename(&tmp, &final_dir).map_err(store_err(&final_dir))?;
            }
            if meta.dropped_devices > 0 || skipped_sockets > 0 {
                tracing::info!(image = %name, dropped_devices = meta.dropped_devices,
                               skipped_sockets, "image imported without its /dev nodes and sockets");
            }
            tracing::info!(image = %name, source = %label, owner_uid, entries = stats.entries,
                           bytes = meta.bytes, "image imported");
            Ok(meta.info(Vec::new()))
        })();
        if result.is_err() {
            let _ = belayer_overlay::remove_dir_all(&tmp);
        }
        result
    }
}

/// Whether `/bin/sh` resolves inside `rootfs` (symlinks followed as if `rootfs` were `/`).
fn has_shell(rootfs: &Path) -> bool {
    let Ok(root) = rustix::fs::open(
        rootfs,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) else {
        return false;
    };
    rustix::fs::openat2(
        &root,
        "bin/sh",
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .is_ok()
}

/// Unpacks the tar archive open as `fd` (plain, gzip or zstd); returns the stats and the
/// `blake3:` digest of the tar stream.
fn unpack_file(
    fd: OwnedFd,
    label: &Path,
    rootfs: &Path,
) -> Result<(ImageStats, String), ImageError> {
    let source_err = |source: io::Error| ImageError::Source {
        path: label.to_path_buf(),
        source,
    };
    let fs_type = rustix::fs::fstatfs(&fd)
        .map_err(|e| source_err(e.into()))?
        .f_type;
    // PROC_SUPER_MAGIC, SYSFS_MAGIC: kernel files, some checking the reader at read time.
    if matches!(fs_type as u64, 0x9fa0 | 0x6265_6572) {
        return Err(source_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a file of procfs or sysfs is not an image archive",
        )));
    }
    let mut file = PositionalReader { fd, offset: 0 };
    let mut magic = [0u8; 4];
    let mut n = 0;
    while n < magic.len() {
        match file.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(source_err(e)),
        }
    }
    file.rewind().map_err(source_err)?;
    let file = BufReader::with_capacity(1 << 20, file);
    let reader: Box<dyn Read> = if n >= 2 && magic[..2] == [0x1f, 0x8b] {
        Box::new(flate2::read::GzDecoder::new(file))
    } else if n == 4 && magic == [0x28, 0xb5, 0x2f, 0xfd] {
        Box::new(
            zstd::stream::read::Decoder::with_buffer(file).map_err(|source| {
                ImageError::Decompress {
                    path: label.to_path_buf(),
                    source,
                }
            })?,
        )
    } else {
        Box::new(file)
    };
    let mut tee = Blake3Tee::new(reader);
    let stats =
        install_image(&mut tee, label, rootfs, &ImageOptions::default()).map_err(|source| {
            ImageError::Unpack {
                path: label.to_path_buf(),
                source,
            }
        })?;
    Ok((stats, tee.digest()))
}

/// Hashes (blake3) what passes through it: the digest of a flat image is that of its tar
/// stream up to the end-of-archive marker.
struct Blake3Tee<R> {
    inner: R,
    hasher: blake3::Hasher,
}

impl<R> Blake3Tee<R> {
    fn new(inner: R) -> Self {
        Blake3Tee {
            inner,
            hasher: blake3::Hasher::new(),
        }
    }

    fn digest(&self) -> String {
        format!("blake3:{}", self.hasher.finalize().to_hex())
    }
}

impl<R: Read> Read for Blake3Tee<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Streams the directory open as `fd` into `rootfs`, read with `reader`'s credentials;
/// returns the install stats, the number of sockets the walk skipped and the `blake3:`
/// digest of the stream.
fn unpack_dir(
    fd: OwnedFd,
    label: &Path,
    rootfs: &Path,
    reader: &Credentials,
    helper_exe: &Path,
) -> Result<(ImageStats, u64, String), ImageError> {
    let helper_err = |source| ImageError::Helper {
        path: label.to_path_buf(),
        source,
    };
    let (rd, wr) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| helper_err(e.into()))?;
    let unpack = |rd: OwnedFd| {
        let mut tee = Blake3Tee::new(File::from(rd));
        install_image(&mut tee, label, rootfs, &ImageOptions::default())
            .map(|stats| (stats, tee.digest()))
            .map_err(|source| ImageError::Unpack {
                path: label.to_path_buf(),
                source,
            })
    };
    if reader.uid == 0 {
        // Root reads with the daemon's own rights: no process to drop privileges in.
        let walk_label = label.to_path_buf();
        let walker = std::thread::Builder::new()
            .name("image-walk".into())
            .spawn(move || {
                let out = io::BufWriter::with_capacity(1 << 20, File::from(wr));
                belayer_overlay::archive_tree(
                    fd.as_fd(),
                    &walk_label,
                    out,
                    &InstallLimits::default(),
                )
            })
            .map_err(helper_err)?;
        let installed = unpack(rd);
        let walked = walker
            .join()
            .map_err(|_| helper_err(io::Error::other("the image walk thread panicked")))?;
        return match (installed, walked) {
            (Ok((stats, digest)), Ok(walk)) => Ok((stats, walk.skipped_sockets, digest)),
            // The installer refused the stream and stopped reading it: its error is the cause.
            (Err(e), Err(walk)) if walk.is_broken_pipe() => Err(e),
            // The walk failing first cuts the stream: its error is the cause.
            (Err(_), Err(walk)) | (Ok(_), Err(walk)) => Err(ImageError::ReadTree {
                path: label.to_path_buf(),
                uid: 0,
                denied: false,
                message: crate::sys::error_chain(&walk),
            }),
            (Err(e), Ok(_)) => Err(e),
        };
    }
    let report = sys::memfd("belayer-tree-report").map_err(|e| helper_err(e.source))?;
    let groups: Vec<String> = reader.groups.iter().map(u32::to_string).collect();
    let mut child = {
        let mut cmd = Command::new(helper_exe);
        cmd.arg(HELPER_ARG)
            .arg("tree")
            .arg("--uid")
            .arg(reader.uid.to_string())
            .arg("--gid")
            .arg(reader.gid.to_string())
            .arg("--groups")
            .arg(groups.join(","))
            .arg("--label")
            .arg(OsString::from_vec(
                label.as_os_str().as_encoded_bytes().to_vec(),
            ))
            .env_clear()
            .stdin(Stdio::from(fd))
            .stdout(Stdio::from(wr))
            .stderr(report.try_clone().map_err(helper_err)?);
        // The command (and with it this process's copy of the pipe's write end) is dropped
        // at the end of this block, so the reader sees the end of the stream when the
        // helper exits.
        cmd.spawn().map_err(helper_err)?
    };
    let installed = unpack(rd);
    if installed.is_err() {
        // It may be blocked writing into the pipe nobody reads any more.
        let _ = child.kill();
    }
    let status = child.wait().map_err(helper_err)?;
    let mut text = String::new();
    let _ = (&report).rewind();
    let _ = (&report).take(MAX_REPORT_BYTES).read_to_string(&mut text);
    let text = text.trim();
    let line = text.lines().last().unwrap_or("");
    let read_tree = |denied: bool, message: String| ImageError::ReadTree {
        path: label.to_path_buf(),
        uid: reader.uid,
        denied,
        message,
    };
    let stopped_reading = line.starts_with("pipe=");
    match (installed, status.code()) {
        // The installer refused the stream: the helper only saw its pipe close.
        (Err(e), _) if stopped_reading => Err(e),
        // The helper failed by itself: its report is the cause (a cut stream follows).
        (_, Some(code)) if code != 0 => Err(match line.split_once('=') {
            Some(("denied", message)) => read_tree(true, message.to_string()),
            Some(("error", message)) => read_tree(false, message.to_string()),
            _ if line.is_empty() => read_tree(false, format!("no report, exit code {code}")),
            _ => read_tree(false, line.to_string()),
        }),
        (Err(e), _) => Err(e),
        (Ok((stats, digest)), Some(0)) => {
            let skipped = line
                .split_whitespace()
                .find_map(|f| f.strip_prefix("skipped_sockets="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            Ok((stats, skipped, digest))
        }
        (Ok(_), _) => Err(read_tree(false, format!("the helper ended with {status}"))),
    }
}

/// Reads a file with `pread` from its own offset (the descriptor's shared file offset,
/// which the client may still use, never moves).
struct PositionalReader {
    fd: OwnedFd,
    offset: u64,
}

impl Read for PositionalReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = rustix::io::pread(&self.fd, buf, self.offset)?;
        self.offset += n as u64;
        Ok(n)
    }
}

impl Seek for PositionalReader {
    fn seek(&mut self, pos: io::SeekFrom) -> io::Result<u64> {
        match pos {
            io::SeekFrom::Start(offset) => {
                self.offset = offset;
                Ok(offset)
            }
            _ => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "only absolute positions",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &Path) -> ImportSource {
        ImportSource::open_host_path(path).unwrap()
    }

    fn import(store: &ImageStore, name: &str, path: &Path) -> Result<ImageInfo, ImageError> {
        store.import(
            name,
            open(path),
            &Credentials::root(),
            0,
            Path::new("/nonexistent"),
        )
    }

    #[test]
    fn names() {
        assert!(valid_name("busybox"));
        assert!(valid_name("bookworm-python_3.11"));
        assert!(!valid_name(""));
        assert!(!valid_name(".hidden"));
        assert!(!valid_name("a//b"));
        assert!(!valid_name(&"x".repeat(256)));
    }

    #[test]
    fn import_dir_and_tar_variants() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        fs::create_dir_all(src.join("bin")).unwrap();
        std::os::unix::fs::symlink("busybox", src.join("bin/sh")).unwrap();
        fs::write(src.join("bin/busybox"), b"x").unwrap();
        let store = ImageStore::open(&tmp.path().join("state")).unwrap();
        let info = import(&store, "dir", &src).unwrap();
        assert_eq!(
            (info.bytes, info.owner_uid, info.dropped_devices),
            (1, 0, 0)
        );
        assert!(matches!(
            import(&store, "dir", &src),
            Err(ImageError::AlreadyExists(_))
        ));
        // tar, gzip, zstd
        let tar_path = tmp.path().join("img.tar");
        {
            let mut b = tar::Builder::new(fs::File::create(&tar_path).unwrap());
            b.append_dir_all(".", &src).unwrap();
            b.finish().unwrap();
        }
        let raw = fs::read(&tar_path).unwrap();
        let gz = tmp.path().join("img.tar.gz");
        {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(
                fs::File::create(&gz).unwrap(),
                flate2::Compression::fast(),
            );
            e.write_all(&raw).unwrap();
            e.finish().unwrap();
        }
        let zst = tmp.path().join("img.tar.zst");
        fs::write(&zst, zstd::encode_all(&raw[..], 1).unwrap()).unwrap();
        for (name, p) in [("t", &tar_path), ("g", &gz), ("z", &zst)] {
            store
                .import(name, open(p), &Credentials::root(), 1234, Path::new("/x"))
                .unwrap();
            assert!(store.lowers(name).unwrap().0[0]
                .join("bin/busybox")
                .is_file());
            assert_eq!(store.meta(name).unwrap().owner_uid, 1234);
        }
        assert_eq!(store.list().unwrap().len(), 4);
        store.remove("t").unwrap();
        assert!(matches!(store.lowers("t"), Err(ImageError::Unknown(_))));
        // no shell → rejected, nothing left behind
        let empty = tmp.path().join("empty");
        fs::create_dir(&empty).unwrap();
        assert!(matches!(
            import(&store, "e", &empty),
            Err(ImageError::NoShell(_))
        ));
        assert_eq!(store.list().unwrap().len(), 3);
        // neither a directory nor a regular file
        let err = import(&store, "n", Path::new("/dev/null")).unwrap_err();
        assert!(matches!(err, ImageError::Source { .. }), "{err}");
        let err = import(&store, "p", Path::new("/proc/self/status")).unwrap_err();
        assert!(matches!(err, ImageError::Source { .. }), "{err}");
        let leftovers: Vec<_> = fs::read_dir(store.dir())
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".import-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn a_shell_symlink_out_of_the_image_does_not_count() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        fs::create_dir_all(&src).unwrap();
        // `bin -> /usr/bin` resolves inside the image, where there is no sh.
        std::os::unix::fs::symlink("/usr/bin", src.join("bin")).unwrap();
        let store = ImageStore::open(&tmp.path().join("state")).unwrap();
        assert!(matches!(
            import(&store, "x", &src),
            Err(ImageError::NoShell(_))
        ));
    }

    #[test]
    fn a_tar_with_a_device_outside_dev_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let tar_path = tmp.path().join("dev.tar");
        {
            let mut b = tar::Builder::new(fs::File::create(&tar_path).unwrap());
            for (name, kind, major) in [
                ("bin/", tar::EntryType::Directory, 0),
                ("dev/", tar::EntryType::Directory, 0),
                ("dev/null", tar::EntryType::Char, 1),
                ("root/", tar::EntryType::Directory, 0),
                ("root/sda", tar::EntryType::Block, 8),
            ] {
                let mut h = tar::Header::new_gnu();
                h.set_path(name).unwrap();
                h.set_entry_type(kind);
                h.set_mode(0o755);
                h.set_uid(0);
                h.set_gid(0);
                h.set_mtime(0);
                h.set_size(0);
                h.set_device_major(major).unwrap();
                h.set_device_minor(if major == 1 { 3 } else { 0 }).unwrap();
                h.set_cksum();
                b.append(&h, io::empty()).unwrap();
            }
            b.finish().unwrap();
        }
        let store = ImageStore::open(&tmp.path().join("state")).unwrap();
        let err = import(&store, "dev", &tar_path).unwrap_err();
        let text = crate::sys::error_chain(&err);
        assert!(
            matches!(
                &err,
                ImageError::Unpack {
                    source: belayer_overlay::InstallError::DeviceInImage { .. },
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("root/sda"), "{text}");
        assert!(store.list().unwrap().is_empty());
    }
}
