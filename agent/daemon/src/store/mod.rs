//! The checkpoint store of one sandbox: `state_dir/sandboxes/<id>/checkpoints/`.
//!
//! Atomic publication (paper: "atomic publication" invariant): a checkpoint is written under
//! `.tmp-<random>`, every file and the directory are fsync'd, the directory is renamed to its
//! final name `c<seq>-k<prefix>`, the parent directory is fsync'd, and only then the ready
//! pointer `READY` (a small file holding the checkpoint name) is replaced by write + fsync +
//! rename + fsync. A crash at any point leaves the previous `READY` in effect; leftovers
//! (`.tmp-*`, or a renamed directory whose sequence number is above the ready one) are never
//! listed and are removed by [`CheckpointStore::discard_unpublished`]; the next
//! [`CheckpointStore::begin`] removes the renamed ones too, so that its sequence number never
//! makes them visible. A restore of an earlier checkpoint points `READY` back at it and so
//! turns the later checkpoints into such leftovers ([`CheckpointStore::discard_after_ready`]).

pub mod manifest;
pub mod snapshot;

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

pub use manifest::{Artifact, ContextRecord, LayerSummary, Manifest, FORMAT_VERSION, UPPER_LAYER};

use crate::sys;

/// Name of the ready pointer file.
pub const READY: &str = "READY";
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
    name.strip_prefix('c')?.split('-').next()?.parse().ok()
}

fn parse_prefix(name: &str) -> Option<u64> {
    name.strip_prefix('c')?.split_once("-k")?.1.parse().ok()
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
    pub fn ready(&self) -> Result<Option<String>, StoreError> {
        let p = self.dir.join(READY);
        match fs::read_to_string(&p) {
            Ok(s) => {
                let name = s.trim().to_string();
                if self.dir.join(&name).join(MANIFEST).is_file() {
                    Ok(Some(name))
                } else {
                    Err(StoreError::DanglingReady(name))
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("read", &p)(e)),
        }
    }

    fn published_names(&self) -> Result<Vec<(u64, String)>, StoreError> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.dir)
            .map_err(io("readdir", &self.dir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(seq) = parse_seq(&name) {
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
    /// Published checkpoints above the ready one (a crash before their pointer moved, or
    /// the future a restore of an earlier checkpoint left behind and could not remove) are
    /// removed first: the new checkpoint's sequence number must not make them visible.
    pub fn begin(&self, prefix: u64) -> Result<Staging, StoreError> {
        let names = self.published_names()?;
        let ready_seq = self.ready()?.as_deref().and_then(parse_seq).unwrap_or(0);
        if names.last().is_some_and(|(s, _)| *s > ready_seq) {
            self.discard_after_ready()?;
        }
        let seq = self.published_names()?.last().map_or(1, |(s, _)| s + 1);
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

    /// Atomically points `READY` at `name` (write temp, fsync, rename, fsync dir).
    ///
    /// On an error the pointer names what it named before (when the rename took effect but
    /// the directory's fsync failed, it is pointed back), so `name` may be removed; except
    /// [`StoreError::PointerMoved`]: pointing back failed as well, the pointer names `name`,
    /// and `name` must be kept.
    pub fn set_ready(&self, name: &str) -> Result<(), StoreError> {
        let ready = self.dir.join(READY);
        let previous = match fs::read_to_string(&ready) {
            Ok(p) => Some(p),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(io("read", &ready)(e)),
        };
        match self.write_pointer(Some(name)) {
            Ok(()) => Ok(()),
            Err((false, e)) => Err(e),
            Err((true, e)) => match self.write_pointer(previous.as_deref()) {
                Ok(()) => Err(e),
                Err(_) => Err(StoreError::PointerMoved {
                    checkpoint: name.to_string(),
                    source: Box::new(e),
                }),
            },
        }
    }

    /// Makes the ready pointer name `name` (`None`: removes it), durably. An error comes
    /// with whether the pointer changed before it.
    fn write_pointer(&self, name: Option<&str>) -> Result<(), (bool, StoreError)> {
        let ready = self.dir.join(READY);
        match name {
            Some(name) => {
                let tmp = self.dir.join(".READY.tmp");
                let written =
                    fs::File::create(&tmp)
                        .map_err(io("create", &tmp))
                        .and_then(|mut f| {
                            f.write_all(name.as_bytes()).map_err(io("write", &tmp))?;
                            f.sync_all().map_err(io("fsync", &tmp))
                        });
                written.map_err(|e| (false, e))?;
                fs::rename(&tmp, &ready).map_err(|e| (false, io("rename", &ready)(e)))?;
            }
            None => match fs::remove_file(&ready) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err((false, io("unlink", &ready)(e))),
            },
        }
        sys::fsync_path(&self.dir).map_err(|e| (true, io("fsync", &self.dir)(e.source)))
    }

    /// Removes the ready pointer (the sandbox then restarts from its base image).
    pub fn clear_ready(&self) -> Result<(), StoreError> {
        self.write_pointer(None).map_err(|(_, e)| e)
    }

    /// Removes staging leftovers and checkpoints published after the ready one (a crash between
    /// rename and pointer update). Returns how many were removed.
    pub fn discard_unpublished(&self) -> Result<usize, StoreError> {
        let ready_seq = match self.ready() {
            Ok(r) => r.as_deref().and_then(parse_seq).unwrap_or(0),
            Err(StoreError::DanglingReady(_)) => 0,
            Err(e) => return Err(e),
        };
        let mut removed = 0;
        for e in fs::read_dir(&self.dir)
            .map_err(io("readdir", &self.dir))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let stale =
                name.starts_with(".tmp-") || parse_seq(&name).is_some_and(|s| s > ready_seq);
            if stale {
                snapshot::remove_checkpoint_dir(&e.path()).map_err(io("rmdir", &e.path()))?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Name of the visible checkpoint (sequence ≤ the ready one) of action boundary
    /// `prefix`, the latest one when several were taken at it; `None` when there is none.
    pub fn visible_of_prefix(&self, prefix: u64) -> Result<Option<String>, StoreError> {
        let Some(ready) = self.ready()? else {
            return Ok(None);
        };
        let ready_seq = parse_seq(&ready).unwrap_or(0);
        Ok(self
            .published_names()?
            .into_iter()
            .filter(|(seq, name)| *seq <= ready_seq && parse_prefix(name) == Some(prefix))
            .filter(|(_, name)| self.dir.join(name).join(MANIFEST).is_file())
            .map(|(_, name)| name)
            .next_back())
    }

    /// Removes the published checkpoints above the ready one (every one, when none is
    /// ready), which no listing shows; staging directories are left alone. A crash half-way
    /// leaves some of them (perhaps half deleted) above the ready one, still invisible, for
    /// the next call, the next [`Self::begin`] or [`Self::discard_unpublished`].
    /// Returns the prefixes removed, oldest first.
    ///
    /// Errors: a dangling ready pointer ([`StoreError::DanglingReady`]: nothing is removed,
    /// the ready checkpoint is unknown), or the first removal that failed.
    pub fn discard_after_ready(&self) -> Result<Vec<u64>, StoreError> {
        let ready_seq = self.ready()?.as_deref().and_then(parse_seq).unwrap_or(0);
        let mut removed = Vec::new();
        for (seq, name) in self.published_names()? {
            if seq > ready_seq {
                let p = self.dir.join(&name);
                snapshot::remove_checkpoint_dir(&p).map_err(io("rmdir", &p))?;
                removed.extend(parse_prefix(&name));
            }
        }
        Ok(removed)
    }

    /// Manifests of the visible checkpoints (sequence ≤ the ready one), oldest first.
    pub fn list(&self) -> Result<Vec<Manifest>, StoreError> {
        let Some(ready) = self.ready()? else {
            return Ok(Vec::new());
        };
        let ready_seq = parse_seq(&ready).unwrap_or(0);
        let mut out = Vec::new();
        for (seq, name) in self.published_names()? {
            if seq <= ready_seq {
                if let Ok(m) = self.load(&name) {
                    out.push(m);
                }
            }
        }
        Ok(out)
    }

    /// Reads the manifest of `name`.
    pub fn load(&self, name: &str) -> Result<Manifest, StoreError> {
        let p = self.dir.join(name).join(MANIFEST);
        let bytes = fs::read(&p).map_err(io("read", &p))?;
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| StoreError::BadManifest {
            checkpoint: name.to_string(),
            reason: e.to_string(),
        })?;
        if m.format != FORMAT_VERSION {
            return Err(StoreError::BadManifest {
                checkpoint: name.to_string(),
                reason: format!("format version {} (supported: {FORMAT_VERSION})", m.format),
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
    pub fn remove(&self, name: &str) -> Result<u64, StoreError> {
        let p = self.dir.join(name);
        let bytes = self
            .load(name)
            .map(|m| m.artifacts().map(|a| a.bytes).sum())
            .unwrap_or(0);
        snapshot::remove_checkpoint_dir(&p).map_err(io("rmdir", &p))?;
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
