//! What the client accepts as a manifest: media types, schema version, the shape of an image
//! manifest and of an index, the linux/amd64 choice in an index, and digests.
//!
//! Everything here works on bytes already received (at most [`MAX_MANIFEST_BYTES`]) and
//! returns a reason text that the caller wraps into [`super::RegistryError::BadManifest`].

use oci_client::manifest::{
    ImageIndexEntry, OciImageIndex, OciImageManifest, IMAGE_DOCKER_CONFIG_MEDIA_TYPE,
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE,
};
use serde::de::IgnoredAny;
use serde::Deserialize;
use sha2::Digest as _;

use super::error::clip;

/// Largest manifest or index accepted, in bytes (4 MiB; registries commonly refuse to
/// store larger ones).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;

/// The `Accept` header of a manifest request: OCI and Docker schema 2 manifests and indexes,
/// never schema 1.
pub(crate) const ACCEPT: &str = "application/vnd.oci.image.manifest.v1+json, \
     application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json, \
     application/vnd.docker.distribution.manifest.list.v2+json";

const SCHEMA1_MEDIA_TYPES: [&str; 2] = [
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
];

/// A manifest's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// An image manifest (OCI or Docker schema 2).
    Image,
    /// An index or manifest list.
    Index,
}

/// The fields that tell what a manifest is, before it is parsed whole.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Probe {
    schema_version: i64,
    media_type: Option<String>,
    manifests: Option<IgnoredAny>,
    config: Option<IgnoredAny>,
    layers: Option<IgnoredAny>,
}

fn kind_of_media_type(media_type: &str) -> Option<Kind> {
    match media_type {
        OCI_IMAGE_MEDIA_TYPE | IMAGE_MANIFEST_MEDIA_TYPE => Some(Kind::Image),
        OCI_IMAGE_INDEX_MEDIA_TYPE | IMAGE_MANIFEST_LIST_MEDIA_TYPE => Some(Kind::Index),
        _ => None,
    }
}

/// `Content-Type` without parameters, lowercased.
fn bare_content_type(content_type: Option<&str>) -> Option<String> {
    let ct = content_type?.split(';').next()?.trim().to_ascii_lowercase();
    (!ct.is_empty()).then_some(ct)
}

/// Tells an image manifest from an index, refusing schema 1, other schema versions, unknown
/// media types and a body whose `mediaType` contradicts a manifest `Content-Type`.
pub(crate) fn classify(bytes: &[u8], content_type: Option<&str>) -> Result<Kind, String> {
    let header = bare_content_type(content_type);
    if let Some(ct) = &header {
        if SCHEMA1_MEDIA_TYPES.contains(&ct.as_str()) {
            return Err("docker schema 1 manifests are not supported".to_string());
        }
    }
    let probe: Probe =
        serde_json::from_slice(bytes).map_err(|e| format!("not a manifest document: {e}"))?;
    match probe.schema_version {
        2 => {}
        1 => return Err("docker schema 1 manifests are not supported".to_string()),
        v => return Err(format!("unsupported schema version {v}")),
    }
    let header_kind = header.as_deref().and_then(kind_of_media_type);
    let kind = match probe.media_type.as_deref() {
        Some(mt) => {
            let kind = kind_of_media_type(mt)
                .ok_or_else(|| format!("unsupported media type {:?}", clip(mt, 200)))?;
            if let (Some(hk), Some(ct)) = (header_kind, &header) {
                if ct != mt {
                    return Err(format!(
                        "media type {mt} in the body but {} in Content-Type",
                        clip(ct, 200)
                    ));
                }
                debug_assert_eq!(hk, kind);
            }
            kind
        }
        // OCI allows a manifest without `mediaType`: the header, else the shape, tells.
        None => match header_kind {
            Some(k) => k,
            None if probe.manifests.is_some() => Kind::Index,
            None if probe.config.is_some() && probe.layers.is_some() => Kind::Image,
            None => {
                return Err(format!(
                    "unsupported media type {:?}",
                    clip(header.as_deref().unwrap_or("none"), 200)
                ))
            }
        },
    };
    Ok(kind)
}

/// Parses and checks an image manifest: an image config media type and well-formed digests
/// and sizes in every descriptor.
pub(crate) fn check_image(bytes: &[u8]) -> Result<OciImageManifest, String> {
    let m: OciImageManifest =
        serde_json::from_slice(bytes).map_err(|e| format!("unparsable image manifest: {e}"))?;
    let config_type = m.config.media_type.as_str();
    if config_type != oci_client::manifest::IMAGE_CONFIG_MEDIA_TYPE
        && config_type != IMAGE_DOCKER_CONFIG_MEDIA_TYPE
    {
        return Err(format!(
            "config media type {:?} is not an image config",
            clip(config_type, 200)
        ));
    }
    for d in std::iter::once(&m.config).chain(m.layers.iter()) {
        if !valid_digest(&d.digest) {
            return Err(format!(
                "descriptor digest {:?} is invalid",
                clip(&d.digest, 200)
            ));
        }
        if d.size < 0 {
            return Err(format!("descriptor {} has negative size", d.digest));
        }
    }
    Ok(m)
}

/// Parses an index and picks its linux/amd64 image manifest (the first one without a
/// variant, else the first one).
pub(crate) fn pick_amd64(bytes: &[u8]) -> Result<ImageIndexEntry, String> {
    let index: OciImageIndex =
        serde_json::from_slice(bytes).map_err(|e| format!("unparsable index: {e}"))?;
    let amd64: Vec<&ImageIndexEntry> = index
        .manifests
        .iter()
        .filter(|e| {
            e.platform.as_ref().is_some_and(|p| {
                // oci-client does not re-export oci-spec's `Os`/`Arch`: compare their names.
                p.os.to_string() == "linux" && p.architecture.to_string() == "amd64"
            })
        })
        .collect();
    let entry = amd64
        .iter()
        .find(|e| e.platform.as_ref().is_some_and(|p| p.variant.is_none()))
        .or(amd64.first())
        .ok_or_else(|| "the index has no linux/amd64 manifest".to_string())?;
    match kind_of_media_type(&entry.media_type) {
        Some(Kind::Image) => {}
        Some(Kind::Index) => return Err("the linux/amd64 entry is itself an index".to_string()),
        None => {
            return Err(format!(
                "the linux/amd64 entry has media type {:?}",
                clip(&entry.media_type, 200)
            ))
        }
    }
    if !valid_digest(&entry.digest) {
        return Err(format!(
            "the linux/amd64 entry's digest {:?} is invalid",
            clip(&entry.digest, 200)
        ));
    }
    if entry.size < 0 || entry.size as u64 > MAX_MANIFEST_BYTES {
        return Err(format!(
            "the linux/amd64 entry's size {} is outside 0..={MAX_MANIFEST_BYTES}",
            entry.size
        ));
    }
    Ok((*entry).clone())
}

/// Whether `digest` is `sha256:` + 64 or `sha512:` + 128 lowercase hex digits (what may go
/// into a URL path).
pub fn valid_digest(digest: &str) -> bool {
    let hex_len = match digest.split_once(':') {
        Some(("sha256", hex)) => (hex, 64),
        Some(("sha512", hex)) => (hex, 128),
        _ => return false,
    };
    let (hex, len) = hex_len;
    hex.len() == len && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The digest of `bytes` in the algorithm of `like` (a valid digest), `sha256` when `like`
/// is `None`.
pub(crate) fn digest_like(like: Option<&str>, bytes: &[u8]) -> String {
    if like.is_some_and(|d| d.starts_with("sha512:")) {
        format!("sha512:{}", hex::encode(sha2::Sha512::digest(bytes)))
    } else {
        format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":2}"#;

    fn image(media_type: &str, config: &str) -> String {
        format!(r#"{{"schemaVersion":2,"mediaType":"{media_type}","config":{config},"layers":[]}}"#)
    }

    #[test]
    fn schema1_is_refused_by_header_and_by_body() {
        let body = br#"{"schemaVersion":1,"name":"x","tag":"latest","fsLayers":[]}"#;
        for ct in [
            Some("application/vnd.docker.distribution.manifest.v1+prettyjws"),
            Some("application/json"),
            None,
        ] {
            let err = classify(body, ct).unwrap_err();
            assert!(err.contains("schema 1"), "{err}");
        }
    }

    #[test]
    fn media_types_are_classified() {
        let oci = image(OCI_IMAGE_MEDIA_TYPE, CONFIG);
        assert_eq!(classify(oci.as_bytes(), None).unwrap(), Kind::Image);
        let docker = image(IMAGE_MANIFEST_MEDIA_TYPE, CONFIG);
        assert_eq!(
            classify(docker.as_bytes(), Some(IMAGE_MANIFEST_MEDIA_TYPE)).unwrap(),
            Kind::Image
        );
        let list = format!(
            r#"{{"schemaVersion":2,"mediaType":"{IMAGE_MANIFEST_LIST_MEDIA_TYPE}","manifests":[]}}"#
        );
        assert_eq!(classify(list.as_bytes(), None).unwrap(), Kind::Index);
        let bare = r#"{"schemaVersion":2,"manifests":[]}"#;
        assert_eq!(
            classify(bare.as_bytes(), Some("application/json")).unwrap(),
            Kind::Index
        );
        let weird = image("application/vnd.example+json", CONFIG);
        assert!(classify(weird.as_bytes(), None)
            .unwrap_err()
            .contains("unsupported media type"));
        let lying = image(OCI_IMAGE_MEDIA_TYPE, CONFIG);
        let err = classify(lying.as_bytes(), Some(OCI_IMAGE_INDEX_MEDIA_TYPE)).unwrap_err();
        assert!(err.contains("Content-Type"), "{err}");
        assert!(classify(b"\x00garbage", None)
            .unwrap_err()
            .contains("not a manifest"));
        let v3 = r#"{"schemaVersion":3}"#;
        assert!(classify(v3.as_bytes(), None)
            .unwrap_err()
            .contains("version 3"));
    }

    #[test]
    fn image_checks_config_type_and_digests() {
        assert!(check_image(image(OCI_IMAGE_MEDIA_TYPE, CONFIG).as_bytes()).is_ok());
        let helm = CONFIG.replace(
            "application/vnd.oci.image.config.v1+json",
            "application/vnd.cncf.helm.config.v1+json",
        );
        let err = check_image(image(OCI_IMAGE_MEDIA_TYPE, &helm).as_bytes()).unwrap_err();
        assert!(err.contains("not an image config"), "{err}");
        let bad = CONFIG.replace("sha256:aaaa", "sha256:../../");
        let err = check_image(image(OCI_IMAGE_MEDIA_TYPE, &bad).as_bytes()).unwrap_err();
        assert!(err.contains("invalid"), "{err}");
    }

    #[test]
    fn index_picks_linux_amd64() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[
              {{"mediaType":"{OCI_IMAGE_MEDIA_TYPE}","digest":"{}","size":10,"platform":{{"os":"linux","architecture":"arm64"}}}},
              {{"mediaType":"{OCI_IMAGE_MEDIA_TYPE}","digest":"{}","size":10,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#,
            d('a'),
            d('b')
        );
        assert_eq!(pick_amd64(index.as_bytes()).unwrap().digest, d('b'));
        let arm_only = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{OCI_IMAGE_MEDIA_TYPE}","digest":"{}","size":10,"platform":{{"os":"linux","architecture":"arm64"}}}}]}}"#,
            d('a')
        );
        assert!(pick_amd64(arm_only.as_bytes())
            .unwrap_err()
            .contains("no linux/amd64"));
        let nested = format!(
            r#"{{"schemaVersion":2,"manifests":[{{"mediaType":"{OCI_IMAGE_INDEX_MEDIA_TYPE}","digest":"{}","size":10,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#,
            d('a')
        );
        assert!(pick_amd64(nested.as_bytes())
            .unwrap_err()
            .contains("itself an index"));
    }

    #[test]
    fn digests_are_validated_and_computed() {
        assert!(valid_digest(&format!("sha256:{}", "0".repeat(64))));
        assert!(valid_digest(&format!("sha512:{}", "f".repeat(128))));
        for bad in [
            "sha256:",
            "sha256:ABC",
            "md5:00",
            "sha256:../x",
            "",
            "sha256",
        ] {
            assert!(!valid_digest(bad), "{bad}");
        }
        assert_eq!(
            digest_like(None, b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert!(digest_like(Some("sha512:00"), b"").starts_with("sha512:cf83e1357eef"));
    }
}
