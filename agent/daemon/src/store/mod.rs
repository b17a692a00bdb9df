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

/// What `READY` holds: the ready checkpoint (none after [`CheckpointStore::clear_ready`])
/// and the visibility bound. Written as `NAME\nbound N\n`; a pointer of an older store holds
/// only the name, whose sequence number is then the bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Pointer {
    name: Option<String>,
    bound: u64,
}

impl Pointer {
    fn parse(text: &str) -> Pointer {
        let mut lines = text.lines();
        let name = lines
            .next()
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_string);
        let written = lines
            .filter_map(|l| l.trim().strip_prefix("bound "))
            .find_map(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let bound = written.max(name.as_deref().and_then(parse_seq).unwrap_or(0));
        Pointer { name, bound }
    }

    fn text(&self) -> String {
        format!(
            "{}\nbound {}\n",
            self.name.as_deref().unwrap_or(""),
            self.bound
        )
    }
}

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
    ///
    /// Errors: [`StoreError::DanglingReady`] when it names a checkpoint without a manifest.
    pub fn ready(&self) -> Result<Option<String>, StoreError> {
        match self.pointer()?.name {
            Some(name) if self.dir.join(&name).join(MANIFEST).is_file() => Ok(Some(name)),
            Some(name) => Err(StoreError::DanglingReady(name)),
            None => Ok(None),
        }
    }

    /// The visibility bound: checkpoints with a sequence number above it are leftovers of
    /// an interrupted publication.
    pub fn bound(&self) -> Result<u64, StoreError> {
        Ok(self.pointer()?.bound)
    }

    /// `READY` as it is (an absent file: no checkpoint, bound 0).
    fn pointer(&self) -> Result<Pointer, StoreError> {
        let p = self.dir.join(READY);
        match fs::read_to_string(&p) {
            Ok(s) => Ok(Pointer::parse(&s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Pointer::default()),
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
    /// Published checkpoints above the bound (a crash before their pointer moved) are
    /// removed first: the new checkpoint's sequence number must not make them visible.
    pub fn begin(&self, prefix: u64) -> Result<Staging, StoreError> {
        let names = self.published_names()?;
        let bound = self.bound()?;
        if names.last().is_some_and(|(s, _)| *s > bound) {
            self.discard_invisible()?;
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

    /// Atomically points `READY` at `name` (write temp, fsync, rename, fsync dir); the bound
    /// rises to `name`'s sequence number when that is higher, and never falls (an earlier
    /// checkpoint made ready keeps the later ones visible).
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
        let bound = previous
            .as_deref()
            .map(|p| Pointer::parse(p).bound)
            .unwrap_or(0)
            .max(parse_seq(name).unwrap_or(0));
        let next = Pointer {
            name: Some(name.to_string()),
            bound,
        };
        match self.write_pointer(Some(&next.text())) {
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

    /// Makes `READY` hold `text` (`None`: removes it), durably. An error comes with whether
    /// the pointer changed before it.
    fn write_pointer(&self, text: Option<&str>) -> Result<(), (bool, StoreError)> {
        let ready = self.dir.join(READY);
        match text {
            Some(text) => {
                let tmp = self.dir.join(".READY.tmp");
                let written =
                    fs::File::create(&tmp)
                        .map_err(io("create", &tmp))
                        .and_then(|mut f| {
                            f.write_all(text.as_bytes()).map_err(io("write", &tmp))?;
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

    /// Makes no checkpoint ready (the sandbox then restarts from its base image); the bound
    /// stays, so the remaining checkpoints stay visible.
    pub fn clear_ready(&self) -> Result<(), StoreError> {
        let next = Pointer {
            name: None,
            bound: self.bound()?,
        };
        self.write_pointer(Some(&next.text())).map_err(|(_, e)| e)
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

    /// Name of the visible checkpoint of action boundary `prefix` that a restore to `prefix`
    /// uses: the latest one on the ready checkpoint's own line (it or its ancestors), else
    /// the latest one of any branch; `None` when there is none.
    pub fn visible_of_prefix(&self, prefix: u64) -> Result<Option<String>, StoreError> {
        if let Some(ready) = self.ready()? {
            if let Some(own) = self
                .ancestry(&ready)
                .into_iter()
                .find(|m| m.prefix == prefix)
            {
                return Ok(Some(own.checkpoint));
            }
        }
        let bound = self.bound()?;
        Ok(self
            .published_names()?
            .into_iter()
            .filter(|(seq, name)| *seq <= bound && parse_prefix(name) == Some(prefix))
            .filter(|(_, name)| self.dir.join(name).join(MANIFEST).is_file())
            .map(|(_, name)| name)
            .next_back())
    }

    /// The manifests of `name` and its ancestors, `name` first, as far as their manifests
    /// can be read (a removed or unreadable one ends the line). Parents always have lower
    /// sequence numbers; a manifest naming a later one ends the line too, so a damaged store
    /// cannot make this loop.
    pub fn ancestry(&self, name: &str) -> Vec<Manifest> {
        let mut line: Vec<Manifest> = Vec::new();
        let mut next = Some(name.to_string());
        while let Some(current) = next.take() {
            let Ok(m) = self.load(&current) else { break };
            if line.last().is_some_and(|child| m.seq >= child.seq) {
                break;
            }
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
