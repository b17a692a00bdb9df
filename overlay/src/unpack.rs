//! Reading tar members: the extension headers (PAX records, GNU long names and link targets)
//! in front of each member, the member's header, and the checks that turn them into a
//! [`Member`] for the tree builder, and the end-of-archive check of a stream. Shared by
//! [`install_upper`](crate::install_upper) (a seekable archive file),
//! [`install_image`](crate::install_image) and
//! [`install_oci_layer`](crate::install_oci_layer) (any stream).

use std::io::{self, Read};
use std::path::Path;

use tar::{Entries, Entry, EntryType, Header};

use crate::format::{
    parse_mtime, parse_pax_records, xattr_name_from_key, MAX_EXTENSION_BYTES, MAX_PATH_BYTES,
};
use crate::tree::{
    check_symlink_target, check_xattr, lossy, name_error, parse_hardlink_target, parse_name,
    path_of, InstallError, Member, MemberKind, RegularData,
};

/// Where the content of regular members is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Content {
    /// At its offset in the (seekable) archive file: [`RegularData::Archive`].
    Seek,
    /// From the member's own reader, in stream order: [`RegularData::Stream`].
    Stream,
}

/// Reads every member of `entries`, with the extension headers in front of it, and hands
/// each decoded, checked member to `visit` with its tar entry (the reader of its content).
/// Returns where the end-of-archive marker should start (the end of the last member's
/// content, rounded up to a block), in bytes from the start of the archive. `archive` names
/// it in errors.
///
/// Errors: [`InstallError`] for an unreadable stream, misplaced, duplicate or oversized
/// extension headers, and every rejection of [`parse_member`]; what `visit` returns.
pub(crate) fn for_each_member<'a, R: Read + 'a>(
    entries: Entries<'a, R>,
    archive: &Path,
    content: Content,
    mut visit: impl FnMut(Member, &mut Entry<'a, R>) -> Result<(), InstallError>,
) -> Result<u64, InstallError> {
    let read_err = |source| InstallError::ReadArchive {
        path: archive.to_path_buf(),
        source,
    };
    let mut pending = Extensions::default();
    let mut end = 0u64;
    for entry in entries.raw(true) {
        let mut entry = entry.map_err(read_err)?;
        let offset = entry.raw_header_position();
        end = entry
            .raw_file_position()
            .saturating_add(entry.size().div_ceil(512).saturating_mul(512));
        match entry.header().entry_type() {
            EntryType::XHeader => {
                let data = read_extension(
                    &mut entry,
                    offset,
                    MAX_EXTENSION_BYTES,
                    pending.pax.is_some(),
                )
                .map_err(|e| e.into_install(archive))?;
                pending.pax = Some((offset, data));
            }
            EntryType::GNULongName => {
                let max = MAX_PATH_BYTES as u64 + 1;
                let data = read_extension(&mut entry, offset, max, pending.long_name.is_some())
                    .map_err(|e| e.into_install(archive))?;
                pending.long_name = Some((offset, strip_nul(data)));
            }
            EntryType::GNULongLink => {
                let max = MAX_PATH_BYTES as u64 + 1;
                let data = read_extension(&mut entry, offset, max, pending.long_link.is_some())
                    .map_err(|e| e.into_install(archive))?;
                pending.long_link = Some((offset, strip_nul(data)));
            }
            _ => {
                let member = parse_member(&entry, std::mem::take(&mut pending), content)?;
                visit(member, &mut entry)?;
            }
        }
    }
    if let Some(offset) = pending.first_offset() {
        return Err(InstallError::MisplacedExtension { offset });
    }
    Ok(end)
}

/// Extension headers seen since the last member, each as (header offset, payload): a PAX
/// record block, a GNU long name, a GNU long link target.
#[derive(Default)]
struct Extensions {
    pax: Option<(u64, Vec<u8>)>,
    long_name: Option<(u64, Vec<u8>)>,
    long_link: Option<(u64, Vec<u8>)>,
}

impl Extensions {
    fn first_offset(&self) -> Option<u64> {
        [&self.pax, &self.long_name, &self.long_link]
            .into_iter()
            .filter_map(|ext| ext.as_ref().map(|(offset, _)| *offset))
            .min()
    }
}

enum ExtensionError {
    TooLarge { offset: u64, size: u64, max: u64 },
    Duplicate { offset: u64 },
    Read(io::Error),
}

impl ExtensionError {
    fn into_install(self, archive: &Path) -> InstallError {
        match self {
            ExtensionError::TooLarge { offset, size, max } => {
                InstallError::ExtensionTooLarge { offset, size, max }
            }
            ExtensionError::Duplicate { offset } => InstallError::MisplacedExtension { offset },
            ExtensionError::Read(source) => InstallError::ReadArchive {
                path: archive.to_path_buf(),
                source,
            },
        }
    }
}

fn read_extension<R: Read>(
    entry: &mut Entry<'_, R>,
    offset: u64,
    max: u64,
    duplicate: bool,
) -> Result<Vec<u8>, ExtensionError> {
    if duplicate {
        return Err(ExtensionError::Duplicate { offset });
    }
    let size = entry.size();
    if size > max {
        return Err(ExtensionError::TooLarge { offset, size, max });
    }
    let mut data = Vec::with_capacity(size as usize);
    entry.read_to_end(&mut data).map_err(ExtensionError::Read)?;
    if data.len() as u64 != size {
        return Err(ExtensionError::Read(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(data)
}

fn strip_nul(mut data: Vec<u8>) -> Vec<u8> {
    if data.last() == Some(&0) {
        data.pop();
    }
    data
}

/// Decodes and checks one member: name, numeric fields, PAX records (extended attributes,
/// `mtime`, `uid`/`gid`, `path`/`linkpath`; `size` and `GNU.sparse.*` refused), type, link
/// targets. Device nodes come back as [`MemberKind::Device`] for the caller's rules.
fn parse_member<R: Read>(
    entry: &Entry<'_, R>,
    ext: Extensions,
    content: Content,
) -> Result<Member, InstallError> {
    let header: &Header = entry.header();
    let records = match &ext.pax {
        Some((pax_offset, pax)) => {
            parse_pax_records(pax).map_err(|reason| InstallError::MalformedExtension {
                offset: *pax_offset,
                reason,
            })?
        }
        None => Vec::new(),
    };
    let pax_value = |key: &[u8]| {
        records
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_vec())
    };
    let raw = pax_value(b"path")
        .or(ext.long_name.map(|(_, name)| name))
        .unwrap_or_else(|| header.path_bytes().into_owned());
    let path = || path_of(&raw);
    let invalid = |field: &'static str, value: &[u8]| InstallError::InvalidField {
        path: path_of(&raw),
        field,
        value: lossy(value),
    };

    let kind_flag = header.entry_type();
    let is_dir = kind_flag == EntryType::Directory;
    let components = parse_name(&raw, is_dir).map_err(|e| name_error(&raw, e))?;

    let old = header.as_old();
    let mut uid = header.uid().map_err(|_| invalid("uid", &old.uid))?;
    let mut gid = header.gid().map_err(|_| invalid("gid", &old.gid))?;
    let mtime_header = header.mtime().map_err(|_| invalid("mtime", &old.mtime))?;
    let mut mtime = (
        i64::try_from(mtime_header).map_err(|_| invalid("mtime", &old.mtime))?,
        0u32,
    );
    let mode = header.mode().map_err(|_| invalid("mode", &old.mode))? & 0o7777;

    let mut xattrs = Vec::new();
    for &(key, value) in &records {
        match key {
            b"path" | b"linkpath" => {}
            b"mtime" => mtime = parse_mtime(value).ok_or_else(|| invalid("mtime", value))?,
            b"uid" | b"gid" => {
                let id = std::str::from_utf8(value)
                    .ok()
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| invalid(if key == b"uid" { "uid" } else { "gid" }, value))?;
                if key == b"uid" {
                    uid = id;
                } else {
                    gid = id;
                }
            }
            b"size" => {
                return Err(InstallError::UnsupportedExtension {
                    path: path(),
                    key: lossy(key),
                })
            }
            k if k.starts_with(b"GNU.sparse.") => {
                return Err(InstallError::UnsupportedExtension {
                    path: path(),
                    key: lossy(key),
                })
            }
            k => match xattr_name_from_key(k) {
                Some(Ok(name)) => {
                    check_xattr(&raw, &name, value)?;
                    xattrs.push((name, value.to_vec()));
                }
                Some(Err(())) => {
                    return Err(InstallError::ForbiddenXattr {
                        path: path(),
                        name: lossy(k),
                        reason: "malformed hex name",
                    })
                }
                None => {
                    tracing::trace!(path = %path().display(), key = %lossy(k), "ignoring PAX record");
                }
            },
        }
    }
    let owner = |field: &'static str, id: u64| {
        // u32::MAX is -1, "leave unchanged", for chown.
        u32::try_from(id)
            .ok()
            .filter(|id| *id != u32::MAX)
            .ok_or_else(|| invalid(field, id.to_string().as_bytes()))
    };
    let uid = owner("uid", uid)?;
    let gid = owner("gid", gid)?;

    let link = || {
        pax_value(b"linkpath")
            .or_else(|| ext.long_link.as_ref().map(|(_, link)| link.clone()))
            .or_else(|| header.link_name_bytes().map(|l| l.into_owned()))
            .unwrap_or_default()
    };
    let size = entry.size();
    let kind = match kind_flag {
        EntryType::Directory => MemberKind::Directory,
        EntryType::Regular | EntryType::Continuous => MemberKind::Regular {
            size,
            data: match content {
                Content::Seek => RegularData::Archive {
                    offset: entry.raw_file_position(),
                },
                Content::Stream => RegularData::Stream,
            },
        },
        EntryType::Symlink => {
            let target = link();
            check_symlink_target(&raw, &target)?;
            MemberKind::Symlink { target }
        }
        EntryType::Link => MemberKind::Hardlink {
            target: parse_hardlink_target(&raw, &link())?,
        },
        EntryType::Char | EntryType::Block => {
            // dev_major and dev_minor sit at the same offsets in ustar and GNU headers.
            let device = |_| invalid("device", &header.as_bytes()[329..345]);
            let major = header.device_major().map_err(device)?;
            let minor = header.device_minor().map_err(device)?;
            MemberKind::Device {
                block: kind_flag == EntryType::Block,
                major: major.unwrap_or(0),
                minor: minor.unwrap_or(0),
            }
        }
        EntryType::Fifo => MemberKind::Fifo,
        other => {
            return Err(InstallError::UnsupportedEntry {
                path: path(),
                kind: char::from(other.as_byte()),
            })
        }
    };
    if size != 0 && !matches!(kind, MemberKind::Regular { .. }) {
        return Err(InstallError::UnexpectedData { path: path(), size });
    }
    if components.is_empty() && !matches!(kind, MemberKind::Directory) {
        return Err(InstallError::RootNotDirectory { path: path() });
    }
    Ok(Member {
        raw: raw.clone(),
        components,
        kind,
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    })
}

/// Checks that the stream holds the two zero blocks of the end-of-archive marker at `end`.
/// The tar reader stops after reading the first zero block (or at the end of the stream),
/// so it consumed `end + 512` bytes exactly when the first block was there.
pub(crate) fn check_end_marker<R: Read>(
    counted: &mut Counting<R>,
    end: u64,
    label: &Path,
) -> Result<(), InstallError> {
    let missing = || InstallError::MissingEndOfArchive {
        path: label.to_path_buf(),
        offset: end,
    };
    if counted.read != end + 512 {
        return Err(missing());
    }
    let mut second = [0u8; 512];
    match counted.read_exact(&mut second) {
        Ok(()) if second.iter().all(|b| *b == 0) => Ok(()),
        Ok(()) => Err(missing()),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Err(missing()),
        Err(source) => Err(InstallError::ReadArchive {
            path: label.to_path_buf(),
            source,
        }),
    }
}

/// A buffered reader over a tar stream that counts the bytes it delivered (for
/// [`check_end_marker`]).
pub(crate) struct Counting<R> {
    inner: io::BufReader<R>,
    read: u64,
}

impl<R: Read> Counting<R> {
    /// Wraps `reader` with a 256 KiB buffer.
    pub(crate) fn new(reader: R) -> Self {
        Counting {
            inner: io::BufReader::with_capacity(256 << 10, reader),
            read: 0,
        }
    }
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}
