//! The few CRIU messages the path check needs, decoded by field number.
//!
//! Field table (CRIU 4.x, `images/*.proto`; numbers and types only, every other field is
//! skipped). Strings are kept as bytes: file names need not be UTF-8.
//!
//! - `files.img` (type magic `0x56303138`), file entry: 1 `type` (enum: 1 regular file,
//!   5 unix socket), 2 `id`, 3 `reg` (regular-file message), 16 `usk` (unix-socket message).
//! - regular file (nested): 1 `id`, 2 `flags` (open flags), 6 `name` (path from the mount
//!   namespace root, with a leading `/`), 7 `mnt_id` (`sint32`, default -1).
//! - unix socket (nested): 1 `id`, 3 `type` (`SOCK_*`), 4 `state` (TCP-style), 6 `uflags`
//!   (bit 0: external), 11 `name` (bytes; abstract when it starts with NUL), 14 `name_dir`
//!   (dir of a relative name), 15 `deleted`, 17 `mnt_id` (`sint32`).
//! - `remap-fpath.img` (`0x59133954`), remap: 1 `orig_id` (a regular-file id), 2 `remap_id`,
//!   3 `remap_type` (0 linked, 1 ghost, 2 procfs; absent: ghost when bit 31 of `remap_id` is
//!   set, then cleared).
//! - `ghost-file-<id in hex>.img` (`0x52583605`), first entry, ghost file: 3 `mode`
//!   (`st_mode`), 6 `rdev`.
//! - `mountpoints-<ns id>.img` (`0x55563928`), mount: 1 `fstype` (enum: 1 proc, 3 devtmpfs,
//!   5 tmpfs, 17 overlayfs, ...), 2 `mnt_id`, 3 `root_dev`, 4 `parent_mnt_id`, 6 `root` (path
//!   inside its file system), 7 `mountpoint` (path from the namespace root), 12 `with_plugin`,
//!   13 `ext_mount`, 16 `deleted`, 18 `ext_key`.

use super::wire::{Fields, Value, WireError};

/// `files.img` type magic.
pub(crate) const FILES_MAGIC: u32 = 0x5630_3138;
/// `remap-fpath.img` type magic.
pub(crate) const REMAP_FPATH_MAGIC: u32 = 0x5913_3954;
/// `ghost-file-*.img` type magic.
pub(crate) const GHOST_FILE_MAGIC: u32 = 0x5258_3605;
/// `mountpoints-*.img` type magic.
pub(crate) const MNTS_MAGIC: u32 = 0x5556_3928;

/// File entry type of a regular file (`FD_TYPES__REG`).
const FD_TYPE_REG: u32 = 1;
/// File entry type of a unix socket (`FD_TYPES__UNIXSK`).
const FD_TYPE_UNIXSK: u32 = 5;
/// Bit 31 of a legacy `remap_id`: a ghost remap (`REMAP_GHOST`).
const LEGACY_REMAP_GHOST: u32 = 1 << 31;

/// Mount `fstype` values this check models.
pub(crate) const FSTYPE_PROC: u32 = 1;
pub(crate) const FSTYPE_TMPFS: u32 = 5;

/// A regular file (or directory, fifo, device) CRIU reopens by path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RegFile {
    pub id: u32,
    pub flags: u32,
    pub name: Vec<u8>,
    pub mnt_id: i32,
}

/// A unix socket; only path-bound ones matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UnixSk {
    pub id: u32,
    pub sk_type: u32,
    pub state: u32,
    pub uflags: u32,
    pub name: Vec<u8>,
    pub name_dir: Option<Vec<u8>>,
    pub deleted: bool,
    pub mnt_id: i32,
}

/// What replaces a file that was not reachable by its name at dump time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RemapKind {
    /// A hard link CRIU made at dump time (`--link-remap`).
    Linked,
    /// The file's content is in `ghost-file-<id>.img`.
    Ghost,
    /// A `/proc/<pid>` of a dead task (restored with a helper task, no path).
    Procfs,
    /// A type this check does not know.
    Unknown(u32),
}

/// One `remap-fpath.img` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remap {
    pub orig_id: u32,
    pub remap_id: u32,
    pub kind: RemapKind,
}

/// The head of a ghost-file image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ghost {
    pub mode: u32,
    pub rdev: Option<u32>,
}

/// One mount of the dumped mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mnt {
    pub fstype: u32,
    pub mnt_id: u32,
    pub root_dev: u32,
    pub parent_mnt_id: u32,
    pub root: Vec<u8>,
    pub mountpoint: Vec<u8>,
    pub external: bool,
    pub deleted: bool,
}

/// What `files.img` holds that this check uses.
#[derive(Debug, Default)]
pub(crate) struct Files {
    pub regs: Vec<RegFile>,
    pub unix: Vec<UnixSk>,
}

fn missing(offset: u64, what: &'static str) -> WireError {
    WireError { offset, what }
}

fn bad(offset: u64) -> WireError {
    missing(offset, "field has the wrong wire type")
}

/// Decodes one `files.img` entry into `out`.
pub(crate) fn file_entry(msg: &[u8], base: u64, out: &mut Files) -> Result<(), WireError> {
    let mut ty = None;
    let mut reg = None;
    let mut usk = None;
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        match n {
            1 => ty = Some(v.u32().ok_or_else(|| bad(at))?),
            3 => reg = Some((v.bytes().ok_or_else(|| bad(at))?, at)),
            16 => usk = Some((v.bytes().ok_or_else(|| bad(at))?, at)),
            _ => {}
        }
    }
    match ty {
        Some(FD_TYPE_REG) => {
            let (m, at) =
                reg.ok_or_else(|| missing(base, "regular file entry without its message"))?;
            out.regs.push(reg_file(m, at)?);
        }
        Some(FD_TYPE_UNIXSK) => {
            let (m, at) =
                usk.ok_or_else(|| missing(base, "unix socket entry without its message"))?;
            out.unix.push(unix_sk(m, at)?);
        }
        Some(_) => {}
        None => return Err(missing(base, "file entry without a type")),
    }
    Ok(())
}

fn reg_file(msg: &[u8], base: u64) -> Result<RegFile, WireError> {
    let (mut id, mut flags, mut name, mut mnt_id) = (None, 0, None, -1);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        match n {
            1 => id = Some(v.u32().ok_or_else(|| bad(at))?),
            2 => flags = v.u32().ok_or_else(|| bad(at))?,
            6 => name = Some(v.bytes().ok_or_else(|| bad(at))?.to_vec()),
            7 => mnt_id = v.sint32().ok_or_else(|| bad(at))?,
            _ => {}
        }
    }
    Ok(RegFile {
        id: id.ok_or_else(|| missing(base, "regular file without an id"))?,
        flags,
        name: name.ok_or_else(|| missing(base, "regular file without a name"))?,
        mnt_id,
    })
}

fn unix_sk(msg: &[u8], base: u64) -> Result<UnixSk, WireError> {
    let mut sk = UnixSk {
        id: 0,
        sk_type: 0,
        state: 0,
        uflags: 0,
        name: Vec::new(),
        name_dir: None,
        deleted: false,
        mnt_id: -1,
    };
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        let num = |v: Value<'_>| v.u32().ok_or_else(|| bad(at));
        match n {
            1 => sk.id = num(v)?,
            3 => sk.sk_type = num(v)?,
            4 => sk.state = num(v)?,
            6 => sk.uflags = num(v)?,
            11 => sk.name = v.bytes().ok_or_else(|| bad(at))?.to_vec(),
            14 => sk.name_dir = Some(v.bytes().ok_or_else(|| bad(at))?.to_vec()),
            15 => sk.deleted = v.bool().ok_or_else(|| bad(at))?,
            17 => sk.mnt_id = v.sint32().ok_or_else(|| bad(at))?,
            _ => {}
        }
    }
    Ok(sk)
}

/// Decodes one `remap-fpath.img` entry.
pub(crate) fn remap(msg: &[u8], base: u64) -> Result<Remap, WireError> {
    let (mut orig, mut rid, mut ty) = (None, None, None);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        match n {
            1 => orig = Some(v.u32().ok_or_else(|| bad(at))?),
            2 => rid = Some(v.u32().ok_or_else(|| bad(at))?),
            3 => ty = Some(v.u32().ok_or_else(|| bad(at))?),
            _ => {}
        }
    }
    let orig_id = orig.ok_or_else(|| missing(base, "remap without orig_id"))?;
    let mut remap_id = rid.ok_or_else(|| missing(base, "remap without remap_id"))?;
    let kind = match ty {
        Some(0) => RemapKind::Linked,
        Some(1) => RemapKind::Ghost,
        Some(2) => RemapKind::Procfs,
        Some(t) => RemapKind::Unknown(t),
        // Images of old CRIUs: the ghost bit lives in the id.
        None if remap_id & LEGACY_REMAP_GHOST != 0 => {
            remap_id &= !LEGACY_REMAP_GHOST;
            RemapKind::Ghost
        }
        None => RemapKind::Linked,
    };
    Ok(Remap {
        orig_id,
        remap_id,
        kind,
    })
}

/// Decodes the first entry of a ghost-file image.
pub(crate) fn ghost(msg: &[u8], base: u64) -> Result<Ghost, WireError> {
    let (mut mode, mut rdev) = (None, None);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        match n {
            3 => mode = Some(v.u32().ok_or_else(|| bad(at))?),
            6 => rdev = Some(v.u32().ok_or_else(|| bad(at))?),
            _ => {}
        }
    }
    Ok(Ghost {
        mode: mode.ok_or_else(|| missing(base, "ghost file without a mode"))?,
        rdev,
    })
}

/// Decodes one `mountpoints-*.img` entry.
pub(crate) fn mnt(msg: &[u8], base: u64) -> Result<Mnt, WireError> {
    let mut m = Mnt {
        fstype: 0,
        mnt_id: 0,
        root_dev: 0,
        parent_mnt_id: 0,
        root: Vec::new(),
        mountpoint: Vec::new(),
        external: false,
        deleted: false,
    };
    let (mut have_id, mut have_mp) = (false, false);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        let at = it.offset();
        let num = |v: Value<'_>| v.u32().ok_or_else(|| bad(at));
        match n {
            1 => m.fstype = num(v)?,
            2 => {
                m.mnt_id = num(v)?;
                have_id = true;
            }
            3 => m.root_dev = num(v)?,
            4 => m.parent_mnt_id = num(v)?,
            6 => m.root = v.bytes().ok_or_else(|| bad(at))?.to_vec(),
            7 => {
                m.mountpoint = v.bytes().ok_or_else(|| bad(at))?.to_vec();
                have_mp = true;
            }
            12 | 13 => m.external |= v.bool().ok_or_else(|| bad(at))?,
            16 => m.deleted = v.bool().ok_or_else(|| bad(at))?,
            18 => m.external = true,
            _ => {}
        }
    }
    if !have_id || !have_mp {
        return Err(missing(base, "mount without mnt_id or mountpoint"));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::enc;

    #[test]
    fn regular_file_and_socket_entries() {
        let reg = enc(&[
            (1, Ok(9)),
            (2, Ok(0o100000)),
            (6, Err(b"/tmp/d/f")),
            (7, Ok(228)),
        ]);
        let sk = enc(&[
            (1, Ok(4)),
            (3, Ok(1)),
            (4, Ok(10)),
            (11, Err(b"/tmp/s")),
            (15, Ok(1)),
        ]);
        let mut files = Files::default();
        file_entry(
            &enc(&[(1, Ok(1)), (2, Ok(9)), (3, Err(&reg))]),
            0,
            &mut files,
        )
        .unwrap();
        file_entry(
            &enc(&[(1, Ok(5)), (2, Ok(4)), (16, Err(&sk))]),
            0,
            &mut files,
        )
        .unwrap();
        file_entry(&enc(&[(1, Ok(2)), (2, Ok(7))]), 0, &mut files).unwrap(); // a pipe
        assert_eq!(
            files.regs,
            vec![RegFile {
                id: 9,
                flags: 0o100000,
                name: b"/tmp/d/f".to_vec(),
                mnt_id: 114
            }]
        );
        assert_eq!(files.unix.len(), 1);
        assert!(files.unix[0].deleted);
        assert_eq!(files.unix[0].name, b"/tmp/s");
        assert_eq!(files.unix[0].mnt_id, -1);
    }

    #[test]
    fn remap_types_and_the_legacy_ghost_bit() {
        let r = remap(&enc(&[(1, Ok(9)), (2, Ok(1)), (3, Ok(1))]), 0).unwrap();
        assert_eq!(r.kind, RemapKind::Ghost);
        let r = remap(&enc(&[(1, Ok(9)), (2, Ok(0x8000_0003))]), 0).unwrap();
        assert_eq!((r.kind, r.remap_id), (RemapKind::Ghost, 3));
        let r = remap(&enc(&[(1, Ok(9)), (2, Ok(3))]), 0).unwrap();
        assert_eq!(r.kind, RemapKind::Linked);
        assert!(remap(&enc(&[(1, Ok(9))]), 0).is_err());
    }

    #[test]
    fn mounts_flag_external_ones() {
        let m = mnt(
            &enc(&[
                (1, Ok(5)),
                (2, Ok(70)),
                (3, Ok(69)),
                (4, Ok(114)),
                (6, Err(b"/")),
                (7, Err(b"/dev")),
            ]),
            0,
        )
        .unwrap();
        assert_eq!((m.fstype, m.mnt_id, m.root_dev), (FSTYPE_TMPFS, 70, 69));
        assert!(!m.external);
        let m = mnt(&enc(&[(2, Ok(1)), (7, Err(b"/x")), (18, Err(b"key"))]), 0).unwrap();
        assert!(m.external);
        assert!(mnt(&enc(&[(2, Ok(1))]), 0).is_err());
    }

    #[test]
    fn wrong_wire_types_are_errors() {
        let reg = enc(&[(1, Err(b"x"))]);
        let mut files = Files::default();
        assert!(file_entry(&enc(&[(1, Ok(1)), (3, Err(&reg))]), 0, &mut files).is_err());
        assert!(ghost(&enc(&[(3, Err(b"x"))]), 0).is_err());
    }
}
