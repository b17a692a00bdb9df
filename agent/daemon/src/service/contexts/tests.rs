//! Tests of [`ContextLogs`]: owners, bounded files, budgets, restarts and hostile files
//! (removals: module `remove`).

mod remove;

use std::fs::OpenOptions;

use belayer_ipc::{ErrorCode, PeerCred};

use super::*;
use belayer_context::{ContextLog, Record, FRAME_HEADER_BYTES};

fn caller(uid: u32) -> Caller {
    Caller {
        cred: PeerCred {
            pid: 1,
            uid,
            gid: uid,
        },
        groups: Some(vec![]),
    }
}

const ROOT: u32 = 0;
const PEER: u32 = 5001;

fn limits() -> ContextLimits {
    ContextLimits::default()
}

fn err(r: Result<ContextEntry, ContextError>) -> (ErrorCode, String) {
    let e = r.expect_err("an error");
    (e.code(), e.reply().message)
}

#[test]
fn another_peers_trajectory_answers_like_an_unknown_one() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let root = caller(ROOT);
    let peer = caller(PEER);
    logs.append(&root, "root-traj", 1, b"root secret".to_vec())
        .unwrap();

    // Lookups: by plain name (the peer's own namespace) and qualified with root's uid.
    for (mine, unknown) in [("root-traj", "never"), ("root-traj@0", "never@0")] {
        for prefix in [None, Some(1)] {
            let a = err(logs.lookup(&peer, mine, prefix));
            let b = err(logs.lookup(&peer, unknown, prefix));
            assert_eq!(a.0, ErrorCode::NotFound, "{}", a.1);
            assert_eq!(a.0, b.0);
            assert_eq!(a.1.replace(mine, "ID"), b.1.replace(unknown, "ID"));
        }
    }
    // An append into root's namespace is refused whether or not the trajectory exists.
    let a = err(logs.append(&peer, "root-traj@0", 2, b"POISONED".to_vec()));
    let b = err(logs.append(&peer, "never@0", 2, b"POISONED".to_vec()));
    assert_eq!(a.0, ErrorCode::PermissionDenied, "{}", a.1);
    assert_eq!(
        a.1.replace("root-traj@0", "ID"),
        b.1.replace("never@0", "ID")
    );
    // A plain append makes the peer's own trajectory of that name, like for an unknown one.
    let own = logs
        .append(&peer, "root-traj", 1, b"POISONED".to_vec())
        .unwrap();
    let fresh = logs
        .append(&peer, "never", 1, b"POISONED".to_vec())
        .unwrap();
    assert_eq!(
        own.record, fresh.record,
        "both are the first record of a new log"
    );

    // Root's trajectory is untouched; root reaches the peer's by its qualified id.
    let r = logs.lookup(&root, "root-traj", None).unwrap();
    assert_eq!((r.prefix, r.context.as_slice()), (1, &b"root secret"[..]));
    assert_eq!(r.digest, belayer_context::record_digest(b"root secret"));
    let p = logs.lookup(&root, "root-traj@5001", Some(1)).unwrap();
    assert_eq!(p.context, b"POISONED");
    assert_eq!(p.trajectory, "root-traj@5001");
    assert_eq!(
        logs.lookup(&peer, "root-traj@5001", None).unwrap().context,
        b"POISONED"
    );
    assert_eq!(
        logs.lookup(&peer, "root-traj", None).unwrap().context,
        b"POISONED"
    );
    assert_eq!(
        logs.lookup(&caller(5002), "root-traj@5001", None)
            .unwrap_err()
            .code(),
        ErrorCode::NotFound
    );
    // Root appends to a peer's trajectory on its behalf, charged to the peer.
    let before = logs.usage(PEER);
    logs.append(&root, "root-traj@5001", 2, b"from root".to_vec())
        .unwrap();
    assert!(logs.usage(PEER) > before);
    assert_eq!(
        logs.lookup(&peer, "root-traj", None).unwrap().context,
        b"from root"
    );
    assert!(dir.path().join("contexts/root-traj.ctxlog").is_file());
    assert!(dir.path().join("contexts/u5001/root-traj.ctxlog").is_file());
    for bad in ["../x", "t@", "t@x", ".t", ""] {
        assert_eq!(
            err(logs.append(&peer, bad, 1, vec![])).0,
            ErrorCode::BadRequest,
            "{bad:?}"
        );
        assert_eq!(err(logs.lookup(&peer, bad, None)).0, ErrorCode::BadRequest);
    }
}

#[test]
fn open_files_stay_bounded_and_logs_reopen_on_demand() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(
        dir.path(),
        ContextLimits {
            max_open_logs: 4,
            ..limits()
        },
    );
    let peer = caller(PEER);
    for i in 0..60 {
        logs.append(&peer, &format!("t{i}"), 1, format!("ctx {i}").into_bytes())
            .unwrap();
        assert!(logs.open_files() <= 4);
    }
    for i in (0..60).rev() {
        let e = logs.lookup(&peer, &format!("t{i}"), Some(1)).unwrap();
        assert_eq!(e.context, format!("ctx {i}").into_bytes());
        assert!(logs.open_files() <= 4);
    }
}

#[test]
fn the_budget_counts_every_record_and_refuses_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let context = vec![7u8; 1000];
    let frame = EncodedRecord::boundary("a", 1, &context)
        .unwrap()
        .frame_bytes();
    let per_record = frame + RECORD_CHARGE;
    let budget = TRAJECTORY_CHARGE + HEADER_BYTES + 3 * per_record;
    let logs = ContextLogs::open(
        dir.path(),
        ContextLimits {
            uid_budget_bytes: Some(budget),
            ..limits()
        },
    );
    let peer = caller(PEER);
    for k in 1..=3 {
        logs.append(&peer, "a", k, context.clone()).unwrap();
    }
    assert_eq!(logs.usage(PEER), budget);
    let (code, message) = err(logs.append(&peer, "a", 4, context.clone()));
    assert_eq!(code, ErrorCode::InvalidState);
    assert!(
        message.contains("budget of uid 5001 exhausted") && message.contains(&budget.to_string()),
        "{message}"
    );
    assert_eq!(logs.usage(PEER), budget, "a refused append charges nothing");
    // A new trajectory is refused too, and leaves neither a file nor a table entry.
    assert_eq!(
        err(logs.append(&peer, "b", 1, vec![1])).0,
        ErrorCode::InvalidState
    );
    assert!(!dir.path().join("contexts/u5001/b.ctxlog").exists());
    assert_eq!(err(logs.lookup(&peer, "b", None)).0, ErrorCode::NotFound);
    assert!(!lock(&logs.table).trajectories.keys().any(|k| k.name == "b"));
    // Another uid and root have budgets of their own (root: unlimited by default).
    logs.append(&caller(5002), "a", 1, context.clone()).unwrap();
    logs.append(&caller(ROOT), "a", 1, vec![0; 100_000])
        .unwrap();
    assert_eq!(logs.lookup(&peer, "a", None).unwrap().prefix, 3);
}

#[test]
fn an_oversized_context_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(
        dir.path(),
        ContextLimits {
            max_context_bytes: 100,
            ..limits()
        },
    );
    let (code, message) = err(logs.append(&caller(PEER), "a", 1, vec![0; 101]));
    assert_eq!(code, ErrorCode::BadRequest);
    assert!(
        message.contains("101 bytes exceeds the limit of 100"),
        "{message}"
    );
    assert!(!dir.path().join("contexts").exists());
    assert_eq!(logs.usage(PEER), 0);
    logs.append(&caller(PEER), "a", 1, vec![0; 100]).unwrap();
}

#[test]
fn a_restart_keeps_owners_budgets_and_lookups() {
    let dir = tempfile::tempdir().unwrap();
    let (root, peer) = (caller(ROOT), caller(PEER));
    let usage = {
        let logs = ContextLogs::open(dir.path(), limits());
        logs.append(&root, "shared", 1, b"root's".to_vec()).unwrap();
        logs.append(&peer, "shared", 1, b"peer's".to_vec()).unwrap();
        logs.append(&peer, "shared", 2, b"peer's 2".to_vec())
            .unwrap();
        logs.append(&peer, "other", 5, vec![3; 5000]).unwrap();
        logs.usage(PEER)
    };
    let logs = ContextLogs::open(dir.path(), limits());
    // Before any use the logs count their file sizes: a lower bound.
    assert!(logs.usage(PEER) > 0 && logs.usage(PEER) <= usage);
    assert_eq!(
        logs.lookup(&root, "shared", None).unwrap().context,
        b"root's"
    );
    assert_eq!(
        logs.lookup(&peer, "shared", None).unwrap().context,
        b"peer's 2"
    );
    assert_eq!(
        logs.lookup(&peer, "shared", Some(1)).unwrap().context,
        b"peer's"
    );
    assert_eq!(logs.lookup(&peer, "other", Some(5)).unwrap().prefix, 5);
    assert_eq!(
        logs.usage(PEER),
        usage,
        "scanned logs are charged as before"
    );
    assert_eq!(
        err(logs.lookup(&peer, "shared@0", None)).0,
        ErrorCode::NotFound
    );
    let next = logs.append(&peer, "shared", 3, b"3".to_vec()).unwrap();
    assert!(next.record > logs.lookup(&peer, "shared", Some(2)).unwrap().record);
}

#[test]
fn logs_older_than_owners_are_roots_and_a_torn_tail_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let contexts = dir.path().join("contexts");
    std::fs::create_dir_all(&contexts).unwrap();
    let path = contexts.join("old.ctxlog");
    let (mut log, _) = ContextLog::open(&path).unwrap();
    for k in 1..=2 {
        log.append(&Record::Boundary {
            trajectory: "old".into(),
            prefix: k,
            context: format!("old {k}").into_bytes(),
        })
        .unwrap();
    }
    let last = log.boundary_id("old", 2).unwrap();
    drop(log);
    // A crash inside the last record.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(last.offset() + FRAME_HEADER_BYTES + 2).unwrap();

    let logs = ContextLogs::open(dir.path(), limits());
    assert_eq!(
        err(logs.lookup(&caller(PEER), "old", None)).0,
        ErrorCode::NotFound
    );
    let e = logs.lookup(&caller(ROOT), "old", None).unwrap();
    assert_eq!((e.prefix, e.context.as_slice()), (1, &b"old 1"[..]));
    assert_eq!(std::fs::metadata(&path).unwrap().len(), last.offset());
    let again = logs
        .append(&caller(ROOT), "old", 2, b"again".to_vec())
        .unwrap();
    assert_eq!(again.record, last.offset());
}

#[test]
fn concurrent_appends_and_lookups_with_few_open_files() {
    let dir = tempfile::tempdir().unwrap();
    let logs = Arc::new(ContextLogs::open(
        dir.path(),
        ContextLimits {
            max_open_logs: 2,
            ..limits()
        },
    ));
    let threads: Vec<_> = (0..4u32)
        .map(|n| {
            let logs = Arc::clone(&logs);
            std::thread::spawn(move || {
                let who = caller(PEER + n % 2);
                for k in 0..15u64 {
                    let t = format!("t{}", k % 3);
                    logs.append(&who, &t, k * 10 + u64::from(n), vec![n as u8; 64])
                        .unwrap();
                    let e = logs.lookup(&who, &t, Some(k * 10 + u64::from(n))).unwrap();
                    assert_eq!(e.context, vec![n as u8; 64]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(logs.open_files() <= 2);
    assert_eq!(lock(&logs.table).trajectories.len(), 6);
}

#[test]
fn the_first_append_after_a_start_is_checked_against_exact_charges() {
    let dir = tempfile::tempdir().unwrap();
    let peer = caller(PEER);
    let frame = EncodedRecord::boundary("a", 1, b"x").unwrap().frame_bytes();
    let budget = TRAJECTORY_CHARGE + HEADER_BYTES + 20 * (frame + RECORD_CHARGE);
    let limits = ContextLimits {
        uid_budget_bytes: Some(budget),
        ..limits()
    };
    {
        let logs = ContextLogs::open(dir.path(), limits.clone());
        for k in 0..20 {
            logs.append(&peer, "a", k, b"x".to_vec()).unwrap();
        }
        assert_eq!(logs.usage(PEER), budget);
    }
    let logs = ContextLogs::open(dir.path(), limits);
    // The listing charges the file size only, which would leave room for a new trajectory...
    assert!(logs.usage(PEER) + TRAJECTORY_CHARGE + HEADER_BYTES + frame + RECORD_CHARGE < budget);
    // ... but the append scans the uid's logs first.
    assert_eq!(
        err(logs.append(&peer, "b", 0, b"x".to_vec())).0,
        ErrorCode::InvalidState
    );
    assert_eq!(logs.usage(PEER), budget);
    assert_eq!(logs.lookup(&peer, "a", None).unwrap().prefix, 19);
}

#[test]
fn hostile_files_in_the_dir_neither_crash_nor_are_followed() {
    let dir = tempfile::tempdir().unwrap();
    let contexts = dir.path().join("contexts");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&contexts).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    // A real log outside, reachable only through links.
    let (mut log, _) = ContextLog::open(outside.join("t.ctxlog")).unwrap();
    log.append(&Record::Boundary {
        trajectory: "t".into(),
        prefix: 1,
        context: b"outside".to_vec(),
    })
    .unwrap();
    drop(log);
    std::os::unix::fs::symlink(&outside, contexts.join(format!("u{PEER}"))).unwrap();
    std::os::unix::fs::symlink(outside.join("t.ctxlog"), contexts.join("t.ctxlog")).unwrap();
    // Corrupt logs: bad magic, a frame announcing 4 GiB, a CRC-valid frame that is no record.
    std::fs::write(contexts.join("magic.ctxlog"), b"not a context log at all").unwrap();
    drop(ContextLog::open(contexts.join("huge.ctxlog")).unwrap());
    let mut huge = std::fs::read(contexts.join("huge.ctxlog")).unwrap();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    huge.extend_from_slice(&[0; 4]);
    std::fs::write(contexts.join("huge.ctxlog"), &huge).unwrap();
    let mut garbage = huge[..HEADER_BYTES as usize].to_vec();
    garbage.extend_from_slice(&3u32.to_le_bytes());
    garbage.extend_from_slice(&crc32fast::hash(&[0x7f; 3]).to_le_bytes());
    garbage.extend_from_slice(&[0x7f; 3]);
    std::fs::write(contexts.join("garbage.ctxlog"), &garbage).unwrap();

    let logs = ContextLogs::open(dir.path(), limits());
    let (root, peer) = (caller(ROOT), caller(PEER));
    // Links are not logs: unknown, and an append neither follows nor replaces them.
    assert_eq!(err(logs.lookup(&root, "t", None)).0, ErrorCode::NotFound);
    assert_eq!(err(logs.lookup(&peer, "t", None)).0, ErrorCode::NotFound);
    assert_eq!(
        err(logs.append(&root, "t", 2, b"through a link".to_vec())).0,
        ErrorCode::Internal
    );
    assert_eq!(
        err(logs.append(&peer, "new", 1, b"into a linked dir".to_vec())).0,
        ErrorCode::Internal
    );
    assert!(!outside.join("new.ctxlog").exists());
    let (log, _) = ContextLog::open(outside.join("t.ctxlog")).unwrap();
    assert_eq!(log.len(), 1, "the linked log is untouched");
    drop(log);
    // Corrupt logs fail for their own trajectory only; a huge length is a cut tail.
    for name in ["magic", "garbage"] {
        assert_eq!(err(logs.lookup(&root, name, None)).0, ErrorCode::Internal);
    }
    assert_eq!(err(logs.lookup(&root, "huge", None)).0, ErrorCode::NotFound);
    assert_eq!(
        std::fs::metadata(contexts.join("huge.ctxlog"))
            .unwrap()
            .len(),
        HEADER_BYTES
    );
    logs.append(&root, "huge", 1, b"fine".to_vec()).unwrap();
    logs.append(&root, "fresh", 1, b"fine".to_vec()).unwrap();
    assert_eq!(logs.lookup(&root, "fresh", None).unwrap().context, b"fine");
}

#[test]
fn a_log_made_behind_the_table_is_taken_over_and_charged() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let peer = caller(PEER);
    logs.append(&peer, "first", 1, b"1".to_vec()).unwrap();
    let before = logs.usage(PEER);
    // A log the listing did not see (written while the daemon ran).
    let path = dir.path().join(format!("contexts/u{PEER}/late.ctxlog"));
    let (mut log, _) = ContextLog::open(&path).unwrap();
    log.append(&Record::Boundary {
        trajectory: "late".into(),
        prefix: 1,
        context: vec![5; 100],
    })
    .unwrap();
    drop(log);
    let e = logs.append(&peer, "late", 2, b"2".to_vec()).unwrap();
    assert!(
        e.record > HEADER_BYTES,
        "appended after the existing record"
    );
    assert_eq!(
        logs.lookup(&peer, "late", Some(1)).unwrap().context,
        vec![5; 100]
    );
    let late = std::fs::metadata(&path).unwrap().len();
    assert_eq!(
        logs.usage(PEER),
        before + TRAJECTORY_CHARGE + late + 2 * RECORD_CHARGE
    );
}

#[test]
fn a_huge_invalid_id_is_quoted_only_in_part() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let id = "é".repeat(100_000);
    let (code, message) = err(logs.lookup(&caller(PEER), &id, None));
    assert_eq!(code, ErrorCode::BadRequest, "{message}");
    assert!(message.len() < 1024, "{} bytes", message.len());
    assert!(message.contains(&"é".repeat(ContextError::QUOTED_ID_CHARS)));
}
