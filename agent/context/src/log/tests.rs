//! Tests of [`ContextLog`]: recovery at every kind of damage, lookups read back from the file.

use super::*;
use crate::{
    frame, record_digest, Damage, FORMAT_VERSION, FRAME_HEADER_BYTES, HEADER_BYTES,
    MAX_RECORD_BYTES,
};

fn boundary(t: &str, k: u64, ctx: &[u8]) -> Record {
    Record::Boundary {
        trajectory: t.into(),
        prefix: k,
        context: ctx.to_vec(),
    }
}

fn tokens(t: &str, req: &str, k: u64, n: u32) -> Record {
    Record::TokenPrefix {
        trajectory: t.into(),
        request: req.into(),
        prefix: k,
        tokens: (0..n).collect(),
    }
}

/// Three boundaries of `a`, one of `b`, two token prefixes: returns the records and ids.
fn fill(log: &mut ContextLog) -> Vec<(RecordId, Record)> {
    let recs = vec![
        boundary("a", 0, b"system prompt"),
        boundary("a", 1, b"system prompt|obs 1"),
        tokens("a", "a-r2", 1, 256),
        boundary("b", 0, &[0xff; 300]),
        tokens("a", "a-r2", 1, 512),
        boundary("a", 2, b"system prompt|obs 1|obs 2"),
    ];
    recs.into_iter()
        .map(|r| (log.append(&r).unwrap(), r))
        .collect()
}

fn assert_records(log: &ContextLog, expected: &[(RecordId, Record)]) {
    let got: Vec<_> = log
        .ids()
        .map(|id| (id, log.get(id).unwrap().unwrap()))
        .collect();
    assert_eq!(got, expected);
}

#[test]
fn create_append_lookup_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, rec) = ContextLog::open(&path).unwrap();
    assert!(rec.created);
    assert_eq!(rec.records, 0);
    assert!(log.is_empty());
    assert_eq!(log.size_bytes(), HEADER_BYTES);
    let written = fill(&mut log);
    assert_eq!(written[0].0, RecordId(HEADER_BYTES));

    let check = |log: &ContextLog| {
        assert_eq!(log.len(), 6);
        assert_eq!(
            log.boundary("a", 1).unwrap(),
            Some(b"system prompt|obs 1".to_vec())
        );
        assert_eq!(log.boundary("b", 0).unwrap(), Some(vec![0xff; 300]));
        assert_eq!(log.boundary("a", 3).unwrap(), None);
        assert_eq!(log.boundary("c", 0).unwrap(), None);
        assert_eq!(
            log.latest_boundary("a").unwrap(),
            Some((2, b"system prompt|obs 1|obs 2".to_vec()))
        );
        assert_eq!(
            log.longest_token_prefix("a", "a-r2")
                .unwrap()
                .map(|t| t.len()),
            Some(512)
        );
        assert_eq!(log.longest_token_prefix("a", "nope").unwrap(), None);
        assert_eq!(log.longest_token_prefix("b", "a-r2").unwrap(), None);
        assert_eq!(log.boundary_id("a", 1), Some(written[1].0));
        assert_eq!(log.get(written[2].0).unwrap(), Some(written[2].1.clone()));
        assert_eq!(log.get(RecordId(1)).unwrap(), None);
        assert_records(log, &written);
    };
    check(&log);
    let size = log.size_bytes();
    drop(log);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), size);

    let (log, rec) = ContextLog::open(&path).unwrap();
    assert_eq!(
        rec,
        Recovery {
            records: 6,
            truncated_bytes: 0,
            damage: None,
            created: false
        }
    );
    check(&log);
}

#[test]
fn later_boundary_of_same_prefix_wins_and_shorter_token_prefix_does_not() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = ContextLog::open(dir.path().join("l")).unwrap();
    log.append(&boundary("a", 3, b"old")).unwrap();
    log.append(&boundary("a", 4, b"old4")).unwrap();
    // Rollback to 2 and regeneration: a new boundary 3 supersedes the old one.
    log.append(&boundary("a", 3, b"new")).unwrap();
    assert_eq!(log.boundary("a", 3).unwrap(), Some(b"new".to_vec()));
    assert_eq!(
        log.latest_boundary("a").unwrap(),
        Some((3, b"new".to_vec()))
    );
    log.append(&tokens("a", "r", 3, 512)).unwrap();
    log.append(&tokens("a", "r", 3, 256)).unwrap();
    assert_eq!(
        log.longest_token_prefix("a", "r").unwrap().unwrap().len(),
        512
    );
    log.append(&tokens("a", "r", 3, 512)).unwrap();
    assert_eq!(
        log.longest_token_prefix("a", "r").unwrap().unwrap().len(),
        512
    );
}

#[test]
fn torn_tail_at_every_offset_of_last_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    let written = fill(&mut log);
    let (last_id, _) = written.last().unwrap().clone();
    let full = log.size_bytes();
    drop(log);
    let pristine = std::fs::read(&path).unwrap();
    let kept = &written[..written.len() - 1];

    for cut in last_id.offset()..full {
        std::fs::write(&path, &pristine[..cut as usize]).unwrap();
        let (mut log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(rec.records, kept.len() as u64, "cut at {cut}");
        assert_eq!(rec.truncated_bytes, cut - last_id.offset(), "cut at {cut}");
        if cut == last_id.offset() {
            assert_eq!(rec.damage, None);
        } else {
            assert_eq!(
                rec.damage,
                Some(Damage::Short {
                    offset: last_id.offset()
                }),
                "cut at {cut}"
            );
        }
        assert_records(&log, kept);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), last_id.offset());
        assert_eq!(log.latest_boundary("a").unwrap().unwrap().0, 1);
        // Appends work after recovery and land where the torn record was.
        let id = log.append(&boundary("a", 2, b"again")).unwrap();
        assert_eq!(id, last_id);
        drop(log);
        let (log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(rec.damage, None);
        assert_eq!(log.len(), kept.len() + 1);
        assert_eq!(log.boundary("a", 2).unwrap(), Some(b"again".to_vec()));
    }
}

#[test]
fn crc_mismatch_in_middle_record_drops_it_and_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    let written = fill(&mut log);
    let full = log.size_bytes();
    drop(log);
    // Flip one payload byte of record 3 (the 300-byte boundary of "b").
    let victim = written[3].0.offset();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(victim + FRAME_HEADER_BYTES + 20) as usize] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();

    let (log, rec) = ContextLog::open(&path).unwrap();
    assert_eq!(rec.records, 3);
    assert_eq!(rec.truncated_bytes, full - victim);
    assert!(
        matches!(rec.damage, Some(Damage::CrcMismatch { offset, stored, computed })
            if offset == victim && stored != computed),
        "{rec:?}"
    );
    assert_records(&log, &written[..3]);
    assert_eq!(log.boundary("b", 0).unwrap(), None);
    assert_eq!(
        log.longest_token_prefix("a", "a-r2")
            .unwrap()
            .unwrap()
            .len(),
        256
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), victim);
}

#[test]
fn zero_filled_tail_is_damage_not_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    log.append(&boundary("a", 0, b"x")).unwrap();
    let end = log.size_bytes();
    drop(log);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(&[0u8; 4096]);
    std::fs::write(&path, &bytes).unwrap();
    let (log, rec) = ContextLog::open(&path).unwrap();
    assert_eq!(rec.records, 1);
    assert_eq!(rec.truncated_bytes, 4096);
    assert_eq!(
        rec.damage,
        Some(Damage::BadLength {
            offset: end,
            len: 0
        })
    );
    assert_eq!(log.len(), 1);
}

#[test]
fn header_errors_and_torn_header() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    std::fs::write(&path, b"definitely not a log").unwrap();
    assert!(matches!(
        ContextLog::open(&path),
        Err(ContextLogError::BadHeader { .. })
    ));
    let mut h = frame::header().to_vec();
    h[8] = 9;
    std::fs::write(&path, &h).unwrap();
    assert!(matches!(
        ContextLog::open(&path),
        Err(ContextLogError::UnsupportedVersion {
            found: 9,
            supported: FORMAT_VERSION,
            ..
        })
    ));
    // A creation cut short inside the header is redone.
    std::fs::write(&path, &frame::header()[..5]).unwrap();
    let (mut log, rec) = ContextLog::open(&path).unwrap();
    assert!(rec.created);
    assert_eq!(rec.truncated_bytes, 5);
    log.append(&boundary("a", 0, b"x")).unwrap();
    drop(log);
    assert_eq!(ContextLog::open(&path).unwrap().0.len(), 1);
}

#[test]
fn crc_valid_garbage_is_a_decode_error_and_file_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    drop(ContextLog::open(&path).unwrap());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(&frame::encode_frame(&[0x7f; 3]));
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        ContextLog::open(&path),
        Err(ContextLogError::Decode {
            offset: HEADER_BYTES,
            ..
        })
    ));
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[test]
fn second_writer_is_refused_and_buffered_mode_syncs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open_with(&path, Durability::Buffered).unwrap();
    assert!(matches!(
        ContextLog::open(&path),
        Err(ContextLogError::Locked { .. })
    ));
    assert_eq!(log.durability(), Durability::Buffered);
    log.append(&boundary("a", 0, b"ctx")).unwrap();
    log.sync().unwrap();
    assert_eq!(log.path(), path);
    let debug = format!("{log:?}");
    assert!(
        debug.contains("records: 1") && !debug.contains("Boundary"),
        "{debug}"
    );
    drop(log);
    let (log, _) = ContextLog::open(&path).unwrap();
    assert_eq!(log.boundary("a", 0).unwrap(), Some(b"ctx".to_vec()));
    assert_eq!(
        record_digest(&log.boundary("a", 0).unwrap().unwrap()),
        record_digest(b"ctx")
    );
    assert_eq!(
        log.boundary_digest("a", 0).as_deref(),
        Some(record_digest(b"ctx").as_str())
    );
}

#[test]
fn oversized_record_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = ContextLog::open(dir.path().join("l")).unwrap();
    let big = boundary("a", 0, &vec![0u8; MAX_RECORD_BYTES as usize + 1]);
    assert!(matches!(
        log.append(&big),
        Err(ContextLogError::RecordTooLarge { max, .. }) if max == u64::from(MAX_RECORD_BYTES)
    ));
    assert!(log.is_empty());
    assert_eq!(log.size_bytes(), HEADER_BYTES);
}

#[test]
fn lookups_read_the_file_and_notice_a_record_changed_behind_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    let written = fill(&mut log);
    // A context is read back from the file, not kept: flip one of its bytes on disk.
    let victim = written[1].0.offset();
    let other = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&other, b"X", victim + FRAME_HEADER_BYTES + 12)
        .unwrap();
    assert!(matches!(
        log.boundary("a", 1),
        Err(ContextLogError::RecordChanged { offset, .. }) if offset == victim
    ));
    // The other records are intact, and the digest still comes from the index.
    assert_eq!(
        log.boundary("a", 0).unwrap(),
        Some(b"system prompt".to_vec())
    );
    assert_eq!(
        log.boundary_digest("a", 1),
        Some(record_digest(b"system prompt|obs 1"))
    );
    // A file cut behind the log: the record is gone, which is an error, not a miss.
    other.set_len(victim).unwrap();
    assert!(matches!(
        log.latest_boundary("a"),
        Err(ContextLogError::RecordChanged { .. })
    ));
}

#[test]
fn an_empty_context_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let (mut log, _) = ContextLog::open(dir.path().join("l")).unwrap();
    log.append(&boundary("a", 0, b"")).unwrap();
    assert_eq!(log.boundary("a", 0).unwrap(), Some(Vec::new()));
    assert_eq!(log.latest_boundary("a").unwrap(), Some((0, Vec::new())));
}

#[test]
fn a_length_past_the_end_or_above_the_maximum_is_a_cut_tail() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    log.append(&boundary("a", 0, b"x")).unwrap();
    let end = log.size_bytes();
    drop(log);
    let clean = std::fs::read(&path).unwrap();
    for (len, damage) in [
        (MAX_RECORD_BYTES, Damage::Short { offset: end }),
        (
            MAX_RECORD_BYTES + 1,
            Damage::BadLength {
                offset: end,
                len: MAX_RECORD_BYTES + 1,
            },
        ),
        (
            u32::MAX,
            Damage::BadLength {
                offset: end,
                len: u32::MAX,
            },
        ),
    ] {
        let mut bytes = clean.clone();
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&[0xab; 12]);
        std::fs::write(&path, &bytes).unwrap();
        let (log, rec) = ContextLog::open(&path).unwrap();
        assert_eq!(rec.damage, Some(damage), "len {len}");
        assert_eq!(rec.truncated_bytes, 16);
        assert_eq!(log.len(), 1);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), end);
    }
}
