//! Images and sandboxes: import, create, inspect, destroy (actions: [`crate::exec`]).

use crate::status::{guard, text, writable, Failure, BELAYER_E_INVALID_ARGUMENT};
use belayer_ipc::{Request, Response, SandboxInfo, SandboxSpec, UsernsMode};
use std::ffi::{c_char, c_int};

use crate::convert::*;
use crate::types::*;

/// Imports the rootfs directory or tar archive (plain, gzip, zstd) at `source` as the
/// read-only image `name`, owned by the calling process's uid; or, for `oci:DIR[:TAG]` (an
/// OCI image layout) and `docker-archive:FILE[:REF]`, an OCI image as shared layers (the
/// layer files opened here and passed as descriptors; every digest verified by the daemon,
/// `BELAYER_E_CORRUPT_IMAGE` when one does not match). The library opens `source`
/// itself, with this process's rights, and passes the descriptor to the daemon, which reads
/// only what this process may read (a directory is walked with its uid and groups). Device
/// nodes are refused, except under the source's top-level `/dev`, where they are left out.
///
/// Errors: daemon codes (`BELAYER_E_ALREADY_EXISTS`, `BELAYER_E_BAD_REQUEST` for a refused
/// entry such as a device node, `BELAYER_E_PERMISSION_DENIED` for an entry this process may
/// not read, ...), `BELAYER_E_PERMISSION_DENIED` or `BELAYER_E_INVALID_ARGUMENT` when
/// `source` cannot be opened here, `BELAYER_E_CONNECT`, `BELAYER_E_BAD_HANDLE`.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `name` and `source` are NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn belayer_image_import(
    client: BelayerClient,
    name: *const c_char,
    source: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (name, source) = unsafe { (text(name, "name")?, text(source, "source")?) };
        let response = match belayer_ipc::oci_source::SourceSpec::parse(source) {
            None => call_using(client, |c| {
                c.import_image(name, std::path::Path::new(source))
            })?,
            Some(spec) => {
                let parts = spec
                    .open()
                    .map_err(|e| Failure::new(BELAYER_E_INVALID_ARGUMENT, e.to_string()))?;
                call_using(client, |c| c.import_oci(name, &parts))?
            }
        };
        match response {
            Response::Image(_) => Ok(()),
            other => Err(unexpected("image import", &other)),
        }
    })
}

/// Pulls `reference` from its OCI distribution registry as image `name` (NULL: the
/// reference), with `username`/`password` (both NULL: anonymous) and plain HTTP when
/// `insecure` is non-zero (loopback registries always are). Blocks until every layer is
/// stored and verified.
///
/// Errors: `BELAYER_E_REGISTRY_UNREACHABLE`, `BELAYER_E_REGISTRY_DENIED`,
/// `BELAYER_E_NOT_FOUND` (no such image), `BELAYER_E_CORRUPT_IMAGE`,
/// `BELAYER_E_ALREADY_EXISTS`, `BELAYER_E_BAD_REQUEST`.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `reference` is a NUL-terminated string; `name`, `username`, `password` null or one.
#[no_mangle]
pub unsafe extern "C" fn belayer_image_pull(
    client: BelayerClient,
    reference: *const c_char,
    name: *const c_char,
    username: *const c_char,
    password: *const c_char,
    insecure: c_int,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (reference, name, username, password) = unsafe {
            (
                text(reference, "reference")?,
                opt_text(name, "name")?,
                opt_text(username, "username")?,
                opt_text(password, "password")?,
            )
        };
        let credentials = match (username, password) {
            (Some(u), Some(p)) => belayer_ipc::RegistryCredentials::Basic {
                username: u.to_string(),
                password: p.to_string(),
            },
            (None, None) => belayer_ipc::RegistryCredentials::Anonymous,
            _ => {
                return Err(Failure::new(
                    BELAYER_E_INVALID_ARGUMENT,
                    "username and password go together",
                ))
            }
        };
        let request = belayer_ipc::Request::PullImage(belayer_ipc::PullRequest {
            reference: reference.to_string(),
            name: name.map(str::to_string),
            credentials,
            insecure: insecure != 0,
        });
        match call_using(client, |c| c.call(request))? {
            Response::Image(_) => Ok(()),
            other => Err(unexpected("image pull", &other)),
        }
    })
}

/// Creates and starts a sandbox from `image` with rollout tag `tag` (NULL: none); stores its
/// id in `*out_id` (free with [`belayer_string_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `image` is a NUL-terminated string, `tag` null or one; `out_id` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_create(
    client: BelayerClient,
    image: *const c_char,
    tag: *const c_char,
    out_id: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (image, tag, out) = unsafe {
            (
                text(image, "image")?,
                opt_text(tag, "tag")?,
                writable(out_id, "out_id")?,
            )
        };
        *out = std::ptr::null_mut();
        let spec = SandboxSpec {
            image: image.to_owned(),
            tag: tag.map(str::to_owned),
            ..Default::default()
        };
        match call(client, Request::CreateSandbox(spec))? {
            Response::Sandbox(info) => {
                *out = c_string(info.id, "sandbox id")?;
                Ok(())
            }
            other => Err(unexpected("sandbox create", &other)),
        }
    })
}

/// Creates and starts a sandbox from `image` with the options `*options` (NULL: every
/// default, as [`belayer_sandbox_create`] without a tag): env, workdir, limits, tag, user
/// namespace; stores its id in `*out_id` (free with [`belayer_string_free`]).
///
/// Errors: `BELAYER_E_INVALID_ARGUMENT` for a null `image` or `out_id`, a string that is not
/// UTF-8, an env entry that is NULL or not `KEY=VALUE` with a non-empty KEY, a NULL `env`
/// with a non-zero `env_len`, a negative or non-finite `cpus`, an unknown `userns`; daemon
/// codes (`BELAYER_E_BAD_REQUEST` for a relative workdir, a bad tag or limits below their
/// minimum, `BELAYER_E_PERMISSION_DENIED` for limits over a non-root caller's ceilings or
/// `BELAYER_USERNS_HOST` from a non-root caller, `BELAYER_E_UNKNOWN_IMAGE`, ...).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `image` is a NUL-terminated string; `options` is NULL or a valid pointer whose `tag` and
/// `workdir` are NULL or NUL-terminated strings and whose `env` points at `env_len`
/// NUL-terminated strings (or is NULL with `env_len` 0); `out_id` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_create_with(
    client: BelayerClient,
    image: *const c_char,
    options: *const BelayerCreateOptions,
    out_id: *mut *mut c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (image, out) = unsafe { (text(image, "image")?, writable(out_id, "out_id")?) };
        *out = std::ptr::null_mut();
        let mut spec = SandboxSpec {
            image: image.to_owned(),
            ..Default::default()
        };
        // SAFETY: `options` is null or valid for reads, its pointers per this contract.
        if let Some(o) = unsafe { options.as_ref() } {
            // SAFETY: forwarded from this function's contract.
            unsafe { apply_create_options(o, &mut spec)? };
        }
        match call(client, Request::CreateSandbox(spec))? {
            Response::Sandbox(info) => {
                *out = c_string(info.id, "sandbox id")?;
                Ok(())
            }
            other => Err(unexpected("sandbox create", &other)),
        }
    })
}

/// Copies the options `o` into `spec`, validating what the C types cannot.
///
/// # Safety
/// The pointers of `o` follow the contract of [`belayer_sandbox_create_with`].
unsafe fn apply_create_options(
    o: &BelayerCreateOptions,
    spec: &mut SandboxSpec,
) -> Result<(), Failure> {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        spec.tag = opt_text(o.tag, "options.tag")?.map(str::to_owned);
        spec.workdir = opt_text(o.workdir, "options.workdir")?.map(str::to_owned);
        spec.env = crate::exec::env_pairs(o.env, o.env_len, "options.env")?;
    }
    let set = |v: u64| (v > 0).then_some(v);
    spec.memory_max = set(o.memory_max);
    spec.pids_max = set(o.pids_max);
    spec.disk_max = set(o.disk_max);
    if !o.cpus.is_finite() || o.cpus < 0.0 {
        return Err(Failure::invalid(&format!(
            "options.cpus {} is not a non-negative number",
            o.cpus
        )));
    }
    spec.cpus = (o.cpus > 0.0).then_some(o.cpus);
    spec.userns = match o.userns {
        BELAYER_USERNS_DEFAULT => None,
        BELAYER_USERNS_PRIVATE => Some(UsernsMode::Private),
        BELAYER_USERNS_HOST => Some(UsernsMode::Host),
        other => {
            return Err(Failure::invalid(&format!(
                "options.userns {other} is none of BELAYER_USERNS_*"
            )))
        }
    };
    Ok(())
}

/// Describes sandbox `id` into `*out` (free with [`belayer_sandbox_info_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_inspect(
    client: BelayerClient,
    id: *const c_char,
    out: *mut BelayerSandboxInfo,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // The caller's struct may hold garbage: overwrite without dropping.
        // SAFETY: `out` is valid for writes (checked non-null above, contract).
        unsafe { std::ptr::write(out, BelayerSandboxInfo::EMPTY) };
        let info = match call(client, Request::InspectSandbox { id: id.to_owned() })? {
            Response::Sandbox(info) => info,
            other => return Err(unexpected("sandbox inspect", &other)),
        };
        *out = sandbox_info_of(info)?;
        Ok(())
    })
}

/// The C form of `info` (its pids and strings; the rest of it is [`crate::listing`]'s).
pub(crate) fn sandbox_info_of(info: SandboxInfo) -> Result<BelayerSandboxInfo, Failure> {
    let mut result = BelayerSandboxInfo {
        init_pid: info.init_pid.unwrap_or(-1),
        instance: info.instance,
        has_ready_prefix: info.ready_prefix.is_some(),
        ready_prefix: info.ready_prefix.unwrap_or(0),
        created_unix_ms: info.created_unix_ms,
        ..BelayerSandboxInfo::EMPTY
    };
    let filled = (|| {
        result.id = c_string(info.id, "sandbox id")?;
        result.image = c_string(info.image, "image")?;
        result.state = c_string(info.state.as_str().to_owned(), "state")?;
        Ok(())
    })();
    if let Err(e) = filled {
        release_sandbox_info(&mut result);
        return Err(e);
    }
    if !info.pids.is_empty() {
        result.pids_len = info.pids.len();
        result.pids = Box::into_raw(info.pids.into_boxed_slice()).cast::<i32>();
    }
    Ok(result)
}

pub(crate) fn release_sandbox_info(info: &mut BelayerSandboxInfo) {
    free_string(&mut info.id);
    free_string(&mut info.image);
    free_string(&mut info.state);
    if !info.pids.is_null() {
        let slice = std::ptr::slice_from_raw_parts_mut(info.pids, info.pids_len);
        // SAFETY: `pids`/`pids_len` came from Box::into_raw of a boxed slice in
        // belayer_sandbox_inspect and are reset below, so the slice is freed once.
        drop(unsafe { Box::from_raw(slice) });
    }
    *info = BelayerSandboxInfo::EMPTY;
}

/// Frees what [`belayer_sandbox_inspect`] stored in `*info` and zeroes it. NULL is ignored.
///
/// # Safety
/// `info` is null or points at a struct filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_info_free(info: *mut BelayerSandboxInfo) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(info) = unsafe { info.as_mut() } {
        release_sandbox_info(info);
    }
}

/// Kills sandbox `id` and deletes it with all its checkpoints.
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_destroy(
    client: BelayerClient,
    id: *const c_char,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let id = unsafe { text(id, "id")? };
        match call(client, Request::RemoveSandbox { id: id.to_owned() })? {
            Response::Done => Ok(()),
            other => Err(unexpected("sandbox destroy", &other)),
        }
    })
}
