//! Binding a listening Unix socket file safely: shared by the daemon's server and the memory
//! servers.

use std::fs::{self, Permissions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use tracing::debug;

/// Why a socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Creating the socket's parent directory failed.
    #[error("creating socket directory {path} failed")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Looking at what already sits at the socket path failed.
    #[error("inspecting {path} failed")]
    Inspect {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Something other than a socket sits at the socket path; it is left alone.
    #[error("{path} exists and is not a socket")]
    NotASocket {
        /// The socket path.
        path: PathBuf,
    },
    /// Another server accepts connections on the socket path.
    #[error("a server is already listening on {path}")]
    InUse {
        /// The socket path.
        path: PathBuf,
    },
    /// Removing a stale socket file failed.
    #[error("removing stale socket {path} failed")]
    RemoveStale {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Binding the listening socket failed.
    #[error("binding {path} failed")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Setting the socket file's mode failed.
    #[error("setting mode {mode:o} on {path} failed")]
    SetMode {
        /// The socket path.
        path: PathBuf,
        /// The requested mode.
        mode: u32,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// Setting the socket file's group failed.
    #[error("setting group {gid} on {path} failed")]
    SetGroup {
        /// The socket path.
        path: PathBuf,
        /// The requested gid.
        gid: u32,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// A freshly bound listener and the `(dev, ino)` identity of its socket file (to tell later
/// whether the file at the path is still ours).
#[derive(Debug)]
pub struct BoundSocket {
    /// The listener (blocking).
    pub listener: UnixListener,
    /// `(st_dev, st_ino)` of the socket file.
    pub identity: (u64, u64),
}

/// Binds a Unix stream socket at `path`: creates the parent directory, replaces a stale socket
/// file left by a dead server, refuses a live one or anything that is not a socket, binds, then
/// sets `mode` and, when given, the group. On a failure after binding the file is removed.
pub fn bind_socket(path: &Path, mode: u32, group: Option<u32>) -> Result<BoundSocket, BindError> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::create_dir_all(parent).map_err(|source| BindError::CreateDir {
            path: parent.to_owned(),
            source,
        })?;
    }
    remove_stale_socket(path)?;
    let listener = UnixListener::bind(path).map_err(|source| BindError::Bind {
        path: path.to_owned(),
        source,
    })?;
    let configured = (|| {
        fs::set_permissions(path, Permissions::from_mode(mode)).map_err(|source| {
            BindError::SetMode {
                path: path.to_owned(),
                mode,
                source,
            }
        })?;
        if let Some(gid) = group {
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(|source| {
                BindError::SetGroup {
                    path: path.to_owned(),
                    gid,
                    source,
                }
            })?;
        }
        let meta = fs::symlink_metadata(path).map_err(|source| BindError::Inspect {
            path: path.to_owned(),
            source,
        })?;
        Ok((meta.dev(), meta.ino()))
    })();
    match configured {
        Ok(identity) => Ok(BoundSocket { listener, identity }),
        Err(e) => {
            let _ = fs::remove_file(path);
            Err(e)
        }
    }
}

/// Removes a socket file left at `path` by a server that is gone; refuses to touch anything
/// else.
fn remove_stale_socket(path: &Path) -> Result<(), BindError> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(BindError::Inspect {
                path: path.to_owned(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(BindError::NotASocket {
            path: path.to_owned(),
        });
    }
    if UnixStream::connect(path).is_ok() {
        return Err(BindError::InUse {
            path: path.to_owned(),
        });
    }
    fs::remove_file(path).map_err(|source| BindError::RemoveStale {
        path: path.to_owned(),
        source,
    })?;
    debug!(path = %path.display(), "removed stale socket file");
    Ok(())
}
