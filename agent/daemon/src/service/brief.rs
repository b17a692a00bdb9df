//! What a client sent, for the log, cut to a bound.
//!
//! A request may carry up to `max_frame_bytes` of data (a context of 64 MiB, say), and its
//! `Debug` form is about three times that ("8, 8, 8, ..."): formatting it whole for a debug
//! line would let any peer make the daemon build and write hundreds of MiB per request.
//! [`Brief`] formats the `Debug` form into a buffer of at most [`BRIEF_BYTES`] and stops the
//! formatting there, so the cost is bounded whatever the value holds.

use std::fmt::{self, Debug, Display, Write};

/// Bytes of a value's `Debug` form a [`Brief`] keeps.
pub const BRIEF_BYTES: usize = 1024;

/// Displays the `Debug` form of the value, cut after [`BRIEF_BYTES`] (then ending in `…`).
#[derive(Debug)]
pub struct Brief<'a, T: Debug>(pub &'a T);

/// A writer that keeps `max` bytes and then fails, which stops the formatting.
struct Capped {
    out: String,
    max: usize,
    cut: bool,
}

impl Write for Capped {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.max - self.out.len();
        if s.len() <= room {
            self.out.push_str(s);
            return Ok(());
        }
        let mut end = room;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.out.push_str(&s[..end]);
        self.cut = true;
        Err(fmt::Error)
    }
}

impl<T: Debug> Display for Brief<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut capped = Capped {
            out: String::new(),
            max: BRIEF_BYTES,
            cut: false,
        };
        // An error here is the cap (a `Debug` impl has no other way to fail).
        let _ = write!(capped, "{:?}", self.0);
        f.write_str(&capped.out)?;
        if capped.cut {
            f.write_str("…")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_are_whole_and_long_ones_cut() {
        assert_eq!(Brief(&Some(3)).to_string(), "Some(3)");
        let big = vec![8u8; 1 << 20];
        let s = Brief(&big).to_string();
        assert!(s.starts_with("[8, 8, "), "{s}");
        assert!(s.ends_with('…'));
        assert_eq!(s.len(), BRIEF_BYTES + '…'.len_utf8());
        // A cut never splits a character.
        let wide = "é".repeat(BRIEF_BYTES);
        let s = Brief(&wide).to_string();
        assert!(s.len() <= BRIEF_BYTES + '…'.len_utf8() && s.ends_with('…'));
    }
}
