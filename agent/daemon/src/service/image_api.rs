//! The image requests of the protocol (`ImportImage`, `RemoveImage`), with the access rules
//! of [`super::access`]: a source is read with the rights of the peer that asked.

use std::os::fd::OwnedFd;
use std::path::Path;

use belayer_ipc::{Caller, ErrorCode, ErrorReply, OciImportRequest, PullRequest, Response};

use super::access::{self, AccessError};
use super::{error, Agent};
use crate::images::oci::blobs::FdBlobs;
use crate::images::oci::OciImport;
use crate::images::registry::{RegistryError, RegistryOptions};
use crate::images::{ImageError, ImportSource};

impl Agent {
    /// `ImportImage { name, source, with_fd }` from `caller` with the descriptors `fds` of
    /// its frame: one descriptor (the source, opened by the client) when `with_fd`, none
    /// otherwise (then `source` is a host path, root only). The image belongs to the caller.
    pub(super) fn import_image(
        &self,
        caller: &Caller,
        name: &str,
        source: String,
        with_fd: bool,
        mut fds: Vec<OwnedFd>,
    ) -> Response {
        let expected = usize::from(with_fd);
        if fds.len() != expected {
            let e = AccessError::Descriptors {
                got: fds.len(),
                expected,
            };
            return error(e.code(), &e);
        }
        let source = match fds.pop() {
            Some(fd) => ImportSource { fd, label: source },
            None if caller.is_root() => match ImportSource::open_host_path(Path::new(&source)) {
                Ok(source) => source,
                Err(e) => return error(image_code(&e), &e),
            },
            None => {
                let e = AccessError::HostPathNeedsRoot {
                    uid: caller.cred.uid,
                };
                tracing::warn!(uid = caller.cred.uid, pid = caller.cred.pid, path = %source,
                               "refused an image import from a host path");
                return error(e.code(), &e);
            }
        };
        let reader = match access::credentials(caller) {
            Ok(c) => c,
            Err(e) => return error(e.code(), &e),
        };
        match self.rt.images.import(
            name,
            source,
            &reader,
            caller.cred.uid,
            &self.rt.helper.exec_path(),
        ) {
            Ok(info) => Response::Image(info),
            Err(e) => {
                tracing::info!(image = %name, uid = caller.cred.uid, error = %crate::sys::error_chain(&e), "image import refused or failed");
                error(image_code(&e), &e)
            }
        }
    }

    /// Refuses a sandbox of `caller` on another peer's image ([`crate::images::ImageMeta::serves`]), or,
    /// for a non-root caller, on an image whose owner cannot be read. An unknown image passes
    /// here and is reported by the creation itself.
    pub(super) fn check_image_use(&self, caller: &Caller, name: &str) -> Result<(), AccessError> {
        match self.rt.images.meta(name) {
            Ok(meta) if !meta.serves(caller.cred.uid) => Err(AccessError::ForeignImage {
                name: name.to_string(),
                owner: meta.owner_uid,
            }),
            Ok(_) => Ok(()),
            Err(_) if !caller.is_root() && self.rt.images.exists(name) => {
                Err(AccessError::ImageOwnerUnknown {
                    name: name.to_string(),
                })
            }
            Err(_) => Ok(()),
        }
    }

    /// `PullImage`: fetches the image from its registry with the daemon's network access
    /// (the credentials are the client's); the image belongs to the caller.
    pub(super) fn pull_image(&self, caller: &Caller, req: &PullRequest) -> Response {
        let cfg = &self.rt.config;
        let opts = RegistryOptions {
            insecure_hosts: cfg.insecure_registries.clone(),
            retries: cfg.registry_retries,
            timeout: std::time::Duration::from_secs(cfg.registry_timeout_s.max(1)),
        };
        match self.rt.images.pull(req, caller.cred.uid, &opts) {
            Ok(info) => Response::Image(info),
            Err(e) => {
                tracing::info!(reference = %req.reference, uid = caller.cred.uid,
                               error = %crate::sys::error_chain(&e), "image pull failed");
                error(image_code(&e), &e)
            }
        }
    }

    /// `ImportOci`: an OCI layout or docker archive whose blobs the client opened and passed
    /// as `fds`; the image belongs to the caller.
    pub(super) fn import_oci(
        &self,
        caller: &Caller,
        req: OciImportRequest,
        fds: Vec<OwnedFd>,
    ) -> Response {
        let result = FdBlobs::new(&req.name, fds, req.layers).and_then(|mut blobs| {
            let import = OciImport {
                name: &req.name,
                source: &req.source,
                owner_uid: caller.cred.uid,
                manifest: req.manifest.as_deref(),
                config: &req.config,
            };
            self.rt.images.import_oci(&import, &mut blobs)
        });
        match result {
            Ok(info) => Response::Image(info),
            Err(e) => {
                tracing::info!(image = %req.name, uid = caller.cred.uid,
                               error = %crate::sys::error_chain(&e), "OCI import refused or failed");
                error(image_code(&e), &e)
            }
        }
    }

    /// `RemoveImage { name }`: only its owner or root, and only when no sandbox uses it.
    pub(super) fn remove_image(&self, caller: &Caller, name: &str) -> Response {
        let meta = match self.rt.images.meta(name) {
            Ok(m) => m,
            Err(e) => return error(image_code(&e), &e),
        };
        if !access::may_act_on(caller, meta.owner_uid) {
            let e = AccessError::NotImageOwner {
                name: name.to_string(),
                owner: meta.owner_uid,
                uid: caller.cred.uid,
            };
            return error(e.code(), &e);
        }
        // Under the registry and in-flight locks: no creation can pass its image check
        // between this one and the rename that takes the name away.
        let detached = {
            let registry = self.registry();
            let creating = self.creating.lock();
            let used = registry.values().any(|s| s.record().spec.image == name)
                || creating.iter().any(|(_, image)| image == name);
            if used {
                return Response::Error(ErrorReply {
                    code: ErrorCode::InUse,
                    message: format!("image {name} is used by a sandbox"),
                });
            }
            self.rt.images.detach(name)
        };
        match detached.and_then(|trash| self.rt.images.delete_detached(trash)) {
            Ok(()) => Response::Done,
            Err(e) => error(image_code(&e), &e),
        }
    }
}

/// The wire code of an image error.
pub(super) fn image_code(e: &ImageError) -> ErrorCode {
    use belayer_overlay::InstallError;
    match e {
        ImageError::InvalidName(_)
        | ImageError::Source { .. }
        | ImageError::NoShell(_)
        | ImageError::Decompress { .. } => ErrorCode::BadRequest,
        ImageError::ReadTree { denied: true, .. } => ErrorCode::PermissionDenied,
        ImageError::ReadTree { .. } => ErrorCode::BadRequest,
        ImageError::Unpack {
            source: InstallError::OpenTarget { .. } | InstallError::TargetNotEmpty { .. },
            ..
        } => ErrorCode::Internal,
        ImageError::Unpack { .. } => ErrorCode::BadRequest,
        ImageError::AlreadyExists(_) => ErrorCode::AlreadyExists,
        ImageError::Unknown(_) => ErrorCode::UnknownImage,
        ImageError::Helper { .. } | ImageError::Store { .. } => ErrorCode::Internal,
        ImageError::BadOci { .. }
        | ImageError::DigestMismatch { .. }
        | ImageError::BlobRead { .. }
        | ImageError::LayerRefused { .. } => ErrorCode::CorruptImage,
        ImageError::BadBlobs { .. } => ErrorCode::BadRequest,
        ImageError::LayerMissing { .. } | ImageError::Inspect { .. } => ErrorCode::Internal,
        ImageError::Registry { source, .. } => registry_code(source),
    }
}

/// The wire code of a registry error.
fn registry_code(e: &RegistryError) -> ErrorCode {
    match e {
        RegistryError::Unreachable { .. } | RegistryError::Setup { .. } => {
            ErrorCode::RegistryUnreachable
        }
        RegistryError::Unauthorized { .. } | RegistryError::Auth { .. } => {
            ErrorCode::RegistryDenied
        }
        RegistryError::NotFound { .. } => ErrorCode::NotFound,
        RegistryError::BadReference { .. } => ErrorCode::BadRequest,
        RegistryError::BadDigest { .. }
        | RegistryError::BadManifest { .. }
        | RegistryError::DigestMismatch { .. }
        | RegistryError::BlobSize { .. } => ErrorCode::CorruptImage,
        RegistryError::Status { .. } | RegistryError::Transport { .. } => {
            ErrorCode::RegistryUnreachable
        }
    }
}
