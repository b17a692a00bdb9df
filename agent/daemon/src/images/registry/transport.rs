//! The HTTP side: the authentication handshake (oci-client's), GET requests with the auth
//! header, retries with backoff, bounded bodies, and the mapping of statuses and transport
//! failures to [`RegistryError`].

use std::net::IpAddr;
use std::time::Duration;

use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciEnvelope, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Reference, RegistryOperation};
use reqwest::{header, Response, StatusCode};

use super::error::{clip, RegistryError};
use super::{Credentials, RegistryOptions};

const USER_AGENT: &str = concat!("belayerd/", env!("CARGO_PKG_VERSION"));

/// Most bytes of an error body read to find the registry's error code.
const ERROR_BODY_MAX: u64 = 64 << 10;

/// First backoff; doubled per attempt up to [`BACKOFF_MAX`].
const BACKOFF_FIRST: Duration = Duration::from_millis(250);
const BACKOFF_MAX: Duration = Duration::from_secs(4);

/// What the `Authorization` header carries.
enum Auth {
    None,
    Basic(String, String),
    /// `from_challenge`: obtained from the registry's token service (so it may expire and
    /// be fetched again), not given by the caller.
    Bearer {
        token: String,
        from_challenge: bool,
    },
}

/// What a request is for, to name it in [`RegistryError::NotFound`].
pub(crate) enum Target<'a> {
    /// A manifest by tag or digest.
    Manifest(&'a str),
    /// A blob by digest.
    Blob(&'a str),
}

/// One registry connection (for one repository).
pub(crate) struct Transport {
    pub(crate) reference: Reference,
    /// The normalized reference, for messages.
    pub(crate) display: String,
    /// Host (and port) requests go to.
    pub(crate) registry: String,
    /// `scheme://registry/v2/repository`.
    base: String,
    http: reqwest::Client,
    oci: oci_client::Client,
    creds: Credentials,
    auth: Auth,
    retries: u32,
    timeout: Duration,
}

/// Whether `registry` (`host[:port]`) is spoken to in plain HTTP: loopback hosts, like
/// docker, and the hosts the options list (as `host` or `host:port`).
pub(crate) fn plain_http(registry: &str, insecure_hosts: &[String]) -> bool {
    let host = if registry.starts_with('[') {
        registry.find(']').map_or(registry, |end| &registry[..=end])
    } else {
        registry.split(':').next().unwrap_or(registry)
    };
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    loopback || insecure_hosts.iter().any(|h| h == registry || h == host)
}

impl Transport {
    /// Builds the clients (nothing is sent yet).
    pub(crate) fn new(
        reference: Reference,
        creds: Credentials,
        opts: &RegistryOptions,
    ) -> Result<Transport, RegistryError> {
        let display = reference.whole();
        let registry = reference.resolve_registry().to_string();
        let plain = plain_http(&registry, &opts.insecure_hosts);
        let scheme = if plain { "http" } else { "https" };
        let base = format!("{scheme}://{registry}/v2/{}", reference.repository());
        let setup = |source: Box<dyn std::error::Error + Send + Sync>| RegistryError::Setup {
            reference: display.clone(),
            source,
        };
        let http = reqwest::Client::builder()
            .connect_timeout(opts.timeout)
            .read_timeout(opts.timeout)
            .user_agent(USER_AGENT)
            .redirect(reqwest::redirect::Policy::limited(5))
            .build()
            .map_err(|e| setup(Box::new(e)))?;
        let config = ClientConfig {
            protocol: if plain {
                ClientProtocol::HttpsExcept(vec![registry.clone()])
            } else {
                ClientProtocol::Https
            },
            connect_timeout: Some(opts.timeout),
            read_timeout: Some(opts.timeout),
            user_agent: USER_AGENT,
            platform_resolver: None,
            ..ClientConfig::default()
        };
        let oci = oci_client::Client::try_from(config).map_err(|e| setup(Box::new(e)))?;
        Ok(Transport {
            reference,
            display,
            registry,
            base,
            http,
            oci,
            creds,
            auth: Auth::None,
            retries: opts.retries,
            timeout: opts.timeout,
        })
    }

    /// A transport failure: connect, DNS, TLS handshake and timeouts are "unreachable".
    pub(crate) fn map_reqwest(&self, source: reqwest::Error) -> RegistryError {
        map_reqwest(&self.registry, &self.display, source)
    }

    fn unauthorized(&self, status: Option<u16>) -> RegistryError {
        RegistryError::Unauthorized {
            registry: self.registry.clone(),
            reference: self.display.clone(),
            status,
            anonymous: matches!(self.creds, Credentials::Anonymous),
        }
    }

    /// Runs `op` until it succeeds, fails with a non-transient error, or the retries are
    /// spent, sleeping 250 ms, 500 ms, ... (at most 4 s) between attempts.
    pub(crate) async fn retrying<T>(
        &mut self,
        mut op: impl AsyncFnMut(&mut Transport) -> Result<T, RegistryError>,
    ) -> Result<T, RegistryError> {
        let mut attempt = 0u32;
        loop {
            match op(self).await {
                Err(e) if e.is_transient() && attempt < self.retries => {
                    let wait = BACKOFF_FIRST
                        .saturating_mul(1 << attempt.min(8))
                        .min(BACKOFF_MAX);
                    tracing::debug!(reference = %self.display, attempt, error = %e, "registry request failed, retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// The pull handshake: a caller's bearer token is used as is; otherwise oci-client
    /// pings `/v2/` and, on a bearer challenge, fetches a pull token from the realm (with
    /// the basic credentials if any); on a basic challenge (or none) the basic credentials
    /// are sent with every request.
    pub(crate) async fn authenticate(&mut self) -> Result<(), RegistryError> {
        let auth = match &self.creds {
            Credentials::Bearer { token } => {
                self.auth = Auth::Bearer {
                    token: token.clone(),
                    from_challenge: false,
                };
                return Ok(());
            }
            Credentials::Anonymous => RegistryAuth::Anonymous,
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
        };
        match self
            .oci
            .auth(&self.reference, &auth, RegistryOperation::Pull)
            .await
        {
            Ok(Some(token)) => {
                self.auth = Auth::Bearer {
                    token,
                    from_challenge: true,
                }
            }
            Ok(None) => {
                self.auth = match auth {
                    RegistryAuth::Basic(u, p) => Auth::Basic(u, p),
                    _ => Auth::None,
                }
            }
            Err(OciDistributionError::RequestError(e)) => return Err(self.map_reqwest(e)),
            Err(OciDistributionError::AuthenticationFailure(_)) => {
                return Err(self.unauthorized(None))
            }
            Err(source) => {
                return Err(RegistryError::Auth {
                    registry: self.registry.clone(),
                    reference: self.display.clone(),
                    source,
                })
            }
        }
        Ok(())
    }

    fn url(&self, target: &Target<'_>) -> String {
        match target {
            Target::Manifest(r) => format!("{}/manifests/{r}", self.base),
            Target::Blob(d) => format!("{}/blobs/{d}", self.base),
        }
    }

    /// One GET that answered 200. A 401 with a token from the token service fetches a new
    /// token once (it may have expired) and asks again. `whole`: the response must come
    /// whole within the timeout (manifests, configs), not only without stalls.
    async fn get_once(
        &mut self,
        target: &Target<'_>,
        accept: Option<&str>,
        whole: bool,
    ) -> Result<Response, RegistryError> {
        let url = self.url(target);
        let mut refreshed = false;
        loop {
            let mut req = self.http.get(&url);
            if let Some(accept) = accept {
                req = req.header(header::ACCEPT, accept);
            }
            if whole {
                req = req.timeout(self.timeout);
            }
            req = match &self.auth {
                Auth::None => req,
                Auth::Basic(u, p) => req.basic_auth(u, Some(p)),
                Auth::Bearer { token, .. } => req.bearer_auth(token),
            };
            let resp = req.send().await.map_err(|e| self.map_reqwest(e))?;
            let status = resp.status();
            match status {
                StatusCode::OK => return Ok(resp),
                StatusCode::UNAUTHORIZED
                    if !refreshed
                        && matches!(
                            self.auth,
                            Auth::Bearer {
                                from_challenge: true,
                                ..
                            }
                        ) =>
                {
                    refreshed = true;
                    self.authenticate().await?;
                }
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                    return Err(self.unauthorized(Some(status.as_u16())))
                }
                StatusCode::NOT_FOUND => return Err(self.not_found(target, resp).await),
                _ => {
                    return Err(RegistryError::Status {
                        registry: self.registry.clone(),
                        reference: self.display.clone(),
                        status: status.as_u16(),
                        url: clip(&url, 300),
                    })
                }
            }
        }
    }

    /// Names what a 404 says is missing, from the registry's error code.
    async fn not_found(&self, target: &Target<'_>, resp: Response) -> RegistryError {
        let body = read_limited(resp, ERROR_BODY_MAX).await.unwrap_or_default();
        let name_unknown = serde_json::from_slice::<OciEnvelope>(&body).is_ok_and(|env| {
            env.errors
                .iter()
                .any(|e| e.code == OciErrorCode::NameUnknown)
        });
        let repo = self.reference.repository();
        let what = match target {
            _ if name_unknown => format!("repository {repo}"),
            Target::Manifest(r) => format!("manifest {r} of repository {repo}"),
            Target::Blob(d) => format!("blob {d} of repository {repo}"),
        };
        RegistryError::NotFound {
            registry: self.registry.clone(),
            reference: self.display.clone(),
            what,
        }
    }

    /// GETs `target` whole, at most `limit` bytes (more: `too_large(bytes seen)`), with
    /// retries; returns the body and the `Content-Type`.
    pub(crate) async fn fetch(
        &mut self,
        target: &Target<'_>,
        accept: Option<&str>,
        limit: u64,
        too_large: &(dyn Fn(u64) -> RegistryError + Sync),
    ) -> Result<(Vec<u8>, Option<String>), RegistryError> {
        self.retrying(async |t| {
            let mut resp = t.get_once(target, accept, true).await?;
            let content_type = resp
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            if let Some(len) = resp.content_length().filter(|&len| len > limit) {
                return Err(too_large(len));
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| t.map_reqwest(e))? {
                if (body.len() + chunk.len()) as u64 > limit {
                    return Err(too_large((body.len() + chunk.len()) as u64));
                }
                body.extend_from_slice(&chunk);
            }
            Ok((body, content_type))
        })
        .await
    }

    /// GETs `target` with retries until a 200 arrives; the body is left to the caller.
    pub(crate) async fn open(&mut self, target: &Target<'_>) -> Result<Response, RegistryError> {
        self.retrying(async |t| t.get_once(target, None, false).await)
            .await
    }
}

/// See [`Transport::map_reqwest`].
pub(crate) fn map_reqwest(
    registry: &str,
    reference: &str,
    source: reqwest::Error,
) -> RegistryError {
    if source.is_connect() || source.is_timeout() {
        RegistryError::Unreachable {
            registry: registry.to_string(),
            reference: reference.to_string(),
            source,
        }
    } else {
        RegistryError::Transport {
            registry: registry.to_string(),
            reference: reference.to_string(),
            source,
        }
    }
}

/// At most `limit` bytes of a body (an error body: failures read as empty).
async fn read_limited(mut resp: Response, limit: u64) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        let room = (limit as usize).saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() as u64 >= limit {
            break;
        }
    }
    Some(out)
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("reference", &self.display)
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_listed_hosts_are_plain_http() {
        for r in [
            "localhost:5000",
            "127.0.0.1:5000",
            "127.0.0.1",
            "[::1]:5000",
            "127.8.0.1",
        ] {
            assert!(plain_http(r, &[]), "{r}");
        }
        for r in [
            "registry.example:5000",
            "index.docker.io",
            "10.0.0.1:5000",
            "[::2]:80",
        ] {
            assert!(!plain_http(r, &[]), "{r}");
        }
        let listed = vec!["reg.local".to_string(), "other:5001".to_string()];
        assert!(plain_http("reg.local:5000", &listed));
        assert!(plain_http("other:5001", &listed));
        assert!(!plain_http("other:5002", &listed));
    }
}
