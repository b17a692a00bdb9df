//! The manifest and config of an OCI (or Docker schema 2) image, parsed with `oci-spec` as
//! untrusted input and reduced to what an import needs ([`ImageParts`]): the config digest,
//! the layer blobs with their media types, the uncompressed layer digests (`diff_ids`) and
//! the run configuration.

use belayer_ipc::ImageConfig;
use oci_spec::image::{ImageConfiguration, ImageManifest};

use super::super::stream::{sha256_digest, valid_sha256};
use super::super::ImageError;

/// Largest manifest or config accepted, bytes.
pub const MAX_JSON_BYTES: usize = 4 << 20;

/// Most layers an image may have (overlayfs stacks up to 500; Docker builds at most 127).
pub const MAX_LAYERS: usize = 128;

/// Layer media types accepted (the compression is detected from the bytes anyway).
const LAYER_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
];

/// Config media types accepted.
const CONFIG_TYPES: &[&str] = &[
    "application/vnd.oci.image.config.v1+json",
    "application/vnd.docker.container.image.v1+json",
];

/// One layer blob as the manifest names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    /// `sha256:<hex>` of the blob.
    pub digest: String,
    /// Its size in bytes.
    pub size: u64,
}

/// What an import needs of a manifest and a config, all checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageParts {
    /// Layer blobs, bottom-most first (empty for a docker archive, which has no manifest).
    pub blobs: Vec<LayerBlob>,
    /// Uncompressed layer digests, bottom-most first.
    pub diff_ids: Vec<String>,
    /// The run configuration (`user_ids` still unresolved).
    pub config: ImageConfig,
}

fn bad(image: &str, what: &'static str, reason: impl Into<String>) -> ImageError {
    ImageError::BadOci {
        image: image.to_string(),
        what,
        reason: reason.into(),
    }
}

/// Parses and checks `manifest` (when there is one) and `config` for image `image`: the
/// manifest's config digest is that of `config`, its media types are an image's, it lists
/// as many layers as the config's `rootfs.diff_ids` (at most [`MAX_LAYERS`]), every digest is
/// `sha256:<64 hex>`, the image is a Linux one.
///
/// Errors: [`ImageError::BadOci`], [`ImageError::DigestMismatch`] (the config).
pub fn parse(
    image: &str,
    manifest: Option<&[u8]>,
    config: &[u8],
) -> Result<ImageParts, ImageError> {
    if config.len() > MAX_JSON_BYTES || manifest.is_some_and(|m| m.len() > MAX_JSON_BYTES) {
        return Err(bad(
            image,
            "manifest",
            format!("larger than {MAX_JSON_BYTES} bytes"),
        ));
    }
    let blobs = match manifest {
        Some(bytes) => parse_manifest(image, bytes, config)?,
        None => Vec::new(),
    };
    let cfg =
        ImageConfiguration::from_reader(config).map_err(|e| bad(image, "config", e.to_string()))?;
    let os = cfg.os().to_string();
    if os != "linux" {
        return Err(bad(image, "config", format!("os {os:?} is not linux")));
    }
    if cfg.rootfs().typ() != "layers" {
        return Err(bad(
            image,
            "config",
            format!("rootfs type {:?} is not \"layers\"", cfg.rootfs().typ()),
        ));
    }
    let diff_ids = cfg.rootfs().diff_ids().clone();
    if diff_ids.is_empty() || diff_ids.len() > MAX_LAYERS {
        return Err(bad(
            image,
            "config",
            format!("{} layers (1 to {MAX_LAYERS} accepted)", diff_ids.len()),
        ));
    }
    if let Some(d) = diff_ids.iter().find(|d| !valid_sha256(d)) {
        return Err(bad(
            image,
            "config",
            format!("diff_id {d:?} is not sha256:<64 hex>"),
        ));
    }
    if manifest.is_some() && blobs.len() != diff_ids.len() {
        return Err(bad(
            image,
            "manifest",
            format!(
                "{} layers, but the config has {} diff_ids",
                blobs.len(),
                diff_ids.len()
            ),
        ));
    }
    let run = cfg.config().clone().unwrap_or_default();
    let env = run
        .env()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (!k.is_empty() && !k.contains('\0') && !v.contains('\0'))
                .then(|| (k.to_string(), v.to_string()))
        })
        .collect();
    let config = ImageConfig {
        env,
        workdir: run.working_dir().clone().filter(|w| w.starts_with('/')),
        user: run.user().clone().filter(|u| !u.is_empty()),
        user_ids: None,
        entrypoint: run.entrypoint().clone().unwrap_or_default(),
        cmd: run.cmd().clone().unwrap_or_default(),
    };
    Ok(ImageParts {
        blobs,
        diff_ids,
        config,
    })
}

fn parse_manifest(image: &str, bytes: &[u8], config: &[u8]) -> Result<Vec<LayerBlob>, ImageError> {
    let m = ImageManifest::from_reader(bytes).map_err(|e| bad(image, "manifest", e.to_string()))?;
    if m.schema_version() != 2 {
        return Err(bad(
            image,
            "manifest",
            format!("schema version {} (2 accepted)", m.schema_version()),
        ));
    }
    let config_type = m.config().media_type().to_string();
    if !CONFIG_TYPES.contains(&config_type.as_str()) {
        return Err(bad(
            image,
            "manifest",
            format!("config media type {config_type:?} is not an image config"),
        ));
    }
    let want = m.config().digest().to_string();
    let got = sha256_digest(config);
    if want != got {
        return Err(ImageError::DigestMismatch {
            image: image.to_string(),
            what: "config".into(),
            expected: want,
            got,
            bytes: config.len() as u64,
        });
    }
    m.layers()
        .iter()
        .map(|d| {
            let media = d.media_type().to_string();
            if !LAYER_TYPES.contains(&media.as_str()) {
                return Err(bad(
                    image,
                    "manifest",
                    format!("layer media type {media:?} is not accepted (foreign, encrypted or not a layer)"),
                ));
            }
            let digest = d.digest().to_string();
            if !valid_sha256(&digest) {
                return Err(bad(image, "manifest", format!("layer digest {digest:?} is not sha256:<64 hex>")));
            }
            Ok(LayerBlob {
                digest,
                size: d.size(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(diff_ids: &[String]) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin", "A=b=c", "=bad"], "WorkingDir": "/work",
                       "User": "1000:1000", "Cmd": ["sh"]},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .unwrap()
    }

    fn manifest(config: &[u8], layers: &[(&str, String, u64)]) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": sha256_digest(config), "size": config.len()},
            "layers": layers.iter().map(|(t, d, s)| serde_json::json!({"mediaType": t, "digest": d, "size": s})).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    #[test]
    fn parses_a_good_image() {
        let diff = sha256_digest(b"layer");
        let cfg = config(std::slice::from_ref(&diff));
        let m = manifest(
            &cfg,
            &[(
                "application/vnd.oci.image.layer.v1.tar+gzip",
                sha256_digest(b"blob"),
                4,
            )],
        );
        let parts = parse("t", Some(&m), &cfg).unwrap();
        assert_eq!(parts.diff_ids, vec![diff]);
        assert_eq!(parts.blobs[0].size, 4);
        assert_eq!(parts.config.workdir.as_deref(), Some("/work"));
        assert_eq!(parts.config.user.as_deref(), Some("1000:1000"));
        assert_eq!(
            parts.config.env,
            vec![
                ("PATH".into(), "/usr/bin:/bin".into()),
                ("A".into(), "b=c".into())
            ]
        );
    }

    #[test]
    fn refuses_bad_images() {
        let diff = sha256_digest(b"layer");
        let cfg = config(std::slice::from_ref(&diff));
        let foreign = manifest(
            &cfg,
            &[(
                "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                sha256_digest(b"b"),
                1,
            )],
        );
        assert!(matches!(
            parse("t", Some(&foreign), &cfg),
            Err(ImageError::BadOci { .. })
        ));
        let two = manifest(
            &cfg,
            &[
                (
                    "application/vnd.oci.image.layer.v1.tar",
                    sha256_digest(b"a"),
                    1,
                ),
                (
                    "application/vnd.oci.image.layer.v1.tar",
                    sha256_digest(b"b"),
                    1,
                ),
            ],
        );
        assert!(matches!(
            parse("t", Some(&two), &cfg),
            Err(ImageError::BadOci { .. })
        ));
        let other_cfg = config(&[sha256_digest(b"other")]);
        let m = manifest(
            &other_cfg,
            &[(
                "application/vnd.oci.image.layer.v1.tar",
                sha256_digest(b"a"),
                1,
            )],
        );
        assert!(matches!(
            parse("t", Some(&m), &cfg),
            Err(ImageError::DigestMismatch { .. })
        ));
        let bad_diff = config(&["sha256:../../etc".to_string()]);
        assert!(matches!(
            parse("t", None, &bad_diff),
            Err(ImageError::BadOci { .. })
        ));
        assert!(matches!(
            parse("t", None, b"{"),
            Err(ImageError::BadOci { .. })
        ));
        assert!(matches!(
            parse("t", Some(b"[]"), &cfg),
            Err(ImageError::BadOci { .. })
        ));
    }
}
