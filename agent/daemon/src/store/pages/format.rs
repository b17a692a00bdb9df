//! The page map `pages-<n>.pmap`: where each page of CRIU's `pages-<n>.img` lies in the
//! node's page packs, and its blake3.
//!
//! Layout (little endian): [`MAGIC`] (8 bytes), version `u32` ([`VERSION`]), page size
//! `u32` (bytes), pack count `u32`, page count `u64`; then each pack's blob id (32 bytes);
//! then per page, in the order of the pages file: pack index `u32`, page index within that
//! pack `u32`, blake3 of the page (32 bytes). The file's length is exactly that: a decoder
//! given anything else refuses it.

use belayer_overlay::layer::BlobId;

/// First bytes of a page map.
pub const MAGIC: &[u8; 8] = b"BLPGMAP\0";
/// Page map format version.
pub const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 4 + 4 + 8;
const PACK_BYTES: usize = 32;
const PAGE_BYTES: usize = 4 + 4 + 32;

/// One page of a pages file: `page` is its index in pack `pack` (an index into
/// [`PageMap::packs`]), `hash` the blake3 of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRef {
    /// Index into [`PageMap::packs`].
    pub pack: u32,
    /// Page index within the pack (byte offset = `page` × page size).
    pub page: u32,
    /// blake3 of the page.
    pub hash: [u8; 32],
}

/// A decoded page map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageMap {
    /// Page size, bytes (the system's when written).
    pub page_size: u32,
    /// The packs the pages lie in.
    pub packs: Vec<BlobId>,
    /// The pages, in the order of the pages file.
    pub pages: Vec<PageRef>,
}

/// Why a page map does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageMapError {
    /// It does not start with [`MAGIC`] or is shorter than its header.
    #[error("not a page map")]
    NotAPageMap,
    /// Another format version.
    #[error("page map version {found} (supported: {VERSION})")]
    Version {
        /// The version found.
        found: u32,
    },
    /// The page size is not a power of two between 4 KiB and 64 KiB.
    #[error("page size {0} bytes")]
    PageSize(u32),
    /// The length does not match the counts of the header.
    #[error("{found} bytes, the header's counts need {expected}")]
    Length {
        /// Bytes found.
        found: u64,
        /// Bytes the counts need.
        expected: u64,
    },
    /// A page names a pack past the pack table.
    #[error("page {page} names pack {pack} of {packs}")]
    PackIndex {
        /// The page's index in the file.
        page: u64,
        /// The pack index it names.
        pack: u32,
        /// Packs in the table.
        packs: u32,
    },
}

impl PageMap {
    /// Bytes of the pages file this map describes.
    pub fn file_bytes(&self) -> u64 {
        self.pages.len() as u64 * u64::from(self.page_size)
    }

    /// Encodes the map (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEADER + self.packs.len() * PACK_BYTES + self.pages.len() * PAGE_BYTES,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.page_size.to_le_bytes());
        out.extend_from_slice(&(self.packs.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.pages.len() as u64).to_le_bytes());
        for p in &self.packs {
            out.extend_from_slice(&p.0);
        }
        for p in &self.pages {
            out.extend_from_slice(&p.pack.to_le_bytes());
            out.extend_from_slice(&p.page.to_le_bytes());
            out.extend_from_slice(&p.hash);
        }
        out
    }

    /// Decodes and checks a map: exact length, known version, sane page size, every pack
    /// index inside the table. Allocation is bounded by `bytes.len()`.
    ///
    /// Errors: [`PageMapError`].
    pub fn decode(bytes: &[u8]) -> Result<PageMap, PageMapError> {
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(PageMapError::NotAPageMap);
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or([0; 4]));
        let version = u32_at(8);
        if version != VERSION {
            return Err(PageMapError::Version { found: version });
        }
        let page_size = u32_at(12);
        if !page_size.is_power_of_two() || !(4096..=65536).contains(&page_size) {
            return Err(PageMapError::PageSize(page_size));
        }
        let packs = u32_at(16);
        let pages = u64::from_le_bytes(bytes[20..28].try_into().unwrap_or([0; 8]));
        let expected = (HEADER as u64)
            .saturating_add(u64::from(packs).saturating_mul(PACK_BYTES as u64))
            .saturating_add(pages.saturating_mul(PAGE_BYTES as u64));
        if expected != bytes.len() as u64 {
            return Err(PageMapError::Length {
                found: bytes.len() as u64,
                expected,
            });
        }
        let mut at = HEADER;
        let mut table = Vec::with_capacity(packs as usize);
        for _ in 0..packs {
            table.push(BlobId(bytes[at..at + 32].try_into().unwrap_or([0; 32])));
            at += PACK_BYTES;
        }
        let mut refs = Vec::with_capacity(pages as usize);
        for i in 0..pages {
            let pack = u32_at(at);
            if pack >= packs {
                return Err(PageMapError::PackIndex {
                    page: i,
                    pack,
                    packs,
                });
            }
            refs.push(PageRef {
                pack,
                page: u32_at(at + 4),
                hash: bytes[at + 8..at + 40].try_into().unwrap_or([0; 32]),
            });
            at += PAGE_BYTES;
        }
        Ok(PageMap {
            page_size,
            packs: table,
            pages: refs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> PageMap {
        PageMap {
            page_size: 4096,
            packs: vec![BlobId([1; 32]), BlobId([2; 32])],
            pages: vec![
                PageRef {
                    pack: 0,
                    page: 0,
                    hash: [7; 32],
                },
                PageRef {
                    pack: 1,
                    page: 3,
                    hash: [8; 32],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(PageMap::decode(&m.encode()).unwrap(), m);
        assert_eq!(m.file_bytes(), 8192);
    }

    #[test]
    fn hostile_maps_are_refused() {
        let good = sample().encode();
        assert_eq!(PageMap::decode(&good[..10]), Err(PageMapError::NotAPageMap));
        let mut v = good.clone();
        v[8] = 9;
        assert_eq!(PageMap::decode(&v), Err(PageMapError::Version { found: 9 }));
        let mut v = good.clone();
        v[12..16].copy_from_slice(&3000u32.to_le_bytes());
        assert_eq!(PageMap::decode(&v), Err(PageMapError::PageSize(3000)));
        // A huge page count must not allocate: the length check comes first.
        let mut v = good.clone();
        v[20..28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            PageMap::decode(&v),
            Err(PageMapError::Length { .. })
        ));
        let mut v = good.clone();
        v[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            PageMap::decode(&v),
            Err(PageMapError::Length { .. })
        ));
        let mut v = good.clone();
        let first_page = HEADER + 2 * PACK_BYTES;
        v[first_page..first_page + 4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            PageMap::decode(&v),
            Err(PageMapError::PackIndex {
                page: 0,
                pack: 2,
                packs: 2
            })
        );
        v.push(0);
        assert!(matches!(
            PageMap::decode(&v),
            Err(PageMapError::Length { .. })
        ));
    }
}
