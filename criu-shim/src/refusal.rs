//! Files `criu dump` refuses, told apart from other dump failures by CRIU's log lines (its
//! only channel for them: the exit status is 1 either way), so a checkpoint can fail with a
//! typed error naming the file instead of a log excerpt.
//!
//! - `files-reg.c` `dump_ghost_remap`: "Can't dump ghost file PATH of N size, increase limit"
//!   — a deleted-but-open file (`st_nlink` 0) whose allocated bytes (`st_blocks * 512`, so a
//!   sparse file counts its data only) exceed `--ghost-limit`;
//! - `files-reg.c` `create_link_remap`: "Can't create link remap for PATH. Use link-remap
//!   option." — a file open under a name that was removed while another hard link keeps it
//!   (`st_nlink` > 0, zdtm `unlink_fstat03`); CRIU would hard-link it into the dumped tree's
//!   file system (`--link-remap`), which Belayer does not allow (see the crate docs).

use crate::log::LogTail;

/// A file CRIU refused to dump, as its log says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileRefusal {
    /// A deleted-but-open file holds more allocated bytes than the ghost limit.
    GhostTooLarge {
        /// Its path in the tree's mount namespace, as it was before it was removed.
        path: String,
        /// Its allocated bytes, as CRIU counted them.
        bytes: u64,
    },
    /// A file open under a removed name while another hard link keeps it.
    LinkRemap {
        /// The removed name, in the tree's mount namespace.
        path: String,
    },
}

impl FileRefusal {
    /// The first refusal among `log`'s error lines, if any.
    pub(crate) fn from_log(log: &LogTail) -> Option<FileRefusal> {
        log.errors().find_map(parse_line)
    }
}

/// Parses one `Error (file:line): ...` line (timestamp already stripped).
fn parse_line(line: &str) -> Option<FileRefusal> {
    let msg = line.split_once("): ").map_or(line, |(_, m)| m);
    if let Some(rest) = msg.strip_prefix("Can't dump ghost file ") {
        let (path, size) = rest
            .strip_suffix(" size, increase limit")?
            .rsplit_once(" of ")?;
        return Some(FileRefusal::GhostTooLarge {
            path: path.to_string(),
            bytes: size.trim().parse().ok()?,
        });
    }
    let rest = msg.strip_prefix("Can't create link remap for ")?;
    let path = rest.strip_suffix(". Use link-remap option.")?;
    Some(FileRefusal::LinkRemap {
        path: path.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail(lines: &[&str]) -> LogTail {
        LogTail {
            path: "/w/dump.log".into(),
            lines: lines.iter().map(|l| l.to_string()).collect(),
            first_errors: Vec::new(),
        }
    }

    #[test]
    fn ghost_above_the_limit_is_named_with_its_size() {
        let log = tail(&[
            "(00.075083) Dumping ghost file for fd 3 id 0x5",
            "(00.075093) Error (criu/files-reg.c:1031): Can't dump ghost file /work/a of b of 6291456 size, increase limit",
            "(00.075100) Error (criu/cr-dump.c:1545): Dump files (pid: 7) failed with -1",
        ]);
        assert_eq!(
            FileRefusal::from_log(&log),
            Some(FileRefusal::GhostTooLarge {
                path: "/work/a of b".into(),
                bytes: 6291456
            })
        );
    }

    #[test]
    fn a_linked_remap_is_named() {
        let log = tail(&[
            "(00.05) Error (criu/files-reg.c:1122): Can't create link remap for /work/lr/f. Use link-remap option.",
        ]);
        assert_eq!(
            FileRefusal::from_log(&log),
            Some(FileRefusal::LinkRemap {
                path: "/work/lr/f".into()
            })
        );
    }

    #[test]
    fn other_failures_are_no_refusal() {
        let log = tail(&[
            "(00.08) Error (criu/fsnotify.c:284): fsnotify: \tCan't dump that handle",
            "(00.08) Error (criu/files-reg.c:1031): Can't dump ghost file /x of many size, increase limit",
        ]);
        assert_eq!(FileRefusal::from_log(&log), None);
    }
}
