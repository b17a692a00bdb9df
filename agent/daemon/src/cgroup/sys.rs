//! Control-file I/O and the one raw syscall (`poll`) of the cgroup module.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::CgroupError;

/// Longest single `poll` on `cgroup.events`: the loop re-reads the file at least this often, so a
/// lost notification costs at most this much latency.
const MAX_POLL_SLICE: Duration = Duration::from_millis(100);

/// Writes `value` to the control file `path` in one `write`.
pub(super) fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_owned(),
        source,
    })
}

/// Reads the whole control file `path`.
pub(super) fn read_file(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a control file holding one unsigned number (`max` is not accepted).
pub(super) fn read_u64(path: &Path) -> Result<u64, CgroupError> {
    let text = read_file(path)?;
    text.trim().parse().map_err(|_| CgroupError::Parse {
        path: path.to_path_buf(),
        contents: text,
    })
}

/// Reads a `cgroup.procs` file: one pid per line.
pub(super) fn read_pids(path: &Path) -> Result<Vec<i32>, CgroupError> {
    let text = read_file(path)?;
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.trim().parse().map_err(|_| CgroupError::Parse {
                path: path.to_path_buf(),
                contents: text.clone(),
            })
        })
        .collect()
}

/// Waits until `fd` reports a priority event (kernfs signals a changed file with
/// `POLLPRI | POLLERR`) or `timeout` passes. Returns whether an event arrived; `EINTR` counts as no
/// event.
fn poll_pri(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLPRI,
        revents: 0,
    };
    // Round up so that a sub-millisecond remainder still waits instead of spinning.
    let ms = timeout.as_micros().div_ceil(1000);
    let ms = libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX);
    // SAFETY: `pfd` is a valid pollfd that lives across the call and is exclusively borrowed by it;
    // nfds is 1, matching the single element passed; `fd` stays open for the call (borrowed).
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(err);
    }
    Ok(rc > 0)
}

/// The state a v2 `cgroup.events` file reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Events {
    /// `populated 1`: some process lives in the cgroup or a descendant.
    pub populated: bool,
    /// `frozen 1`: the cgroup and all descendants are frozen (Linux 5.2+).
    pub frozen: bool,
}

impl Events {
    fn parse(text: &str) -> Option<Events> {
        let mut populated = None;
        let mut frozen = false;
        for line in text.lines() {
            match line.split_once(' ') {
                Some(("populated", v)) => populated = Some(v.trim() == "1"),
                Some(("frozen", v)) => frozen = v.trim() == "1",
                _ => {}
            }
        }
        Some(Events {
            populated: populated?,
            frozen,
        })
    }
}

/// An open v2 `cgroup.events` file that can be waited on without busy polling.
#[derive(Debug)]
pub(super) struct EventsFile {
    path: PathBuf,
    file: File,
}

impl EventsFile {
    /// Opens `<dir>/cgroup.events`.
    pub fn open(dir: &Path) -> Result<EventsFile, CgroupError> {
        let path = dir.join("cgroup.events");
        let file = File::open(&path).map_err(|source| CgroupError::Read {
            path: path.clone(),
            source,
        })?;
        Ok(EventsFile { path, file })
    }

    /// Reads the current state. Reading also re-arms the kernfs notification for [`Self::wait_until`].
    pub fn read(&self) -> Result<Events, CgroupError> {
        let mut buf = [0u8; 256];
        let n = self
            .file
            .read_at(&mut buf, 0)
            .map_err(|source| CgroupError::Read {
                path: self.path.clone(),
                source,
            })?;
        let text = String::from_utf8_lossy(&buf[..n]);
        Events::parse(&text).ok_or_else(|| CgroupError::Parse {
            path: self.path.clone(),
            contents: text.into_owned(),
        })
    }

    /// Waits until `done` holds for the events or `deadline` passes; returns the last events read
    /// and whether `done` held.
    pub fn wait_until(
        &self,
        deadline: Instant,
        done: impl Fn(Events) -> bool,
    ) -> Result<(Events, bool), CgroupError> {
        loop {
            let events = self.read()?;
            if done(events) {
                return Ok((events, true));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok((events, false));
            }
            let slice = (deadline - now).min(MAX_POLL_SLICE);
            poll_pri(self.file.as_fd(), slice).map_err(|source| CgroupError::Poll {
                path: self.path.clone(),
                source,
            })?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_parse() {
        let e = Events::parse("populated 1\nfrozen 0\n").unwrap();
        assert_eq!(
            e,
            Events {
                populated: true,
                frozen: false
            }
        );
        let e = Events::parse("populated 0\n").unwrap();
        assert!(!e.populated && !e.frozen);
        assert!(Events::parse("frozen 1\n").is_none());
    }

    #[test]
    fn poll_times_out_without_event() {
        let Some(v2) = super::super::CgroupLayout::detect().unwrap().v2_mount() else {
            return;
        };
        let dir = v2.join(format!("belayer-test-poll-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let events = EventsFile::open(&dir).unwrap();
        let start = Instant::now();
        let (e, done) = events
            .wait_until(start + Duration::from_millis(30), |e| e.populated)
            .unwrap();
        assert!(!done && !e.populated);
        assert!(start.elapsed() >= Duration::from_millis(30));
        std::fs::remove_dir(&dir).unwrap();
    }
}
