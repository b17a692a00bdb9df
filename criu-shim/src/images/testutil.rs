//! Test helpers: hand-made images (protobuf messages, framed image files, tmpfs archives).

use std::path::Path;

use super::wire::COMMON_MAGIC;

/// Encodes `(field, value)` pairs as a message: `Ok` a varint, `Err` a byte string.
pub(crate) fn enc(fields: &[(u32, Result<u64, &[u8]>)]) -> Vec<u8> {
    use super::userns::varint;
    let mut out = Vec::new();
    for (n, v) in fields {
        match v {
            Ok(x) => {
                varint(u64::from(*n) << 3, &mut out);
                varint(*x, &mut out);
            }
            Err(b) => {
                varint((u64::from(*n) << 3) | 2, &mut out);
                varint(b.len() as u64, &mut out);
                out.extend_from_slice(b);
            }
        }
    }
    out
}

/// Writes `dir/name` as a CRIU image of `magic` holding `entries`.
pub(crate) fn write_image(dir: &Path, name: &str, magic: u32, entries: &[Vec<u8>]) {
    let mut data = Vec::new();
    data.extend_from_slice(&COMMON_MAGIC.to_le_bytes());
    data.extend_from_slice(&magic.to_le_bytes());
    for e in entries {
        data.extend_from_slice(&(e.len() as u32).to_le_bytes());
        data.extend_from_slice(e);
    }
    std::fs::write(dir.join(name), data).unwrap();
}

/// A gzip'd tar of `(name, type, link or device minor)` members; names written raw.
pub(crate) fn tar_gz(members: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (name, ty, link) in members {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*ty);
        h.set_size(0);
        h.set_mode(0o755);
        if *ty == tar::EntryType::Char {
            h.set_device_major(1).unwrap();
            h.set_device_minor(link.parse().unwrap()).unwrap();
        }
        // set_path refuses `..`; write the raw name as an attacker would.
        let raw = &mut h.as_old_mut().name;
        raw[..name.len()].copy_from_slice(name.as_bytes());
        if matches!(ty, tar::EntryType::Symlink | tar::EntryType::Link) {
            h.set_link_name(link).unwrap();
        }
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
    }
    b.into_inner().unwrap().finish().unwrap()
}
