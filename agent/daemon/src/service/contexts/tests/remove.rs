//! Tests of [`ContextLogs::remove`]: answers, budgets, owners, hostile files, restarts and
//! races with appends and lookups.

use super::*;

fn removed(r: Result<u64, ContextError>) -> (ErrorCode, String) {
    let e = r.expect_err("an error");
    (e.code(), e.reply().message)
}

fn log_path(dir: &Path, owner: u32, name: &str) -> PathBuf {
    names::path(
        &dir.join("contexts"),
        &Key {
            owner,
            name: name.into(),
        },
    )
}

#[test]
fn a_removed_trajectory_is_unknown_and_its_next_append_starts_a_new_log() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let peer = caller(PEER);
    let first = logs.append(&peer, "t", 1, b"one".to_vec()).unwrap();
    for k in 2..=3 {
        logs.append(&peer, "t", k, vec![k as u8; 100]).unwrap();
    }
    let path = log_path(dir.path(), PEER, "t");
    assert!(path.is_file());
    let used = logs.usage(PEER);
    assert_eq!(logs.remove(&peer, "t").unwrap(), used);
    assert!(!path.exists());
    assert_eq!(logs.usage(PEER), 0);
    assert_eq!(logs.open_files(), 0);
    for prefix in [None, Some(1), Some(3)] {
        assert_eq!(err(logs.lookup(&peer, "t", prefix)).0, ErrorCode::NotFound);
    }
    let (code, message) = removed(logs.remove(&peer, "t"));
    assert_eq!(code, ErrorCode::NotFound, "{message}");
    assert_eq!(message, "no context log for trajectory t");

    // A new log: its first record where the first one was, the old boundaries gone.
    let again = logs.append(&peer, "t", 1, b"new one".to_vec()).unwrap();
    assert_eq!(again.record, first.record);
    assert_eq!(logs.lookup(&peer, "t", None).unwrap().context, b"new one");
    assert_eq!(err(logs.lookup(&peer, "t", Some(3))).0, ErrorCode::NotFound);
    for bad in ["../x", "t@", "t@x", ".t", ""] {
        assert_eq!(removed(logs.remove(&peer, bad)).0, ErrorCode::BadRequest);
    }
}

#[test]
fn a_removal_gives_the_budget_back() {
    let dir = tempfile::tempdir().unwrap();
    let context = vec![7u8; 1000];
    let frame = EncodedRecord::boundary("a", 1, &context)
        .unwrap()
        .frame_bytes();
    let budget = TRAJECTORY_CHARGE + HEADER_BYTES + 3 * (frame + RECORD_CHARGE);
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
    assert_eq!(
        err(logs.append(&peer, "b", 1, context.clone())).0,
        ErrorCode::InvalidState
    );
    assert_eq!(logs.remove(&peer, "a").unwrap(), budget);
    assert_eq!(logs.usage(PEER), 0);
    logs.append(&peer, "b", 1, context.clone()).unwrap();
    assert_eq!(
        logs.usage(PEER),
        TRAJECTORY_CHARGE + HEADER_BYTES + frame + RECORD_CHARGE
    );
}

#[test]
fn only_root_and_the_owner_remove_and_others_are_answered_like_for_an_unknown_one() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let (root, peer, other) = (caller(ROOT), caller(PEER), caller(5002));
    logs.append(&peer, "peer-log", 1, b"peer's".to_vec())
        .unwrap();
    logs.append(&root, "root-log", 1, b"root's".to_vec())
        .unwrap();
    let used = logs.usage(PEER);

    for (theirs, unknown) in [
        ("peer-log@5001", "never@5001"),
        ("root-log@0", "never@0"),
        ("root-log", "never"),
    ] {
        let a = removed(logs.remove(&other, theirs));
        let b = removed(logs.remove(&other, unknown));
        assert_eq!(a.0, ErrorCode::NotFound, "{}", a.1);
        assert_eq!(a.0, b.0);
        assert_eq!(a.1.replace(theirs, "ID"), b.1.replace(unknown, "ID"));
    }
    // The other uid's plain `peer-log` names its own namespace, where there is none.
    assert_eq!(
        removed(logs.remove(&other, "peer-log")).0,
        ErrorCode::NotFound
    );
    assert_eq!(logs.usage(PEER), used);
    assert_eq!(
        logs.lookup(&peer, "peer-log", None).unwrap().context,
        b"peer's"
    );
    assert_eq!(
        logs.lookup(&root, "root-log", None).unwrap().context,
        b"root's"
    );

    // Root removes the peer's by its qualified id; the peer its own by either id.
    assert_eq!(logs.remove(&root, "peer-log@5001").unwrap(), used);
    assert_eq!(logs.usage(PEER), 0);
    assert_eq!(
        err(logs.lookup(&peer, "peer-log", None)).0,
        ErrorCode::NotFound
    );
    assert!(!log_path(dir.path(), PEER, "peer-log").exists());
    logs.append(&peer, "u", 1, b"x".to_vec()).unwrap();
    logs.remove(&peer, "u@5001").unwrap();
    assert!(
        logs.lookup(&root, "root-log", None).is_ok(),
        "root's is untouched"
    );
}

#[test]
fn a_removal_unlinks_what_lies_in_the_dir_and_never_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let logs = ContextLogs::open(dir.path(), limits());
    let (root, peer) = (caller(ROOT), caller(PEER));
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("t.ctxlog"), b"outside").unwrap();

    // The log replaced by a symlink to a file outside: the link goes, the file stays.
    logs.append(&peer, "t", 1, b"1".to_vec()).unwrap();
    let path = log_path(dir.path(), PEER, "t");
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink(outside.join("t.ctxlog"), &path).unwrap();
    logs.remove(&peer, "t").unwrap();
    assert!(
        std::fs::symlink_metadata(&path).is_err(),
        "the link is gone"
    );
    assert_eq!(std::fs::read(outside.join("t.ctxlog")).unwrap(), b"outside");
    assert_eq!(logs.usage(PEER), 0);

    // An owner's directory replaced by a symlink to a directory outside: refused, and
    // nothing outside is removed.
    logs.append(&caller(5002), "t", 1, b"1".to_vec()).unwrap();
    let owner_dir = dir.path().join("contexts/u5002");
    std::fs::rename(&owner_dir, dir.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(&outside, &owner_dir).unwrap();
    let (code, message) = removed(logs.remove(&caller(5002), "t"));
    assert_eq!(code, ErrorCode::Internal, "{message}");
    assert!(message.contains("cannot remove context log"), "{message}");
    assert_eq!(std::fs::read(outside.join("t.ctxlog")).unwrap(), b"outside");
    assert!(
        logs.usage(5002) > 0,
        "the trajectory is kept, with its charge"
    );

    // A directory in place of a log is refused and left there.
    logs.append(&root, "d", 1, b"1".to_vec()).unwrap();
    let d = log_path(dir.path(), ROOT, "d");
    std::fs::remove_file(&d).unwrap();
    std::fs::create_dir(&d).unwrap();
    assert_eq!(removed(logs.remove(&root, "d")).0, ErrorCode::Internal);
    assert!(d.is_dir());

    // A log removed behind the daemon's back leaves the table (and its charge) on removal.
    logs.append(&root, "gone", 1, b"1".to_vec()).unwrap();
    std::fs::remove_file(log_path(dir.path(), ROOT, "gone")).unwrap();
    assert!(logs.remove(&root, "gone").unwrap() > 0);
    assert_eq!(removed(logs.remove(&root, "gone")).0, ErrorCode::NotFound);
}

#[test]
fn a_removal_after_a_restart_releases_the_file_size_charge() {
    let dir = tempfile::tempdir().unwrap();
    let peer = caller(PEER);
    {
        let logs = ContextLogs::open(dir.path(), limits());
        for k in 1..=5 {
            logs.append(&peer, "a", k, vec![1; 3000]).unwrap();
        }
        logs.append(&peer, "b", 1, b"b".to_vec()).unwrap();
    }
    let logs = ContextLogs::open(dir.path(), limits());
    let a_bytes = std::fs::metadata(log_path(dir.path(), PEER, "a"))
        .unwrap()
        .len();
    let listed = logs.usage(PEER);
    // Not scanned yet: charged its file size.
    assert_eq!(
        logs.remove(&peer, "a").unwrap(),
        TRAJECTORY_CHARGE + a_bytes
    );
    assert_eq!(logs.usage(PEER), listed - TRAJECTORY_CHARGE - a_bytes);
    assert!(!log_path(dir.path(), PEER, "a").exists());
    // The uid's first append settles what is left, exactly.
    logs.append(&peer, "c", 1, b"c".to_vec()).unwrap();
    let frame = EncodedRecord::boundary("b", 1, b"b").unwrap().frame_bytes();
    let one = TRAJECTORY_CHARGE + HEADER_BYTES + frame + RECORD_CHARGE;
    assert_eq!(logs.usage(PEER), 2 * one);
    logs.remove(&peer, "b").unwrap();
    logs.remove(&peer, "c").unwrap();
    assert_eq!(logs.usage(PEER), 0);
}

#[test]
fn appends_lookups_and_removals_racing_leave_usage_equal_to_what_remains() {
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
                let who = caller(PEER);
                for i in 0..40u64 {
                    let t = format!("t{}", (i + u64::from(n)) % 3);
                    match (i + u64::from(n)) % 4 {
                        0 => match logs.remove(&who, &t) {
                            Ok(_) => {}
                            Err(e) => assert_eq!(e.code(), ErrorCode::NotFound, "{e}"),
                        },
                        1 => match logs.lookup(&who, &t, None) {
                            Ok(e) => assert_eq!(e.context.len(), 64),
                            Err(e) => assert_eq!(e.code(), ErrorCode::NotFound, "{e}"),
                        },
                        _ => {
                            logs.append(&who, &t, i, vec![n as u8; 64]).unwrap();
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let logs = Arc::into_inner(logs).unwrap();
    let (charged, on_disk): (u64, Vec<String>) = {
        let table = lock(&logs.table);
        let mut names = Vec::new();
        let mut sum = 0;
        for (key, slot) in &table.trajectories {
            let t = lock(slot);
            assert_eq!(t.status, Status::OnDisk, "{key:?}");
            sum += t.charged;
            names.push(key.name.clone());
        }
        (sum, names)
    };
    let used = logs.usage(PEER);
    assert_eq!(used, charged);
    let mut files: Vec<String> = std::fs::read_dir(dir.path().join("contexts/u5001"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let mut expected: Vec<String> = on_disk.iter().map(|n| format!("{n}.ctxlog")).collect();
    expected.sort();
    assert_eq!(files, expected, "a log file per trajectory left, no other");
    drop(logs);

    // What a fresh start charges for the logs left, once scanned, is what was charged.
    let logs = ContextLogs::open(dir.path(), limits());
    for name in &on_disk {
        logs.lookup(&caller(PEER), name, None).unwrap();
    }
    assert_eq!(logs.usage(PEER), used);
    for name in &on_disk {
        logs.remove(&caller(PEER), name).unwrap();
    }
    assert_eq!(logs.usage(PEER), 0);
}
