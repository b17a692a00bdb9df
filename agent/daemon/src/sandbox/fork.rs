//! `fork`: N new sandboxes, each restored from one checkpoint C_K of a sandbox that keeps
//! running (GRPO's samples of one prompt, tree search branching at a step).
//!
//! 1. [`prepare`], under the source's verb lock (a few milliseconds per child): the checkpoint
//!    C_K is chosen as a restore chooses it ([`Choice`]); each child gets a new id, its own
//!    user-namespace range, and a record marked `pending_fork` written before anything else
//!    of it exists; then a copy of C_K in its own store, its ready checkpoint
//!    ([`crate::store::copy`]: hard links, F_k's ids and R_k's namespace maps moved to the
//!    child's range).
//! 2. [`restore_children`]: every child is restored from its copy by the ordinary restore
//!    (fresh instance, own namespaces, cgroup and limits, the verifier, the path check of
//!    the images, CRIU), several at once.
//! 3. [`commit`]: the fork's marker `state_dir/forks/<fork id>` is written and fsync'd (the
//!    commit point), then each child's `pending_fork` is cleared, then the marker removed.
//!
//! All or nothing: a child that fails makes the fork remove every child ([`discard`]); a
//! daemon killed before the marker exists leaves children that the next adoption removes
//! (their cgroups killed with whatever CRIU had restored, their dirs deleted, their ranges
//! not taken up again), and one killed after leaves them all. The source and its
//! checkpoints are never changed.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use belayer_ipc::{ErrorCode, RestoreInfo};

use super::restore::{Choice, RestoreError, Target};
use super::{SandboxPaths, SandboxRecord, SandboxSlot, SandboxState};
use crate::runtime::Runtime;
use crate::store::copy::CopyTarget;
use crate::store::{CheckpointStore, StoreError};
use crate::sys;

/// Most children one fork may ask for.
pub const MAX_FORK_COUNT: u32 = 256;

/// Children restored at once (each restore is one CRIU run and a file-system install).
const PARALLEL_RESTORES: usize = 8;

/// Errors of a fork. Nothing of the source changes on any of them, and no child stays.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    /// The request is malformed.
    #[error("invalid fork request: {0}")]
    Invalid(String),
    /// The source has no ready checkpoint to fork from.
    #[error("sandbox {id} has no ready checkpoint to fork from")]
    NoCheckpoint {
        /// Source sandbox id.
        id: String,
    },
    /// The checkpoint could not be chosen (no such prefix or name, an unreadable store).
    #[error(transparent)]
    Choose(Box<RestoreError>),
    /// Reading the checkpoint or copying it into a child's store failed.
    #[error("cannot copy checkpoint {checkpoint} of sandbox {id} for a fork")]
    Copy {
        /// Source sandbox id.
        id: String,
        /// Checkpoint name.
        checkpoint: String,
        /// Cause.
        #[source]
        source: StoreError,
    },
    /// The blob store could not be leased (its lock file).
    #[error("cannot lease the blob store for a fork")]
    Lease(#[source] belayer_overlay::layer::BlobError),
    /// No user-namespace range is free for a child.
    #[error(transparent)]
    Userns(#[from] crate::userns::UsernsError),
    /// Making a child's directory or record failed.
    #[error("cannot set up fork child {id}")]
    Setup {
        /// Child id.
        id: String,
        /// Cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Restoring a child failed.
    #[error("fork child {id} (of {count}) could not be restored")]
    Restore {
        /// Child id.
        id: String,
        /// Children asked for.
        count: u32,
        /// Cause.
        #[source]
        source: Box<RestoreError>,
    },
    /// The commit marker could not be written.
    #[error("cannot commit fork {fork}")]
    Commit {
        /// Fork id.
        fork: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

impl ForkError {
    /// Protocol error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            ForkError::Invalid(_) => ErrorCode::BadRequest,
            ForkError::NoCheckpoint { .. } => ErrorCode::NotFound,
            ForkError::Choose(e) | ForkError::Restore { source: e, .. } => e.code(),
            ForkError::Copy {
                source: StoreError::BadManifest { .. } | StoreError::Corrupt { .. },
                ..
            } => ErrorCode::CorruptCheckpoint,
            ForkError::Userns(crate::userns::UsernsError::PoolExhausted { .. }) => {
                ErrorCode::InvalidState
            }
            _ => ErrorCode::Internal,
        }
    }
}

/// What [`prepare`] makes.
#[derive(Debug, Clone, Copy)]
pub struct ForkSpec<'a> {
    /// The fork's id ([`new_fork_id`]).
    pub fork: &'a str,
    /// The checkpoint C_K, chosen as a restore chooses.
    pub choice: &'a Choice,
    /// Children, 1 to [`MAX_FORK_COUNT`].
    pub count: u32,
    /// Their owner.
    pub owner_uid: u32,
}

/// The children of a fork, copied and not restored yet.
#[derive(Debug)]
pub struct Prepared {
    /// The fork's id, `fk-<12 hex>`.
    pub fork: String,
    /// The checkpoint forked from.
    pub checkpoint: String,
    /// Its action boundary K.
    pub prefix: u64,
    /// L_K.
    pub context: Vec<u8>,
    /// The children, in order.
    pub children: Vec<Arc<SandboxSlot>>,
}

/// `state_dir/forks`: the commit markers of forks being finished.
pub fn markers_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("forks")
}

/// Whether fork `fork` reached its commit point (its marker exists).
pub fn is_committed(state_dir: &Path, fork: &str) -> bool {
    // Names are `fk-<hex>`: nothing else is looked up.
    fork.strip_prefix("fk-")
        .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
        && markers_dir(state_dir).join(fork).is_file()
}

/// Checks a fork's child count. Errors: [`ForkError::Invalid`] for 0 or above
/// [`MAX_FORK_COUNT`].
pub fn check_count(count: u32) -> Result<(), ForkError> {
    if count == 0 || count > MAX_FORK_COUNT {
        return Err(ForkError::Invalid(format!(
            "count {count}: between 1 and {MAX_FORK_COUNT}"
        )));
    }
    Ok(())
}

/// A new fork id, `fk-<12 hex>`.
pub fn new_fork_id() -> String {
    format!("fk-{}", sys::random_hex(6))
}

/// Step 1 (see the module docs): `count` children of `source` for fork `fork`, each with a
/// ready copy of the checkpoint `choice` names, owned by `owner_uid`. Holds the source's
/// verb lock and a lease of the blob store throughout; `hold` is given each child as soon as
/// it exists (the caller makes it known to the blob collection, which cannot run before
/// this returns).
///
/// Errors: [`ForkError::Invalid`] (a count of 0 or above [`MAX_FORK_COUNT`]),
/// [`ForkError::NoCheckpoint`], [`ForkError::Choose`], [`ForkError::Copy`],
/// [`ForkError::Userns`], [`ForkError::Setup`]; the children made so far are removed.
pub fn prepare(
    rt: &Runtime,
    source: &SandboxSlot,
    spec: ForkSpec<'_>,
    hold: &dyn Fn(&Arc<SandboxSlot>),
) -> Result<Prepared, ForkError> {
    let ForkSpec {
        fork,
        choice,
        count,
        owner_uid,
    } = spec;
    check_count(count)?;
    let fork = fork.to_string();
    let _op = source.lock_op();
    let rec = source.refresh();
    let copy_err = |checkpoint: &str| {
        let (id, checkpoint) = (rec.id.clone(), checkpoint.to_string());
        move |source| ForkError::Copy {
            id,
            checkpoint,
            source,
        }
    };
    let _lease = rt.blobs.lease().map_err(ForkError::Lease)?;
    let store = CheckpointStore::open(&source.paths.checkpoints()).map_err(copy_err(""))?;
    let target =
        Target::choose(&store, &rec.id, choice).map_err(|e| ForkError::Choose(Box::new(e)))?;
    let name = target
        .chosen
        .ok_or_else(|| ForkError::NoCheckpoint { id: rec.id.clone() })?;
    let m = store.load(&name).map_err(copy_err(&name))?;
    let layer = store.load_layer(&m).map_err(copy_err(&name))?;
    let context = store.read_context(&m).map_err(copy_err(&name))?;
    let mut children = Vec::with_capacity(count as usize);
    for _ in 0..count {
        match make_child(rt, &rec, &fork, owner_uid) {
            Ok(child) => {
                let child = Arc::new(child);
                hold(&child);
                children.push(child.clone());
                let (id, userns) = {
                    let r = child.record();
                    (r.id.clone(), r.userns)
                };
                let copied = CheckpointStore::open(&child.paths.checkpoints()).and_then(|s| {
                    s.import_copy(
                        &store,
                        &m,
                        &layer,
                        rec.userns,
                        &CopyTarget {
                            sandbox: &id,
                            userns,
                        },
                    )
                });
                if let Err(e) = copied {
                    discard(rt, &children);
                    return Err(copy_err(&name)(e));
                }
            }
            Err(e) => {
                discard(rt, &children);
                return Err(e);
            }
        }
    }
    tracing::info!(sandbox = %rec.id, fork = %fork, checkpoint = %name, count, "fork prepared");
    Ok(Prepared {
        fork,
        checkpoint: name,
        prefix: m.prefix,
        context,
        children,
    })
}

/// A child's id, directory, range and record (`pending_fork`, failed: not restored yet).
///
/// The directory is made under a trash name (`.trash-<id>-fork`, which an adoption deletes)
/// with the record and an empty store in it, then renamed into place: a daemon killed
/// meanwhile leaves no sandbox dir without a record.
fn make_child(
    rt: &Runtime,
    source: &SandboxRecord,
    fork: &str,
    owner_uid: u32,
) -> Result<SandboxSlot, ForkError> {
    let id = format!("sb-{}", sys::random_hex(6));
    let paths = SandboxPaths::new(&rt.config.state_dir, &id);
    let staging_name = format!("{}{id}-fork", super::remove::TRASH_PREFIX);
    let staging = SandboxPaths::new(&rt.config.state_dir, &staging_name);
    let setup = |source: Box<dyn std::error::Error + Send + Sync>| ForkError::Setup {
        id: id.clone(),
        source,
    };
    fs::create_dir(&staging.dir).map_err(|e| setup(e.into()))?;
    let userns = match source.userns.map(|_| rt.userns.reserve()).transpose() {
        Ok(u) => u,
        Err(e) => {
            super::remove::delete_sandbox_dir(&staging.dir);
            return Err(e.into());
        }
    };
    let rec = SandboxRecord {
        cgroup: rt.cgroup_rel(&id),
        id: id.clone(),
        spec: source.spec.clone(),
        state: SandboxState::Failed,
        instance: 0,
        init_pid: None,
        init_start_time: None,
        created_unix_ms: sys::now_unix_ms(),
        userns,
        owner_uid,
        inherited_bytes: 0,
        image_digest: source.image_digest.clone(),
        pending_fork: Some(fork.to_string()),
    };
    // The record first: whatever exists of the child from here on, an adoption finds it
    // and removes it unless the fork committed.
    let staged = rec
        .save(&staging)
        .map_err(|e| setup(e.into()))
        .and_then(|()| CheckpointStore::create(&staging.checkpoints()).map_err(|e| setup(e.into())))
        .and_then(|_| {
            // Never over another sandbox's dir.
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &staging.dir,
                rustix::fs::CWD,
                &paths.dir,
                rustix::fs::RenameFlags::NOREPLACE,
            )
            .map_err(|e| setup(std::io::Error::from(e).into()))
        });
    let placed = staged.and_then(|()| {
        sys::fsync_path(&rt.config.state_dir.join("sandboxes")).map_err(|e| {
            super::remove::delete_sandbox_dir(&paths.dir);
            setup(e.into())
        })
    });
    if let Err(e) = placed {
        super::remove::delete_sandbox_dir(&staging.dir);
        if let Some(range) = userns {
            rt.userns.release(range);
        }
        return Err(e);
    }
    Ok(SandboxSlot::new(rec, paths))
}

/// Step 2: restores every child from its ready copy, [`PARALLEL_RESTORES`] at a time, with
/// the daemon's one retry of a restore CRIU failed on a task's `SIGTRAP`. Returns each
/// child's answer, in order.
///
/// Errors: [`ForkError::Restore`] for the first child that failed (the others may have
/// been restored; [`discard`] them all).
pub fn restore_children(
    rt: &Runtime,
    prepared: &Prepared,
    verify: bool,
) -> Result<Vec<RestoreInfo>, ForkError> {
    let children = &prepared.children;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<RestoreInfo, RestoreError>>>> = children
        .iter()
        .map(|_| std::sync::Mutex::new(None))
        .collect();
    let workers = children.len().clamp(1, PARALLEL_RESTORES);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(child) = children.get(i) else { break };
                let restore = || super::restore::restore(rt, child, verify, &Choice::Ready);
                let mut r = restore();
                if let Err(e) = &r {
                    if e.is_transient() {
                        tracing::warn!(error = %e, "a fork child's restore failed in a way seen to pass on a second try; trying once more");
                        r = restore();
                    }
                }
                *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    let mut out = Vec::with_capacity(children.len());
    for (child, r) in children.iter().zip(results) {
        let r = r.into_inner().unwrap_or_else(|p| p.into_inner());
        match r {
            Some(Ok(info)) => out.push(info),
            Some(Err(source)) => {
                return Err(ForkError::Restore {
                    id: child.record().id.clone(),
                    count: children.len() as u32,
                    source: Box::new(source),
                })
            }
            None => {
                return Err(ForkError::Invalid(
                    "a restore worker ended without an answer".into(),
                ))
            }
        }
    }
    Ok(out)
}

/// Step 3: the commit marker, then every child's `pending_fork` cleared, then the marker
/// removed (kept when a child's record could not be rewritten: the next adoption keeps that
/// child by it).
///
/// Errors: [`ForkError::Commit`] when the marker could not be made durable (nothing is
/// committed; [`discard`] the children).
pub fn commit(rt: &Runtime, prepared: &Prepared) -> Result<(), ForkError> {
    let dir = markers_dir(&rt.config.state_dir);
    let marker = dir.join(&prepared.fork);
    let err = |source| ForkError::Commit {
        fork: prepared.fork.clone(),
        source,
    };
    fs::create_dir_all(&dir).map_err(err)?;
    fs::write(&marker, b"").map_err(err)?;
    sys::fsync_path(&marker)
        .and_then(|()| sys::fsync_path(&dir))
        .map_err(|e| err(e.source))?;
    let mut all_cleared = true;
    for child in &prepared.children {
        if let Err(e) = child.commit(|r| r.pending_fork = None) {
            tracing::warn!(sandbox = %child.record().id, error = %e, "fork child still marked pending (kept by the commit marker)");
            all_cleared = false;
        }
    }
    if all_cleared {
        let _ = fs::remove_file(&marker);
    }
    Ok(())
}

/// Removes children of a fork that did not complete: untraced, killed, unmounted, deleted,
/// their ranges released. Failures are logged (a child whose tree cannot be killed keeps its
/// range).
pub fn discard(rt: &Runtime, children: &[Arc<SandboxSlot>]) {
    for child in children {
        let (id, userns) = {
            let r = child.record();
            (r.id.clone(), r.userns)
        };
        rt.tracer.untrack(&id);
        match super::remove::remove(child) {
            Ok(()) => {
                if let Some(range) = userns {
                    rt.userns.release(range);
                }
            }
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "cannot remove a child of a failed fork")
            }
        }
    }
}
