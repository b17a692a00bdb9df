//! The checkpoint store of one sandbox: `state_dir/sandboxes/<id>/checkpoints/`.
//!
//! Atomic publication (paper: "atomic publication" invariant): a checkpoint is written under
//! `.tmp-<random>`, every file and the directory are fsync'd, the directory is renamed to its
//! final name `c<seq>-k<prefix>`, the parent directory is fsync'd, and only then the ready
//! pointer `READY` is replaced by write + fsync + rename + fsync. `READY` names the ready
//! checkpoint and holds the **visibility bound**: the highest sequence number ever made ready.
//! A checkpoint is visible when its sequence number is at most the bound; a crash at any point
//! leaves the previous `READY` in effect, so leftovers (`.tmp-*`, or a renamed directory above
//! the bound) are never listed and are removed by [`CheckpointStore::discard_unpublished`]
//! and by the next [`CheckpointStore::begin`], so that its sequence number never makes them
//! visible.
//!
//! Checkpoints form a tree: each manifest names its parent, the checkpoint that was ready
//! when it was taken (the state it descends from). A restore of an earlier checkpoint points
//! `READY` back at it without lowering the bound, so the checkpoints taken after it stay
//! visible and restorable as another branch; the next checkpoint starts a new branch from it.

pub mod copy;
pub mod manifest;
pub mod pages;
pub mod pointer;
pub mod share;
pub mod snapshot;

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

pub use manifest::{
    Artifact, ContextRecord, LayerSummary, Manifest, FORMAT_VERSION, OLDEST_FORMAT_VERSION,
    UPPER_LAYER,
};

use crate::sys;

pub use pointer::{BOUND, READY};
const MANIFEST: &str = "manifest.json";

/// Store errors.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A filesystem operation failed.
    #[error("checkpoint store operation {op} on {path} failed")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A manifest could not be parsed or has another format version.
    #[error("checkpoint {checkpoint}: bad manifest: {reason}")]
    BadManifest {
        /// Checkpoint name.
        checkpoint: String,
        /// Why.
        reason: String,
    },
    /// An artifact is missing or its size or digest differ from the manifest.
    #[error("checkpoint {checkpoint}: artifact {path} is corrupt: {reason}")]
    Corrupt {
        /// Checkpoint name.
        checkpoint: String,
        /// Artifact path.
        path: String,
        /// What differs.
        reason: String,
    },
    /// The layer manifest F_k does not decode.
    #[error("checkpoint {checkpoint}: bad layer manifest")]
    BadLayer {
        /// Checkpoint name.
        checkpoint: String,
        /// Cause.
        #[source]
        source: belayer_overlay::layer::ManifestError,
    },
    /// The ready pointer names a checkpoint that does not exist.
    #[error("ready pointer names missing checkpoint {0}")]
    DanglingReady(String),
    /// `READY` or `BOUND` holds something else than a checkpoint name or a number: nothing
    /// is known to be a leftover, so nothing is deleted.
    #[error("{path} holds {text:?}, not a checkpoint name or a sequence number")]
    BadPointer {
        /// The file.
        path: PathBuf,
        /// What it holds (at most 80 characters).
        text: String,
    },
    /// The ready pointer was renamed to name `checkpoint` but could not be made durable, and
    /// pointing it back failed too: it names `checkpoint` now (which must be kept), and after
    /// a crash it may name the previous one.
    #[error("ready pointer moved to {checkpoint} but is not known to be durable")]
    PointerMoved {
        /// The checkpoint the pointer names now.
        checkpoint: String,
        /// The first failure (the directory's fsync).
        #[source]
        source: Box<StoreError>,
    },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.to_path_buf();
    move |source| StoreError::Io { op, path, source }
}

/// A checkpoint being written; removed on drop unless published.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    seq: u64,
    prefix: u64,
    published: bool,
}

impl Staging {
    /// The staging directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Name the checkpoint will have once published.
    pub fn name(&self) -> String {
        checkpoint_name(self.seq, self.prefix)
    }

    /// Its sequence number.
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            if let Err(e) = snapshot::remove_checkpoint_dir(&self.dir) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.dir.display(), error = %e, "cannot remove checkpoint staging dir");
                }
            }
        }
    }
}

fn checkpoint_name(seq: u64, prefix: u64) -> String {
    format!("c{seq:06}-k{prefix}")
}

fn parse_seq(name: &str) -> Option<u64> {
    pointer::parse_name(name).map(|(seq, _)| seq)
}

fn parse_prefix(name: &str) -> Option<u64> {
    pointer::parse_name(name).map(|(_, prefix)| prefix)
}

/// The checkpoints of one sandbox.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
}

impl CheckpointStore {
    /// Opens (creating) the store at `dir`.
    pub fn open(dir: &Path) -> Result<CheckpointStore, StoreError> {
        // Only the store dir itself, never its parents: a reader racing the removal of its
        // sandbox (whose dir was renamed away) must fail, not re-create the sandbox's dir.
        match fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("mkdir", dir)(e)),
        }
        Ok(CheckpointStore {
            dir: dir.to_path_buf(),
        })
    }

    /// Creates the store at `dir` and every missing parent (a new sandbox's dir), then opens
    /// it as [`Self::open`] does.
    pub fn create(dir: &Path) -> Result<CheckpointStore, StoreError> {
        fs::create_dir_all(dir).map_err(io("mkdir", dir))?;
        Self::open(dir)
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Directory of checkpoint `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Name of the ready checkpoint, if any.
    ///
    /// Errors: [`StoreError::DanglingReady`] when it names a checkpoint without a manifest.
    pub fn ready(&self) -> Result<Option<String>, StoreError> {
        match pointer::read_ready(&self.dir)? {
            Some(name) if self.dir.join(&name).join(MANIFEST).is_file() => Ok(Some(name)),
            Some(name) => Err(StoreError::DanglingReady(name)),
            None => Ok(None),
        }
    }

    /// The visibility bound (see [`pointer`]): checkpoints with a sequence number above it
    /// are leftovers of an interrupted publication.
    ///
    /// Errors: [`StoreError::BadPointer`], [`StoreError::Io`].
    pub fn bound(&self) -> Result<u64, StoreError> {
        let ready = pointer::read_ready(&self.dir)?
            .as_deref()
            .and_then(parse_seq);
        Ok(pointer::read_bound(&self.dir)?.max(ready.unwrap_or(0)))
    }

    /// Makes `BOUND` hold `bound`, durably, when it holds less.
    fn raise_bound(&self, bound: u64) -> Result<(), StoreError> {
        if pointer::read_bound(&self.dir)? >= bound {
            return Ok(());
        }
        pointer::write(&self.dir, BOUND, Some(&format!("{bound}\n"))).map_err(|(_, e)| e)
    }

    fn published_names(&self) -> Result<Vec<(u64, String)>, StoreError> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.dir)
            .map_err(io("readdir", &self.dir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some((seq, _)) = pointer::parse_name(&name) {
                out.push((seq, name));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Names of every published checkpoint, ready or not, in publication order.
    pub fn names(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .published_names()?
            .into_iter()
            .map(|(_, name)| name)
            .collect())
    }

    /// Starts a new checkpoint of prefix `prefix` in a fresh staging directory.
    ///
    /// Published checkpoints above the bound (a crash before their pointer moved) are
    /// removed first: the new checkpoint's sequence number must not make them visible.
    pub fn begin(&self, prefix: u64) -> Result<Staging, StoreError> {
        let names = self.published_names()?;
        let bound = self.bound()?;
        if names.last().is_some_and(|(s, _)| *s > bound) {
            self.discard_invisible()?;
        }
        // Above every name ever made ready too, so that a number is never used twice (a
        // removed branch's numbers stay under the bound).
        let last = self.published_names()?.last().map_or(0, |(s, _)| *s);
        let seq = last.max(self.bound()?) + 1;
        let dir = self.dir.join(format!(".tmp-{}", sys::random_hex(6)));
        fs::create_dir(&dir).map_err(io("mkdir", &dir))?;
        Ok(Staging {
            dir,
            seq,
            prefix,
            published: false,
        })
    }

    /// Renames a complete, fsync'd staging directory to its final name and fsyncs the store.
    /// The ready pointer does not move yet.
    pub fn publish(&self, staging: &mut Staging) -> Result<PathBuf, StoreError> {
        let dest = self.dir.join(staging.name());
        fs::rename(&staging.dir, &dest).map_err(io("rename", &dest))?;
        staging.published = true;
        sys::fsync_path(&self.dir).map_err(|e| io("fsync", &self.dir)(e.source))?;
        Ok(dest)
    }

    /// Atomically points `READY` at `name` (write temp, fsync, rename, fsync dir); the bound
    /// never falls: moving back to an earlier checkpoint first makes `BOUND` hold the
    /// current bound, so the later checkpoints stay visible (see [`pointer`] for the order;
    /// a move forward writes only `READY`).
    ///
    /// On an error the pointer names what it named before (when the rename took effect but
    /// the directory's fsync failed, it is pointed back), so `name` may be removed; except
    /// [`StoreError::PointerMoved`]: pointing back failed as well, the pointer names `name`,
    /// and `name` must be kept.
    pub fn set_ready(&self, name: &str) -> Result<(), StoreError> {
        let Some((seq, _)) = pointer::parse_name(name) else {
            return Err(StoreError::BadPointer {
                path: self.dir.join(READY),
                text: name.chars().take(80).collect(),
            });
        };
        let bound = self.bound()?;
        if seq < bound {
            self.raise_bound(bound)?;
        }
        let previous = pointer::read_ready(&self.dir)?;
        match pointer::write(&self.dir, READY, Some(name)) {
            Ok(()) => {}
            Err((false, e)) => return Err(e),
            Err((true, e)) => {
                return match pointer::write(&self.dir, READY, previous.as_deref()) {
                    Ok(()) => Err(e),
                    Err(_) => Err(StoreError::PointerMoved {
                        checkpoint: name.to_string(),
                        source: Box::new(e),
                    }),
                }
            }
        }
        // Moving forward, the new name bounds by itself: `BOUND` is written only before a
        // move back or a clear, which is when the name would stop bounding.
        Ok(())
    }

    /// Makes no checkpoint ready (the sandbox then restarts from its base image); the bound
    /// is written first and stays, so the remaining checkpoints stay visible.
    pub fn clear_ready(&self) -> Result<(), StoreError> {
        self.raise_bound(self.bound()?)?;
        pointer::write(&self.dir, READY, None).map_err(|(_, e)| e)
    }

    /// Removes staging leftovers and checkpoints published above the bound (a crash between
    /// rename and pointer update). Returns how many were removed.
    pub fn discard_unpublished(&self) -> Result<usize, StoreError> {
        let bound = self.bound()?;
        let mut removed = 0;
        for e in fs::read_dir(&self.dir)
            .map_err(io("readdir", &self.dir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale = name.starts_with(".tmp-") || parse_seq(&name).is_some_and(|s| s > bound);
            if stale {
                snapshot::remove_checkpoint_dir(&e.path()).map_err(io("rmdir", &e.path()))?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Name of the latest checkpoint of action boundary `prefix` on the ready checkpoint's
    /// line (it and its ancestors: the history of the state the sandbox runs); `None` when
    /// that line has none (a checkpoint of another branch is chosen by name, [`Self::visible`]).
    pub fn line_of_prefix(&self, prefix: u64) -> Result<Option<String>, StoreError> {
        let Some(ready) = self.ready()? else {
            return Ok(None);
        };
        Ok(self
            .ancestry(&ready)
            .into_iter()
            .find(|m| m.prefix == prefix)
            .map(|m| m.checkpoint))
    }

    /// `name` when it is a visible checkpoint (a plain checkpoint name, at most the bound,
    /// with a manifest); `None` otherwise.
    pub fn visible(&self, name: &str) -> Result<Option<String>, StoreError> {
        let Some((seq, _)) = pointer::parse_name(name) else {
            return Ok(None);
        };
        let visible = seq <= self.bound()? && self.dir.join(name).join(MANIFEST).is_file();
        Ok(visible.then(|| name.to_string()))
    }

    /// The manifests of `name` and its ancestors, `name` first, as far as their manifests
    /// can be read (a removed or unreadable one ends the line). A parent must be a plain
    /// checkpoint name (no path) with a lower sequence number than its child's name: a
    /// damaged or hostile manifest ends the line there, so the walk can neither loop nor
    /// leave the store.
    pub fn ancestry(&self, name: &str) -> Vec<Manifest> {
        let mut line: Vec<Manifest> = Vec::new();
        let mut next = Some(name.to_string());
        while let Some(current) = next.take() {
            let Some((seq, _)) = pointer::parse_name(&current) else {
                break;
            };
            let earlier = line
                .last()
                .and_then(|child| parse_seq(&child.checkpoint))
                .is_none_or(|child| seq < child);
            if !earlier {
                break;
            }
            let Ok(m) = self.load(&current) else { break };
            next = m.parent.clone();
            line.push(m);
        }
        line
    }

    /// Removes the published checkpoints above the bound, which no listing shows; staging
    /// directories are left alone. A crash half-way leaves some of them (perhaps half
    /// deleted) above the bound, still invisible, for the next call, the next
    /// [`Self::begin`] or [`Self::discard_unpublished`]. Returns the prefixes removed, oldest
    /// first.
    ///
    /// Errors: `READY` cannot be read, or the first removal that failed.
    pub fn discard_invisible(&self) -> Result<Vec<u64>, StoreError> {
        let bound = self.bound()?;
        let mut removed = Vec::new();
        for (seq, name) in self.published_names()? {
            if seq > bound {
                let p = self.dir.join(&name);
                snapshot::remove_checkpoint_dir(&p).map_err(io("rmdir", &p))?;
                removed.extend(parse_prefix(&name));
            }
        }
        Ok(removed)
    }

    /// Manifests of the visible checkpoints (sequence ≤ the bound) of every branch, oldest
    /// first.
    pub fn list(&self) -> Result<Vec<Manifest>, StoreError> {
        let bound = self.bound()?;
        let mut out = Vec::new();
        for (seq, name) in self.published_names()? {
            if seq <= bound {
                if let Ok(m) = self.load(&name) {
                    out.push(m);
                }
            }
        }
        Ok(out)
    }

    /// The wire description of every visible checkpoint, oldest first, the ready one
    /// marked ([`belayer_ipc::CheckpointInfo::ready`]).
    pub fn infos(&self) -> Result<Vec<belayer_ipc::CheckpointInfo>, StoreError> {
        let ready = self.ready().ok().flatten();
        Ok(self
            .list()?
            .iter()
            .map(|m| belayer_ipc::CheckpointInfo {
                ready: ready.as_deref() == Some(m.checkpoint.as_str()),
                ..m.info()
            })
            .collect())
    }

    /// Reads the manifest of `name`.
    pub fn load(&self, name: &str) -> Result<Manifest, StoreError> {
        if pointer::parse_name(name).is_none() {
            return Err(StoreError::BadManifest {
                checkpoint: name.chars().take(80).collect(),
                reason: "not a checkpoint name".into(),
            });
        }
        let p = self.dir.join(name).join(MANIFEST);
        let bytes = fs::read(&p).map_err(io("read", &p))?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| StoreError::BadManifest {
            checkpoint: name.to_string(),
            reason: e.to_string(),
        })?;
        if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&m.format) {
            return Err(StoreError::BadManifest {
                checkpoint: name.to_string(),
                reason: format!(
                    "format version {} (supported: {OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})",
                    m.format
                ),
            });
        }
        if m.checkpoint != name {
            return Err(StoreError::BadManifest {
                checkpoint: name.to_string(),
                reason: format!("names checkpoint {}", m.checkpoint),
            });
        }
        Ok(m)
    }

    /// Loads `name` and verifies every artifact's size and blake3 digest.
    pub fn verify(&self, name: &str) -> Result<Manifest, StoreError> {
        let m = self.load(name)?;
        let dir = self.dir.join(name);
        for a in m.artifacts() {
            let corrupt = |reason: String| StoreError::Corrupt {
                checkpoint: name.to_string(),
                path: a.path.clone(),
                reason,
            };
            if !a.path_is_safe() {
                return Err(corrupt("path escapes the checkpoint".into()));
            }
            let p = dir.join(&a.path);
            let meta = fs::symlink_metadata(&p).map_err(|e| corrupt(format!("missing ({e})")))?;
            if !meta.is_file() {
                return Err(corrupt("not a regular file".into()));
            }
            if meta.len() != a.bytes {
                return Err(corrupt(format!(
                    "{} bytes, manifest says {}",
                    meta.len(),
                    a.bytes
                )));
            }
            let digest = digest_file(&p).map_err(|e| corrupt(format!("unreadable ({e})")))?;
            if digest != a.digest {
                return Err(corrupt("digest mismatch".into()));
            }
        }
        Ok(m)
    }

    /// Reads the context bytes L_k of a verified checkpoint.
    pub fn read_context(&self, m: &Manifest) -> Result<Vec<u8>, StoreError> {
        let p = self.dir.join(&m.checkpoint).join(&m.context.artifact.path);
        fs::read(&p).map_err(io("read", &p))
    }

    /// Reads and decodes the layer manifest F_k of `m` (verify the checkpoint first).
    pub fn load_layer(
        &self,
        m: &Manifest,
    ) -> Result<belayer_overlay::layer::LayerManifest, StoreError> {
        let p = self.dir.join(&m.checkpoint).join(&m.upper.path);
        let bytes = fs::read(&p).map_err(io("read", &p))?;
        belayer_overlay::layer::LayerManifest::decode(&bytes).map_err(|source| {
            StoreError::BadLayer {
                checkpoint: m.checkpoint.clone(),
                source,
            }
        })
    }

    /// Deletes checkpoint `name`.
    /// Returns the bytes of its artifacts (its blobs are freed by the blob collection once no
    /// other checkpoint refers to them).
    ///
    /// The directory is first renamed to `.tmp-del-<name>` (and the store fsync'd), so that
    /// a crash half-way through the deletion leaves a leftover the next adoption removes,
    /// never a listed checkpoint with missing artifacts.
    ///
    /// Errors: [`StoreError::BadManifest`] for a name that is not a checkpoint's;
    /// [`StoreError::Io`].
    pub fn remove(&self, name: &str) -> Result<u64, StoreError> {
        if pointer::parse_name(name).is_none() {
            return Err(StoreError::BadManifest {
                checkpoint: name.chars().take(80).collect(),
                reason: "not a checkpoint name".into(),
            });
        }
        let p = self.dir.join(name);
        let bytes = self
            .load(name)
            .map(|m| m.artifacts().map(|a| a.bytes).sum())
            .unwrap_or(0);
        let doomed = self.dir.join(format!(".tmp-del-{name}"));
        fs::rename(&p, &doomed).map_err(io("rename", &p))?;
        sys::fsync_path(&self.dir).map_err(|e| io("fsync", &self.dir)(e.source))?;
        snapshot::remove_checkpoint_dir(&doomed).map_err(io("rmdir", &doomed))?;
        Ok(bytes)
    }
}

/// blake3 of a file, lowercase hex; also used while writing manifests.
pub fn digest_file(path: &Path) -> std::io::Result<String> {
    let mut hasher = blake3::Hasher::new();
    let mut f = fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// Describes a file as an artifact (size + digest) and fsyncs it.
pub fn artifact(root: &Path, rel: &str) -> std::io::Result<Artifact> {
    let p = root.join(rel);
    let f = fs::File::open(&p)?;
    f.sync_all()?;
    let bytes = f.metadata()?.len();
    Ok(Artifact {
        path: rel.to_string(),
        bytes,
        digest: digest_file(&p)?,
    })
}

#[cfg(test)]
mod tests;
