//! Text forms every front end shares: byte sizes with binary suffixes (`64M`), and how an
//! action's argv becomes the `sh -c` command line the daemon runs
//! ([`ExecRequest::argv`](crate::ExecRequest)).

/// Parses `123`, `64K`, `512M`, `2G`, `1T` (powers of 1024; the suffix in either case).
///
/// Errors: a message naming the input for an unknown suffix, a non-number or an overflow of
/// `u64`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => return Err(format!("unknown size suffix in {s:?}")),
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("invalid size {s:?}"))
}

/// Quotes one word for `sh`: unchanged when it holds only characters `sh` never interprets,
/// else in single quotes.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// The shell command line of an action's argv: a single element as is (a shell command
/// line), several elements quoted word by word and joined with spaces.
pub fn command_line(argv: &[String]) -> String {
    if argv.len() == 1 {
        argv[0].clone()
    } else {
        argv.iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("123"), Ok(123));
        assert_eq!(parse_bytes("64K"), Ok(65536));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("12Q").is_err());
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("a-b/c"), "a-b/c");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(command_line(&["echo hi".into()]), "echo hi");
        assert_eq!(command_line(&["echo".into(), "a b".into()]), "echo 'a b'");
    }
}
