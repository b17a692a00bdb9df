//! CRIU's log files: verbosity and the tail that failures carry.
//!
//! Every dump and restore writes CRIU's own log (`-o <work_dir>/<op>.log`) into the request's work
//! dir, never into the images dir (the images dir is published as a checkpoint artifact; a log there
//! would be archived and digested with it). On failure the last [`TAIL_LINES`] lines travel in the
//! error as a [`LogTail`].

use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// How many lines of CRIU's log a failure carries.
pub const TAIL_LINES: usize = 30;

/// How many bytes from the end of the log are read to find the tail (a `-v4` log of a big tree runs
/// to megabytes; its last 30 lines are far shorter than this).
const TAIL_BYTES: u64 = 64 * 1024;

/// How many of CRIU's `Error (...)` lines the one-line [`fmt::Display`] of a [`LogTail`] shows.
const SHOWN_ERRORS: usize = 3;

/// How many bytes from the start of the log are searched for its first error lines (the cause:
/// in a restore, the errors at the end are the other tasks giving up after it).
const HEAD_BYTES: u64 = 8 << 20;

/// How many first error lines a [`LogTail`] keeps.
const FIRST_ERRORS: usize = 3;

/// Error lines CRIU logs and then carries on from, never the cause of a failure: raising its
/// own fd limit fails in a user namespace whose hard limit is lower (`criu/util.c`).
const BENIGN_ERRORS: &[&str] = &["Can't setup RLIMIT_NOFILE for self"];

/// CRIU's log verbosity (`-v<N>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogLevel {
    /// `-v1`: errors only.
    Errors,
    /// `-v2`: errors and warnings.
    Warnings,
    /// `-v3`: adds progress messages.
    Info,
    /// `-v4`: everything, with timestamps per step; what container runtimes use, and what a failed
    /// dump needs for a post-mortem. For a 50 MB process the log is about 2,300 lines (200 KB);
    /// dump times with `-v4` and `-v1` stayed within run-to-run noise of each other.
    #[default]
    Debug,
}

impl LogLevel {
    /// The `-vN` argument.
    pub(crate) fn arg(self) -> &'static str {
        match self {
            LogLevel::Errors => "-v1",
            LogLevel::Warnings => "-v2",
            LogLevel::Info => "-v3",
            LogLevel::Debug => "-v4",
        }
    }
}

/// The end of a CRIU log, carried by a failed operation's error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTail {
    /// The full log file (in the request's work dir).
    pub path: PathBuf,
    /// Its last lines (at most [`TAIL_LINES`]), followed by CRIU's stderr if it printed any (e.g.
    /// option errors found before the log was opened), each stderr line prefixed `stderr: `.
    pub lines: Vec<String>,
    /// The first error lines of the whole log (at most 3 from its first 8 MiB), timestamps
    /// stripped: usually the cause, which a long restore log pushes out of [`Self::lines`].
    pub first_errors: Vec<String>,
}

impl LogTail {
    /// Reads the tail of `path` and appends the non-empty lines of `stderr`. An unreadable log becomes
    /// one line saying why (the failure being reported matters more than the log).
    pub(crate) fn collect(path: &Path, stderr: &str) -> LogTail {
        let mut lines = match read_tail(path) {
            Ok(lines) => lines,
            Err(err) => vec![format!("(cannot read {}: {err})", path.display())],
        };
        lines.extend(
            stderr
                .lines()
                .map(str::trim_end)
                .filter(|l| !l.is_empty())
                .map(|l| format!("stderr: {l}")),
        );
        LogTail {
            path: path.to_path_buf(),
            lines,
            first_errors: read_first_errors(path).unwrap_or_default(),
        }
    }

    /// CRIU's error lines (`Error (file:line): ...`) in the tail, timestamps stripped, oldest first.
    pub fn errors(&self) -> impl Iterator<Item = &str> {
        self.lines
            .iter()
            .map(|l| strip_timestamp(l))
            .filter(|l| is_error(l) || l.starts_with("stderr: Error "))
    }

    /// Whether any tail line contains `needle` (e.g. `"File exists"`).
    pub fn contains(&self, needle: &str) -> bool {
        self.lines.iter().any(|l| l.contains(needle))
    }
}

impl fmt::Display for LogTail {
    /// The last few `Error` lines joined by ` | ` (or the last line when there is none), then the
    /// log path.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let errors: Vec<&str> = self.errors().collect();
        let shown: Vec<&str> = if errors.is_empty() {
            self.lines
                .iter()
                .rev()
                .map(|l| strip_timestamp(l))
                .find(|l| !l.trim().is_empty())
                .into_iter()
                .collect()
        } else {
            errors[errors.len().saturating_sub(SHOWN_ERRORS)..].to_vec()
        };
        if let Some(first) = self.first_errors.first() {
            if !shown.iter().any(|l| l == first) {
                write!(f, "first: {first} | ")?;
            }
        }
        if shown.is_empty() {
            write!(f, "empty log")?;
        } else {
            write!(f, "{}", shown.join(" | "))?;
        }
        write!(f, " (log {})", self.path.display())
    }
}

/// `(00.001890) Error (...)` → `Error (...)`; other lines unchanged.
fn strip_timestamp(line: &str) -> &str {
    if let Some(rest) = line.strip_prefix('(') {
        if let Some((stamp, after)) = rest.split_once(')') {
            if stamp.chars().all(|c| c.is_ascii_digit() || c == '.') {
                return after.trim_start();
            }
        }
    }
    line
}

/// Whether a log line (timestamp stripped) is one of CRIU's error lines: `Error (file:line): ...`,
/// in a restore also after the task's pid (`1: Error (...)`) or `pie: 1: `.
fn is_error(line: &str) -> bool {
    match line.find("Error (") {
        Some(0) => true,
        Some(at) => line[..at]
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, ':' | ' ' | 'p' | 'i' | 'e')),
        None => false,
    }
}

fn read_first_errors(path: &Path) -> std::io::Result<Vec<String>> {
    let mut bytes = Vec::new();
    File::open(path)?.take(HEAD_BYTES).read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes)
        .lines()
        .map(strip_timestamp)
        .filter(|l| is_error(l) && !BENIGN_ERRORS.iter().any(|b| l.contains(b)))
        .take(FIRST_ERRORS)
        .map(str::to_string)
        .collect())
}

fn read_tail(path: &Path) -> std::io::Result<Vec<String>> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let start = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(start))?;
    let mut bytes = Vec::with_capacity((len - start) as usize);
    file.read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes);
    let mut lines: Vec<&str> = text.lines().collect();
    if start > 0 && !lines.is_empty() {
        lines.remove(0); // the first line was cut by the seek
    }
    let keep = lines.len().saturating_sub(TAIL_LINES);
    Ok(lines[keep..].iter().map(|l| l.to_string()).collect())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    const FAILED_DUMP: &str = "\
(00.001871) Warn  (compel/src/lib/infect.c:133): Unable to interrupt task: 999999 (No such process)
(00.001881) net: Unlock network
(00.001890) Error (compel/src/lib/infect.c:418): Unable to detach from 999999: No such process
(00.001896) Error (criu/cr-dump.c:2111): Dumping FAILED.
";

    fn write_log(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dump.log");
        File::create(&path)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        (dir, path)
    }

    #[test]
    fn display_shows_error_lines_without_timestamps_and_the_path() {
        let (_dir, path) = write_log(FAILED_DUMP);
        let tail = LogTail::collect(&path, "");
        assert_eq!(tail.lines.len(), 4);
        let shown = tail.to_string();
        assert!(shown.starts_with(
            "Error (compel/src/lib/infect.c:418): Unable to detach from 999999: No such process | \
             Error (criu/cr-dump.c:2111): Dumping FAILED."
        ));
        assert!(shown.ends_with(&format!("(log {})", path.display())));
        assert!(tail.contains("No such process"));
    }

    #[test]
    fn tail_keeps_the_last_lines_of_a_long_log() {
        let text: String = (0..100_000)
            .map(|i| format!("({i:08}) line {i}\n"))
            .collect();
        let (_dir, path) = write_log(&text);
        let tail = LogTail::collect(&path, "");
        assert_eq!(tail.lines.len(), TAIL_LINES);
        assert_eq!(tail.lines.last().unwrap(), "(00099999) line 99999");
        assert_eq!(tail.to_string().split(' ').next(), Some("line"));
    }

    #[test]
    fn the_first_error_of_a_long_restore_log_is_shown() {
        let mut text = String::from(
            "(00.000050) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: \
             Operation not permitted\n\
             (00.000100)      1: Error (criu/sk-tcp.c:101): Can't turn TCP repair mode ON\n",
        );
        text.extend((0..1000).map(|i| format!("(00.0{i:05}) line {i}\n")));
        text.push_str("(00.900000) Error (criu/cr-restore.c:2500): Restoring FAILED.\n");
        let (_dir, path) = write_log(&text);
        let tail = LogTail::collect(&path, "");
        assert_eq!(
            tail.first_errors[0],
            "1: Error (criu/sk-tcp.c:101): Can't turn TCP repair mode ON"
        );
        let shown = tail.to_string();
        assert!(
            shown.starts_with(
                "first: 1: Error (criu/sk-tcp.c:101): Can't turn TCP repair mode ON | \
                 Error (criu/cr-restore.c:2500): Restoring FAILED."
            ),
            "{shown}"
        );
        assert!(!is_error("line about an Error (in text)"));
        assert!(is_error("pie: 12: Error (criu/pie/restorer.c:1): x"));
    }

    #[test]
    fn missing_log_and_stderr_are_reported() {
        let tail = LogTail::collect(
            Path::new("/nonexistent/dump.log"),
            "Error (criu/config.c:1): bad option\n",
        );
        assert_eq!(tail.lines.len(), 2);
        assert!(tail.lines[0].starts_with("(cannot read /nonexistent/dump.log"));
        assert!(tail
            .to_string()
            .starts_with("stderr: Error (criu/config.c:1): bad option"));
    }

    #[test]
    fn log_levels_map_to_flags() {
        assert_eq!(LogLevel::default().arg(), "-v4");
        assert_eq!(LogLevel::Errors.arg(), "-v1");
    }
}
