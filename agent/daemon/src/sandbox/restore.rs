//! `restore`: full_restore (paper: "Environment-state recovery"; DESIGN.md invariant "recovery
//! alignment").
//!
//! 1. load the manifests of the ready checkpoint, or of the one of the requested boundary K
//!    (untrusted input, checked entry by entry);
//! 2. install F_k into a fresh instance: a writable snapshot of the checkpoint's upper
//!    snapshot where it has one (one ioctl; files keep their inode numbers and times), else
//!    materialized from its layer manifest and the blob store (`upper`); meanwhile a second
//!    thread verifies every artifact (size, blake3) and, when materializing, re-hashes every
//!    blob the layer refers to; a corrupt checkpoint is refused here, before the failed
//!    instance is touched;
//! 3. tear down whatever is left of the failed instance (cgroup kill, reap, unmount, delete),
//!    then mount the fresh instance's overlay and create its cgroup;
//! 4. check every path of R_k beneath the new merged dir (`belayer_criu::validate_restore_paths`),
//!    then CRIU-restore R_k into it (`--root` the new merged dir);
//! 5. for an earlier checkpoint C_K: move the ready pointer back to it, then (once the record
//!    names the new instance) drop the checkpoints published after it ([`rewind`]);
//! 6. hand back L_k.
//!
//! Without a ready checkpoint the sandbox restarts from its base image (k = 0) in a fresh
//! instance and the answer says so (`prefix: None`).

use std::fs;
use std::time::{Duration, Instant};

use belayer_criu::{NetworkLock, RestoreRequest, RestoreStage};
use belayer_ipc::{RestoreInfo, RestoreTimings, RestoreValidity};
use belayer_overlay::layer::{materialize_layer, MaterializeOptions};

use super::create::{CreateError, Instance};
use super::instance::{retire_instance, teardown};
use super::{SandboxSlot, SandboxState};
use crate::cgroup::SandboxCgroup;
use crate::runtime::Runtime;
use crate::store::CheckpointStore;
use crate::sys;

mod error;
mod images;
mod rewind;
pub use rewind::Choice;
pub(crate) use rewind::Target;
mod upper;
pub use error::RestoreError;
pub(crate) use upper::{charged_bytes, ghost_bytes};

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Restores the sandbox in `slot` from its ready checkpoint, or from its base image when it has
/// none; or from the checkpoint `choice` names, of a boundary on the ready line or by name
/// (it becomes the ready checkpoint; the later ones stay as a branch, see [`rewind`]), or
/// [`RestoreError::NoCheckpoint`] / [`RestoreError::NoSuchCheckpoint`] when there is none.
pub fn restore(
    rt: &Runtime,
    slot: &SandboxSlot,
    verify: bool,
    choice: &rewind::Choice,
) -> Result<RestoreInfo, RestoreError> {
    let started = Instant::now();
    let _op = slot.lock_op();
    let (info, baseline) = restore_locked(rt, slot, verify, choice, started)?;
    // Clean only when the tracer's baseline is the restored state itself; otherwise unknown
    // until the next checkpoint.
    if baseline {
        slot.changes.mark_clean();
    }
    Ok(info)
}

/// [`restore`] under the sandbox's op lock; also whether the tracer's baseline for the next
/// action is the restored state (taken at CRIU's pre-resume stage, or a fresh init from the
/// image, where nothing ran yet).
fn restore_locked(
    rt: &Runtime,
    slot: &SandboxSlot,
    verify: bool,
    choice: &rewind::Choice,
    started: Instant,
) -> Result<(RestoreInfo, bool), RestoreError> {
    let rec = slot.refresh();
    let id = rec.id.clone();
    let mut t = RestoreTimings::default();

    // 1. The chosen checkpoint's manifests (decoded as untrusted input; verified below).
    let store = CheckpointStore::open(&slot.paths.checkpoints())?;
    let corrupt = |source| RestoreError::Corrupt {
        id: id.clone(),
        source,
    };
    let target = rewind::Target::choose(&store, &id, choice)?;
    // Unknown from here (a refused prefix, above, changes nothing) while the old instance is
    // torn down and the new one built; the ready state once it is restored.
    slot.changes.forget();
    let manifest = match &target.chosen {
        Some(name) => Some(store.load(name).map_err(corrupt)?),
        None => None,
    };
    if let Some(found) = manifest.as_ref().and_then(|m| m.userns) {
        if rec.userns != Some(found) {
            return Err(RestoreError::ForeignRange {
                id: id.clone(),
                checkpoint: manifest
                    .as_ref()
                    .map(|m| m.checkpoint.clone())
                    .unwrap_or_default(),
                expected: rec.userns,
                found,
            });
        }
    }
    let layer = match &manifest {
        Some(m) => Some(store.load_layer(m).map_err(corrupt)?),
        None => None,
    };
    let (lowers, image) = rt
        .images
        .lowers(&rec.spec.image)
        .map_err(CreateError::from)?;
    // The image under that name must still be one the sandbox's owner may run on.
    if !image.serves(rec.owner_uid) {
        return Err(RestoreError::ForeignImage {
            id: id.clone(),
            image: rec.spec.image.clone(),
            owner: Some(image.owner_uid),
        });
    }
    // ... and the very image the checkpoint (or the sandbox) was made on.
    let recorded = manifest
        .as_ref()
        .and_then(|m| m.image_digest.clone())
        .or_else(|| rec.image_digest.clone());
    if let (Some(expected), Some(found)) = (&recorded, &image.digest) {
        if expected != found {
            return Err(RestoreError::ImageChanged {
                id: id.clone(),
                image: rec.spec.image.clone(),
                expected: expected.clone(),
                found: found.clone(),
            });
        }
    }
    if recorded.is_some() && image.digest.is_none() {
        return Err(RestoreError::ImageChanged {
            id: id.clone(),
            image: rec.spec.image.clone(),
            expected: recorded.unwrap_or_default(),
            found: "none".into(),
        });
    }

    // 2. F_k into a fresh instance's upper dir, while every artifact digest and every blob
    //    is verified on a second thread; both before the failed instance is touched, so a
    //    corrupt checkpoint costs the running instance nothing.
    // A number no instance dir on disk has: a stale one (an interrupted restore's, found by
    // the adoption) may still be being deleted in the background.
    let n = slot.paths.next_instance(rec.instance);
    // Whatever of instance n exists goes again on every way out before the record names it
    // (declared before the instance, so that the instance's own drop, which unmounts it,
    // runs first).
    let mut new_dir = NewInstanceDir {
        paths: &slot.paths,
        n,
        keep: false,
    };
    let t_fs = Instant::now();
    let from_snapshot = upper::from_snapshot(rt, &rec, &slot.paths, n, &store, manifest.as_ref());
    if !from_snapshot {
        // With a checkpoint the limit is set once the overlay is mounted (`upper::apply_limit`),
        // before CRIU writes anything; a restart from the image gets it now.
        let limit = rec.spec.disk_max.filter(|_| manifest.is_none());
        super::instance::make_instance_dir(rt, &slot.paths, n, limit).map_err(CreateError::from)?;
    }
    let upper = slot.paths.upper(n);
    fs::create_dir_all(&upper).map_err(|source| RestoreError::Dirs {
        path: upper.clone(),
        source,
    })?;
    // R_k with its own (bare) network namespace: CRIU makes a fresh one, owned by the user
    // namespace it recreates (`sandbox::netns`); otherwise it joins one made here.
    let criu_netns = manifest.as_ref().is_some_and(|m| m.own_netns);
    let (verified, materialized, netns, assembled) = std::thread::scope(|scope| {
        // R_k's network namespace, made meanwhile (it takes a thread and ~1 ms).
        let netns = (manifest.is_some() && !criu_netns)
            .then(|| scope.spawn(|| locked_netns(&id, rec.userns.is_some())));
        let verifier = scope.spawn(|| {
            let t_verify = Instant::now();
            let result = match (&manifest, &layer) {
                (Some(m), Some(layer)) => upper::verify_checkpoint(
                    &store,
                    m,
                    layer,
                    (!from_snapshot).then_some(&rt.blobs),
                    &rt.blobs,
                    &id,
                ),
                _ => Ok(()),
            };
            (result, ms(t_verify))
        });
        let materialized = layer.as_ref().filter(|_| !from_snapshot).map(|layer| {
            // Blobs are verified by the other thread: copy them with the kernel.
            let opts = MaterializeOptions {
                verify_blobs: false,
                ..MaterializeOptions::default()
            };
            materialize_layer(layer, &rt.blobs, &upper, &opts)
        });
        // R_k's pages files from their packs (checked by the verifier meanwhile).
        let assembled = manifest
            .as_ref()
            .filter(|m| m.memory.is_some())
            .map(|m| images::assemble(rt, &slot.paths, &store, m, &id));
        t.fs_install = ms(t_fs);
        let verified = verifier
            .join()
            .unwrap_or_else(|_| (Err(RestoreError::VerifierPanicked { id: id.clone() }), 0.0));
        let netns = netns.map(|made| {
            made.join().unwrap_or_else(|_| {
                Err(sys::SyscallError::new(
                    "unshare",
                    "CLONE_NEWNET (thread panicked)",
                    nix::errno::Errno::EINVAL,
                ))
            })
        });
        (verified, materialized, netns, assembled)
    });
    t.verify = verified.1;
    verified.0?;
    let assembled = assembled
        .transpose()
        .map_err(|source| RestoreError::Pages {
            id: id.clone(),
            source,
        })?;
    let (base, shared_bytes) = match materialized {
        Some(Ok((stats, rekeyed))) => (Some((n, std::sync::Arc::new(rekeyed))), stats.shared_bytes),
        Some(Err(source)) => {
            return Err(RestoreError::FsInstall {
                id: id.clone(),
                source,
            })
        }
        // From the snapshot: the capture's keys hold (same inodes and times), and every data
        // byte is shared with the snapshot.
        None => match (&layer, &manifest) {
            (Some(layer), Some(m)) if from_snapshot => (
                Some((n, std::sync::Arc::new(layer.clone()))),
                m.layer.data_bytes,
            ),
            _ => (None, 0),
        },
    };
    let inherited = upper::inherited_bytes(
        rt,
        manifest.as_ref(),
        layer.as_ref(),
        from_snapshot,
        shared_bytes,
    );
    let context = match &manifest {
        Some(m) => store.read_context(m)?,
        None => Vec::new(),
    };
    let fs_matches = match (&layer, verify) {
        (Some(layer), true) => Some(upper::upper_matches(&id, &upper, layer)?),
        _ => None,
    };

    // 3. The fresh root, and every path R_k's restore will touch checked against it (no
    //    sandbox process exists there yet, so nothing can change it before CRIU runs), while
    //    the old instance still stands: a refused checkpoint costs it nothing.
    let t_mount = Instant::now();
    let mut snapshot = rec.clone();
    snapshot.instance = n;
    let mut instance = Instance::mount_only(rt, &snapshot, &slot.paths, n, &lowers)?;
    if let Some(m) = &manifest {
        let images = store.path(&m.checkpoint).join("criu");
        if let Err(source) = check_image_paths(&images, &slot.paths.merged(n)) {
            drop(instance);
            return Err(RestoreError::UnsafeImages {
                id: id.clone(),
                source,
            });
        }
    }
    // The disk limit, before CRIU writes into the instance (ghost files): only the mount,
    // above, ran without one, so that a sandbox at its limit can still be mounted.
    if let Err(e) = upper::apply_limit(rt, &rec, &slot.paths.instance(n), inherited) {
        drop(instance);
        return Err(CreateError::from(e).into());
    }

    t.mount = ms(t_mount);

    // 4. Tear down the failed instance (untraced: these kills are the agent's own).
    slot.set_transient(SandboxState::Restoring);
    let mut restoring = RestoringGuard { slot, done: false };
    rt.tracer.untrack(&id);
    let t_down = Instant::now();
    teardown(slot).map_err(|source| RestoreError::Teardown {
        id: id.clone(),
        source,
    })?;
    t.teardown = ms(t_down);
    instance.create_cgroup(rt, &snapshot)?;

    // 5. Processes.
    slot.set_layer_base(base);
    let t_criu = Instant::now();
    let mut restored_processes = None;
    let (pid, start, traced) = match &manifest {
        Some(m) => {
            let work = slot.paths.criu_work();
            let _ = belayer_overlay::remove_dir_all(&work);
            fs::create_dir_all(&work).map_err(|source| RestoreError::Dirs {
                path: work.clone(),
                source,
            })?;
            let images = match &assembled {
                Some(dir) => dir.path.clone(),
                None => store.path(&m.checkpoint).join("criu"),
            };
            let cgroup_dirs = instance
                .cgroup()
                .procs_files()
                .into_iter()
                .filter_map(|f| f.parent().map(|p| p.to_path_buf()));
            let req = RestoreRequest::new(&images, &work)
                .root(slot.paths.merged(n))
                .tcp_established(true)
                .file_locks(true)
                .network_lock(Some(NetworkLock::Skip))
                .join_cgroups(cgroup_dirs)
                .new_cgroupns(true)
                .time_limit(Some(super::criu_time_limit(&rt.config, m.criu_bytes())));
            // CRIU holds the restored tree at its pre-resume stage: the pid counter is set
            // and (with `verify`) the tree listed exactly as CRIU rebuilt it before any task
            // runs, without a signal to any of them (see `belayer_criu::RestoreStage`).
            let ns_last_pid = m.ns_last_pid;
            // Read before CRIU starts (without BPF: a walk of the upper layer, which must not
            // hold the tree at pre-resume); nothing of the sandbox runs until then.
            let baseline = rt.tracer.restore_baseline(&upper);
            let mut restored_list = None;
            let mut netns_lock = None;
            let mut traced = false;
            let mut on_stage = |stage, pid| {
                match stage {
                    RestoreStage::Namespaces => {
                        netns_lock = super::netns::ready_restored(&id, pid)?;
                    }
                    RestoreStage::PreResume => {
                        if let Some(last) = ns_last_pid {
                            let t_pid = Instant::now();
                            match super::pid_counter::write(pid, last) {
                                Ok(()) => {
                                    tracing::debug!(sandbox = %id, last, ms = ms(t_pid), "pid counter restored")
                                }
                                Err(e) => {
                                    tracing::warn!(sandbox = %id, error = %e, "pid counter not restored")
                                }
                            }
                        }
                        if verify {
                            restored_list = Some(super::process_list(instance.cgroup()));
                        }
                        // Traced from here, so the first action's verdict covers everything
                        // the restored tree does once it runs (`SandboxTracer::track_restored`).
                        traced = rt
                            .tracer
                            .track_restored(&id, instance.cgroup(), pid, &baseline);
                    }
                }
                Ok(())
            };
            let hook_err = |e: belayer_criu::HookedRestoreError<_>| match e {
                belayer_criu::HookedRestoreError::Restore(e) => RestoreError::Criu {
                    id: id.clone(),
                    source: Box::new(e),
                },
                other => RestoreError::StageHook {
                    id: id.clone(),
                    source: Box::new(other),
                },
            };
            let restored = if criu_netns {
                // CRIU makes the network namespace with the user namespace; it is readied and
                // locked at CRIU's post-setup-namespaces stage, before any socket exists.
                let req = req.empty_netns(true);
                rt.criu
                    .restore_staged(
                        &req,
                        &[RestoreStage::Namespaces, RestoreStage::PreResume],
                        &mut on_stage,
                    )
                    .map(|outcome| (outcome, None))
                    .map_err(hook_err)
            } else {
                let (netns, lock) = match netns {
                    Some(made) => made,
                    None => locked_netns(&id, rec.userns.is_some()),
                }
                .map_err(|source| RestoreError::Netns {
                    id: id.clone(),
                    source,
                })?;
                let req = req.join_netns(format!(
                    "/proc/self/fd/{}",
                    std::os::fd::AsRawFd::as_raw_fd(&netns)
                ));
                rt.criu
                    .restore_staged(&req, &[RestoreStage::PreResume], &mut on_stage)
                    .map(|outcome| (outcome, lock))
                    .map_err(hook_err)
            };
            let (outcome, lock) = match restored {
                Ok(restored) => restored,
                Err(e) => {
                    // Whatever CRIU had restored dies with the fresh cgroup (`Instance`'s drop:
                    // cgroup.kill, then unmount); the reaper collects it. The ready checkpoint
                    // is untouched and the sandbox `failed`: a later restore starts afresh.
                    rt.tracer.untrack(&id);
                    drop(instance);
                    return Err(e);
                }
            };
            let t_unlock = Instant::now();
            if let Some(lock) = lock.or(netns_lock) {
                match lock.unlock() {
                    Ok(()) => {
                        tracing::debug!(sandbox = %id, ms = ms(t_unlock), "network namespace unlocked")
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "network namespace not unlocked")
                    }
                }
            }
            restored_processes = restored_list;
            instance.keep();
            let start = sys::process_start_time(outcome.pid).unwrap_or(0);
            (outcome.pid, start, traced)
        }
        None => {
            let (pid, start) = instance.spawn_init(rt, &snapshot, &slot.paths)?;
            (pid, start, false)
        }
    };
    t.criu_restore = ms(t_criu);

    // An earlier checkpoint becomes the ready one before the record names the new instance
    // (`rewind`); the new instance becomes the record only once that is on disk; otherwise
    // it goes again and the sandbox stays failed (its checkpoints untouched, the pointer
    // back where it was).
    let committed = target.move_pointer(&store).and_then(|()| {
        slot.commit(|r| {
            r.instance = n;
            r.init_pid = Some(pid);
            r.init_start_time = Some(start);
            r.state = SandboxState::Running;
            r.inherited_bytes = inherited;
        })
        .map_err(|e| {
            target.undo(&store, &id);
            RestoreError::from(e)
        })
    });
    if let Err(e) = committed {
        rt.tracer.untrack(&id);
        slot.set_transient(SandboxState::Failed);
        if let Ok(cg) = SandboxCgroup::open(&rec.cgroup) {
            let _ = cg.kill_all(Duration::from_secs(10));
        }
        sys::try_reap(pid);
        let (paths, new) = (slot.paths.clone(), n);
        new_dir.keep = true;
        std::thread::spawn(move || retire_instance(&paths, new));
        return Err(e);
    }
    restoring.done = true;
    new_dir.keep = true;
    // The checkpoints after a restored earlier one stay: another branch of the tree.
    let dropped_prefixes = Vec::new();
    if !traced {
        rt.tracer.track(&slot.record());
    }
    // The old instance is garbage now.
    let (paths, old) = (slot.paths.clone(), rec.instance);
    std::thread::spawn(move || retire_instance(&paths, old));
    if from_snapshot {
        upper::warm_in_background(id.clone(), upper);
    }
    t.total = ms(started);
    let prefix = manifest.as_ref().map(|m| m.prefix);
    tracing::info!(sandbox = %id, ?prefix, pid, total_ms = t.total, "sandbox restored");
    let validity = match (&manifest, fs_matches, restored_processes) {
        (Some(m), Some(fs_matches), Some(restored)) => Some(RestoreValidity {
            fs_matches,
            processes_match: restored == m.processes,
            expected_processes: m.processes.clone(),
            restored_processes: restored,
        }),
        _ => None,
    };
    if let Some(v) = validity
        .as_ref()
        .filter(|v| !(v.fs_matches && v.processes_match))
    {
        tracing::warn!(sandbox = %id, ?v, "restored sandbox differs from its checkpoint");
    }
    let info = RestoreInfo {
        sandbox: id,
        prefix,
        context,
        init_pid: pid,
        timings_ms: t,
        validity,
        inodes_kept: from_snapshot,
        dropped_prefixes,
    };
    Ok((info, traced || manifest.is_none()))
}

/// A fresh network namespace for a restore, locked ([`super::net_lock`]) until CRIU is done;
/// a lock that cannot be taken is logged and the restore goes on without it.
fn locked_netns(id: &str, unprivileged_root: bool) -> sys::SysResult<LockedNetns> {
    let netns = sys::new_netns(unprivileged_root)?;
    let t = Instant::now();
    let lock = match super::net_lock::NetLock::lock(std::os::fd::AsFd::as_fd(&netns)) {
        Ok(lock) => {
            tracing::debug!(sandbox = %id, ms = ms(t), "network namespace locked");
            Some(lock)
        }
        Err(e) => {
            tracing::warn!(sandbox = %id, error = %e, "network namespace not locked");
            None
        }
    };
    Ok((netns, lock))
}

/// A fresh network namespace and its lock, if taken.
type LockedNetns = (std::os::fd::OwnedFd, Option<super::net_lock::NetLock>);

/// Checks every path the restore of the CRIU images in `images` would touch beneath `root`,
/// allowing the sandbox's own binds of host paths ([`crate::helper::mount::host_binds`]).
pub(crate) fn check_image_paths(
    images: &std::path::Path,
    root: &std::path::Path,
) -> Result<belayer_criu::ImagePathReport, belayer_criu::UnsafeImagePath> {
    let host_binds = crate::helper::mount::host_binds();
    let binds: Vec<belayer_criu::AllowedBind<'_>> = host_binds
        .iter()
        .map(|(host_path, dir)| belayer_criu::AllowedBind {
            host_path,
            dir: *dir,
        })
        .collect();
    belayer_criu::validate_restore_paths_allowing(images, root, &binds)
}

/// Removes the directory of the instance a restore was making (`inst-<n>`) when the restore
/// gives up before its record names it, on every error path (a restore takes a number past
/// every instance dir on disk, so a failed attempt's dir would otherwise stay until the next
/// adoption), unless `keep` (the record names it, or a background retirement took it over).
struct NewInstanceDir<'a> {
    paths: &'a super::SandboxPaths,
    n: u32,
    keep: bool,
}

impl Drop for NewInstanceDir<'_> {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let dir = self.paths.instance(self.n);
        if let Err(e) = crate::quota::remove_instance_dir(&dir) {
            tracing::warn!(path = %dir.display(), error = %e, "cannot remove the instance of a failed restore (the next start retries)");
        }
    }
}

/// Leaves a sandbox `failed` (not `restoring`) when a restore gives up after it tore the old
/// instance down.
struct RestoringGuard<'a> {
    slot: &'a SandboxSlot,
    done: bool,
}

impl Drop for RestoringGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.slot.set_transient(SandboxState::Failed);
        }
    }
}
