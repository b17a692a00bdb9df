//! Keeping CRIU's kernel-feature cache ("kdat") alive on hosts whose `/run` is not a tmpfs.
//!
//! Every `criu` run starts by probing the kernel (pagemap, vDSO layout, netfilter, TCP repair,
//! ...). CRIU caches the result in `<RUNDIR>/criu.kdat` (`RUNDIR` is fixed at build time, `/run`
//! by default) but only keeps the file when it sits on a tmpfs, so that a reboot into another
//! kernel cannot leave a stale cache behind ("Can't keep kdat cache on non-tempfs"). Systemd hosts
//! have a tmpfs `/run` and need nothing. Where `/run` is an ordinary directory, every dump and
//! every restore re-probes: about 20 ms of a 35 ms dump of a shell loop on an idle development
//! machine (the same dump took 14 ms with the cache), 40-60 ms when the machine is busy.
//!
//! [`Criu::kdat_cache`] fixes that without touching anything but CRIU's own cache path:
//! 1. a tiny tmpfs (1 MiB, mode 0700) is mounted on a caller-chosen backing dir;
//! 2. `criu check --feature mnt_id` runs once in a private mount namespace where that tmpfs is
//!    bind-mounted over `RUNDIR`, so CRIU probes the kernel and saves `criu.kdat` into the tmpfs
//!    (the cache holds kernel facts only, nothing tied to a mount namespace);
//! 3. the saved file is bind-mounted over `<RUNDIR>/criu.kdat` in the caller's namespace (an empty
//!    placeholder file is created there if needed), where CRIU loads it (loading does not check
//!    the file system; only saving does);
//! 4. one more run confirms that CRIU says "Loaded kdat cache".
//!
//! The cache lives on tmpfs, so a reboot drops it; the placeholder left behind is empty, which
//! CRIU treats as stale and deletes. A CRIU binary built at another time rejects the cache (its
//! magic differs) and probes as before; call [`Criu::kdat_cache`] again after changing CRIU.

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use crate::locate::Criu;
use crate::log::LogTail;
use crate::run::{self, ChildSetup};
use crate::sys::{self, SyscallError};

/// Size limit of the backing tmpfs, in bytes (the cache is about 1 KiB; logs of the three probe
/// runs pass through it too).
const BACKING_TMPFS_BYTES: u64 = 1 << 20;

/// CRIU's cache file name (`KERNDAT_CACHE_NAME`).
const KDAT_FILE_NAME: &str = "criu.kdat";

/// How many times the bind is retried when a concurrent `criu` deletes the placeholder (CRIU
/// unlinks a cache file it finds stale, and an empty placeholder is stale).
const BIND_ATTEMPTS: usize = 5;

/// How the kdat cache is kept, as found by [`Criu::kdat_cache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdatMode {
    /// CRIU already loaded a cache (a tmpfs `RUNDIR`, or a binding kept by an earlier call).
    AlreadyLoaded,
    /// `RUNDIR` is a tmpfs: CRIU saves and loads the cache by itself.
    Native,
    /// The cache is bind-mounted from the backing tmpfs; undone when the guard drops.
    Bound,
}

/// Guard for a kdat cache set up by [`Criu::kdat_cache`]. Dropping it unmounts what it mounted
/// (the binding over `criu.kdat`, the backing tmpfs) and removes the placeholder it created;
/// [`KdatCache::leak`] keeps them for the life of the host.
#[derive(Debug)]
pub struct KdatCache {
    kdat_path: PathBuf,
    mode: KdatMode,
    /// The backing dir, when this guard mounted the tmpfs on it.
    tmpfs: Option<PathBuf>,
    bound: bool,
    placeholder_created: bool,
    armed: bool,
}

/// Why the kdat cache could not be set up. Whatever was mounted before the failure is undone.
#[derive(Debug, thiserror::Error)]
pub enum KdatError {
    /// The backing dir could not be created.
    #[error("cannot create kdat backing dir {}", path.display())]
    CreateBackingDir {
        /// The backing dir.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A file system type could not be read.
    #[error("cannot tell whether {} is on tmpfs", path.display())]
    Statfs {
        /// The path asked about.
        path: PathBuf,
        /// The failed syscall.
        #[source]
        source: SyscallError,
    },
    /// The backing tmpfs could not be mounted.
    #[error("cannot mount a tmpfs on {}", path.display())]
    MountTmpfs {
        /// The backing dir.
        path: PathBuf,
        /// The failed syscall.
        #[source]
        source: SyscallError,
    },
    /// `criu` could not be started.
    #[error("cannot run {}", criu.display())]
    Spawn {
        /// The binary.
        criu: PathBuf,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// A `criu check` run failed.
    #[error("criu check ({step}) failed ({status}): {log}")]
    Check {
        /// `"probe"`, `"prime"` or `"verify"`.
        step: &'static str,
        /// CRIU's exit status.
        status: ExitStatus,
        /// The end of CRIU's log.
        log: LogTail,
    },
    /// CRIU's log did not name its kdat cache file.
    #[error("criu did not name its kdat cache file: {log}")]
    CachePathUnknown {
        /// The end of CRIU's log.
        log: LogTail,
    },
    /// The private-namespace run did not save a cache into the backing tmpfs.
    #[error("criu saved no kdat cache at {}: {log}", path.display())]
    NotSaved {
        /// Where the cache was expected.
        path: PathBuf,
        /// The end of CRIU's log.
        log: LogTail,
    },
    /// The placeholder file for the bind mount could not be created.
    #[error("cannot create the placeholder {}", path.display())]
    Placeholder {
        /// CRIU's cache path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The cache could not be bind-mounted over CRIU's cache path.
    #[error("cannot bind the kdat cache onto {}", path.display())]
    Bind {
        /// CRIU's cache path.
        path: PathBuf,
        /// The failed syscall.
        #[source]
        source: SyscallError,
    },
    /// After binding, CRIU still did not load the cache.
    #[error("criu does not load the bound kdat cache: {log}")]
    NotLoaded {
        /// The end of CRIU's log.
        log: LogTail,
    },
}

/// What one probe run says about the cache.
#[derive(Debug)]
struct Probe {
    kdat_path: PathBuf,
    loaded: bool,
}

impl Criu {
    /// Makes CRIU's kernel-feature cache effective, saving 20 ms or more per dump and per restore
    /// where `RUNDIR` (`/run`) is not a tmpfs (see the [module docs](crate::kdat)). `backing_dir`
    /// is created if missing and gets a 1 MiB tmpfs (unless already on tmpfs); it should be a
    /// root-only dir of the agent's, e.g. `/run/belayer/criu-kdat`.
    ///
    /// Costs three short `criu check --feature` runs (about 100 ms in all). Returns a guard: keep
    /// it for as long as CRIU should use the cache (for the agent, its whole life, or
    /// [`KdatCache::leak`] it). Where nothing needs doing the guard holds nothing
    /// ([`KdatMode::Native`], [`KdatMode::AlreadyLoaded`]).
    ///
    /// Errors: [`KdatError`]; on error nothing stays mounted.
    pub fn kdat_cache(&self, backing_dir: &Path) -> Result<KdatCache, KdatError> {
        std::fs::create_dir_all(backing_dir).map_err(|source| KdatError::CreateBackingDir {
            path: backing_dir.to_path_buf(),
            source,
        })?;
        let mut guard = KdatCache {
            kdat_path: PathBuf::new(),
            mode: KdatMode::Native,
            tmpfs: None,
            bound: false,
            placeholder_created: false,
            armed: true,
        };
        if !is_tmpfs(backing_dir)? {
            sys::mount_tmpfs(backing_dir, BACKING_TMPFS_BYTES).map_err(|source| {
                KdatError::MountTmpfs {
                    path: backing_dir.to_path_buf(),
                    source,
                }
            })?;
            guard.tmpfs = Some(backing_dir.to_path_buf());
        }

        let probe = self.probe_kdat("probe", backing_dir, backing_dir, ChildSetup::default())?;
        guard.kdat_path = probe.kdat_path.clone();
        let run_dir = probe
            .kdat_path
            .parent()
            .unwrap_or(Path::new("/"))
            .to_path_buf();
        if probe.loaded || is_tmpfs(&run_dir)? {
            guard.mode = if probe.loaded {
                KdatMode::AlreadyLoaded
            } else {
                KdatMode::Native
            };
            let _ = std::fs::remove_file(backing_dir.join(log_name("probe")));
            guard.unmount_tmpfs();
            tracing::debug!(kdat = %guard.kdat_path.display(), mode = ?guard.mode, "criu kdat cache needs no binding");
            return Ok(guard);
        }

        // Prime: CRIU sees the backing tmpfs as its RUNDIR and saves the cache there.
        let cached = backing_dir.join(KDAT_FILE_NAME);
        let _ = std::fs::remove_file(&cached);
        let setup = ChildSetup {
            private_bind: Some((c_path(backing_dir)?, c_path(&run_dir)?)),
            ..ChildSetup::default()
        };
        // Inside that namespace the backing tmpfs *is* `run_dir`: the log goes there.
        self.probe_kdat("prime", &run_dir, backing_dir, setup)?;
        let saved = std::fs::metadata(&cached).is_ok_and(|m| m.is_file() && m.len() > 0);
        if !saved {
            return Err(KdatError::NotSaved {
                path: cached,
                log: LogTail::collect(&backing_dir.join(log_name("prime")), ""),
            });
        }

        // Bind it over CRIU's cache path, replacing bindings left by an earlier (leaked) guard.
        for _ in 0..16 {
            if sys::unmount_detach(&guard.kdat_path).is_err() {
                break; // EINVAL: nothing (more) mounted there
            }
        }
        guard.bind(&cached)?;
        guard.mode = KdatMode::Bound;

        let verify = self.probe_kdat("verify", backing_dir, backing_dir, ChildSetup::default())?;
        if !verify.loaded {
            return Err(KdatError::NotLoaded {
                log: LogTail::collect(&backing_dir.join(log_name("verify")), ""),
            });
        }
        for step in ["probe", "prime", "verify"] {
            let _ = std::fs::remove_file(backing_dir.join(log_name(step)));
        }
        tracing::info!(kdat = %guard.kdat_path.display(), backing = %backing_dir.display(), "criu kdat cache bound from tmpfs");
        Ok(guard)
    }

    /// Runs `criu check --feature mnt_id` (cheap; every run initialises kdat first) with its log
    /// in `work_dir` (as CRIU sees it), then reads that log from `log_dir` (as this process sees
    /// it) for what CRIU did with its cache.
    fn probe_kdat(
        &self,
        step: &'static str,
        work_dir: &Path,
        log_dir: &Path,
        setup: ChildSetup,
    ) -> Result<Probe, KdatError> {
        let args = [
            "check".into(),
            "--feature".into(),
            "mnt_id".into(),
            "--work-dir".into(),
            work_dir.as_os_str().to_owned(),
            "--log-file".into(),
            log_name(step).into(),
            "-v4".into(),
        ];
        let done = run::run(self.path(), &args, setup).map_err(|source| KdatError::Spawn {
            criu: self.path().to_path_buf(),
            source,
        })?;
        let log_path = log_dir.join(log_name(step));
        if !done.status.success() {
            return Err(KdatError::Check {
                step,
                status: done.status,
                log: LogTail::collect(&log_path, &done.stderr),
            });
        }
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        match parse_kdat_log(&text) {
            Some((kdat_path, loaded)) => Ok(Probe { kdat_path, loaded }),
            None => Err(KdatError::CachePathUnknown {
                log: LogTail::collect(&log_path, &done.stderr),
            }),
        }
    }
}

impl KdatCache {
    /// CRIU's cache file, e.g. `/run/criu.kdat`.
    pub fn kdat_path(&self) -> &Path {
        &self.kdat_path
    }

    /// How the cache is kept.
    pub fn mode(&self) -> KdatMode {
        self.mode
    }

    /// Keeps the mounts after this guard is gone (they vanish with the host's next reboot).
    /// Returns CRIU's cache path.
    pub fn leak(mut self) -> PathBuf {
        self.armed = false;
        std::mem::take(&mut self.kdat_path)
    }

    /// Bind-mounts `cached` over the cache path, creating an empty placeholder file there first.
    fn bind(&mut self, cached: &Path) -> Result<(), KdatError> {
        let mut last = None;
        for _ in 0..BIND_ATTEMPTS {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&self.kdat_path)
            {
                Ok(_) => self.placeholder_created = true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(source) => {
                    return Err(KdatError::Placeholder {
                        path: self.kdat_path.clone(),
                        source,
                    })
                }
            }
            match sys::bind_mount(cached, &self.kdat_path) {
                Ok(()) => {
                    self.bound = true;
                    return Ok(());
                }
                // A concurrent criu found the placeholder stale and deleted it: make it again.
                Err(e) if e.errno() == Some(libc::ENOENT) => last = Some(e),
                Err(source) => {
                    return Err(KdatError::Bind {
                        path: self.kdat_path.clone(),
                        source,
                    })
                }
            }
        }
        Err(KdatError::Bind {
            path: self.kdat_path.clone(),
            source: last.unwrap_or_else(|| SyscallError {
                call: "mount",
                source: io::Error::from_raw_os_error(libc::ENOENT),
            }),
        })
    }

    fn unmount_tmpfs(&mut self) {
        if let Some(dir) = self.tmpfs.take() {
            if let Err(err) = sys::unmount_detach(&dir) {
                tracing::warn!(dir = %dir.display(), %err, "cannot unmount the kdat backing tmpfs");
            }
        }
    }
}

impl Drop for KdatCache {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if self.bound {
            if let Err(err) = sys::unmount_detach(&self.kdat_path) {
                tracing::warn!(kdat = %self.kdat_path.display(), %err, "cannot unbind the kdat cache");
            }
        }
        if self.placeholder_created {
            let _ = std::fs::remove_file(&self.kdat_path);
        }
        self.unmount_tmpfs();
    }
}

fn is_tmpfs(path: &Path) -> Result<bool, KdatError> {
    sys::is_tmpfs(path).map_err(|source| KdatError::Statfs {
        path: path.to_path_buf(),
        source,
    })
}

fn c_path(path: &Path) -> Result<CString, KdatError> {
    CString::new(path.as_os_str().as_bytes()).map_err(|e| KdatError::Spawn {
        criu: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, e),
    })
}

fn log_name(step: &str) -> String {
    format!("kdat-{step}.log")
}

/// From a `-v4` log: CRIU's cache path and whether it loaded the cache. CRIU names the path in
/// exactly one of "Loaded kdat cache from P", "File P does not exist", "Stale P file",
/// "Can't load P".
fn parse_kdat_log(text: &str) -> Option<(PathBuf, bool)> {
    for line in text.lines() {
        if let Some((_, rest)) = line.split_once("Loaded kdat cache from ") {
            return Some((PathBuf::from(rest.trim()), true));
        }
        let candidates = [
            line.split_once("File ")
                .and_then(|(_, r)| r.strip_suffix(" does not exist")),
            line.split_once("Stale ")
                .and_then(|(_, r)| r.strip_suffix(" file")),
            line.split_once("Can't load ").map(|(_, r)| r),
        ];
        for path in candidates.into_iter().flatten() {
            let path = path.trim();
            if path.ends_with(KDAT_FILE_NAME) {
                return Some((PathBuf::from(path), false));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kdat_message() {
        assert_eq!(
            parse_kdat_log("(00.000235) Loaded kdat cache from /run/criu.kdat\n"),
            Some((PathBuf::from("/run/criu.kdat"), true))
        );
        assert_eq!(
            parse_kdat_log(
                "(00.000077) Version: 4.1.1 (gitid 0)\n(00.000093) File /run/criu.kdat does not exist\n"
            ),
            Some((PathBuf::from("/run/criu.kdat"), false))
        );
        assert_eq!(
            parse_kdat_log(
                "(00.000100) Warn  (criu/kerndat.c:1244): Stale /var/run/criu.kdat file\n"
            ),
            Some((PathBuf::from("/var/run/criu.kdat"), false))
        );
        assert_eq!(
            parse_kdat_log("(00.000100) Warn  (criu/kerndat.c:1230): Can't load /run/criu.kdat\n"),
            Some((PathBuf::from("/run/criu.kdat"), false))
        );
    }

    #[test]
    fn ignores_other_missing_files() {
        assert_eq!(
            parse_kdat_log("(00.1) File /proc/sys/foo does not exist\n"),
            None
        );
    }
}
