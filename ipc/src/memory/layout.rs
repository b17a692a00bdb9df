//! Layout files: the named regions a memory server allocates and the hash both sides agree on.
//!
//! A layout is a TOML file with a list of named regions (sizes in bytes) and/or one KV-cache
//! arena (block size in bytes and block count):
//!
//! ```toml
//! [[region]]
//! name = "embed"
//! size = 1048576        # bytes
//!
//! [[region]]
//! name = "layers"
//! size = 8589934592
//!
//! [kv]                  # optional; required for a server of role "kv"
//! name = "kv"           # optional, default "kv"
//! block_size = 65536    # bytes per block
//! block_count = 4096
//! ```
//!
//! Unknown keys are refused. [`Layout::validate_for`] checks names (`[A-Za-z0-9._-]`, 1 to
//! [`MAX_NAME_LEN`] bytes, unique), sizes (non-zero, no overflow), the number of regions (at most
//! [`MAX_REGIONS`]) and the role (a weights layout has regions and no arena, a KV layout has an
//! arena).
//!
//! The **layout hash** is the BLAKE3 hash of the canonical text of the layout
//! ([`Layout::canonical`]), as 64 lowercase hex digits. It depends only on the regions (order,
//! names, sizes) and the arena geometry, not on the TOML formatting or comments. A worker sends
//! the hash of its own copy of the layout when it attaches; a mismatch is refused.
//!
//! Placement ([`Layout::place`]): the regions, then the arena, lie back to back in one address
//! range, each starting at a multiple of the backend's granularity (the page size for host
//! memory, `cuMemGetAllocationGranularity` for CUDA) and occupying its size rounded up to it.
//! Workers map the whole layout into one reservation of [`Placement::total`] bytes, so every
//! region sits at `base + offset` (paper: "State isolation").

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Most regions (the KV arena included) one layout may hold.
pub const MAX_REGIONS: usize = 4096;

/// Longest region name, bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Name of the KV arena when the layout does not give one.
pub const DEFAULT_KV_NAME: &str = "kv";

/// What a memory server holds (paper: weight servers and KV-cache servers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    /// Model weights: read by workers, written by the weight-update path, versioned.
    Weights,
    /// The KV-cache arena: written by the serving worker, flushed on handover.
    Kv,
}

impl Role {
    /// `"weights"` or `"kv"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Weights => "weights",
            Role::Kv => "kv",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = LayoutError;

    /// Parses `"weights"` or `"kv"`.
    fn from_str(s: &str) -> Result<Role, LayoutError> {
        match s {
            "weights" => Ok(Role::Weights),
            "kv" => Ok(Role::Kv),
            other => Err(LayoutError::UnknownRole {
                role: other.to_owned(),
            }),
        }
    }
}

/// Why a layout could not be read, parsed or accepted.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// Reading the layout file failed.
    #[error("reading layout file {path} failed")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown or missing keys.
    #[error("parsing the layout failed")]
    Parse {
        /// The TOML error.
        #[source]
        source: toml::de::Error,
    },
    /// The layout has neither regions nor a KV arena.
    #[error("the layout has no regions and no kv arena")]
    Empty,
    /// More regions than [`MAX_REGIONS`].
    #[error("the layout has {count} regions, more than the {MAX_REGIONS} allowed")]
    TooManyRegions {
        /// Number of regions, the arena included.
        count: usize,
    },
    /// A name is empty, too long or holds a character outside `[A-Za-z0-9._-]`.
    #[error("region name {name:?} is invalid (1 to {MAX_NAME_LEN} bytes of [A-Za-z0-9._-])")]
    BadName {
        /// The name.
        name: String,
    },
    /// Two regions share a name.
    #[error("region name {name:?} is used twice")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A region or the arena has size 0, a zero block size or a zero block count.
    #[error("region {name:?} has a zero size, block size or block count")]
    ZeroSize {
        /// The name.
        name: String,
    },
    /// A size, or the sum of the placed sizes, does not fit in 64 bits.
    #[error("the size of region {name:?} overflows 64 bits once placed")]
    SizeOverflow {
        /// The region where the overflow happened.
        name: String,
    },
    /// The granularity given to [`Layout::place`] is not a power of two.
    #[error("granularity {granularity} is not a power of two")]
    BadGranularity {
        /// The granularity, bytes.
        granularity: u64,
    },
    /// A role name other than `weights` or `kv`.
    #[error("unknown role {role:?} (expected \"weights\" or \"kv\")")]
    UnknownRole {
        /// The text given.
        role: String,
    },
    /// A weights layout with a KV arena, or a KV layout without one.
    #[error("a {role} layout {requirement}")]
    RoleMismatch {
        /// The server role.
        role: Role,
        /// What the role requires.
        requirement: &'static str,
    },
}

/// One named region of a layout file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionSpec {
    /// Region name, `[A-Za-z0-9._-]{1,128}`.
    pub name: String,
    /// Size in bytes (> 0).
    pub size: u64,
}

/// The KV-cache arena of a layout file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvArenaSpec {
    /// Region name of the arena (default [`DEFAULT_KV_NAME`]).
    #[serde(default = "default_kv_name")]
    pub name: String,
    /// Bytes per block (> 0).
    pub block_size: u64,
    /// Number of blocks (> 0).
    pub block_count: u64,
}

fn default_kv_name() -> String {
    DEFAULT_KV_NAME.to_owned()
}

/// A parsed layout file (see the module docs for the format).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Named regions, in file order.
    #[serde(default, rename = "region")]
    pub regions: Vec<RegionSpec>,
    /// The KV-cache arena, placed after the regions.
    #[serde(default)]
    pub kv: Option<KvArenaSpec>,
}

/// What a region is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RegionKind {
    /// A plain named region (e.g. one weight tensor or a weights blob).
    Plain,
    /// The KV-cache arena: `block_count` blocks of `block_size` bytes.
    KvArena {
        /// Bytes per block.
        block_size: u64,
        /// Number of blocks.
        block_count: u64,
    },
}

/// One region of a layout as placed in the layout's address range.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionPlacement {
    /// Region name.
    pub name: String,
    /// Plain region or KV arena.
    pub kind: RegionKind,
    /// Offset of the region from the start of the layout, bytes (a multiple of the
    /// granularity).
    pub offset: u64,
    /// Size asked for by the layout, bytes.
    pub size: u64,
    /// Size allocated and mapped: `size` rounded up to the granularity, bytes.
    pub mapped_size: u64,
}

/// A layout placed with a given granularity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The granularity used, bytes.
    pub granularity: u64,
    /// Regions in layout order (plain regions, then the arena).
    pub regions: Vec<RegionPlacement>,
    /// Bytes from the start of the first region to the end of the last one (the size of a
    /// worker's reservation).
    pub total: u64,
}

impl Layout {
    /// Reads, parses and validates (without a role) the layout file at `path`.
    ///
    /// Errors: [`LayoutError::Read`], then those of [`Layout::from_toml`].
    pub fn load(path: &Path) -> Result<Layout, LayoutError> {
        let text = std::fs::read_to_string(path).map_err(|source| LayoutError::Read {
            path: path.to_owned(),
            source,
        })?;
        Layout::from_toml(&text)
    }

    /// Parses and validates (without a role) a layout from TOML text.
    ///
    /// Errors: [`LayoutError::Parse`], then those of [`Layout::validate`].
    pub fn from_toml(text: &str) -> Result<Layout, LayoutError> {
        let layout: Layout =
            toml::from_str(text).map_err(|source| LayoutError::Parse { source })?;
        layout.validate()?;
        Ok(layout)
    }

    /// Checks names, sizes and the region count.
    ///
    /// Errors: [`LayoutError::Empty`], [`LayoutError::TooManyRegions`],
    /// [`LayoutError::BadName`], [`LayoutError::DuplicateName`], [`LayoutError::ZeroSize`],
    /// [`LayoutError::SizeOverflow`].
    pub fn validate(&self) -> Result<(), LayoutError> {
        let count = self.regions.len() + usize::from(self.kv.is_some());
        if count == 0 {
            return Err(LayoutError::Empty);
        }
        if count > MAX_REGIONS {
            return Err(LayoutError::TooManyRegions { count });
        }
        let mut seen = HashSet::new();
        for (name, size) in self.entries().map(|(name, _, size)| (name, size)) {
            if !valid_name(name) {
                return Err(LayoutError::BadName {
                    name: name.to_owned(),
                });
            }
            if !seen.insert(name) {
                return Err(LayoutError::DuplicateName {
                    name: name.to_owned(),
                });
            }
            if size == Some(0) {
                return Err(LayoutError::ZeroSize {
                    name: name.to_owned(),
                });
            }
            if size.is_none() {
                return Err(LayoutError::SizeOverflow {
                    name: name.to_owned(),
                });
            }
        }
        if let Some(kv) = &self.kv {
            if kv.block_size == 0 || kv.block_count == 0 {
                return Err(LayoutError::ZeroSize {
                    name: kv.name.clone(),
                });
            }
        }
        // Placement at the largest granularity any backend uses must not overflow either.
        self.place(1 << 30).map(drop)
    }

    /// [`validate`](Layout::validate), plus the rules of `role`: a weights layout has at least
    /// one region and no KV arena; a KV layout has a KV arena.
    ///
    /// Errors: those of `validate`, [`LayoutError::RoleMismatch`].
    pub fn validate_for(&self, role: Role) -> Result<(), LayoutError> {
        self.validate()?;
        match role {
            Role::Weights if self.kv.is_some() => Err(LayoutError::RoleMismatch {
                role,
                requirement: "must not have a kv arena",
            }),
            Role::Kv if self.kv.is_none() => Err(LayoutError::RoleMismatch {
                role,
                requirement: "needs a [kv] arena",
            }),
            _ => Ok(()),
        }
    }

    /// `(name, kind, size)` of every region in layout order; the size is `None` when the
    /// arena's `block_size * block_count` overflows.
    fn entries(&self) -> impl Iterator<Item = (&str, RegionKind, Option<u64>)> {
        let plain = self
            .regions
            .iter()
            .map(|r| (r.name.as_str(), RegionKind::Plain, Some(r.size)));
        let kv = self.kv.iter().map(|kv| {
            (
                kv.name.as_str(),
                RegionKind::KvArena {
                    block_size: kv.block_size,
                    block_count: kv.block_count,
                },
                kv.block_size.checked_mul(kv.block_count),
            )
        });
        plain.chain(kv)
    }

    /// The canonical text the layout hash is computed over: a first line
    /// `belayer-layout v1`, then one line per plain region `region <name> <size>`, then for the
    /// arena `kv <name> <block_size> <block_count>`, each ended by `\n`, sizes in decimal bytes.
    pub fn canonical(&self) -> String {
        let mut text = String::from("belayer-layout v1\n");
        for region in &self.regions {
            let _ = writeln!(text, "region {} {}", region.name, region.size);
        }
        if let Some(kv) = &self.kv {
            let _ = writeln!(text, "kv {} {} {}", kv.name, kv.block_size, kv.block_count);
        }
        text
    }

    /// The layout hash: BLAKE3 of [`canonical`](Layout::canonical), 64 lowercase hex digits.
    pub fn hash(&self) -> String {
        blake3::hash(self.canonical().as_bytes())
            .to_hex()
            .to_string()
    }

    /// Places the regions back to back, each at a multiple of `granularity` bytes and
    /// occupying its size rounded up to it (see the module docs).
    ///
    /// Errors: [`LayoutError::BadGranularity`] unless `granularity` is a power of two;
    /// [`LayoutError::SizeOverflow`] when a rounded size or the total exceeds `u64`.
    pub fn place(&self, granularity: u64) -> Result<Placement, LayoutError> {
        if !granularity.is_power_of_two() {
            return Err(LayoutError::BadGranularity { granularity });
        }
        let mut offset = 0u64;
        let mut regions = Vec::with_capacity(self.regions.len() + 1);
        for (name, kind, size) in self.entries() {
            let overflow = || LayoutError::SizeOverflow {
                name: name.to_owned(),
            };
            let size = size.ok_or_else(overflow)?;
            let mapped_size = size
                .checked_next_multiple_of(granularity)
                .ok_or_else(overflow)?;
            regions.push(RegionPlacement {
                name: name.to_owned(),
                kind,
                offset,
                size,
                mapped_size,
            });
            offset = offset.checked_add(mapped_size).ok_or_else(overflow)?;
        }
        Ok(Placement {
            granularity,
            regions,
            total: offset,
        })
    }
}

fn valid_name(name: &str) -> bool {
    crate::names::valid_name(name, MAX_NAME_LEN, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
        # two tensors and an arena
        [[region]]
        name = "embed"
        size = 5000

        [[region]]
        name = "layers.0"
        size = 8192

        [kv]
        block_size = 4096
        block_count = 3
    "#;

    #[test]
    fn a_layout_parses_places_and_hashes() {
        let layout = Layout::from_toml(SAMPLE).unwrap();
        assert_eq!(layout.regions.len(), 2);
        assert_eq!(layout.kv.as_ref().unwrap().name, "kv");
        let placement = layout.place(4096).unwrap();
        let offsets: Vec<_> = placement
            .regions
            .iter()
            .map(|r| (r.name.as_str(), r.offset, r.size, r.mapped_size))
            .collect();
        assert_eq!(
            offsets,
            vec![
                ("embed", 0, 5000, 8192),
                ("layers.0", 8192, 8192, 8192),
                ("kv", 16384, 12288, 12288)
            ]
        );
        assert_eq!(placement.total, 28672);
        assert_eq!(
            placement.regions[2].kind,
            RegionKind::KvArena {
                block_size: 4096,
                block_count: 3
            }
        );
        let big = layout.place(2 << 20).unwrap();
        assert_eq!(big.total, 3 * (2 << 20));
        assert_eq!(
            layout.canonical(),
            "belayer-layout v1\nregion embed 5000\nregion layers.0 8192\nkv kv 4096 3\n"
        );
        assert_eq!(layout.hash().len(), 64);
    }

    #[test]
    fn the_hash_ignores_formatting_but_not_content() {
        let a = Layout::from_toml(SAMPLE).unwrap();
        let b = Layout::from_toml(
            "kv = { name = \"kv\", block_size = 4096, block_count = 3 }\n\
             region = [{ name = \"embed\", size = 5000 }, { name = \"layers.0\", size = 8192 }]\n",
        )
        .unwrap();
        assert_eq!(a.hash(), b.hash());
        let mut c = a.clone();
        c.regions[0].size += 1;
        assert_ne!(a.hash(), c.hash());
        let mut d = a.clone();
        d.regions.swap(0, 1);
        assert_ne!(a.hash(), d.hash());
    }

    #[test]
    fn bad_layouts_give_typed_errors() {
        let err = |text: &str| Layout::from_toml(text).unwrap_err();
        assert!(matches!(err(""), LayoutError::Empty));
        assert!(matches!(
            err("[[region]]\nname = \"a\"\nsize = 1\ncolour = 3\n"),
            LayoutError::Parse { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"a\"\n"),
            LayoutError::Parse { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"a/b\"\nsize = 1\n"),
            LayoutError::BadName { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"\"\nsize = 1\n"),
            LayoutError::BadName { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"a\"\nsize = 1\n[[region]]\nname = \"a\"\nsize = 2\n"),
            LayoutError::DuplicateName { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"kv\"\nsize = 1\n[kv]\nblock_size = 1\nblock_count = 1\n"),
            LayoutError::DuplicateName { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"a\"\nsize = 0\n"),
            LayoutError::ZeroSize { .. }
        ));
        assert!(matches!(
            err("[kv]\nblock_size = 0\nblock_count = 4\n"),
            LayoutError::ZeroSize { .. }
        ));
        assert!(matches!(
            err("[kv]\nblock_size = 4294967296\nblock_count = 4294967296\n"),
            LayoutError::SizeOverflow { .. }
        ));
        assert!(matches!(
            err("[[region]]\nname = \"a\"\nsize = 9223372036854775807\n\
                 [[region]]\nname = \"b\"\nsize = 9223372036854775807\n"),
            LayoutError::SizeOverflow { .. }
        ));
        let many: String = (0..=MAX_REGIONS)
            .map(|i| format!("[[region]]\nname = \"r{i}\"\nsize = 1\n"))
            .collect();
        assert!(matches!(
            err(&many),
            LayoutError::TooManyRegions { count } if count == MAX_REGIONS + 1
        ));
        let layout = Layout::from_toml(SAMPLE).unwrap();
        assert!(matches!(
            layout.place(3000),
            Err(LayoutError::BadGranularity { granularity: 3000 })
        ));
    }

    #[test]
    fn roles_constrain_the_layout() {
        let with_kv = Layout::from_toml(SAMPLE).unwrap();
        with_kv.validate_for(Role::Kv).unwrap();
        assert!(matches!(
            with_kv.validate_for(Role::Weights),
            Err(LayoutError::RoleMismatch {
                role: Role::Weights,
                ..
            })
        ));
        let weights = Layout::from_toml("[[region]]\nname = \"w\"\nsize = 10\n").unwrap();
        weights.validate_for(Role::Weights).unwrap();
        assert!(matches!(
            weights.validate_for(Role::Kv),
            Err(LayoutError::RoleMismatch { role: Role::Kv, .. })
        ));
        assert_eq!("kv".parse::<Role>().unwrap(), Role::Kv);
        assert!(matches!(
            "gpu".parse::<Role>(),
            Err(LayoutError::UnknownRole { .. })
        ));
    }
}
