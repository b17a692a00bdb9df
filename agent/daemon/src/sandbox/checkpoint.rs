//! `checkpoint`: full_checkpoint (paper: "Environment-state recovery", Fig. 6; DESIGN.md
//! invariants "state agreement" and "atomic publication").
//!
//! 1. start CRIU; once it is ready to seize the tree (its `pre-dump` stage, see
//!    [`belayer_criu::Criu::dump_gated`]), freeze the sandbox cgroup and wait until every task
//!    is frozen;
//! 2. capture the overlay upper layer F_k incrementally: walk it, take unchanged entries over
//!    from the previous capture of this instance, read changed files (see
//!    [`belayer_overlay::layer`]);
//! 3. CRIU-dump the process tree R_k into `criu/`, leaving it running;
//! 4. thaw (a guard thaws on every path, errors included);
//! 5. content-address R_k's memory pages against the parent checkpoint's (new pages into a
//!    page pack per pages file, [`crate::store::pages`]); seal F_k (hash staged files, move
//!    new blobs into the node's blob store, fsync'd) and write its layer manifest
//!    `upper.layer`; store L_k, digest every artifact, write `manifest.json`, fsync
//!    everything;
//! 6. rename the staging dir into place, then move the ready pointer to it.
//!
//! A shared lease on the blob store is held from before the freeze until the pointer moved,
//! so a blob collection never removes a blob this checkpoint refers to.
//!
//! CRIU runs inside the sandbox's network namespace, so it does not dump that namespace (only
//! its sockets): a sandbox's namespace holds nothing but `lo`, and dumping it meant running
//! `ip` and `iptables-save` and walking the host's conntrack table inside the frozen window;
//! restore runs CRIU inside a fresh namespace with `lo` up.
//!
//! CRIU's network lock is skipped: a sandbox's network namespace has only `lo`, and every task
//! that could send on it is frozen for the whole dump (the iptables lock/unlock alone cost
//! ≈45 ms per dump here).
//!
//! The files are written to the page cache while frozen and made durable after the thaw, so
//! the frozen window holds only the capture and the dump. Any failure drops the staging dir and
//! leaves the previous ready checkpoint in effect.

use std::fs;
use std::time::Instant;

use belayer_criu::{DumpRequest, GatedDumpError, NetworkLock};
use belayer_ipc::{CheckpointInfo, CheckpointRequest, CheckpointTimings, FailPoint, TestFault};
use belayer_overlay::layer::{capture_layer_rereading, LayerCaptureOptions, LayerManifest};
use belayer_overlay::CaptureError;

use super::{SandboxSlot, SandboxState};
use crate::cgroup::SandboxCgroup;
use crate::runtime::Runtime;
use crate::store::{
    self, CheckpointStore, ContextRecord, LayerSummary, Manifest, FORMAT_VERSION, UPPER_LAYER,
};
use crate::sys;

mod error;
pub use error::CheckpointError;

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Applies a test fault if it targets `at`.
fn fault(fault: Option<TestFault>, at: FailPoint) -> Result<(), CheckpointError> {
    match fault {
        Some(f) if f.at == at => {
            if f.kill_daemon {
                tracing::warn!(?at, "test fault: killing the daemon");
                // SIGKILL ourselves: nothing runs after this, exactly like a crash.
                let _ = nix::sys::signal::kill(nix::unistd::Pid::this(), nix::sys::signal::SIGKILL);
            }
            Err(CheckpointError::Injected(at))
        }
        _ => Ok(()),
    }
}

/// Takes checkpoint C_k of the sandbox in `slot`.
pub fn checkpoint(
    rt: &Runtime,
    slot: &SandboxSlot,
    req: &CheckpointRequest,
) -> Result<CheckpointInfo, CheckpointError> {
    if req.fault.is_some() && !rt.config.test_hooks {
        return Err(CheckpointError::HooksDisabled);
    }
    let started = Instant::now();
    let _op = slot.lock_op();
    slot.drain_outputs();
    let rec = slot.refresh();
    if !rec.state.can_checkpoint() || !rec.init_alive() {
        let state = if rec.state == SandboxState::Running {
            "failed"
        } else {
            rec.state.as_str()
        };
        return Err(CheckpointError::NotRunning {
            id: rec.id.clone(),
            state,
        });
    }
    // Transient, in memory only: a full disk cannot leave the sandbox "checkpointing".
    slot.set_transient(SandboxState::Checkpointing);
    let result = take(rt, slot, req, started);
    // Back to running unless the init died meanwhile (then refresh marks it failed).
    slot.set_transient(SandboxState::Running);
    slot.refresh();
    if result.is_ok() {
        slot.changes.mark_clean();
    }
    match &result {
        Ok(info) => tracing::info!(
            sandbox = %info.sandbox, prefix = info.prefix, frozen_ms = info.timings_ms.frozen_total,
            total_ms = info.timings_ms.total, bytes = info.bytes, "checkpoint ready"
        ),
        Err(e) => {
            tracing::warn!(sandbox = %rec.id, prefix = req.prefix, error = %e, "checkpoint failed")
        }
    }
    result
}

fn take(
    rt: &Runtime,
    slot: &SandboxSlot,
    req: &CheckpointRequest,
    started: Instant,
) -> Result<CheckpointInfo, CheckpointError> {
    let rec = slot.record().clone();
    let id = rec.id.clone();
    let store = CheckpointStore::open(&slot.paths.checkpoints())?;
    // The state being checkpointed descends from the ready checkpoint: its parent.
    let parent = store.ready().ok().flatten();
    let mut staging = store.begin(req.prefix)?;
    let dir = staging.dir().to_path_buf();
    let criu_dir = dir.join("criu");
    let write_err = |path: &std::path::Path| {
        let path = path.to_path_buf();
        move |source| CheckpointError::Write { path, source }
    };
    fs::create_dir(&criu_dir).map_err(write_err(&criu_dir))?;
    let work = slot.paths.criu_work();
    let _ = belayer_overlay::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(write_err(&work))?;
    let cgroup = SandboxCgroup::open(&rec.cgroup).map_err(|source| CheckpointError::Freeze {
        id: id.clone(),
        source,
    })?;
    let fs_err = |source| CheckpointError::FsCapture {
        id: id.clone(),
        source,
    };
    let _lease = rt
        .blobs
        .lease()
        .map_err(|e| fs_err(CaptureError::Blob(e)))?;
    let base = slot
        .layer_base(rec.instance)
        .or_else(|| ready_layer(&store, rec.instance));
    let mut t = CheckpointTimings::default();

    let init_pid = rec.init_pid.unwrap_or(0);
    // Before the freeze (O(inotify watches)); racing it only costs the sandbox its own watch.
    let pids = cgroup.pids().unwrap_or_default();
    if let Some(w) = super::watches::deleted_watch(&pids, &slot.paths.merged(rec.instance)) {
        return Err(CheckpointError::DeletedWatch {
            id: id.clone(),
            pid: w.pid,
            fd: w.fd,
            ino: w.ino,
        });
    }
    // CRIU writes into the tmpfs stage when it has room (moved here after the thaw): the
    // sandbox's memory and the deleted-but-open files it copies as ghosts.
    let ghost_limit = rt.config.criu_ghost_limit_bytes;
    let stage = rt
        .stage
        .as_ref()
        .zip(cgroup.memory_current())
        .and_then(|(stage, memory)| {
            let ghosts = super::ghosts::deleted_open_bytes(&pids, ghost_limit);
            stage.reserve(memory.saturating_add(ghosts))
        });
    let images_dir = stage
        .as_ref()
        .map_or(criu_dir.clone(), |slot| slot.dir().to_path_buf());
    // A network namespace the sandbox's user namespace owns (sandboxes created with that
    // layout) is dumped as a bare entry, so the restore makes a fresh one owned by the
    // restored user namespace, where TCP sockets can be repaired; a host-owned one (with
    // `--userns=host`, or a sandbox made before) is joined by CRIU and left out of the images.
    let own_netns = rec.userns.is_some()
        && super::netns::owned_by_own_userns(init_pid).unwrap_or_else(|e| {
            tracing::warn!(sandbox = %id, error = %e, "cannot tell who owns the network namespace");
            false
        });
    let dump = DumpRequest::new(init_pid, &images_dir, &work);
    let dump = if own_netns {
        dump.empty_netns(true)
    } else {
        dump.in_netns(format!("/proc/{init_pid}/ns/net"))
    };
    let dump = dump
        .in_cgroupns(format!("/proc/{init_pid}/ns/cgroup"))
        .freeze_cgroup(cgroup.freezer_dir())
        .tcp_established(true)
        .skip_in_flight(true)
        .file_locks(true)
        .ghost_limit_bytes(ghost_limit)
        .network_lock(Some(NetworkLock::Skip))
        .time_limit(Some(super::criu_time_limit(
            &rt.config,
            cgroup.memory_current().unwrap_or(0),
        )));
    let dump = dump.action_script(fault_during_dump(req.fault, &work));

    // Frozen window: F_k and R_k at the same action boundary. CRIU starts first and calls
    // back when it is ready to seize the tree; the freeze and the upper-layer capture happen
    // then, so CRIU's start-up stays out of the window.
    let gated = rt.criu.dump_gated(&dump, || {
        let t_freeze = Instant::now();
        let freeze = || {
            cgroup
                .freeze(std::time::Duration::from_millis(
                    rt.config.freeze_timeout_ms,
                ))
                .map_err(|source| CheckpointError::Freeze {
                    id: id.clone(),
                    source,
                })
        };
        let mut frozen = freeze()?;
        // A parent frozen between vfork() and its child's exec sleeps uninterruptibly: CRIU
        // cannot seize it and gives up after its timeout. Let such a tree run for a moment.
        for _ in 0..MAX_REFREEZES {
            if !super::in_vfork(&cgroup) {
                break;
            }
            drop(frozen);
            std::thread::sleep(std::time::Duration::from_millis(1));
            frozen = freeze()?;
        }
        let freeze_ms = ms(t_freeze);
        fault(req.fault, FailPoint::AfterFreeze)?;
        // Nothing of the sandbox can fork now: its pid counter is what the next fork uses.
        let t_states = Instant::now();
        let ns_last_pid = super::pid_counter::read(init_pid)
            .inspect_err(|e| tracing::warn!(sandbox = %id, error = %e, "pid counter not recorded"))
            .ok();
        let pids = cgroup.pids().unwrap_or_default();
        super::unrestorable::check_frozen(&pids).map_err(
            |state| CheckpointError::Unsupported {
                id: id.clone(),
                state,
            },
        )?;
        tracing::debug!(sandbox = %id, ?ns_last_pid, processes = pids.len(), ms = ms(t_states), "pid counter read, states checked");
        let processes = super::process_list(&cgroup);
        if rec.userns.is_some() {
            if let Some((pid, caps)) =
                super::caps::first_unrestorable(&cgroup.pids().unwrap_or_default())
            {
                return Err(CheckpointError::UnrestorableCapabilities {
                    id: id.clone(),
                    pid,
                    bits: caps.unrestorable(),
                });
            }
        }
        let t_fs = Instant::now();
        let pending = capture_layer_rereading(
            &slot.paths.upper(rec.instance),
            base.as_deref(),
            &rt.blobs,
            &LayerCaptureOptions::default(),
            &super::shared_writable_inodes(&cgroup),
        )
        .map_err(fs_err)?;
        let fs_ms = ms(t_fs);
        let t_snap = Instant::now();
        let upper_snapshot = upper_snapshot(rt, &rec, &slot.paths.instance(rec.instance), &dir);
        let snapshot_ms = upper_snapshot.map_or(0.0, |_| ms(t_snap));
        fault(req.fault, FailPoint::AfterFsCapture)?;
        Ok(Frozen {
            guard: frozen,
            since: t_freeze,
            freeze_ms,
            fs_ms,
            snapshot_ms,
            upper_snapshot,
            processes,
            pending,
            ns_last_pid,
            dump_started: Instant::now(),
        })
    });
    let frozen = match gated {
        Ok((_, frozen)) => frozen,
        Err(GatedDumpError::Gate(e)) => return Err(e),
        Err(GatedDumpError::Dump(source)) => {
            let pids = cgroup.pids().unwrap_or_default();
            if let Some(state) = super::unrestorable::diagnose_dump_failure(&pids) {
                tracing::debug!(sandbox = %id, error = %source, "dump failed on an unsupported state");
                return Err(CheckpointError::Unsupported { id, state });
            }
            return Err(CheckpointError::Dump {
                id: id.clone(),
                source: Box::new(source),
            });
        }
        Err(GatedDumpError::Setup { path, source }) => {
            return Err(CheckpointError::DumpStart {
                id: id.clone(),
                path,
                source,
            })
        }
    };
    t.freeze = frozen.freeze_ms;
    t.fs_capture = frozen.fs_ms;
    t.upper_snapshot = frozen.snapshot_ms;
    let (upper_snapshot, upper_bytes) = frozen.upper_snapshot.unzip();
    t.criu_dump = ms(frozen.dump_started);
    let (processes, pending, ns_last_pid) = (frozen.processes, frozen.pending, frozen.ns_last_pid);
    // While the tree is still what was dumped: a checkpoint whose restore would be refused
    // (a path of R_k through a symlink out of the sandbox) is not published, so the previous
    // good one stays ready (about a millisecond).
    let restorable =
        super::restore::check_image_paths(&images_dir, &slot.paths.merged(rec.instance));
    drop(frozen.guard);
    t.frozen_total = ms(frozen.since);
    let report = restorable.map_err(|source| CheckpointError::Unrestorable {
        id: id.clone(),
        source,
    })?;
    if rec.userns.is_none() && report.dev_tty > 0 {
        return Err(CheckpointError::Unsupported {
            id: id.clone(),
            state: super::unrestorable::UnsupportedState::DevTtyInHostUserns {
                count: report.dev_tty,
            },
        });
    }
    if rec.userns.is_some() && !own_netns {
        super::unrestorable::check_tcp_images(&images_dir).map_err(|state| {
            CheckpointError::Unsupported {
                id: id.clone(),
                state,
            }
        })?;
    }

    // Publish: F_k's blobs and layer manifest, L_k, digests, manifest, fsync, rename, pointer.
    let t_pub = Instant::now();
    // The parent's manifest, read once for the page index and the shared images (one that
    // does not load: nothing is shared with it).
    let parent_manifest = parent.as_deref().and_then(|name| store.load(name).ok());
    // R_k's pages split into packs while F_k's new blobs are hashed and made durable: two
    // independent passes over the two biggest parts of the checkpoint, one thread each.
    let (memory, sealed) = std::thread::scope(|scope| {
        let split = scope.spawn(|| {
            store::pages::split_against_parent(
                &store,
                parent_manifest.as_ref(),
                &images_dir,
                &rt.blobs,
            )
        });
        let sealed = pending.seal();
        let memory = split.join().unwrap_or_else(|_| {
            Err(store::pages::PageError::Io {
                op: "split (thread panicked)",
                path: images_dir.clone(),
                source: std::io::Error::other("the page split thread panicked"),
            })
        });
        (memory, sealed)
    });
    if sealed.is_err() {
        // A base blob may have been collected: the next capture reads everything.
        slot.set_layer_base(None);
    }
    let memory = memory.map_err(|source| CheckpointError::Pages {
        id: id.clone(),
        source,
    })?;
    if let Some(slot) = stage {
        slot.move_into(&criu_dir).map_err(write_err(&criu_dir))?;
    }
    let (layer, stats) = sealed.map_err(fs_err)?;
    let layer_path = dir.join(UPPER_LAYER);
    fs::write(&layer_path, layer.encode()).map_err(write_err(&layer_path))?;
    let summary = LayerSummary {
        entries: stats.entries,
        data_bytes: stats.data_bytes,
        reused: stats.reused,
        bytes_read: stats.bytes_read,
        new_blobs: stats.new_blobs,
        new_blob_bytes: stats.new_blob_bytes,
        blobs: layer.blobs().len() as u64,
        removed: stats.removed,
        incremental: base.is_some(),
    };
    let ctx_path = dir.join("context.bin");
    fs::write(&ctx_path, &req.context).map_err(write_err(&ctx_path))?;
    let art = |rel: &str| store::artifact(&dir, rel).map_err(write_err(&dir.join(rel)));
    let context = art("context.bin")?;
    let upper = art(UPPER_LAYER)?;
    let mut criu = Vec::new();
    let mut names: Vec<String> = fs::read_dir(&criu_dir)
        .map_err(write_err(&criu_dir))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        criu.push(art(&format!("criu/{name}"))?);
    }
    let shared_image_bytes =
        store::share::link_unchanged_images(&store, parent_manifest.as_ref(), &dir, &criu);
    ghosts_fit(
        rt,
        &rec,
        &slot.paths.instance(rec.instance),
        upper_bytes,
        &criu,
    )?;
    let mut manifest = Manifest {
        format: FORMAT_VERSION,
        sandbox: id.clone(),
        prefix: req.prefix,
        checkpoint: staging.name(),
        seq: staging.seq(),
        parent,
        image: rec.spec.image.clone(),
        image_digest: rec.image_digest.clone(),
        instance: rec.instance,
        context: ContextRecord {
            record: format!("{id}/k{}", req.prefix),
            artifact: context,
        },
        upper,
        layer: summary,
        criu,
        memory,
        shared_image_bytes,
        processes,
        ns_last_pid,
        own_netns,
        upper_snapshot,
        upper_bytes,
        userns: rec.userns,
        forked_from: None,
        timings_ms: t.clone(),
        created_unix_ms: sys::now_unix_ms(),
    };
    manifest.timings_ms.total = ms(started);
    let manifest_path = dir.join("manifest.json");
    {
        let json = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
        fs::write(&manifest_path, json).map_err(write_err(&manifest_path))?;
        sys::fsync_path(&manifest_path).map_err(|e| CheckpointError::Write {
            path: manifest_path.clone(),
            source: e.source,
        })?;
        for d in [&criu_dir, &dir] {
            sys::fsync_path(d).map_err(|e| CheckpointError::Write {
                path: d.to_path_buf(),
                source: e.source,
            })?;
        }
    }
    fault(req.fault, FailPoint::BeforeRename)?;
    let published = store.publish(&mut staging)?;
    if let Err(e) = fault(req.fault, FailPoint::BeforePointerUpdate) {
        let _ = store::snapshot::remove_checkpoint_dir(&published);
        return Err(e);
    }
    if let Err(e) = store.set_ready(&manifest.checkpoint) {
        // The pointer names the previous checkpoint again, unless even pointing it back
        // failed: then it names this one, which stays. Either way no ready checkpoint is
        // known to hold the current state durably.
        if !matches!(e, store::StoreError::PointerMoved { .. }) {
            let _ = store::snapshot::remove_checkpoint_dir(&published);
        }
        slot.changes.forget();
        return Err(e.into());
    }
    slot.set_layer_base(Some((rec.instance, std::sync::Arc::new(layer))));
    t.publish = ms(t_pub);
    t.total = ms(started);
    Ok(CheckpointInfo {
        timings_ms: t,
        ready: true,
        ..manifest.info()
    })
}

/// Refuses a checkpoint whose ghost files (`criu/ghost-file-*.img` among `criu`) would not fit
/// what the sandbox's disk limit leaves once the rest of its upper layer is charged
/// ([`super::unrestorable::check_ghost_room`]; the charge is `upper_bytes`, or read from the
/// volume without a snapshot). No limit, no quotas or no ghosts: nothing to check.
fn ghosts_fit(
    rt: &Runtime,
    rec: &super::SandboxRecord,
    instance: &std::path::Path,
    upper_bytes: Option<u64>,
    criu: &[store::Artifact],
) -> Result<(), CheckpointError> {
    let ghosts = super::restore::ghost_bytes(criu);
    let (Some(quota), Some(limit)) = (&rt.quota, rec.spec.disk_max) else {
        return Ok(());
    };
    if ghosts == 0 {
        return Ok(());
    }
    let charged = match upper_bytes {
        Some(bytes) => bytes,
        None => crate::quota::Volume::open(instance)
            .and_then(|v| v.usage())
            .map(|u| super::restore::charged_bytes(quota, rec, u.referenced))
            .unwrap_or(0),
    };
    super::unrestorable::check_ghost_room(ghosts, charged, limit).map_err(|state| {
        CheckpointError::Unsupported {
            id: rec.id.clone(),
            state,
        }
    })
}

/// Most times a freeze is undone and retried because it caught a task inside `vfork`.
const MAX_REFREEZES: usize = 20;

/// What the frozen part of a checkpoint hands to the dump and the publication.
struct Frozen<'c, 's> {
    guard: crate::cgroup::FrozenGuard<'c>,
    since: Instant,
    freeze_ms: f64,
    fs_ms: f64,
    snapshot_ms: f64,
    upper_snapshot: Option<(u64, u64)>,
    processes: Vec<String>,
    pending: belayer_overlay::layer::PendingLayer<'s>,
    ns_last_pid: Option<i32>,
    dump_started: Instant,
}

/// Takes the checkpoint's upper snapshot ([`store::snapshot`]) of instance volume `instance`
/// into staging dir `dir`, where the state dir has quotas (so instances are volumes) and the
/// config asks for it (`upper_snapshots`). Returns its subvolume id and the bytes charged for
/// the upper layer ([`crate::store::Manifest::upper_bytes`]: the volume's usage, current
/// after the snapshot's commit, plus what the instance inherited), or `None`: without either,
/// and when the snapshot or the usage fails (a warning; the checkpoint is still complete, and
/// its restore materializes F_k with new inode numbers).
fn upper_snapshot(
    rt: &Runtime,
    rec: &super::SandboxRecord,
    instance: &std::path::Path,
    dir: &std::path::Path,
) -> Option<(u64, u64)> {
    let quota = rt.quota.as_ref().filter(|_| rt.config.upper_snapshots)?;
    let taken = store::snapshot::take(instance, dir).and_then(|id| {
        let usage = crate::quota::Volume::open(instance)?.usage()?;
        Ok((
            id,
            super::restore::charged_bytes(quota, rec, usage.referenced),
        ))
    });
    taken
        .inspect_err(|e| {
            tracing::warn!(sandbox = %rec.id, error = %belayer_ipc::error_chain(e), "no upper snapshot: a restore of this checkpoint gives new inode numbers")
        })
        .ok()
}

/// The layer manifest of the ready checkpoint when it was taken of instance `instance` (the
/// base after a daemon restart); `None` when there is none or it does not load.
fn ready_layer(store: &CheckpointStore, instance: u32) -> Option<std::sync::Arc<LayerManifest>> {
    let name = store.ready().ok()??;
    let m = store.load(&name).ok().filter(|m| m.instance == instance)?;
    match store.load_layer(&m) {
        Ok(layer) => Some(std::sync::Arc::new(layer)),
        Err(e) => {
            tracing::warn!(checkpoint = %name, error = %e, "cannot load the base layer: capturing fully");
            None
        }
    }
}

/// Test hook `DuringCriuDump`: a CRIU action script (its path in `work` and its text) that,
/// once the process tree is dumped but before CRIU finishes (its `post-dump` stage), fails the
/// dump or SIGKILLs the daemon.
fn fault_during_dump(
    f: Option<TestFault>,
    work: &std::path::Path,
) -> Option<(std::path::PathBuf, String)> {
    let f = f.filter(|f| f.at == FailPoint::DuringCriuDump)?;
    let action = if f.kill_daemon {
        format!("kill -9 {}; exit 1", std::process::id())
    } else {
        "exit 1".to_string()
    };
    let script =
        format!("#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\n{action}\n");
    Some((work.join("fault-during-dump.sh"), script))
}
