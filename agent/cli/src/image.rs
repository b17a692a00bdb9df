//! `belayer image import|pull`: the source opened here with the caller's rights (a flat
//! tree or archive, an OCI layout, a docker archive), and registry credentials resolved
//! here from the caller's own auth files, so the daemon never reads a user's files.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use belayer_ipc::oci_source::SourceSpec;
use belayer_ipc::{Client, PullRequest, RegistryCredentials, Request, Response};
use serde_json::Value;

use crate::args::PullArgs;
use crate::client::{answer, call, import_image};

/// Imports `source` (`oci:…`, `docker-archive:…` or a path) as image `name`.
pub fn import(client: &mut Client, name: &str, source: &str) -> Result<Response> {
    match SourceSpec::parse(source) {
        None => import_image(client, name, Path::new(source)),
        Some(spec) => {
            let parts = spec.open()?;
            answer(
                client
                    .import_oci(name, &parts)
                    .context("talking to belayerd")?,
            )
        }
    }
}

/// Pulls `args.reference`.
pub fn pull(client: &mut Client, args: PullArgs) -> Result<Response> {
    let credentials = match &args.creds {
        Some(c) => match c.split_once(':') {
            Some((u, p)) => RegistryCredentials::Basic {
                username: u.to_string(),
                password: p.to_string(),
            },
            None => bail!("--creds must be USER:PASSWORD"),
        },
        None => from_auth_files(args.authfile.as_deref(), registry_of(&args.reference))?,
    };
    call(
        client,
        Request::PullImage(PullRequest {
            reference: args.reference,
            name: args.name,
            credentials,
            insecure: args.insecure,
        }),
    )
}

/// The registry part of a reference (`docker.io` when it has none).
fn registry_of(reference: &str) -> &str {
    match reference.split_once('/') {
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => first,
        _ => "docker.io",
    }
}

/// The auth files looked at, in order.
fn auth_files(explicit: Option<&Path>) -> Vec<PathBuf> {
    if let Some(p) = explicit {
        return vec![p.to_path_buf()];
    }
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let mut out = Vec::new();
    if let Some(p) = env("REGISTRY_AUTH_FILE") {
        out.push(p);
    }
    if let Some(d) = env("DOCKER_CONFIG") {
        out.push(d.join("config.json"));
    }
    if let Some(h) = env("HOME") {
        out.push(h.join(".docker/config.json"));
    }
    if let Some(r) = env("XDG_RUNTIME_DIR") {
        out.push(r.join("containers/auth.json"));
    }
    out
}

/// Credentials for `registry` from the first auth file that has an entry for it.
fn from_auth_files(explicit: Option<&Path>, registry: &str) -> Result<RegistryCredentials> {
    for path in auth_files(explicit) {
        let text = match std::fs::read(&path) {
            Ok(t) => t,
            Err(_) if explicit.is_none() => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        let v: Value = serde_json::from_slice(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        if let Some(c) = entry_for(&v, registry, &path)? {
            return Ok(c);
        }
    }
    Ok(RegistryCredentials::Anonymous)
}

/// The entry of `auths` for `registry` (keys may carry a scheme and a path, and docker.io
/// is `https://index.docker.io/v1/`).
fn entry_for(v: &Value, registry: &str, path: &Path) -> Result<Option<RegistryCredentials>> {
    let Some(auths) = v.get("auths").and_then(Value::as_object) else {
        return Ok(None);
    };
    let host_of = |key: &str| -> String {
        let k = key
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        let k = k.split('/').next().unwrap_or(k);
        match k {
            "index.docker.io" | "registry-1.docker.io" => "docker.io".to_string(),
            k => k.to_string(),
        }
    };
    let Some((_, e)) = auths.iter().find(|(k, _)| host_of(k) == registry) else {
        return Ok(None);
    };
    if let Some(token) = e.get("registrytoken").and_then(Value::as_str) {
        return Ok(Some(RegistryCredentials::Bearer {
            token: token.to_string(),
        }));
    }
    if let (Some(u), Some(p)) = (
        e.get("username").and_then(Value::as_str),
        e.get("password").and_then(Value::as_str),
    ) {
        return Ok(Some(RegistryCredentials::Basic {
            username: u.to_string(),
            password: p.to_string(),
        }));
    }
    let Some(auth) = e.get("auth").and_then(Value::as_str) else {
        return Ok(None);
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .with_context(|| {
            format!(
                "{}: the auth of {registry} is not base64 text",
                path.display()
            )
        })?;
    match decoded.split_once(':') {
        Some((u, p)) => Ok(Some(RegistryCredentials::Basic {
            username: u.to_string(),
            password: p.to_string(),
        })),
        None => bail!(
            "{}: the auth of {registry} is not USER:PASSWORD",
            path.display()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries() {
        assert_eq!(registry_of("localhost:5000/a/b:1"), "localhost:5000");
        assert_eq!(registry_of("localhost/a"), "localhost");
        assert_eq!(registry_of("ghcr.io/x/y"), "ghcr.io");
        assert_eq!(registry_of("library/python:3"), "docker.io");
        assert_eq!(registry_of("python"), "docker.io");
    }

    #[test]
    fn auth_entries() {
        let auth = base64::engine::general_purpose::STANDARD.encode("u:p:w");
        let v = serde_json::json!({"auths": {
            "http://127.0.0.1:5000": {"auth": auth},
            "https://index.docker.io/v1/": {"registrytoken": "tok"},
        }});
        let p = Path::new("config.json");
        assert_eq!(
            entry_for(&v, "127.0.0.1:5000", p).unwrap(),
            Some(RegistryCredentials::Basic {
                username: "u".into(),
                password: "p:w".into()
            })
        );
        assert_eq!(
            entry_for(&v, "docker.io", p).unwrap(),
            Some(RegistryCredentials::Bearer {
                token: "tok".into()
            })
        );
        assert_eq!(entry_for(&v, "ghcr.io", p).unwrap(), None);
    }
}
