//! The sandbox filter compiled once per daemon and handed to each init and exec helper in a
//! sealed memfd.
//!
//! Compiling the profile with libseccomp takes about 1.5 ms, and an exec helper is a fresh
//! process per action: compiled there, it was the largest single step of an action's start.
//! `belayerd` compiles it once at start ([`SealedFilter::compile`]) into a memfd sealed against
//! every change (`F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) and gives each
//! helper a read-only descriptor of it (`--seccomp-fd N`). The helper checks the seals, reads
//! the program and closes the descriptor before it forks the sandbox process
//! ([`from_helper_arg`]): what it installs is byte for byte what the daemon compiled, and no
//! process, the daemon included, can change it afterwards. `belayer-helper` itself then never
//! calls libseccomp and does not load it.

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use super::{SandboxFilter, SeccompError};
use crate::sys::{self, SyscallError};

/// Largest program the kernel takes (`BPF_MAXINSNS`), in instructions.
const MAX_INSTRUCTIONS: usize = 4096;

/// Bytes of one classic-BPF instruction (`struct sock_filter`).
const INSTRUCTION_BYTES: usize = 8;

/// The compiled filter in a sealed memfd: a read-only descriptor, close-on-exec in the daemon.
#[derive(Debug)]
pub struct SealedFilter {
    reader: OwnedFd,
    instructions: usize,
}

impl SealedFilter {
    /// Compiles the profile ([`SandboxFilter::build`]) and seals the program in a memfd.
    ///
    /// Errors: [`SeccompError::Compile`]; [`SeccompError::Load`] when the memfd cannot be made,
    /// filled or sealed.
    pub fn compile() -> Result<SealedFilter, SeccompError> {
        let filter = SandboxFilter::build()?;
        let bytes = filter.to_bytes();
        let load = |e: SyscallError| SeccompError::Load {
            step: "memfd",
            source: std::io::Error::other(e),
        };
        let source = sys::memfd("belayer-seccomp-source").map_err(load)?;
        std::os::unix::fs::FileExt::write_all_at(&source, &bytes, 0).map_err(|source| {
            SeccompError::Load {
                step: "memfd write",
                source,
            }
        })?;
        let memfd = sys::SealableMemfd::create("belayer-seccomp").map_err(load)?;
        let reader = memfd
            .fill_and_seal(source.as_fd(), None)
            .map_err(load)?
            .try_clone_to_owned()
            .map_err(|source| SeccompError::Load {
                step: "dup",
                source,
            })?;
        Ok(SealedFilter {
            reader,
            instructions: filter.instructions(),
        })
    }

    /// The read-only descriptor to give a helper.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.reader.as_fd()
    }

    /// Instructions of the program.
    pub fn instructions(&self) -> usize {
        self.instructions
    }
}

/// In a helper: takes the descriptor named by `--seccomp-fd` (placed by the daemon),
/// checks it is sealed, reads the program from it and closes it.
///
/// Errors: [`SeccompError::Load`]: no or a bad fd number, an unsealed memfd, a failed read,
/// or bytes that are not a program the kernel would take.
pub fn from_helper_arg(arg: Option<&str>) -> Result<SandboxFilter, SeccompError> {
    let bad = |step| SeccompError::Load {
        step,
        source: std::io::ErrorKind::InvalidInput.into(),
    };
    let fd: RawFd = arg
        .and_then(|s| s.parse().ok())
        .filter(|fd| *fd > 2)
        .ok_or_else(|| bad("--seccomp-fd"))?;
    // SAFETY: the daemon places the sealed filter at this number for the helper alone
    // (`helper::spawn`, the init's `pre_exec`); nothing else in this single-threaded process
    // owns or closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    read_program(fd.as_fd())
}

/// Reads and checks the program held by the sealed memfd `fd`.
fn read_program(fd: BorrowedFd<'_>) -> Result<SandboxFilter, SeccompError> {
    let load = |step| {
        move |e: rustix::io::Errno| SeccompError::Load {
            step,
            source: e.into(),
        }
    };
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(load("fcntl(F_GET_SEALS)"))?;
    let needed = rustix::fs::SealFlags::WRITE
        | rustix::fs::SealFlags::SHRINK
        | rustix::fs::SealFlags::GROW
        | rustix::fs::SealFlags::SEAL;
    if !seals.contains(needed) {
        return Err(SeccompError::Load {
            step: "seals",
            source: std::io::ErrorKind::PermissionDenied.into(),
        });
    }
    // One byte more than the largest program: a longer file is refused, not cut.
    let mut bytes = vec![0u8; MAX_INSTRUCTIONS * INSTRUCTION_BYTES + 1];
    let mut len = 0;
    while len < bytes.len() {
        match rustix::io::pread(fd, &mut bytes[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(load("pread")(e)),
        }
    }
    bytes.truncate(len);
    SandboxFilter::from_bytes(&bytes).ok_or(SeccompError::Load {
        step: "program",
        source: std::io::ErrorKind::InvalidData.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sealed_program_is_the_compiled_one() {
        let sealed = SealedFilter::compile().unwrap();
        let read = read_program(sealed.as_fd()).unwrap();
        assert_eq!(read.to_bytes(), SandboxFilter::build().unwrap().to_bytes());
        assert_eq!(read.instructions(), sealed.instructions());
        // Read-only and sealed: neither this descriptor nor a reopened one can change it.
        let path = format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&sealed.as_fd())
        );
        assert!(rustix::io::write(sealed.as_fd(), b"x").is_err());
        if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&path) {
            assert!(std::os::unix::fs::FileExt::write_at(&f, b"x", 0).is_err());
            assert!(f.set_len(0).is_err());
        }
    }

    #[test]
    fn unsealed_or_malformed_programs_are_refused() {
        let f = sys::memfd("t").unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0u8; 16], 0).unwrap();
        assert!(matches!(
            read_program(f.as_fd()),
            Err(SeccompError::Load { step: "seals", .. })
        ));
        for bytes in [
            &[][..],
            &[0u8; 12][..],
            &[0u8; (MAX_INSTRUCTIONS + 1) * 8][..],
        ] {
            let src = sys::memfd("src").unwrap();
            std::os::unix::fs::FileExt::write_all_at(&src, bytes, 0).unwrap();
            let memfd = sys::SealableMemfd::create("t").unwrap();
            let reader = memfd.fill_and_seal(src.as_fd(), None).unwrap();
            assert!(
                matches!(
                    read_program(reader),
                    Err(SeccompError::Load {
                        step: "program",
                        ..
                    })
                ),
                "{} bytes",
                bytes.len()
            );
        }
        assert!(from_helper_arg(None).is_err());
        assert!(from_helper_arg(Some("1")).is_err());
        assert!(from_helper_arg(Some("x")).is_err());
    }
}
