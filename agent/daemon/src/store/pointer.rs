//! The two small files that say which checkpoints of a store count: `READY`, the name of the
//! ready checkpoint (the publication point of a checkpoint, exactly as before branches), and
//! `BOUND`, the visibility bound: the highest sequence number ever made ready. A checkpoint
//! is visible when its sequence number is at most `max(BOUND, seq(READY))`.
//!
//! Order of writes, so that a crash between any two never lowers the effective bound nor
//! raises it over an unannounced checkpoint: moving `READY` forward (to a higher sequence
//! number) writes only `READY` (the name bounds by itself); moving it back, or removing it,
//! first makes `BOUND` hold the bound in effect. Both are replaced by write, fsync, rename and a
//! fsync of the store. A store written before branches has no `BOUND`: its bound is the ready
//! checkpoint's sequence number, as it always was; and a binary of that time still reads a
//! newer store's `READY` (it would drop the branches above the ready checkpoint, nothing else).

use std::fs;
use std::io::Write;
use std::path::Path;

use super::{io, StoreError};
use crate::sys;

/// Name of the ready pointer file.
pub const READY: &str = "READY";
/// Name of the visibility-bound file.
pub const BOUND: &str = "BOUND";

/// `(seq, prefix)` of a checkpoint directory name `c<seq>-k<prefix>` (digits only, nothing
/// else: no `/`, no `..`, no suffix); `None` for any other name.
pub fn parse_name(name: &str) -> Option<(u64, u64)> {
    let (seq, prefix) = name.strip_prefix('c')?.split_once("-k")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(seq) || !digits(prefix) {
        return None;
    }
    Some((seq.parse().ok()?, prefix.parse().ok()?))
}

/// The name `READY` holds (`None`: no file, or an empty one).
///
/// Errors: [`StoreError::BadPointer`] for anything but one checkpoint name.
pub fn read_ready(dir: &Path) -> Result<Option<String>, StoreError> {
    let p = dir.join(READY);
    match fs::read_to_string(&p) {
        Ok(s) => {
            let name = s.trim();
            if name.is_empty() {
                return Ok(None);
            }
            match parse_name(name) {
                Some(_) => Ok(Some(name.to_string())),
                None => Err(StoreError::BadPointer {
                    path: p,
                    text: name.chars().take(80).collect(),
                }),
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io("read", &p)(e)),
    }
}

/// The number `BOUND` holds (0: no file).
///
/// Errors: [`StoreError::BadPointer`] for anything but a decimal number: nothing is then
/// known to be a leftover, and callers that delete leftovers must not guess.
pub fn read_bound(dir: &Path) -> Result<u64, StoreError> {
    let p = dir.join(BOUND);
    match fs::read_to_string(&p) {
        Ok(s) => s.trim().parse().map_err(|_| StoreError::BadPointer {
            path: p.clone(),
            text: s.trim().chars().take(80).collect(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(io("read", &p)(e)),
    }
}

/// Makes `dir/file` hold `text` (`None`: removes it), durably. An error comes with whether
/// the file changed before it (the rename took effect, the directory's fsync failed).
pub fn write(dir: &Path, file: &str, text: Option<&str>) -> Result<(), (bool, StoreError)> {
    let path = dir.join(file);
    match text {
        Some(text) => {
            let tmp = dir.join(format!(".{file}.tmp"));
            let written = fs::File::create(&tmp)
                .map_err(io("create", &tmp))
                .and_then(|mut f| {
                    f.write_all(text.as_bytes()).map_err(io("write", &tmp))?;
                    f.sync_all().map_err(io("fsync", &tmp))
                });
            written.map_err(|e| (false, e))?;
            fs::rename(&tmp, &path).map_err(|e| (false, io("rename", &path)(e)))?;
        }
        None => match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err((false, io("unlink", &path)(e))),
        },
    }
    sys::fsync_path(dir).map_err(|e| (true, io("fsync", dir)(e.source)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_checkpoint_names_parse() {
        assert_eq!(parse_name("c000003-k7"), Some((3, 7)));
        assert_eq!(parse_name("c1-k0"), Some((1, 0)));
        for bad in [
            "c1-k1/../../x",
            "c-k1",
            "c1-k",
            "c1k1",
            "x1-k1",
            "c1-k1 ",
            "c+1-k1",
            "c1-k-1",
            "/c1-k1",
            "c99999999999999999999-k1",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }
}
