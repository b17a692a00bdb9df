//! Listing and collection: every sandbox with its configuration (`belayer_sandbox_list`,
//! `belayer_sandbox_inspect_with`), the ready checkpoints of one (`belayer_checkpoint_list`),
//! and checkpoint garbage collection (`belayer_gc`).

use std::ffi::{c_char, c_int};

use belayer_ipc::{Request, Response, SandboxInfo};

use crate::convert::*;
use crate::sandbox::{release_sandbox_info, sandbox_info_of};
use crate::status::{guard, text, writable, Failure};
use crate::types::*;

impl BelayerSandboxConfig {
    pub(crate) const EMPTY: BelayerSandboxConfig = BelayerSandboxConfig {
        tag: std::ptr::null_mut(),
        workdir: std::ptr::null_mut(),
        env: std::ptr::null_mut(),
        env_len: 0,
        memory_max: 0,
        pids_max: 0,
        cpus: 0.0,
        disk_max: 0,
        userns: BELAYER_USERNS_DEFAULT,
        cgroup: std::ptr::null_mut(),
    };

    /// The C form of `info`'s configuration; on an error nothing is left allocated.
    fn of(info: &SandboxInfo) -> Result<BelayerSandboxConfig, Failure> {
        let mut c = BelayerSandboxConfig {
            memory_max: info.limits.memory_max.unwrap_or(0),
            pids_max: info.limits.pids_max.unwrap_or(0),
            cpus: info.limits.cpus.unwrap_or(0.0),
            disk_max: info.limits.disk_max.unwrap_or(0),
            userns: match info.userns.as_ref().map(|u| u.mode.as_str()) {
                Some("private") => BELAYER_USERNS_PRIVATE,
                Some("host") => BELAYER_USERNS_HOST,
                _ => BELAYER_USERNS_DEFAULT,
            },
            ..BelayerSandboxConfig::EMPTY
        };
        let filled = (|| {
            if let Some(tag) = &info.tag {
                c.tag = c_string(tag.clone(), "tag")?;
            }
            if let Some(dir) = &info.workdir {
                c.workdir = c_string(dir.clone(), "workdir")?;
            }
            c.cgroup = c_string(info.cgroup.clone(), "cgroup")?;
            let mut env = Vec::with_capacity(info.env.len());
            for (k, v) in &info.env {
                match c_string(format!("{k}={v}"), "env entry") {
                    Ok(p) => env.push(p),
                    Err(e) => {
                        for mut p in env {
                            free_string(&mut p);
                        }
                        return Err(e);
                    }
                }
            }
            if !env.is_empty() {
                c.env_len = env.len();
                c.env = Box::into_raw(env.into_boxed_slice()).cast::<*mut c_char>();
            }
            Ok(())
        })();
        if let Err(e) = filled {
            c.release();
            return Err(e);
        }
        Ok(c)
    }

    fn release(&mut self) {
        free_string(&mut self.tag);
        free_string(&mut self.workdir);
        free_string(&mut self.cgroup);
        if !self.env.is_null() {
            let slice = std::ptr::slice_from_raw_parts_mut(self.env, self.env_len);
            // SAFETY: `env`/`env_len` came from Box::into_raw of a boxed slice in `of` and are
            // reset below, so the slice (and each string in it, once) is freed once.
            let mut entries = unsafe { Box::from_raw(slice) };
            for p in entries.iter_mut() {
                free_string(p);
            }
        }
        *self = BelayerSandboxConfig::EMPTY;
    }
}

impl BelayerSandboxEntry {
    const EMPTY: BelayerSandboxEntry = BelayerSandboxEntry {
        info: BelayerSandboxInfo::EMPTY,
        config: BelayerSandboxConfig::EMPTY,
    };

    fn of(info: SandboxInfo) -> Result<BelayerSandboxEntry, Failure> {
        let mut config = BelayerSandboxConfig::of(&info)?;
        match sandbox_info_of(info) {
            Ok(info) => Ok(BelayerSandboxEntry { info, config }),
            Err(e) => {
                config.release();
                Err(e)
            }
        }
    }

    fn release(&mut self) {
        release_sandbox_info(&mut self.info);
        self.config.release();
    }
}

/// Describes sandbox `id` with its configuration (tag, env, workdir, limits, user
/// namespace, cgroup) into `*out` (free with [`belayer_sandbox_entry_free`]).
///
/// Errors: daemon codes (`BELAYER_E_UNKNOWN_SANDBOX`, ...).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_inspect_with(
    client: BelayerClient,
    id: *const c_char,
    out: *mut BelayerSandboxEntry,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe { std::ptr::write(out, BelayerSandboxEntry::EMPTY) };
        match call(client, Request::InspectSandbox { id: id.to_owned() })? {
            Response::Sandbox(info) => {
                *out = BelayerSandboxEntry::of(info)?;
                Ok(())
            }
            other => Err(unexpected("sandbox inspect", &other)),
        }
    })
}

/// Frees what [`belayer_sandbox_inspect_with`] stored in `*entry` and zeroes it. NULL is
/// ignored.
///
/// # Safety
/// `entry` is null or points at an entry filled by this library (or zeroed), not one of a
/// [`BelayerSandboxList`].
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_entry_free(entry: *mut BelayerSandboxEntry) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(entry) = unsafe { entry.as_mut() } {
        entry.release();
    }
}

/// Lists the sandboxes this caller may see (root: every one), oldest first, with their
/// configurations, into `*out` (free with [`belayer_sandbox_list_free`]).
///
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_list(
    client: BelayerClient,
    out: *mut BelayerSandboxList,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let out = unsafe { writable(out, "out")? };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe {
            std::ptr::write(
                out,
                BelayerSandboxList {
                    items: std::ptr::null_mut(),
                    len: 0,
                },
            )
        };
        let infos = match call(client, Request::ListSandboxes)? {
            Response::Sandboxes(v) => v,
            other => return Err(unexpected("sandbox list", &other)),
        };
        let mut entries = Vec::with_capacity(infos.len());
        for info in infos {
            match BelayerSandboxEntry::of(info) {
                Ok(e) => entries.push(e),
                Err(e) => {
                    entries.iter_mut().for_each(BelayerSandboxEntry::release);
                    return Err(e);
                }
            }
        }
        (out.items, out.len) = array(entries);
        Ok(())
    })
}

/// Frees a list of [`belayer_sandbox_list`] with every entry and zeroes it. NULL is ignored.
///
/// # Safety
/// `list` is null or points at a list filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_sandbox_list_free(list: *mut BelayerSandboxList) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(list) = unsafe { list.as_mut() } {
        // SAFETY: the list came from `belayer_sandbox_list` (contract).
        for mut entry in unsafe { take_array(&mut list.items, &mut list.len) } {
            entry.release();
        }
    }
}

/// Lists the ready checkpoints of sandbox `id`, oldest first (those up to the ready one)
/// into `*out` (free with [`belayer_checkpoint_list_free`]).
///
/// Errors: daemon codes (`BELAYER_E_UNKNOWN_SANDBOX`, ...).
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `id` is a NUL-terminated string; `out` is a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint_list(
    client: BelayerClient,
    id: *const c_char,
    out: *mut BelayerCheckpointList,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let (id, out) = unsafe { (text(id, "id")?, writable(out, "out")?) };
        // SAFETY: valid for writes; the old content may be garbage, so no drop.
        unsafe {
            std::ptr::write(
                out,
                BelayerCheckpointList {
                    items: std::ptr::null_mut(),
                    len: 0,
                },
            )
        };
        let infos = match call(client, Request::ListCheckpoints { id: id.to_owned() })? {
            Response::Checkpoints(v) => v,
            other => return Err(unexpected("checkpoint list", &other)),
        };
        let mut entries = Vec::with_capacity(infos.len());
        for info in infos {
            let created_unix_ms = info.created_unix_ms;
            match BelayerCheckpointInfo::from_info(info) {
                Ok(info) => entries.push(BelayerCheckpointEntry {
                    info,
                    created_unix_ms,
                }),
                Err(e) => {
                    for mut entry in entries {
                        free_checkpoint(&mut entry.info);
                    }
                    return Err(e);
                }
            }
        }
        (out.items, out.len) = array(entries);
        Ok(())
    })
}

fn free_checkpoint(info: &mut BelayerCheckpointInfo) {
    free_string(&mut info.name);
    free_string(&mut info.context_digest);
}

/// Frees a list of [`belayer_checkpoint_list`] and zeroes it. NULL is ignored.
///
/// # Safety
/// `list` is null or points at a list filled by this library (or zeroed).
#[no_mangle]
pub unsafe extern "C" fn belayer_checkpoint_list_free(list: *mut BelayerCheckpointList) {
    // SAFETY: forwarded from this function's contract (null allowed).
    if let Some(list) = unsafe { list.as_mut() } {
        // SAFETY: the list came from `belayer_checkpoint_list` (contract).
        for mut entry in unsafe { take_array(&mut list.items, &mut list.len) } {
            free_checkpoint(&mut entry.info);
        }
    }
}

/// Drops checkpoints of the caller's sandboxes (root: of every sandbox): those older than
/// `older_than_s` seconds (negative: no age criterion; every sandbox keeps its ready one),
/// and every one of the sandboxes with rollout tag `tag` (NULL: none), ready ones included.
/// Stores what was removed in `*out` when `out` is not NULL.
///
/// Errors: `BELAYER_E_BAD_REQUEST` with neither criterion; daemon codes.
/// Thread-safety: any thread; serialized per client.
///
/// # Safety
/// `tag` is NULL or a NUL-terminated string; `out` is NULL or a valid pointer to write to.
#[no_mangle]
pub unsafe extern "C" fn belayer_gc(
    client: BelayerClient,
    older_than_s: i64,
    tag: *const c_char,
    out: *mut BelayerGcResult,
) -> c_int {
    guard(|| {
        // SAFETY: forwarded from this function's contract; plain values, no drop needed.
        let (tag, out) = unsafe { (opt_text(tag, "tag")?, out.as_mut()) };
        let out = out.map(|o| {
            *o = BelayerGcResult::default();
            o
        });
        let req = Request::Gc {
            older_than_s: u64::try_from(older_than_s).ok(),
            tag: tag.map(str::to_owned),
        };
        match call(client, req)? {
            Response::Gc { removed, bytes } => {
                if let Some(o) = out {
                    *o = BelayerGcResult { removed, bytes };
                }
                Ok(())
            }
            other => Err(unexpected("gc", &other)),
        }
    })
}
