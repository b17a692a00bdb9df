//! Raw socket calls that nix does not wrap, behind safe functions.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

/// `SO_PEERGROUPS` (Linux 4.13+): value 59 on every architecture using the asm-generic socket
/// option numbers.
#[cfg(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64",
    target_arch = "powerpc64",
    target_arch = "s390x",
    target_arch = "loongarch64"
))]
const SO_PEERGROUPS: Option<libc::c_int> = Some(59);
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64",
    target_arch = "powerpc64",
    target_arch = "s390x",
    target_arch = "loongarch64"
)))]
const SO_PEERGROUPS: Option<libc::c_int> = None;

/// Supplementary groups of the peer of a connected Unix socket, as they were when it called
/// `connect(2)` (`getsockopt(SO_PEERGROUPS)`).
///
/// Errors: the errno of `getsockopt`; `ENOPROTOOPT` where the kernel or architecture lacks the
/// option.
pub(crate) fn peer_groups(socket: BorrowedFd<'_>) -> Result<Vec<u32>, Errno> {
    let Some(option) = SO_PEERGROUPS else {
        return Err(Errno::ENOPROTOOPT);
    };
    let gid_size = std::mem::size_of::<libc::gid_t>();
    let mut groups: Vec<libc::gid_t> = vec![0; 32];
    loop {
        let mut len = (groups.len() * gid_size) as libc::socklen_t;
        // SAFETY: `groups` is an initialised, writable buffer of exactly `len` bytes that lives
        // across the call; the kernel writes at most `len` bytes into it and stores the number
        // of bytes written (or, with ERANGE, the number needed) into `len`, a valid socklen_t.
        let rc = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if rc == 0 {
            groups.truncate(len as usize / gid_size);
            return Ok(groups);
        }
        let errno = Errno::last();
        let needed = len as usize / gid_size;
        if errno == Errno::ERANGE && needed > groups.len() {
            groups.resize(needed, 0);
            continue;
        }
        return Err(errno);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn peer_groups_of_a_socket_pair_are_our_own_groups() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut ours: Vec<u32> = nix::unistd::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        let mut theirs = peer_groups(a.as_fd()).unwrap();
        ours.sort_unstable();
        theirs.sort_unstable();
        assert_eq!(theirs, ours);
    }
}
