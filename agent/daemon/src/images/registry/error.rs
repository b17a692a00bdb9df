//! The registry client's error type: every message names the image reference it was for.

/// What went wrong talking to a registry. `reference` is the normalized reference
/// ([`super::Registry::reference`], or the text given when it did not parse); `registry` the
/// host (and port) that was asked.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The reference does not parse as `[host[:port]/]repo[:tag][@digest]`.
    #[error("invalid image reference {reference:?}")]
    BadReference {
        /// The text given.
        reference: String,
        /// Cause.
        #[source]
        source: oci_client::ParseError,
    },
    /// A digest (given by the caller or found in a manifest) is not `sha256:<64 hex>` or
    /// `sha512:<128 hex>` (lowercase).
    #[error("invalid digest {digest:?} for {reference}")]
    BadDigest {
        /// Reference.
        reference: String,
        /// The digest text (truncated to 200 bytes).
        digest: String,
    },
    /// The registry could not be reached: connection refused, name resolution, TLS handshake,
    /// or a timeout (after the retries).
    #[error("registry {registry} unreachable for {reference}")]
    Unreachable {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// Cause (of the last attempt).
        #[source]
        source: reqwest::Error,
    },
    /// The registry answered 401 or 403, or its token service refused to issue a token:
    /// missing or wrong credentials, or no pull right on the repository.
    #[error(
        "registry {registry} denied access to {reference} ({}, {})",
        status_text(.status),
        credentials_text(.anonymous)
    )]
    Unauthorized {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// HTTP status (`None`: the token service refused).
        status: Option<u16>,
        /// Whether no credentials were given.
        anonymous: bool,
    },
    /// The registry does not know the manifest, repository or blob (404); `what` names it,
    /// e.g. `manifest nope of repository swe/task`, `repository swe/nope`,
    /// `blob sha256:...`.
    #[error("{what} not found at registry {registry} for {reference}")]
    NotFound {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// What was missing.
        what: String,
    },
    /// The manifest is not a usable image manifest: unparsable JSON, schema 1, an unknown or
    /// inconsistent media type, a config that is not an image config, an index without a
    /// linux/amd64 entry, an index naming an index, or more bytes than the cap.
    #[error("bad manifest for {reference}: {reason}")]
    BadManifest {
        /// Reference.
        reference: String,
        /// What is wrong (fixed text plus the offending value, truncated).
        reason: String,
    },
    /// Content does not hash to the digest that names it.
    #[error("digest mismatch for {what} of {reference}: expected {expected}, got {actual}")]
    DigestMismatch {
        /// Reference.
        reference: String,
        /// What was checked (`manifest`, `index`, `blob`).
        what: &'static str,
        /// Digest named by the reference, the index or the caller.
        expected: String,
        /// Digest of the bytes received.
        actual: String,
    },
    /// A blob has more bytes than allowed, or another length than its descriptor says.
    #[error("blob {digest} of {reference} has {got} bytes, expected {expected}")]
    BlobSize {
        /// Reference.
        reference: String,
        /// Blob digest.
        digest: String,
        /// Expected length (`at most N` for [`super::Registry::blob`], `N` for a stream).
        expected: String,
        /// Length announced or received so far.
        got: u64,
    },
    /// The registry answered with an unexpected HTTP status (5xx or 429 after the retries,
    /// another 4xx, a 2xx other than 200).
    #[error("registry {registry} answered http {status} for {url} ({reference})")]
    Status {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// HTTP status.
        status: u16,
        /// Request URL.
        url: String,
    },
    /// A transport failure after the connection was made (a broken or undecodable response,
    /// too many redirects), after the retries where they apply.
    #[error("transfer from registry {registry} failed for {reference}")]
    Transport {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// Cause.
        #[source]
        source: reqwest::Error,
    },
    /// The authentication handshake failed other than by refusal or unreachability (an
    /// undecodable token, a malformed challenge header).
    #[error("authentication with registry {registry} failed for {reference}")]
    Auth {
        /// Registry host.
        registry: String,
        /// Reference.
        reference: String,
        /// Cause.
        #[source]
        source: oci_client::errors::OciDistributionError,
    },
    /// The HTTP client or its runtime could not be created.
    #[error("cannot set up the registry client for {reference}")]
    Setup {
        /// Reference.
        reference: String,
        /// Cause: the runtime's `io::Error`, or the HTTP client builder's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl RegistryError {
    /// Whether another attempt may succeed: unreachable, 5xx/429, transport failures.
    pub fn is_transient(&self) -> bool {
        match self {
            RegistryError::Unreachable { .. } | RegistryError::Transport { .. } => true,
            RegistryError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }
}

fn status_text(status: &Option<u16>) -> String {
    match status {
        Some(s) => format!("http {s}"),
        None => "token refused".to_string(),
    }
}

fn credentials_text(anonymous: &bool) -> &'static str {
    if *anonymous {
        "no credentials given"
    } else {
        "credentials refused"
    }
}

/// `text` cut to at most `max` bytes on a char boundary, control characters replaced: for
/// registry-provided values that end up in messages.
pub(crate) fn clip(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut out: String = text[..end]
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if end < text.len() {
        out.push_str("...");
    }
    out
}
