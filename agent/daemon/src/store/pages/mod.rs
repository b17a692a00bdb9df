//! Content-addressed memory images (paper: "Environment-state recovery", R_k; checkpoint
//! format 3): CRIU's `pages-<n>.img` files, which hold the dumped memory pages back to back,
//! are not kept in the checkpoint. Each is cut into pages and every page is looked up by its
//! blake3 among the pages of the checkpoint's parent (the previous checkpoint of its
//! branch) and of the files already split: a page found there is referred to, a new one is
//! appended to the file's **page pack**, an uncompressed blob of the node's blob store. The
//! checkpoint keeps a page map `pages-<n>.pmap` per file ([`format`]), an artifact like
//! every other image, and the manifest lists the packs ([`MemoryImages`]), which keeps them
//! alive for the blob collection. A second checkpoint of a sandbox that dirtied 1% of its
//! memory stores about 1% of the pages, plus 40 bytes of map per page.
//!
//! A restore gives CRIU an images dir ([`assemble`]) with R_k's other files hard-linked and
//! each pages file that is one whole pack (a first checkpoint's, memory that all changed)
//! hard-linked to it, the others rebuilt from the packs over runs of consecutive pages. The packs are
//! verified by the restore's verifier (each hashed against its id) before CRIU runs.
//!
//! Pages are deduplicated within one branch's lineage (the parent's pages, which include
//! its ancestors' that it still holds) and within a checkpoint, never against another
//! sandbox's, so one sandbox's memory is never read to build another's images; forks share
//! packs because they copy their source's checkpoint.

pub mod assemble;
pub mod format;
pub mod split;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use assemble::{assemble, linkable_bytes, AssembleStats};
pub use format::{PageMap, PageMapError, PageRef};
pub use split::{split_against_parent, split_pages, PageIndex};

/// Suffix of a page map artifact (`criu/pages-<n>.pmap`).
pub const MAP_SUFFIX: &str = ".pmap";

/// What a checkpoint's manifest records of its content-addressed memory images.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryImages {
    /// Page size, bytes.
    pub page_size: u32,
    /// Pages in R_k's pages files.
    pub pages: u64,
    /// Of those, pages not found in the parent (nor earlier in this checkpoint): stored anew.
    pub new_pages: u64,
    /// Bytes the blob store grew by for them.
    pub new_bytes: u64,
    /// Every pack a page map of this checkpoint refers to (blob ids, hex), sorted.
    pub packs: Vec<String>,
}

impl MemoryImages {
    /// Bytes of the pages files (what CRIU reads at restore).
    pub fn bytes(&self) -> u64 {
        self.pages * u64::from(self.page_size)
    }

    /// The packs as blob ids; a malformed id is skipped (the checkpoint's restore then
    /// fails on the map that names it, as for a missing pack).
    pub fn pack_ids(&self) -> impl Iterator<Item = belayer_overlay::layer::BlobId> + '_ {
        self.packs
            .iter()
            .filter_map(|h| belayer_overlay::layer::BlobId::from_hex(h))
    }
}

/// `pages-<n>.img` → `pages-<n>`; `None` for other names.
pub fn pages_stem(name: &str) -> Option<&str> {
    let stem = name.strip_suffix(".img")?;
    let n = stem.strip_prefix("pages-")?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some(stem)
}

/// Why content-addressing or assembling memory images failed.
#[derive(Debug, thiserror::Error)]
pub enum PageError {
    /// A file operation on the images failed.
    #[error("memory images: {op} {path} failed")]
    Io {
        /// What was attempted.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The blob store failed (a pack could not be written, found or copied).
    #[error("memory images: page pack")]
    Blob(#[from] belayer_overlay::layer::BlobError),
    /// A page map does not decode.
    #[error("page map {path}")]
    Map {
        /// The map.
        path: PathBuf,
        /// Why.
        #[source]
        source: PageMapError,
    },
    /// A page map was written with another page size than this system's.
    #[error("page map {path} has {found}-byte pages, this system {system}")]
    PageSize {
        /// The map.
        path: PathBuf,
        /// Its page size.
        found: u32,
        /// The system's.
        system: u32,
    },
    /// A page map names a pack the manifest does not list.
    #[error("page map {path} names pack {pack}, which the manifest does not list")]
    UnlistedPack {
        /// The map.
        path: PathBuf,
        /// The pack.
        pack: String,
    },
}

fn io(op: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> PageError {
    let path = path.to_path_buf();
    move |source| PageError::Io { op, path, source }
}

/// The system's page size, bytes.
pub fn system_page_size() -> u32 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|n| u32::try_from(n).ok())
        .unwrap_or(4096)
}

#[cfg(test)]
mod tests;
