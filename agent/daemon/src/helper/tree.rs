//! The `tree` helper: streams a tar of a directory, read with a socket client's rights.
//!
//! `belayerd` imports a directory image for a non-root peer through this helper: the
//! directory the peer passed (`SCM_RIGHTS`) is its stdin, a pipe to the daemon its stdout, a
//! memfd its stderr. Before it reads anything it closes every other descriptor and drops to
//! the peer's supplementary groups, gid and uid (`setgroups`, `setresgid`, `setresuid`: real,
//! effective and saved ids, so no way back; a non-root uid leaves no capabilities, which is
//! checked), then walks the directory with [`belayer_overlay::archive_tree`] (no symlink is
//! ever followed) and writes the tar to stdout. Every `openat` of the walk is thus checked
//! against the peer's own rights: what the peer cannot read fails the walk, it never reaches
//! the image. The helper then makes itself non-dumpable (`PR_SET_DUMPABLE`; the kernel
//! usually did already when the credentials changed), so the peer cannot ptrace it or open
//! its descriptors.
//!
//! The last line on stderr is the report: `ok entries=<n> bytes=<n> skipped_sockets=<n>`;
//! `denied=<message>` (an entry the peer may not read), `pipe=<message>` (the daemon stopped
//! reading) or `error=<message>` with exit code 1 (125 for bad arguments).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::fd::{BorrowedFd, FromRawFd};
use std::path::Path;

use nix::unistd::{getresgid, getresuid, setgroups, setresgid, setresuid, Gid, Uid};

use super::Args;
use crate::sys;

/// Errors of the tree helper.
#[derive(Debug, thiserror::Error)]
pub enum TreeHelperError {
    /// A required argument is missing or malformed.
    #[error("bad argument {0}")]
    BadArgument(&'static str),
    /// Dropping to the peer's credentials failed or did not stick.
    #[error("cannot drop to uid {uid} gid {gid}: {step}")]
    DropCredentials {
        /// Target uid.
        uid: u32,
        /// Target gid.
        gid: u32,
        /// The step that failed.
        step: String,
    },
    /// Closing inherited descriptors failed.
    #[error(transparent)]
    Syscall(#[from] sys::SyscallError),
    /// Walking or writing the tree failed.
    #[error(transparent)]
    Archive(#[from] belayer_overlay::CaptureError),
    /// Flushing the stream failed.
    #[error("writing the tar stream failed")]
    Flush(#[source] std::io::Error),
}

impl TreeHelperError {
    /// Whether the walk failed because the peer may not read an entry.
    fn is_denied(&self) -> bool {
        let errno = match self {
            TreeHelperError::Archive(belayer_overlay::CaptureError::ReadUpper {
                source, ..
            }) => source.errno(),
            _ => None,
        };
        matches!(errno, Some(libc::EACCES | libc::EPERM))
    }

    /// Whether writing the stream failed because the daemon stopped reading it.
    fn is_broken_pipe(&self) -> bool {
        match self {
            TreeHelperError::Archive(e) => e.is_broken_pipe(),
            TreeHelperError::Flush(e) => e.raw_os_error() == Some(libc::EPIPE),
            _ => false,
        }
    }
}

/// Entry point; returns the helper's exit code.
pub fn main(args: &[String]) -> i32 {
    // SAFETY: the daemon gives this helper a memfd as stderr and nothing else in this
    // process owns descriptor 2 (std never closes it).
    let mut report = unsafe { File::from_raw_fd(2) };
    let code = match run(&Args::new(args)) {
        Ok(stats) => {
            let _ = writeln!(
                report,
                "ok entries={} bytes={} skipped_sockets={}",
                stats.entries, stats.bytes, stats.skipped_sockets
            );
            0
        }
        Err(e) => {
            // `denied=`: the peer may not read an entry (EACCES/EPERM); `pipe=`: the daemon
            // stopped reading (it refused the stream); `error=`: anything else.
            let key = if e.is_denied() {
                "denied"
            } else if e.is_broken_pipe() {
                "pipe"
            } else {
                "error"
            };
            let _ = writeln!(report, "{key}={}", sys::error_chain(&e));
            if matches!(e, TreeHelperError::BadArgument(_)) {
                125
            } else {
                1
            }
        }
    };
    code
}

fn run(args: &Args<'_>) -> Result<belayer_overlay::CaptureStats, TreeHelperError> {
    let number = |name: &'static str| -> Result<u32, TreeHelperError> {
        args.one(name)
            .and_then(|v| v.parse().ok())
            .ok_or(TreeHelperError::BadArgument(name))
    };
    let uid = number("--uid")?;
    let gid = number("--gid")?;
    let groups: Vec<Gid> = args
        .one("--groups")
        .ok_or(TreeHelperError::BadArgument("--groups"))?
        .split(',')
        .filter(|g| !g.is_empty())
        .map(|g| g.parse().map(Gid::from_raw))
        .collect::<Result<_, _>>()
        .map_err(|_| TreeHelperError::BadArgument("--groups"))?;
    let label = args.one("--label").unwrap_or("source");
    // Nothing but stdin (the tree), stdout (the stream) and stderr (the report) stays open.
    sys::close_range(3, u32::MAX)?;
    drop_credentials(uid, gid, &groups)?;
    // The kernel already made this process non-dumpable when its credentials changed (unless
    // fs.suid_dumpable is 1): make sure, so the peer cannot ptrace it or open its fds.
    nix::sys::prctl::set_dumpable(false).map_err(|e| TreeHelperError::DropCredentials {
        uid,
        gid,
        step: format!("prctl(PR_SET_DUMPABLE): {e}"),
    })?;
    // SAFETY: descriptor 0 is the directory the daemon passed as stdin; it stays open for
    // the whole life of this process and is only borrowed here.
    let tree = unsafe { BorrowedFd::borrow_raw(0) };
    // SAFETY: descriptor 1 is the pipe to the daemon, owned by nothing else in this process
    // (std's stdout is never used by this helper).
    let stdout = unsafe { File::from_raw_fd(1) };
    let mut out = BufWriter::with_capacity(1 << 20, stdout);
    let stats = belayer_overlay::archive_tree(
        tree,
        Path::new(label),
        &mut out,
        &belayer_overlay::InstallLimits::default(),
    )?;
    out.flush().map_err(TreeHelperError::Flush)?;
    Ok(stats)
}

/// Becomes `uid`/`gid` with exactly `groups`, for good, and checks that it stuck.
fn drop_credentials(uid: u32, gid: u32, groups: &[Gid]) -> Result<(), TreeHelperError> {
    let fail = |step: String| TreeHelperError::DropCredentials { uid, gid, step };
    setgroups(groups).map_err(|e| fail(format!("setgroups: {e}")))?;
    let (g, u) = (Gid::from_raw(gid), Uid::from_raw(uid));
    setresgid(g, g, g).map_err(|e| fail(format!("setresgid: {e}")))?;
    setresuid(u, u, u).map_err(|e| fail(format!("setresuid: {e}")))?;
    let ids = getresuid().map_err(|e| fail(format!("getresuid: {e}")))?;
    let gids = getresgid().map_err(|e| fail(format!("getresgid: {e}")))?;
    if [ids.real, ids.effective, ids.saved] != [u, u, u]
        || [gids.real, gids.effective, gids.saved] != [g, g, g]
    {
        return Err(fail("the ids did not change".into()));
    }
    if uid != 0 {
        if setresuid(Uid::from_raw(0), Uid::from_raw(0), Uid::from_raw(0)).is_ok() {
            return Err(fail("root could be regained".into()));
        }
        for set in [caps::CapSet::Effective, caps::CapSet::Permitted] {
            match caps::read(None, set) {
                Ok(held) if held.is_empty() => {}
                Ok(held) => return Err(fail(format!("capabilities left: {held:?}"))),
                Err(e) => return Err(fail(format!("reading capabilities: {e}"))),
            }
        }
    }
    Ok(())
}
