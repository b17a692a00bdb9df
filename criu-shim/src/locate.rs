//! Finding a usable `criu` binary and asking it about itself (`--version`, `check`).

use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;

use crate::run::{self, ChildSetup};

/// Environment variable naming the `criu` binary to use (when no explicit path is given).
pub const CRIU_ENV: &str = "BELAYER_CRIU";

/// Where `scripts/setup.sh` installs CRIU, tried before `$PATH`.
pub const DEFAULT_CRIU_PATH: &str = "/usr/local/sbin/criu";

/// The oldest CRIU major version accepted. Debian 12's CRIU 3.17 fails on the 6.x kernels of the
/// target machines ("Unexpected rt vDSO area bounds"); CRIU 4.1.1 passes `criu check` and dumps and
/// restores sandboxes there.
pub const MIN_MAJOR_VERSION: u32 = 4;

/// How to get a usable CRIU, appended to the errors that need it.
const INSTALL_HINT: &str = "CRIU >= 4 is required: run scripts/setup.sh (builds CRIU 4.1.1 from \
    source into /usr/local/sbin/criu) or point $BELAYER_CRIU at a CRIU 4.x binary";

/// A `criu` binary of an acceptable version. Cheap to clone; holds no resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Criu {
    path: PathBuf,
    version: String,
}

/// Why no usable `criu` was found.
#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    /// None of the candidate paths holds an executable file.
    #[error(
        "no criu binary found (searched {}); {INSTALL_HINT}",
        display_paths(searched)
    )]
    NotFound {
        /// Every path looked at, in order.
        searched: Vec<PathBuf>,
    },
    /// The binary is older than [`MIN_MAJOR_VERSION`].
    #[error("criu at {} is version {version}, older than {MIN_MAJOR_VERSION}.0; {INSTALL_HINT}", path.display())]
    TooOld {
        /// The binary.
        path: PathBuf,
        /// The version it reported.
        version: String,
    },
    /// `criu --version` could not be run.
    #[error("cannot run {} --version", path.display())]
    RunVersion {
        /// The binary.
        path: PathBuf,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// `criu --version` printed no `Version: X.Y[.Z]` line (or failed).
    #[error("cannot parse the output of {} --version ({status}): {output:?}", path.display())]
    ParseVersion {
        /// The binary.
        path: PathBuf,
        /// Its exit status.
        status: ExitStatus,
        /// What it printed (stdout, then stderr).
        output: String,
    },
}

/// `criu check` found a problem (or could not be run).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The binary could not be started.
    #[error("cannot run {} check", path.display())]
    Run {
        /// The binary.
        path: PathBuf,
        /// Why it did not start.
        #[source]
        source: io::Error,
    },
    /// `criu check` exited non-zero: this kernel lacks something CRIU needs.
    #[error("criu check failed ({status}): {output}")]
    Failed {
        /// Its exit status.
        status: ExitStatus,
        /// Everything it printed (stdout, then stderr), trimmed.
        output: String,
    },
}

impl Criu {
    /// Finds a usable `criu`: `explicit` if given, else `$BELAYER_CRIU` if set, else
    /// [`DEFAULT_CRIU_PATH`], else `criu` in a `$PATH` directory. An explicit path or the
    /// environment variable is the only candidate when given (a misconfiguration is reported, not
    /// silently replaced). The first existing candidate is run with `--version` (a few ms) and must
    /// report major version >= [`MIN_MAJOR_VERSION`].
    ///
    /// Errors: [`LocateError::NotFound`] (with every path searched and how to install CRIU),
    /// [`LocateError::TooOld`], [`LocateError::RunVersion`], [`LocateError::ParseVersion`].
    pub fn locate(explicit: Option<&Path>) -> Result<Criu, LocateError> {
        let from_env = std::env::var_os(CRIU_ENV).filter(|v| !v.is_empty());
        let candidates = candidates(explicit, from_env, std::env::var_os("PATH"));
        let Some(path) = candidates.iter().find(|p| is_executable_file(p)).cloned() else {
            return Err(LocateError::NotFound {
                searched: candidates,
            });
        };
        let done =
            run::run(&path, &["--version".into()], ChildSetup::default()).map_err(|source| {
                LocateError::RunVersion {
                    path: path.clone(),
                    source,
                }
            })?;
        let parsed = if done.status.success() {
            parse_version(&done.stdout)
        } else {
            None
        };
        let Some((version, major)) = parsed else {
            return Err(LocateError::ParseVersion {
                path,
                status: done.status,
                output: format!("{}{}", done.stdout, done.stderr),
            });
        };
        if major < MIN_MAJOR_VERSION {
            return Err(LocateError::TooOld { path, version });
        }
        tracing::debug!(criu = %path.display(), %version, "located criu");
        Ok(Criu { path, version })
    }

    /// A `Criu` that was never located, for unit tests that must not reach it.
    #[cfg(test)]
    pub(crate) fn unchecked(path: &str) -> Criu {
        Criu {
            path: PathBuf::from(path),
            version: "4.1.1".into(),
        }
    }

    /// The binary in use.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its version as printed by `criu --version`, e.g. `"4.1.1"`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Runs `criu check` (about 50 ms): CRIU probes the kernel features it needs.
    ///
    /// Errors: [`CheckError::Failed`] carries CRIU's output, [`CheckError::Run`] when it cannot start.
    pub fn check(&self) -> Result<(), CheckError> {
        let done =
            run::run(&self.path, &["check".into()], ChildSetup::default()).map_err(|source| {
                CheckError::Run {
                    path: self.path.clone(),
                    source,
                }
            })?;
        if done.status.success() {
            return Ok(());
        }
        Err(CheckError::Failed {
            status: done.status,
            output: format!("{}{}", done.stdout, done.stderr).trim().to_string(),
        })
    }
}

/// The candidate paths, in the order [`Criu::locate`] tries them.
fn candidates(
    explicit: Option<&Path>,
    from_env: Option<OsString>,
    path_var: Option<OsString>,
) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_path_buf()];
    }
    if let Some(p) = from_env {
        return vec![PathBuf::from(p)];
    }
    let mut out = vec![PathBuf::from(DEFAULT_CRIU_PATH)];
    if let Some(path_var) = path_var {
        for dir in std::env::split_paths(&path_var) {
            let p = dir.join("criu");
            if !dir.as_os_str().is_empty() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `"Version: 4.1.1\nGitID: ...\n"` → `("4.1.1", 4)`.
fn parse_version(stdout: &str) -> Option<(String, u32)> {
    let version = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let major = version.split('.').next()?.parse().ok()?;
    Some((version.to_string(), major))
}

fn display_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_and_git_versions() {
        assert_eq!(
            parse_version("Version: 4.1.1\n"),
            Some(("4.1.1".to_string(), 4))
        );
        assert_eq!(
            parse_version("Version: 3.17\nGitID: v3.17-1\n"),
            Some(("3.17".to_string(), 3))
        );
        assert_eq!(parse_version("criu: unknown option\n"), None);
        assert_eq!(parse_version("Version: x.y\n"), None);
    }

    #[test]
    fn explicit_path_and_env_are_exclusive() {
        let explicit = candidates(
            Some(Path::new("/opt/criu")),
            Some("/env/criu".into()),
            Some("/usr/bin".into()),
        );
        assert_eq!(explicit, vec![PathBuf::from("/opt/criu")]);
        let env = candidates(None, Some("/env/criu".into()), Some("/usr/bin".into()));
        assert_eq!(env, vec![PathBuf::from("/env/criu")]);
    }

    #[test]
    fn default_then_path_without_duplicates() {
        let all = candidates(None, None, Some("/usr/local/sbin:/usr/sbin::/bin".into()));
        assert_eq!(
            all,
            vec![
                PathBuf::from(DEFAULT_CRIU_PATH),
                PathBuf::from("/usr/sbin/criu"),
                PathBuf::from("/bin/criu"),
            ]
        );
    }

    #[test]
    fn missing_explicit_path_is_not_found_with_install_hint() {
        let err = Criu::locate(Some(Path::new("/nonexistent/criu"))).unwrap_err();
        match &err {
            LocateError::NotFound { searched } => {
                assert_eq!(searched, &vec![PathBuf::from("/nonexistent/criu")])
            }
            other => panic!("unexpected {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("/nonexistent/criu") && msg.contains("scripts/setup.sh"),
            "{msg}"
        );
    }

    #[test]
    fn a_binary_without_version_output_is_rejected() {
        let err = Criu::locate(Some(Path::new("/bin/true"))).unwrap_err();
        assert!(matches!(err, LocateError::ParseVersion { .. }), "{err:?}");
    }

    #[test]
    fn an_old_version_is_too_old() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Another test thread forking while the script was open for writing makes exec fail
        // with ETXTBSY for a moment: retry that.
        let mut attempts = 0;
        let err = loop {
            match Criu::locate(Some(&fake)).unwrap_err() {
                LocateError::RunVersion { source, .. }
                    if source.raw_os_error() == Some(libc::ETXTBSY) && attempts < 50 =>
                {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other,
            }
        };
        match err {
            LocateError::TooOld { version, .. } => assert_eq!(version, "3.17"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
