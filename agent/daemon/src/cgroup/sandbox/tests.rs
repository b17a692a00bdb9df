//! Tests of sandbox cgroups: limits in the right hierarchies, adoption, membership, removal
//! (as root, against the host's cgroup tree).

use super::super::sys::{read_file, read_pids};
use super::*;
use crate::cgroup::test_support::{spawn_gated, unique_rel, TestCgroup};

#[test]
fn rejects_bad_paths() {
    for bad in [
        "", "/abs", "a//b", "a/", "a/../b", "..", ".", "a/./b", "a\0b",
    ] {
        assert!(
            matches!(validate_rel(bad), Err(CgroupError::InvalidPath { .. })),
            "{bad:?} accepted"
        );
    }
    assert_eq!(
        validate_rel("belayer/sb-1").unwrap(),
        Path::new("belayer/sb-1")
    );
    assert!(matches!(
        SandboxCgroup::create("../etc", &Limits::default()),
        Err(CgroupError::InvalidPath { .. })
    ));
}

#[test]
fn create_applies_limits_in_the_right_hierarchies() {
    let layout = CgroupLayout::detect().unwrap();
    let limits = Limits {
        memory_max: Some(64 << 20),
        pids_max: Some(7),
        ..Limits::default()
    };
    let t = TestCgroup::create("limits", &limits);
    let cg = t.cg();
    let (mem_file, pids_file) = match cg.v2_dir() {
        Some(v2) if layout.v2_has("memory") => (v2.join("memory.max"), v2.join("pids.max")),
        _ => (
            cg.v1_memory.as_ref().unwrap().join("memory.limit_in_bytes"),
            cg.v1_pids.as_ref().unwrap().join("pids.max"),
        ),
    };
    println!(
        "limits in {} and {}",
        mem_file.display(),
        pids_file.display()
    );
    assert_eq!(
        std::fs::read_to_string(&mem_file).unwrap().trim(),
        "67108864"
    );
    assert_eq!(std::fs::read_to_string(&pids_file).unwrap().trim(), "7");
    if layout.v2_mount().is_some() {
        assert!(cg.v2_dir().unwrap().is_dir());
        assert_eq!(cg.freezer_kind(), FreezerKind::V2);
        assert_eq!(cg.freezer_dir(), cg.v2_dir().unwrap());
    }
    if !layout.v2_has("memory") {
        // Hybrid: the v2 directory carries no limit files.
        assert!(!cg.v2_dir().unwrap().join("memory.max").exists());
    }
    assert_eq!(cg.procs_files().len(), cg.dirs().count());
    assert!(cg.procs_files().iter().all(|f| f.is_file()));
}

#[test]
fn create_twice_fails_and_open_adopts() {
    let t = TestCgroup::create("adopt", &Limits::default());
    let err = SandboxCgroup::create(t.cg().rel_path(), &Limits::default()).unwrap_err();
    assert!(matches!(err, CgroupError::AlreadyExists { .. }), "{err}");
    let child = t.spawn_in("exec sleep 1000");
    let opened = SandboxCgroup::open(t.cg().rel_path()).unwrap();
    assert_eq!(opened.rel_path(), t.cg().rel_path());
    assert_eq!(opened.procs_files(), t.cg().procs_files());
    assert_eq!(opened.freezer_kind(), t.cg().freezer_kind());
    assert_eq!(opened.pids().unwrap(), vec![child]);
    assert!(matches!(
        SandboxCgroup::open(&unique_rel("never-created")),
        Err(CgroupError::NotFound { .. })
    ));
}

#[test]
fn add_pid_puts_a_process_in_every_hierarchy() {
    let t = TestCgroup::create("add", &Limits::default());
    let pid = t.spawn_in("exec sleep 1000");
    assert_eq!(t.cg().pids().unwrap(), vec![pid]);
    let membership = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let suffix = format!("/{}", t.cg().rel_path());
    let lines: Vec<&str> = membership
        .lines()
        .filter(|l| l.ends_with(&suffix))
        .collect();
    println!("/proc/{pid}/cgroup entries in the sandbox: {lines:?}");
    assert_eq!(lines.len(), t.cg().dirs().count());
    for file in t.cg().procs_files() {
        assert_eq!(read_pids(&file).unwrap(), vec![pid], "{}", file.display());
    }
    assert!(t.cg().memory_current().is_some());
}

#[test]
fn pids_include_child_cgroups() {
    let t = TestCgroup::create("nested", &Limits::default());
    let top = t.spawn_in("exec sleep 1000");
    let nested = t.cg().main_dir().unwrap().join("inner");
    std::fs::create_dir(&nested).unwrap();
    let (mut child, gate) = spawn_gated("exec sleep 1000");
    let inner_pid = i32::try_from(child.id()).unwrap();
    std::fs::write(nested.join("cgroup.procs"), inner_pid.to_string()).unwrap();
    drop(gate);
    let mut expected = vec![top, inner_pid];
    expected.sort_unstable();
    assert_eq!(t.cg().pids().unwrap(), expected);
    // kill_all and remove (via the guard) handle the nested cgroup too.
    t.cg().kill_all(std::time::Duration::from_secs(5)).unwrap();
    child.wait().unwrap();
    assert!(t.cg().pids().unwrap().is_empty());
}

#[test]
fn pids_max_stops_forks() {
    let t = TestCgroup::create(
        "pidsmax",
        &Limits {
            pids_max: Some(5),
            ..Limits::default()
        },
    );
    // The shell itself counts: four sleeps start, the fifth fork fails and dash gives up.
    let shell = t.spawn_in("for i in 1 2 3 4 5 6 7 8 9 10; do sleep 1000 & done; exit 0");
    let status = t.wait_child(shell);
    println!("pids.max=5: the shell forking 10 sleeps ended with {status:?}");
    assert_eq!(status.code(), Some(2));
    let pids = t.cg().pids().unwrap();
    assert_eq!(pids.len(), 4, "{pids:?}");
    let layout = CgroupLayout::detect().unwrap();
    let pids_dir = match t.cg().v2_dir() {
        Some(v2) if layout.v2_has("pids") => v2.to_path_buf(),
        _ => t.cg().v1_pids.clone().unwrap(),
    };
    let events = std::fs::read_to_string(pids_dir.join("pids.events")).unwrap();
    println!("pids.events: {}", events.trim());
    let refused: u64 = events
        .lines()
        .find_map(|l| l.strip_prefix("max "))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(refused >= 1, "{events}");
}

#[test]
fn memory_limit_is_enforced() {
    let t = TestCgroup::create(
        "memmax",
        &Limits {
            memory_max: Some(32 << 20),
            ..Limits::default()
        },
    );
    // A shell variable of 64 MiB cannot fit in 32 MiB: the shell is OOM-killed.
    let pid = t.spawn_in("x=$(head -c 67108864 /dev/zero | tr '\\0' a); sleep 1000");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while t.cg().pids().unwrap().contains(&pid) {
        assert!(std::time::Instant::now() < deadline, "not OOM-killed");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let status = t.wait_child(pid);
    println!("memory.max=32MiB: allocating shell ended with {status:?}");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
}

#[test]
fn enables_v2_controllers_along_the_path() {
    // Memory and pids are v1 here, but any v2 controller takes the same path; hugetlb is
    // the one a hybrid v2 root usually offers.
    let layout = CgroupLayout::detect().unwrap();
    let (Some(root), Some(controller)) = (
        layout.v2_mount(),
        ["hugetlb", "pids", "memory"]
            .into_iter()
            .find(|c| layout.v2_has(c)),
    ) else {
        println!("no v2 controller to enable here, skipped");
        return;
    };
    let root_control = root.join("cgroup.subtree_control");
    let was_enabled = read_file(&root_control)
        .unwrap()
        .split_whitespace()
        .any(|c| c == controller);
    let top = format!("belayer-test-enable-{}", std::process::id());
    let rel = PathBuf::from(format!("{top}/mid/leaf"));
    mkdir_p(&root.join(&rel)).unwrap();
    enable_v2_controller(root, &rel, controller).unwrap();
    // Idempotent: a second call finds it enabled everywhere.
    enable_v2_controller(root, &rel, controller).unwrap();
    let leaf_files: Vec<String> = std::fs::read_dir(root.join(&rel))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{controller}.")))
        .collect();
    println!("{controller} files in the leaf: {leaf_files:?}");
    let leaf_controllers = read_file(&root.join(&rel).join("cgroup.controllers")).unwrap();
    let mid_control = read_file(&root.join(&top).join("mid/cgroup.subtree_control")).unwrap();
    remove_tree(&root.join(&top)).unwrap();
    if !was_enabled {
        write_file(&root_control, &format!("-{controller}")).unwrap();
    }
    assert!(leaf_controllers.split_whitespace().any(|c| c == controller));
    assert!(mid_control.split_whitespace().any(|c| c == controller));
    assert!(!leaf_files.is_empty());
}

#[test]
fn remove_is_idempotent_and_refuses_busy() {
    let rel = unique_rel("remove");
    let cg = SandboxCgroup::create(&rel, &Limits::default()).unwrap();
    let dirs: Vec<PathBuf> = cg.dirs().map(Path::to_path_buf).collect();
    let nested = cg.main_dir().unwrap().join("a/b");
    std::fs::create_dir_all(&nested).unwrap();
    let again = SandboxCgroup::open(&rel).unwrap();
    cg.remove().unwrap();
    assert!(dirs.iter().all(|d| !d.exists()));
    again.remove().unwrap();

    let t = TestCgroup::create("busy", &Limits::default());
    t.spawn_in("sleep 1000");
    let err = SandboxCgroup::open(t.cg().rel_path())
        .unwrap()
        .remove()
        .unwrap_err();
    assert!(matches!(err, CgroupError::RemoveDir { .. }), "{err}");
    println!("busy removal: {err}: {:?}", std::error::Error::source(&err));
}
