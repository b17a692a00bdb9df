//! `PullImage`: an image from an OCI distribution registry ([`super::super::registry`]),
//! through the same verified import as every OCI source.

use std::io::Read;

use belayer_ipc::{ImageInfo, PullRequest, RegistryCredentials};

use super::super::registry::{Credentials, Registry, RegistryOptions};
use super::super::{ImageError, ImageStore};
use super::parts::MAX_JSON_BYTES;
use super::{BlobSource, LayerBlob, OciImport};

/// Layer blobs streamed from a registry.
struct RegistryBlobs<'a> {
    registry: &'a mut Registry,
    retries: u32,
}

impl BlobSource for RegistryBlobs<'_> {
    fn open_layer(
        &mut self,
        index: usize,
        blob: Option<&LayerBlob>,
    ) -> std::io::Result<Box<dyn Read + Send + '_>> {
        let blob = blob.ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("the manifest names no blob for layer {index}"),
            )
        })?;
        self.registry
            .blob_reader(&blob.digest, blob.size)
            .map_err(std::io::Error::other)
    }

    fn retries(&self) -> u32 {
        self.retries
    }
}

impl ImageStore {
    /// Pulls `req.reference` into the store as `req.name` (or the reference), owned by
    /// `owner_uid`, talking to registries as `opts` says.
    ///
    /// Errors: [`ImageError::Registry`] (unreachable, credentials refused, not found, bad
    /// manifest), and those of [`ImageStore::import_oci`].
    pub fn pull(
        &self,
        req: &PullRequest,
        owner_uid: u32,
        opts: &RegistryOptions,
    ) -> Result<ImageInfo, ImageError> {
        let name = req.name.clone().unwrap_or_else(|| req.reference.clone());
        if !super::super::valid_name(&name) {
            return Err(ImageError::InvalidName(name));
        }
        if self.exists(&name) {
            return Err(ImageError::AlreadyExists(name));
        }
        let reg_err = |source| ImageError::Registry {
            reference: req.reference.clone(),
            source: Box::new(source),
        };
        let creds = match &req.credentials {
            RegistryCredentials::Anonymous => Credentials::Anonymous,
            RegistryCredentials::Basic { username, password } => Credentials::Basic {
                username: username.clone(),
                password: password.clone(),
            },
            RegistryCredentials::Bearer { token } => Credentials::Bearer {
                token: token.clone(),
            },
        };
        let mut opts = opts.clone();
        if req.insecure {
            if let Some(host) = req.reference.split('/').next() {
                opts.insecure_hosts.push(host.to_string());
            }
        }
        let mut registry = Registry::connect(&req.reference, creds, &opts).map_err(reg_err)?;
        let (manifest, _digest) = registry.manifest().map_err(reg_err)?;
        let config_digest = config_digest(&name, &manifest)?;
        let config = registry
            .blob(&config_digest, MAX_JSON_BYTES as u64)
            .map_err(reg_err)?;
        let source = registry.reference().to_string();
        let import = OciImport {
            name: &name,
            source: &source,
            owner_uid,
            manifest: Some(&manifest),
            config: &config,
        };
        let mut blobs = RegistryBlobs {
            registry: &mut registry,
            retries: opts.retries,
        };
        self.import_oci(&import, &mut blobs)
    }
}

/// The config digest a manifest names (checked again, with everything else, by the
/// import).
fn config_digest(image: &str, manifest: &[u8]) -> Result<String, ImageError> {
    let m =
        oci_spec::image::ImageManifest::from_reader(manifest).map_err(|e| ImageError::BadOci {
            image: image.to_string(),
            what: "manifest",
            reason: e.to_string(),
        })?;
    let digest = m.config().digest().to_string();
    if !super::super::stream::valid_sha256(&digest) {
        return Err(ImageError::BadOci {
            image: image.to_string(),
            what: "manifest",
            reason: format!("config digest {digest:?} is not sha256:<64 hex>"),
        });
    }
    Ok(digest)
}
