//! The run configuration of an OCI image applied to a new sandbox's spec: the image's `Env`
//! under the spec's, its `WorkingDir` unless the spec names one, its resolved `User` unless
//! the spec names one. The result is kept in the sandbox's record, so a sandbox keeps what
//! it was created with across restores and daemon restarts.

use belayer_ipc::SandboxSpec;

use super::create::{valid_dir, valid_env, CreateError};
use super::exec::parse_user;
use crate::images::ImageMeta;

/// Largest uid or gid of a sandbox in a private user namespace (its map covers `0..65536`).
const MAX_PRIVATE_ID: u32 = 65535;

/// Checks `spec.user` and fills in what the image's config gives and the spec leaves open.
///
/// Errors: [`CreateError::InvalidSpec`] for a `user` that is not `uid` or `uid:gid`, an id
/// outside a private user namespace's map, or an image whose `User` names an account its
/// `/etc/passwd` lacks (with no `user` in the spec to replace it).
pub(crate) fn apply_image_config(
    spec: &mut SandboxSpec,
    image: &ImageMeta,
) -> Result<(), CreateError> {
    if let Some(cfg) = &image.config {
        let mut env: Vec<(String, String)> = cfg
            .env
            .iter()
            .filter(|(k, v)| valid_env(k, v))
            .cloned()
            .collect();
        for (k, v) in spec.env.drain(..) {
            match env.iter_mut().find(|(key, _)| *key == k) {
                Some(slot) => slot.1 = v,
                None => env.push((k, v)),
            }
        }
        spec.env = env;
        if spec.workdir.is_none() {
            spec.workdir = cfg.workdir.clone().filter(|d| valid_dir(d));
        }
        if spec.user.is_none() {
            match (&cfg.user, cfg.user_ids) {
                (_, Some((uid, gid))) => spec.user = Some(format!("{uid}:{gid}")),
                (Some(name), None) => {
                    return Err(CreateError::InvalidSpec(format!(
                        "image {} runs as user {name:?}, which its /etc/passwd or /etc/group \
                         does not define; give the sandbox a numeric user",
                        image.name
                    )))
                }
                (None, None) => {}
            }
        }
    }
    if let Some(user) = spec.user.as_deref() {
        let Some((uid, gid)) = parse_user(user) else {
            return Err(CreateError::InvalidSpec(format!(
                "user {:?} must be UID or UID:GID (numbers)",
                user.chars().take(64).collect::<String>()
            )));
        };
        let private = spec.userns != Some(belayer_ipc::UsernsMode::Host);
        if private && (uid > MAX_PRIVATE_ID || gid > MAX_PRIVATE_ID) {
            return Err(CreateError::InvalidSpec(format!(
                "user {uid}:{gid} is outside the sandbox's user namespace (ids 0..={MAX_PRIVATE_ID})"
            )));
        }
    }
    Ok(())
}
