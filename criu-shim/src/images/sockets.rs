//! The TCP sockets a dump holds (`files.img`, file entries of type `INETSK`), for callers
//! that must know before publishing a checkpoint whether its restore needs TCP repair mode.
//!
//! Fields used (CRIU `images/fdinfo.proto`, `sk-inet.proto`): file entry 1 `type` (4 =
//! `INETSK`), 4 `isk`; inet socket 2 `ino`, 3 `family`, 5 `proto` (6 = TCP), 6 `state` (the
//! kernel's TCP state: 1 `ESTABLISHED` ... 7 `CLOSE`, 10 `LISTEN`), 7 `src_port`, 8
//! `dst_port`.

use std::path::{Path, PathBuf};

use super::entries::FILES_MAGIC;
use super::wire::{Fields, Image, ImageError};

const FD_TYPE_INETSK: u32 = 4;
const IPPROTO_TCP: u32 = 6;
const TCP_CLOSE: u32 = 7;
const TCP_LISTEN: u32 = 10;

/// A TCP socket of the images that CRIU restores in repair mode (any state but `LISTEN` and
/// `CLOSE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpConnection {
    /// Socket inode at dump time.
    pub ino: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u32,
    /// Kernel TCP state (1 `ESTABLISHED`, 2 `SYN_SENT`, 8 `CLOSE_WAIT`, ...).
    pub state: u32,
    /// Local port.
    pub src_port: u32,
    /// Remote port.
    pub dst_port: u32,
}

/// `files.img` could not be read or decoded.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the sockets of {}: {what}", path.display())]
pub struct SocketImageError {
    /// The image file.
    pub path: PathBuf,
    /// What went wrong (an I/O error, or the malformed field and its offset).
    pub what: String,
}

/// The TCP connections in the images in `images_dir` (its `files.img`; none when the dump
/// holds no files image). Reads at most the size the path check reads.
pub fn tcp_connections(images_dir: &Path) -> Result<Vec<TcpConnection>, SocketImageError> {
    let path = images_dir.join("files.img");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let fail = |what: String| SocketImageError {
        path: path.clone(),
        what,
    };
    let image = Image::read(&path, FILES_MAGIC, true).map_err(|e| match e {
        ImageError::Io(e) => fail(e.to_string()),
        ImageError::Wire(w) => fail(format!("{} at byte {}", w.what, w.offset)),
    })?;
    let mut out = Vec::new();
    for (base, msg) in image.entries() {
        if let Some(c) =
            entry(msg, base).map_err(|w| fail(format!("{} at byte {}", w.what, w.offset)))?
        {
            out.push(c);
        }
    }
    Ok(out)
}

/// One file entry: its TCP connection, if it is one.
fn entry(msg: &[u8], base: u64) -> Result<Option<TcpConnection>, super::wire::WireError> {
    let (mut ty, mut isk) = (None, None);
    let mut it = Fields::new(msg, base);
    while let Some(f) = it.next() {
        let (n, v) = f?;
        match n {
            1 => ty = v.u32(),
            4 => isk = v.bytes().map(|b| (b, it.offset())),
            _ => {}
        }
    }
    let (Some(FD_TYPE_INETSK), Some((isk, at))) = (ty, isk) else {
        return Ok(None);
    };
    let (mut ino, mut family, mut proto, mut state, mut src_port, mut dst_port) =
        (0, 0, 0, 0, 0, 0);
    for f in Fields::new(isk, at) {
        let (n, v) = f?;
        let x = v.u32().unwrap_or(0);
        match n {
            2 => ino = x,
            3 => family = x,
            5 => proto = x,
            6 => state = x,
            7 => src_port = x,
            8 => dst_port = x,
            _ => {}
        }
    }
    if proto != IPPROTO_TCP || state == TCP_LISTEN || state == TCP_CLOSE {
        return Ok(None);
    }
    Ok(Some(TcpConnection {
        ino,
        family,
        state,
        src_port,
        dst_port,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::testutil::{enc, write_image};

    fn inet(ino: u64, proto: u64, state: u64) -> Vec<u8> {
        let sk = enc(&[
            (1, Ok(ino)),
            (2, Ok(ino)),
            (3, Ok(2)),
            (4, Ok(1)),
            (5, Ok(proto)),
            (6, Ok(state)),
            (7, Ok(40000)),
            (8, Ok(8080)),
        ]);
        enc(&[(1, Ok(4)), (2, Ok(ino)), (4, Err(&sk))])
    }

    #[test]
    fn lists_only_connections_needing_repair() {
        let dir = tempfile::tempdir().unwrap();
        let entries = vec![
            inet(1, 6, 1),                  // established TCP
            inet(2, 6, 10),                 // listening
            inet(3, 6, 7),                  // closed
            inet(4, 17, 1),                 // UDP
            inet(5, 6, 8),                  // close-wait
            enc(&[(1, Ok(1)), (2, Ok(6))]), // a regular file without its message: skipped
        ];
        write_image(dir.path(), "files.img", FILES_MAGIC, &entries);
        let conns = tcp_connections(dir.path()).unwrap();
        assert_eq!(conns.iter().map(|c| c.ino).collect::<Vec<_>>(), [1, 5]);
        assert_eq!(conns[0].dst_port, 8080);
    }

    #[test]
    fn no_files_image_means_no_connections() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(tcp_connections(dir.path()).unwrap(), []);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("files.img"),
            b"\x19\x43\x56\x54\x18\x31\x30\x56\xff\xff",
        )
        .unwrap();
        assert!(tcp_connections(dir.path()).is_err());
    }
}
