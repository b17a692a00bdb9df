//! A pull-only client of the OCI distribution API: manifests, configs and layer streams
//! from a registry, for the image import pipeline.
//!
//! Built on `oci-client` for what it does well: reference parsing and normalization
//! (`busybox` is `docker.io/library/busybox:latest`, Docker Hub is reached at
//! `index.docker.io`), the authentication handshake (the `/v2/` ping, bearer challenges and
//! the token request with or without basic credentials) and the manifest types and media
//! types. The GET requests themselves go through `reqwest` here, because the daemon needs
//! what oci-client's pull calls do not give: a cap on a manifest's bytes before they are
//! buffered (a hostile registry could otherwise send gigabytes), a layer stream that is not
//! hashed twice (the caller verifies as it unpacks), and statuses mapped to typed errors.
//!
//! Security: the registry is untrusted. A manifest is at most [`MAX_MANIFEST_BYTES`] and
//! must hash to its digest (the reference's, or the index entry's); every digest is checked
//! to be `sha256:`/`sha512:` hex before it goes into a URL; a config is read whole only up to
//! the caller's cap; a layer stream ends in an error when it carries more or fewer bytes than
//! its descriptor says. Credentials travel only to the registry and its token service
//! (reqwest drops the `Authorization` header on a redirect to another host). Loopback
//! registries (`localhost`, `127.0.0.0/8`, `[::1]`, any port) speak plain HTTP, like
//! docker; others HTTPS (system roots, rustls) unless listed in
//! [`RegistryOptions::insecure_hosts`].
//!
//! Threads: the daemon is thread-based; each [`Registry`] owns a tokio runtime with one
//! worker thread. Calls block the calling thread; a blob stream's network task runs on the
//! worker while the caller reads. Not for use inside an async runtime.

mod error;
mod manifest;
mod stream;
mod transport;

use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

pub use error::RegistryError;
use manifest::{check_image, classify, digest_like, pick_amd64, Kind, ACCEPT};
pub use manifest::{valid_digest, MAX_MANIFEST_BYTES};
use stream::{Runtime, StreamContext};
use transport::{Target, Transport};

use self::error::clip;

/// How to authenticate for a pull.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// No credentials (a token service may still grant an anonymous pull token).
    Anonymous,
    /// A user name and password: sent to the token service on a bearer challenge, else as
    /// HTTP basic auth with every request.
    Basic {
        /// User name.
        username: String,
        /// Password.
        password: String,
    },
    /// A bearer token used as is (no token request).
    Bearer {
        /// The token.
        token: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Anonymous => f.write_str("Anonymous"),
            Credentials::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
            Credentials::Bearer { .. } => f
                .debug_struct("Bearer")
                .field("token", &"<redacted>")
                .finish(),
        }
    }
}

/// Connection options.
#[derive(Debug, Clone)]
pub struct RegistryOptions {
    /// Registries spoken to in plain HTTP besides loopback ones: `host` (any port) or
    /// `host:port`.
    pub insecure_hosts: Vec<String>,
    /// Extra attempts after a transient failure (connection refused, DNS, timeout, 5xx, 429,
    /// a broken transfer), with backoff from 250 ms doubling up to 4 s. Default 3.
    pub retries: u32,
    /// Connect timeout and longest stall between two reads; also the longest a whole
    /// manifest or config request may take. Default 30 s.
    pub timeout: Duration,
}

impl Default for RegistryOptions {
    fn default() -> Self {
        RegistryOptions {
            insecure_hosts: Vec::new(),
            retries: 3,
            timeout: Duration::from_secs(30),
        }
    }
}

/// A connection to one repository of a registry, authenticated for pulling one reference.
pub struct Registry {
    rt: Arc<Runtime>,
    t: Transport,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("reference", &self.t.display)
            .finish_non_exhaustive()
    }
}

impl Registry {
    /// Parses `reference` (`[host[:port]/]repo[:tag][@sha256:<hex>]`; tag `latest` by
    /// default, Docker Hub when no host is named) and authenticates for pull (see
    /// [`Credentials`]), retrying transient failures.
    ///
    /// Errors: [`RegistryError::BadReference`], [`RegistryError::Unreachable`],
    /// [`RegistryError::Unauthorized`] (a token service refused), [`RegistryError::Auth`],
    /// [`RegistryError::Setup`]. Wrong basic credentials on a basic-auth registry show at
    /// the first request ([`Self::manifest`]).
    pub fn connect(
        reference: &str,
        creds: Credentials,
        opts: &RegistryOptions,
    ) -> Result<Registry, RegistryError> {
        let parsed = oci_client::Reference::try_from(reference).map_err(|source| {
            RegistryError::BadReference {
                reference: clip(reference, 300),
                source,
            }
        })?;
        let rt = Runtime::new().map_err(|e| RegistryError::Setup {
            reference: parsed.whole(),
            source: Box::new(e),
        })?;
        let mut t = Transport::new(parsed, creds, opts)?;
        rt.get()
            .block_on(t.retrying(async |t| t.authenticate().await))?;
        Ok(Registry {
            rt: Arc::new(rt),
            t,
        })
    }

    /// The normalized reference, e.g. `127.0.0.1:5000/swe/task:latest` or
    /// `docker.io/library/busybox@sha256:<hex>`.
    pub fn reference(&self) -> &str {
        &self.t.display
    }

    /// The host (and port) requests go to (`index.docker.io` for Docker Hub).
    pub fn registry(&self) -> &str {
        &self.t.registry
    }

    /// The image manifest for linux/amd64 and its digest (`sha256:<hex>`, or `sha512:` when
    /// the reference names a sha512 digest).
    ///
    /// An index or manifest list is resolved to its linux/amd64 entry, whose manifest must
    /// hash to the entry's digest. When the reference names a digest, the first document
    /// fetched (the index, or the manifest) must hash to it. Accepts OCI and Docker schema 2
    /// media types, and an image manifest only with an image config media type.
    ///
    /// Errors: [`RegistryError::BadManifest`] (unparsable, schema 1, unknown or inconsistent
    /// media type, not an image, no linux/amd64 entry, over [`MAX_MANIFEST_BYTES`]),
    /// [`RegistryError::DigestMismatch`], [`RegistryError::NotFound`],
    /// [`RegistryError::Unauthorized`], [`RegistryError::Unreachable`],
    /// [`RegistryError::Status`], [`RegistryError::Transport`].
    pub fn manifest(&mut self) -> Result<(Vec<u8>, String), RegistryError> {
        let reference = self.t.display.clone();
        let wanted = self.t.reference.digest().map(str::to_string);
        let target = wanted
            .clone()
            .or_else(|| self.t.reference.tag().map(str::to_string))
            .unwrap_or_else(|| "latest".to_string());
        let bad = |reason: String| RegistryError::BadManifest {
            reference: reference.clone(),
            reason,
        };
        let (bytes, content_type) = self.fetch_manifest(&target)?;
        // Integrity first: a mismatch is reported as such, even for bytes that do not parse.
        let actual = digest_like(wanted.as_deref(), &bytes);
        if let Some(expected) = &wanted {
            if *expected != actual {
                let index = classify(&bytes, content_type.as_deref()) == Ok(Kind::Index);
                return Err(RegistryError::DigestMismatch {
                    reference,
                    what: if index { "index" } else { "manifest" },
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        let kind = classify(&bytes, content_type.as_deref()).map_err(bad)?;
        if kind == Kind::Image {
            check_image(&bytes).map_err(bad)?;
            return Ok((bytes, actual));
        }
        let entry = pick_amd64(&bytes).map_err(bad)?;
        let (bytes, content_type) = self.fetch_manifest(&entry.digest)?;
        let actual = digest_like(Some(&entry.digest), &bytes);
        if actual != entry.digest {
            return Err(RegistryError::DigestMismatch {
                reference,
                what: "manifest",
                expected: entry.digest,
                actual,
            });
        }
        if bytes.len() as u64 != entry.size as u64 {
            return Err(bad(format!(
                "the linux/amd64 manifest has {} bytes, its index entry says {}",
                bytes.len(),
                entry.size
            )));
        }
        match classify(&bytes, content_type.as_deref()).map_err(bad)? {
            Kind::Image => check_image(&bytes).map_err(bad)?,
            Kind::Index => return Err(bad("the linux/amd64 entry is itself an index".into())),
        };
        Ok((bytes, entry.digest))
    }

    fn fetch_manifest(&mut self, target: &str) -> Result<(Vec<u8>, Option<String>), RegistryError> {
        let reference = self.t.display.clone();
        let too_large = move |got: u64| RegistryError::BadManifest {
            reference: reference.clone(),
            reason: format!("{got} bytes, more than the {MAX_MANIFEST_BYTES} allowed"),
        };
        let t = &mut self.t;
        self.rt.get().block_on(t.fetch(
            &Target::Manifest(target),
            Some(ACCEPT),
            MAX_MANIFEST_BYTES,
            &too_large,
        ))
    }

    fn check_digest(&self, digest: &str) -> Result<(), RegistryError> {
        if valid_digest(digest) {
            Ok(())
        } else {
            Err(RegistryError::BadDigest {
                reference: self.t.display.clone(),
                digest: clip(digest, 200),
            })
        }
    }

    /// A small blob (a config), whole: at most `max` bytes, and it must hash to `digest`.
    ///
    /// Errors: [`RegistryError::BadDigest`], [`RegistryError::BlobSize`] (more than `max`),
    /// [`RegistryError::DigestMismatch`], and the request errors of [`Self::manifest`].
    pub fn blob(&mut self, digest: &str, max: u64) -> Result<Vec<u8>, RegistryError> {
        self.check_digest(digest)?;
        let (reference, d) = (self.t.display.clone(), digest.to_string());
        let too_large = move |got: u64| RegistryError::BlobSize {
            reference: reference.clone(),
            digest: d.clone(),
            expected: format!("at most {max}"),
            got,
        };
        let t = &mut self.t;
        let (bytes, _) =
            self.rt
                .get()
                .block_on(t.fetch(&Target::Blob(digest), None, max, &too_large))?;
        let actual = digest_like(Some(digest), &bytes);
        if actual != digest {
            return Err(RegistryError::DigestMismatch {
                reference: self.t.display.clone(),
                what: "blob",
                expected: digest.to_string(),
                actual,
            });
        }
        Ok(bytes)
    }

    /// A blob of `size` bytes (a layer, of any size) as a blocking stream: streamed, never
    /// buffered whole. Opening is retried like the other requests; once open, the stream is
    /// not hashed here (the caller verifies `digest` as it reads) and a failure surfaces as
    /// an `io::Error` whose inner error is a [`RegistryError`]: `Transport`/`Unreachable`
    /// (kind `ConnectionAborted`/`TimedOut`), or `BlobSize` when the body carries more
    /// (`InvalidData`) or fewer (`UnexpectedEof`) bytes than `size`. Call again to retry.
    ///
    /// The reader must not be used inside an async runtime; it keeps this registry's runtime
    /// alive, and dropping it stops the download.
    ///
    /// Errors (opening): [`RegistryError::BadDigest`], [`RegistryError::BlobSize`] (a
    /// `Content-Length` other than `size`), and the request errors of [`Self::manifest`].
    pub fn blob_reader(
        &mut self,
        digest: &str,
        size: u64,
    ) -> Result<Box<dyn Read + Send>, RegistryError> {
        self.check_digest(digest)?;
        let t = &mut self.t;
        let resp = self.rt.get().block_on(t.open(&Target::Blob(digest)))?;
        if let Some(len) = resp.content_length().filter(|&len| len != size) {
            return Err(RegistryError::BlobSize {
                reference: self.t.display.clone(),
                digest: digest.to_string(),
                expected: size.to_string(),
                got: len,
            });
        }
        let ctx = StreamContext {
            registry: self.t.registry.clone(),
            reference: self.t.display.clone(),
            digest: digest.to_string(),
        };
        Ok(Box::new(stream::spawn(&self.rt, resp, size, ctx)))
    }
}
