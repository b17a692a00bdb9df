//! The helper executable as a sealed, read-only memfd.
//!
//! Helpers end up inside sandboxes: the exec helper joins a sandbox's namespaces before it
//! runs the action. If it were a host file, a sandbox could reach it (runc CVE-2019-5736: make
//! `/bin/sh` a link to `/proc/self/exe`, keep an `O_PATH` fd on the host binary, reopen it for
//! writing once the daemon stops) and own the host at the next start. So `belayerd` copies the
//! helper binary once, at start, into a memfd, seals it against every change
//! (`F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`), and starts helpers from that
//! memfd (`/proc/self/fd/<n>` of the daemon). `/proc/<helper>/exe` then names an anonymous,
//! immutable file that no process can write, and no host executable is ever reachable from a
//! sandbox.

use std::fs;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Name of the helper binary, installed next to `belayerd` and `belayer`.
pub const HELPER_BINARY: &str = "belayer-helper";

/// Errors loading the helper.
#[derive(Debug, thiserror::Error)]
pub enum HelperImageError {
    /// The helper binary could not be opened or read.
    #[error("cannot read the helper binary {path}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The helper binary is not a root-owned regular file that only root can write.
    #[error("helper binary {path} must be a regular file owned by root and not writable by group or others (uid {uid}, mode {mode:o})")]
    Unsafe {
        /// Path.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// Its mode.
        mode: u32,
    },
    /// Making or sealing the memfd failed.
    #[error("cannot make the sealed helper memfd ({call})")]
    Memfd {
        /// The failed call.
        call: &'static str,
        /// Cause.
        #[source]
        source: io::Error,
    },
}

/// The helper executable, sealed in a memfd for the life of the daemon.
#[derive(Debug)]
pub struct HelperImage {
    memfd: OwnedFd,
    source: PathBuf,
    bytes: u64,
}

/// Seals `memfd` against writes, size changes and further seals. The kernel answers EBUSY
/// while a page of it is still pinned by I/O in flight (it waits a little itself first): try
/// again for up to about a second.
fn seal(memfd: &OwnedFd) -> rustix::io::Result<()> {
    let seals = rustix::fs::SealFlags::WRITE
        | rustix::fs::SealFlags::SHRINK
        | rustix::fs::SealFlags::GROW
        | rustix::fs::SealFlags::SEAL;
    let mut tries = 0;
    loop {
        match rustix::fs::fcntl_add_seals(memfd, seals) {
            Err(rustix::io::Errno::BUSY) if tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

impl HelperImage {
    /// The helper next to the running executable (`<dir of /proc/self/exe>/belayer-helper`).
    pub fn beside_current_exe() -> Result<HelperImage, HelperImageError> {
        let exe = std::env::current_exe().map_err(|source| HelperImageError::Read {
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?;
        Self::load(&exe.with_file_name(HELPER_BINARY))
    }

    /// Copies the binary at `path` into a sealed memfd.
    ///
    /// Errors: [`HelperImageError::Read`], [`HelperImageError::Unsafe`] (not root-owned, or
    /// writable by group or others: anyone who can change it could run code as root),
    /// [`HelperImageError::Memfd`].
    pub fn load(path: &Path) -> Result<HelperImage, HelperImageError> {
        let read_err = |source| HelperImageError::Read {
            path: path.to_path_buf(),
            source,
        };
        let mut file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(read_err)?;
        let meta = file.metadata().map_err(read_err)?;
        if !meta.is_file() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
            return Err(HelperImageError::Unsafe {
                path: path.to_path_buf(),
                uid: meta.uid(),
                mode: meta.mode() & 0o7777,
            });
        }
        let memfd_err = |call| move |source| HelperImageError::Memfd { call, source };
        let memfd = rustix::fs::memfd_create(
            "belayer-helper",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| HelperImageError::Memfd {
            call: "memfd_create",
            source: e.into(),
        })?;
        let mut out = fs::File::from(memfd);
        // Plain reads and writes, not `io::copy` (which splices or sendfiles file to file):
        // pages still referenced by a pipe or a page-cache transfer make F_SEAL_WRITE fail
        // with EBUSY.
        let mut bytes = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = io::Read::read(&mut file, &mut buf).map_err(memfd_err("read"))?;
            if n == 0 {
                break;
            }
            io::Write::write_all(&mut out, &buf[..n]).map_err(memfd_err("write"))?;
            bytes += n as u64;
        }
        out.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o555))
            .map_err(memfd_err("fchmod"))?;
        let memfd = OwnedFd::from(out);
        seal(&memfd).map_err(|e| HelperImageError::Memfd {
            call: "fcntl(F_ADD_SEALS)",
            source: e.into(),
        })?;
        tracing::debug!(source = %path.display(), bytes, "helper sealed in a memfd");
        Ok(HelperImage {
            memfd,
            source: path.to_path_buf(),
            bytes,
        })
    }

    /// The path that executes the sealed copy (`/proc/self/fd/<n>`; valid in this process
    /// and in children until they exec).
    pub fn exec_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.memfd.as_raw_fd()))
    }

    /// The binary it was copied from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Size of the copy, bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_copy_runs_and_cannot_be_written() {
        let image = HelperImage::load(Path::new("/bin/true")).unwrap();
        let status = std::process::Command::new(image.exec_path())
            .status()
            .unwrap();
        assert!(status.success());
        let err = fs::OpenOptions::new()
            .write(true)
            .open(image.exec_path())
            .map(|mut f| io::Write::write_all(&mut f, b"x"))
            .and_then(|r| r);
        assert!(err.is_err(), "a sealed helper accepted a write");
    }

    #[test]
    fn unsafe_helpers_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("h");
        fs::copy("/bin/true", &p).unwrap();
        fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        assert!(matches!(
            HelperImage::load(&p),
            Err(HelperImageError::Unsafe { .. })
        ));
        let link = dir.path().join("l");
        std::os::unix::fs::symlink("/bin/true", &link).unwrap();
        assert!(matches!(
            HelperImage::load(&link),
            Err(HelperImageError::Read { .. })
        ));
    }
}
