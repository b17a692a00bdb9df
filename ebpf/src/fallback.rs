//! The fallback detector, used when BPF cannot be loaded: a pidfd per sandbox init (readable
//! when it exits; `waitid(WNOWAIT)` gives the status of our own children without reaping),
//! `cgroup.events` (`populated 0`: nothing left) and the memory controller's `oom_kill`
//! counter, polled every 20 ms.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::sys;
use crate::types::{read_oom_kills, Fault, Sink, Target, Targets, TraceEvent, TracerError};

/// Poll period: the longest a fault waits to be noticed (init death wakes the poll at once).
const PERIOD_MS: i32 = 20;

struct Watch {
    init_pid: i32,
    pidfd: OwnedFd,
    events: Option<File>,
    oom_seen: Option<u64>,
    done: bool,
}

pub(crate) struct FallbackTracer {
    watches: Arc<Mutex<HashMap<u64, Watch>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FallbackTracer {
    pub(crate) fn start(targets: Targets, sink: Sink) -> Result<FallbackTracer, TracerError> {
        let watches: Arc<Mutex<HashMap<u64, Watch>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (w, flag) = (watches.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("sandbox-watch".into())
            .spawn(move || run(w, targets, sink, flag))
            .map_err(TracerError::Thread)?;
        Ok(FallbackTracer {
            watches,
            stop,
            thread: Some(thread),
        })
    }

    pub(crate) fn track(&self, target: &Target) -> Result<(), TracerError> {
        let pidfd = sys::pidfd_open(target.init_pid).map_err(|source| TracerError::Pidfd {
            pid: target.init_pid,
            source,
        })?;
        let path = target.cgroup_dir.join("cgroup.events");
        let events = match File::open(&path) {
            Ok(f) => Some(f),
            Err(source) if source.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(TracerError::Open { path, source }),
        };
        let oom_seen = target.oom_events.as_deref().and_then(read_oom_kills);
        self.watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                target.cgroup_id,
                Watch {
                    init_pid: target.init_pid,
                    pidfd,
                    events,
                    oom_seen,
                    done: false,
                },
            );
        Ok(())
    }

    pub(crate) fn untrack(&self, cgroup_id: u64) {
        self.watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&cgroup_id);
    }
}

impl Drop for FallbackTracer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn populated(f: &File) -> Option<bool> {
    let mut buf = [0u8; 256];
    let n = std::os::unix::fs::FileExt::read_at(f, &mut buf, 0).ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("populated "))
        .map(|v| v.trim() != "0")
}

fn pidfd_exited(pidfd: &OwnedFd) -> bool {
    let mut p = [libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    sys::poll(&mut p, 0).is_ok_and(|n| n > 0 && p[0].revents & libc::POLLIN != 0)
}

fn run(
    watches: Arc<Mutex<HashMap<u64, Watch>>>,
    targets: Targets,
    sink: Sink,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        // Duplicate the descriptors so the poll runs without holding the lock.
        let fds: Vec<(u64, OwnedFd)> = watches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, w)| !w.done)
            .filter_map(|(id, w)| w.pidfd.as_fd().try_clone_to_owned().ok().map(|f| (*id, f)))
            .collect();
        let mut pfds: Vec<libc::pollfd> = fds
            .iter()
            .map(|(_, f)| libc::pollfd {
                fd: f.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        if pfds.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(PERIOD_MS as u64));
        } else if let Err(e) = sys::poll(&mut pfds, PERIOD_MS) {
            tracing::error!(error = %e, "polling sandbox pidfds failed; watcher stops");
            return;
        }
        let mut faults = Vec::new();
        {
            let mut map = watches.lock().unwrap_or_else(|p| p.into_inner());
            for (id, w) in map.iter_mut() {
                if w.done {
                    continue;
                }
                // Asked again for every watch: one tracked after the poll started may have
                // exited already.
                let exited = pidfd_exited(&w.pidfd);
                if let (Some(path), Some(seen)) = (
                    targets
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(id)
                        .and_then(|t| t.oom_events.clone()),
                    w.oom_seen,
                ) {
                    if let Some(now) = read_oom_kills(&path) {
                        if now > seen {
                            w.oom_seen = Some(now);
                            faults.push((*id, Fault::Oom { pid: None }));
                        }
                    }
                }
                if exited {
                    let (exit_code, signal) =
                        sys::waitid_nowait(w.pidfd.as_fd()).unwrap_or((None, None));
                    w.done = true;
                    faults.push((
                        *id,
                        Fault::InitExited {
                            pid: w.init_pid,
                            exit_code,
                            signal,
                        },
                    ));
                } else if w.events.as_ref().and_then(populated) == Some(false) {
                    w.done = true;
                    faults.push((*id, Fault::CgroupEmpty));
                }
            }
        }
        for (cgroup_id, fault) in faults {
            tracing::debug!(cgroup_id, %fault, "sandbox fault (fallback)");
            sink(TraceEvent {
                cgroup_id,
                fault,
                observed: Instant::now(),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn populated_parses() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cgroup.events");
        std::fs::write(&p, "populated 0\nfrozen 0\n").unwrap();
        assert_eq!(populated(&File::open(&p).unwrap()), Some(false));
        std::fs::write(&p, "populated 1\nfrozen 0\n").unwrap();
        let mut s = String::new();
        File::open(&p).unwrap().read_to_string(&mut s).unwrap();
        assert_eq!(populated(&File::open(&p).unwrap()), Some(true));
    }
}
