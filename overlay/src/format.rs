//! The archive format shared by capture and install: PAX record keys, the encoding of
//! nanosecond mtimes and of extended-attribute names, and the name limits.

/// Longest accepted path of an entry, in bytes (Linux `PATH_MAX` less the NUL).
pub(crate) const MAX_PATH_BYTES: usize = 4096;
/// Longest accepted single path component, in bytes (Linux `NAME_MAX`).
pub(crate) const MAX_NAME_BYTES: usize = 255;
/// Largest extended-attribute value Linux accepts (`XATTR_SIZE_MAX`), in bytes.
pub(crate) const MAX_XATTR_VALUE_BYTES: usize = 65536;

/// Largest PAX extension record block accepted for one entry, in bytes. Capture keeps the
/// extended attributes of an entry under half of it.
pub(crate) const MAX_EXTENSION_BYTES: u64 = 16 << 20;

/// PAX record holding the entry path when it does not fit the 100-byte header field.
pub(crate) const PAX_PATH: &str = "path";
/// PAX record holding a link target when it does not fit the 100-byte header field.
pub(crate) const PAX_LINKPATH: &str = "linkpath";
/// PAX record holding the modification time with nanoseconds (`seconds.nanoseconds`).
pub(crate) const PAX_MTIME: &str = "mtime";
/// PAX records with an extended attribute whose name is UTF-8 without `=` (GNU tar, bsdtar).
pub(crate) const PAX_XATTR_PREFIX: &str = "SCHILY.xattr.";
/// PAX records with an extended attribute whose name is not representable after
/// [`PAX_XATTR_PREFIX`] (not UTF-8, or containing `=`): the name follows in lowercase hex.
pub(crate) const PAX_XATTR_HEX_PREFIX: &str = "BELAYER.xattrhex.";

/// Whether an extended attribute belongs to the namespaces an upper layer carries: `user.`,
/// `security.`, `trusted.` (which includes `trusted.overlay.*`) and the POSIX ACLs.
pub(crate) fn is_layer_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.")
        || name.starts_with(b"security.")
        || name.starts_with(b"trusted.")
        || name == b"system.posix_acl_access"
        || name == b"system.posix_acl_default"
}

/// The PAX key under which an extended attribute named `name` is stored.
pub(crate) fn xattr_key(name: &[u8]) -> String {
    match std::str::from_utf8(name) {
        Ok(text) if !text.contains('=') => format!("{PAX_XATTR_PREFIX}{text}"),
        _ => format!("{PAX_XATTR_HEX_PREFIX}{}", hex(name)),
    }
}

/// The extended-attribute name stored under a PAX key, `None` when the key is not an
/// extended-attribute key, `Some(Err(()))` when it is one but malformed.
pub(crate) fn xattr_name_from_key(key: &[u8]) -> Option<Result<Vec<u8>, ()>> {
    if let Some(name) = key.strip_prefix(PAX_XATTR_PREFIX.as_bytes()) {
        return Some(Ok(name.to_vec()));
    }
    key.strip_prefix(PAX_XATTR_HEX_PREFIX.as_bytes()).map(unhex)
}

/// `seconds.nanoseconds` as PAX writes times; negative times count the fraction towards
/// zero too, so `(-2, 750_000_000)` (1.25 s before the epoch) is `-1.250000000`.
pub(crate) fn format_mtime(sec: i64, nsec: u32) -> String {
    if sec < 0 && nsec > 0 {
        let whole = -(sec + 1);
        let frac = 1_000_000_000 - nsec;
        format!("-{whole}.{frac:09}")
    } else {
        format!("{sec}.{nsec:09}")
    }
}

/// Parses a PAX time (`[-]seconds[.fraction]`, fraction up to 9 digits kept) into seconds
/// and nanoseconds with `0 <= nanoseconds < 10^9`.
pub(crate) fn parse_mtime(value: &[u8]) -> Option<(i64, u32)> {
    let text = std::str::from_utf8(value).ok()?;
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, frac) = match text.split_once('.') {
        Some((whole, frac)) => (whole, frac),
        None => (text, ""),
    };
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let whole: i64 = whole.parse().ok()?;
    let mut nsec: u32 = 0;
    for (i, digit) in frac.bytes().take(9).enumerate() {
        nsec += u32::from(digit - b'0') * 10u32.pow(8 - i as u32);
    }
    if !negative {
        return Some((whole, nsec));
    }
    if nsec == 0 {
        Some((whole.checked_neg()?, 0))
    } else {
        Some((whole.checked_neg()?.checked_sub(1)?, 1_000_000_000 - nsec))
    }
}

/// One PAX record: key and value bytes.
pub(crate) type PaxRecord<'a> = (&'a [u8], &'a [u8]);

/// Splits a PAX extended-header block into `(key, value)` records. Each record is
/// `"<length> <key>=<value>\n"` where `<length>` counts the whole record in decimal; values
/// are taken by length, so they may hold any byte (including newlines, which the `tar`
/// crate's own line-based parser mishandles). Errors name what is malformed.
pub(crate) fn parse_pax_records(data: &[u8]) -> Result<Vec<PaxRecord<'_>>, &'static str> {
    let mut records = Vec::new();
    let mut rest = data;
    while !rest.is_empty() {
        let space = rest
            .iter()
            .take(21)
            .position(|b| *b == b' ')
            .ok_or("record length not followed by a space")?;
        let digits = &rest[..space];
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return Err("record length is not a decimal number");
        }
        let len: usize = std::str::from_utf8(digits)
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or("record length out of range")?;
        if len <= space + 2 || len > rest.len() {
            return Err("record length out of range");
        }
        let record = &rest[..len];
        if record[len - 1] != b'\n' {
            return Err("record does not end with a newline");
        }
        let body = &record[space + 1..len - 1];
        let equals = body
            .iter()
            .position(|b| *b == b'=')
            .ok_or("record has no `=`")?;
        if equals == 0 {
            return Err("record has an empty key");
        }
        records.push((&body[..equals], &body[equals + 1..]));
        rest = &rest[len..];
    }
    Ok(records)
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        out.push(char::from(DIGITS[usize::from(byte >> 4)]));
        out.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    out
}

/// Decodes lowercase or uppercase hex; `Err(())` on odd length or a non-hex digit.
pub(crate) fn unhex(text: &[u8]) -> Result<Vec<u8>, ()> {
    fn nibble(c: u8) -> Result<u8, ()> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(()),
        }
    }
    if !text.len().is_multiple_of(2) {
        return Err(());
    }
    text.chunks_exact(2)
        .map(|pair| Ok((nibble(pair[0])? << 4) | nibble(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtime_round_trips() {
        for (sec, nsec) in [
            (0, 0),
            (1, 5),
            (1_700_000_000, 123_456_789),
            (-1, 0),
            (-2, 750_000_000),
            (-1, 999_999_999),
            (i64::MAX, 999_999_999),
        ] {
            let text = format_mtime(sec, nsec);
            assert_eq!(parse_mtime(text.as_bytes()), Some((sec, nsec)), "{text}");
        }
        assert_eq!(format_mtime(-2, 750_000_000), "-1.250000000");
        assert_eq!(parse_mtime(b"12"), Some((12, 0)));
        assert_eq!(parse_mtime(b"12.5"), Some((12, 500_000_000)));
        assert_eq!(parse_mtime(b"12.1234567891"), Some((12, 123_456_789)));
        for bad in [
            &b""[..],
            b"-",
            b".5",
            b"1.2.3",
            b"1e5",
            b"+1",
            b"1.-2",
            b" 1",
        ] {
            assert_eq!(parse_mtime(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn xattr_keys_round_trip() {
        for name in [
            &b"user.a"[..],
            b"trusted.overlay.opaque",
            b"user.a=b",
            b"user.\xff\x00",
        ] {
            let key = xattr_key(name);
            assert_eq!(xattr_name_from_key(key.as_bytes()), Some(Ok(name.to_vec())));
        }
        assert_eq!(xattr_key(b"user.x"), "SCHILY.xattr.user.x");
        assert_eq!(xattr_name_from_key(b"mtime"), None);
        assert_eq!(xattr_name_from_key(b"BELAYER.xattrhex.abc"), Some(Err(())));
    }

    #[test]
    fn pax_records_parse_by_length() {
        let mut block = Vec::new();
        let mut builder = tar::Builder::new(&mut block);
        let binary: &[u8] = b"a\nb=c\n\0";
        builder
            .append_pax_extensions([("mtime", &b"1.5"[..]), ("SCHILY.xattr.user.x", binary)])
            .unwrap();
        drop(builder);
        let data = &block[512..];
        let len = tar::Header::from_byte_slice(&block[..512])
            .entry_size()
            .unwrap() as usize;
        let records = parse_pax_records(&data[..len]).unwrap();
        assert_eq!(
            records,
            [
                (&b"mtime"[..], &b"1.5"[..]),
                (&b"SCHILY.xattr.user.x"[..], binary)
            ]
        );
        for bad in [
            &b"5 a=b"[..],
            b"x a=b\n",
            b"6 ab\n",
            b"5 =b\n",
            b"99 a=b\n",
            b"3 \n",
            b"a",
        ] {
            assert!(parse_pax_records(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_pax_records(b"").unwrap(), []);
    }

    #[test]
    fn layer_xattr_namespaces() {
        assert!(is_layer_xattr(b"user.foo"));
        assert!(is_layer_xattr(b"trusted.overlay.opaque"));
        assert!(is_layer_xattr(b"security.capability"));
        assert!(is_layer_xattr(b"system.posix_acl_access"));
        assert!(!is_layer_xattr(b"system.nfs4_acl"));
        assert!(!is_layer_xattr(b"foo.bar"));
    }
}
