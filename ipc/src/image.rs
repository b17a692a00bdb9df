//! Images in the protocol: what clients see of one ([`ImageInfo`], its [`LayerInfo`]s and its
//! [`ImageConfig`]), and the parameters of the two ways an OCI image arrives: pulled by the
//! daemon from a registry ([`PullRequest`]) or read from blobs the client opened
//! ([`OciImportRequest`], `oci:DIR[:TAG]` layouts and `docker-archive:FILE` archives). Part of the
//! messages of [`crate::message`], which re-exports them; encoded like them.

use serde::{Deserialize, Serialize};

/// Longest image name when it is a registry reference (`HOST[:PORT]/REPO[:TAG][@DIGEST]`),
/// bytes.
pub const MAX_IMAGE_REFERENCE: usize = 255;

/// Whether `name` may name an image: either a plain name (`[A-Za-z0-9._-]{1,64}`, no leading
/// dot) or a registry reference of at most [`MAX_IMAGE_REFERENCE`] bytes of
/// `[A-Za-z0-9._:/@+-]` that starts with an alphanumeric byte and has no empty, `.` or `..`
/// path component (e.g. `localhost:5000/swe/task-123:latest`).
pub fn valid_image_name(name: &str) -> bool {
    if crate::names::valid_name(name, crate::names::MAX_IMAGE_NAME, false) {
        return true;
    }
    !name.is_empty()
        && name.len() <= MAX_IMAGE_REFERENCE
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/@+-".contains(&b))
        && name
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// An imported image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// Image name.
    pub name: String,
    /// Bytes of the rootfs: for an OCI image, the sum of its layers' content bytes (layers
    /// shared with other images counted in full here; see [`LayerInfo::images`]).
    pub bytes: u64,
    /// Import time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// Uid of the peer that imported it (only it and root may remove it).
    pub owner_uid: u32,
    /// Device nodes under the source's top-level `/dev` left out at import (every sandbox
    /// mounts its own `/dev`; device nodes anywhere else are refused).
    pub dropped_devices: u64,
    /// Unix sockets of a source directory left out at import (a tar cannot hold them).
    pub skipped_sockets: u64,
    /// Content digest of the image (`sha256:<hex>` of its manifest for a pulled or OCI-layout
    /// image, of its config for a docker archive; `blake3:<hex>` of the imported stream for a
    /// flat image). Checkpoints record it; a restore onto an image whose digest differs is
    /// refused (`ImageChanged`). `None` for images imported before protocol 10.
    pub digest: Option<String>,
    /// Where it came from: the registry reference it was pulled by, or the client's label of
    /// the layout or archive. Since protocol 10.
    pub source: String,
    /// `flat` (one unpacked tree) or `oci` (a stack of shared layers). Since protocol 10.
    pub kind: String,
    /// The layers, bottom-most first; empty for a flat image. Since protocol 10.
    pub layers: Vec<LayerInfo>,
    /// The image's run configuration; `None` for a flat image. Since protocol 10.
    pub config: Option<ImageConfig>,
}

/// One layer of an OCI image, stored once per node by the digest of its uncompressed tar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    /// `sha256:<hex>` of the uncompressed layer tar (the config's `rootfs.diff_ids` entry).
    pub diff_id: String,
    /// Bytes of regular-file content of the unpacked layer.
    pub bytes: u64,
    /// Members of the layer tar.
    pub entries: u64,
    /// Images that use this layer (this one included): its bytes are stored once for all.
    pub images: u32,
}

/// The run configuration of an OCI image (its config's `config` object), applied to the
/// sandboxes created from it unless the [`crate::SandboxSpec`] overrides it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `Env`, `(key, value)`: the base environment of every action; a key the sandbox spec
    /// sets too takes the spec's value.
    pub env: Vec<(String, String)>,
    /// `WorkingDir`: the default working directory when the spec names none.
    pub workdir: Option<String>,
    /// `User` as the image names it (`name`, `uid`, `uid:gid`, `name:group`).
    pub user: Option<String>,
    /// `User` resolved against the image's `/etc/passwd` and `/etc/group` at import:
    /// `(uid, gid)` every action runs as unless the spec names a user. `None`: root.
    pub user_ids: Option<(u32, u32)>,
    /// `Entrypoint` (documentation only: sandboxes run actions, not the image's command).
    pub entrypoint: Vec<String>,
    /// `Cmd` (documentation only).
    pub cmd: Vec<String>,
}

/// Credentials for a registry, resolved by the client (from `--creds`, or a docker-style
/// `config.json`: `auths.<registry>.auth`, `identitytoken`, `registrytoken`).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegistryCredentials {
    /// No credentials (anonymous bearer tokens are still fetched when asked for).
    Anonymous,
    /// User name and password (basic auth, or exchanged for a bearer token).
    Basic {
        /// User name.
        username: String,
        /// Password or access token.
        password: String,
    },
    /// A bearer token sent as it is.
    Bearer {
        /// The token.
        token: String,
    },
}

impl std::fmt::Debug for RegistryCredentials {
    /// Never prints a secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryCredentials::Anonymous => f.write_str("Anonymous"),
            RegistryCredentials::Basic { username, .. } => {
                write!(f, "Basic {{ username: {username:?}, password: <hidden> }}")
            }
            RegistryCredentials::Bearer { .. } => f.write_str("Bearer { token: <hidden> }"),
        }
    }
}

/// `PullImage`: fetch an image from an OCI distribution registry into the layer store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PullRequest {
    /// `HOST[:PORT]/REPO[:TAG]` or `...@sha256:<hex>`; without a host, `docker.io`; without a
    /// tag, `latest`.
    pub reference: String,
    /// Local image name; `None`: the reference as given.
    pub name: Option<String>,
    /// Credentials for the reference's registry.
    pub credentials: RegistryCredentials,
    /// Talk plain HTTP to this registry (loopback registries always are).
    pub insecure: bool,
}

/// One blob of an [`OciImportRequest`]: a byte range of one of the descriptors attached to the
/// request's frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobRange {
    /// Index of the descriptor among the frame's descriptors.
    pub fd: u32,
    /// First byte of the blob in that file.
    pub offset: u64,
    /// Length of the blob in bytes.
    pub len: u64,
}

/// `ImportOci`: an OCI image whose parts the client found (in an OCI layout or a docker
/// archive) and opened with its own rights; the daemon trusts none of it and verifies every
/// digest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OciImportRequest {
    /// Image name ([`valid_image_name`]).
    pub name: String,
    /// The client's label of the source (recorded, never opened).
    pub source: String,
    /// The image manifest's bytes (an OCI layout): its config and layer digests are checked
    /// against the blobs. `None` (a docker archive): the layers are checked against the
    /// config's `rootfs.diff_ids` only.
    pub manifest: Option<Vec<u8>>,
    /// The image config's bytes.
    pub config: Vec<u8>,
    /// The layer blobs, bottom-most first, as the manifest (or archive) lists them.
    pub layers: Vec<BlobRange>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names() {
        for good in [
            "busybox",
            "localhost:5000/swe/task-123:latest",
            "127.0.0.1:5000/a@sha256:0123abcd",
            "docker.io/library/python:3.11-slim",
        ] {
            assert!(valid_image_name(good), "{good:?}");
        }
        for bad in [
            "",
            ".hidden",
            "/abs",
            "a//b",
            "a/../b",
            "a/./b",
            "a b",
            "a\nb",
            "é",
            &"x".repeat(256),
        ] {
            assert!(!valid_image_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn credentials_debug_hides_secrets() {
        let basic = RegistryCredentials::Basic {
            username: "u".into(),
            password: "hunter2".into(),
        };
        let bearer = RegistryCredentials::Bearer {
            token: "tok-secret".into(),
        };
        assert!(!format!("{basic:?}").contains("hunter2"));
        assert!(!format!("{bearer:?}").contains("tok-secret"));
    }
}
