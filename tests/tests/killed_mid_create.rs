//! A daemon SIGKILLed while it creates a sandbox (before, during or after the record is
//! written): after the restart the sandbox either exists whole or has left nothing: no dir,
//! cgroup, mount or process.

use std::collections::BTreeSet;
use std::time::Duration;

use belayer_ipc::{Request, Response, SandboxSpec};
use belayer_tests::orphans::{mounts_under, sandbox_cgroups, sandbox_dirs, settle};
use belayer_tests::{busybox_rootfs, unique, Daemon, DaemonOptions};

fn sandbox_ids(d: &Daemon) -> BTreeSet<String> {
    match d.call(Request::ListSandboxes) {
        Response::Sandboxes(v) => v.into_iter().map(|s| s.id).collect(),
        r => panic!("{r:?}"),
    }
}

#[test]
fn a_daemon_killed_during_a_creation_leaves_the_sandbox_whole_or_nothing() {
    let parent = format!("belayer-create-test-{}-{}", std::process::id(), unique());
    let mut d = Daemon::start_options(DaemonOptions {
        test_hooks: true,
        config: format!("cgroup_parent = \"{parent}\"\n"),
        ..DaemonOptions::default()
    });
    d.image("busybox", &busybox_rootfs());
    let mut outcomes = Vec::new();
    for delay_ms in [0u64, 1, 3, 6, 10, 15, 25, 40, 80, 150] {
        let mut client = d.client();
        let req = Request::CreateSandbox(SandboxSpec {
            image: "busybox".into(),
            ..Default::default()
        });
        let call = std::thread::spawn(move || client.call(req));
        std::thread::sleep(Duration::from_millis(delay_ms));
        d.kill();
        let answered = matches!(call.join().unwrap(), Ok(Response::Sandbox(_)));
        d.restart();
        let ids = sandbox_ids(&d);
        assert!(ids.len() <= 1, "{ids:?}");
        assert!(
            !answered || ids.len() == 1,
            "answered but lost at {delay_ms} ms"
        );
        settle(&format!("orphan dirs at {delay_ms} ms"), || {
            sandbox_dirs(&d) == ids
        });
        settle(&format!("orphan cgroups at {delay_ms} ms"), || {
            sandbox_cgroups(&parent) == ids
        });
        for id in &ids {
            assert_eq!(d.sh(id, "echo alive"), "alive");
            assert!(matches!(
                d.call(Request::RemoveSandbox { id: id.clone() }),
                Response::Done
            ));
        }
        settle(&format!("orphan mounts at {delay_ms} ms"), || {
            mounts_under(&d).is_empty()
        });
        outcomes.push((delay_ms, ids.len()));
    }
    eprintln!("(kill delay ms, sandboxes kept): {outcomes:?}");
}
