//! Tests of `dump`: arguments and error mapping.

use super::*;

const STATS: &str = "Displaying dump stats:\nFreezing time: 259 us\nFrozen time: 8146 us\n\
    Memory dump time: 1379 us\nMemory pages written: 60 (0x3c)\n";

fn strings(args: &[OsString]) -> Vec<String> {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

#[test]
fn default_args_follow_the_sandbox_lessons() {
    let args = strings(&DumpRequest::new(42, "/ck/img", "/ck/work").args());
    let joined = args.join(" ");
    assert!(joined.starts_with(
        "dump --no-default-config --tree 42 --images-dir /ck/img --work-dir /ck/work --log-file dump.log -v4"
    ));
    for expected in [
        "--leave-running",
        "--ext-mount-map auto",
        "--ghost-limit 268435456",
        "--manage-cgroups=ignore",
        "--display-stats",
    ] {
        assert!(joined.contains(expected), "{expected} missing in {joined}");
    }
    for absent in [
        "--freeze-cgroup",
        "--tcp-established",
        "--skip-in-flight",
        "--file-locks",
        "--timeout",
    ] {
        assert!(!joined.contains(absent), "{absent} present in {joined}");
    }
}

#[test]
fn options_map_to_flags() {
    let req = DumpRequest::new(7, "/i", "/w")
        .leave_running(false)
        .freeze_cgroup("/sys/fs/cgroup/unified/sb")
        .tcp_established(true)
        .skip_in_flight(true)
        .file_locks(true)
        .ext_mount_auto(false)
        .ghost_limit_bytes(1024)
        .manage_cgroups(true)
        .network_lock(Some(NetworkLock::Skip))
        .timeout_s(Some(5))
        .empty_netns(true)
        .log_level(LogLevel::Warnings);
    let joined = strings(&req.args()).join(" ");
    let plain = strings(&DumpRequest::new(7, "/i", "/w").args()).join(" ");
    assert!(!plain.contains("--empty-ns"));
    for expected in [
        "--empty-ns net",
        "--freeze-cgroup /sys/fs/cgroup/unified/sb",
        "--tcp-established",
        "--skip-in-flight",
        "--file-locks",
        "--ghost-limit 1024",
        "--manage-cgroups=soft",
        "--network-lock skip",
        "--timeout 5",
        " -v2 ",
    ] {
        assert!(joined.contains(expected), "{expected} missing in {joined}");
    }
    assert!(!joined.contains("--leave-running"));
    assert!(!joined.contains("--ext-mount-map"));
    assert_eq!(req.log_path(), PathBuf::from("/w/dump.log"));
}

#[test]
fn no_option_lets_criu_write_link_remaps_into_the_tree() {
    // --link-remap would make CRIU hard-link files at paths resolved through the
    // sandbox's symbolic links (absolute ones from the host root) while dumping.
    let req = DumpRequest::new(7, "/i", "/w")
        .freeze_cgroup("/cg")
        .tcp_established(true)
        .file_locks(true)
        .manage_cgroups(true);
    for r in [DumpRequest::new(7, "/i", "/w"), req] {
        let joined = strings(&r.args()).join(" ");
        assert!(!joined.contains("link-remap"), "{joined}");
    }
}

#[test]
fn parses_display_stats() {
    assert_eq!(stat_value(STATS, "Frozen time:"), Some(8146));
    assert_eq!(stat_value(STATS, "Memory pages written:"), Some(60));
    assert_eq!(stat_value(STATS, "Lazy memory pages:"), None);
}

#[test]
fn refuses_a_non_empty_images_dir_before_running_criu() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("inventory.img"), b"x").unwrap();
    let criu = Criu::unchecked("/nonexistent/criu");
    let err = criu
        .dump(&DumpRequest::new(1, dir.path(), dir.path().join("work")))
        .unwrap_err();
    assert!(
        matches!(err, DumpError::ImagesDirNotEmpty { entries: 1, .. }),
        "{err:?}"
    );
}
