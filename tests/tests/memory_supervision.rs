//! belayerd starts the memory servers of its config, restarts one that dies, and leaves them
//! running when it stops (paper: "State isolation": allocations outlive workers).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use belayer_ipc::memory::MemClient;
use belayer_tests::bin;

fn wait_pid(socket: &std::path::Path, not: Option<i32>) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(info) = MemClient::connect(socket).and_then(|mut c| c.ping()) {
            if Some(info.pid) != not {
                return info.pid;
            }
        }
        assert!(
            Instant::now() < deadline,
            "memory server on {} never answered",
            socket.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn belayerd_supervises_memory_servers() {
    let dir = tempfile::Builder::new()
        .prefix("belayer-mem-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let layout = dir.path().join("kv.toml");
    std::fs::write(&layout, "[kv]\nblock_size = 65536\nblock_count = 64\n").unwrap();
    let kv_socket = dir.path().join("kv.sock");
    let config = dir.path().join("belayer.toml");
    std::fs::write(
        &config,
        format!(
            // The state dir is on ext4 here: no sandbox runs, so no disk limit is needed.
            "default_disk_max_bytes = 0\n[[memory_server]]\nrole = \"kv\"\ndevice = \"host\"\nlayout = \"{}\"\nsocket = \"{}\"\n",
            layout.display(),
            kv_socket.display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new(bin("belayerd"))
        .arg("--socket")
        .arg(dir.path().join("belayer.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let first = wait_pid(&kv_socket, None);
    // A crash of the server: belayerd starts a fresh one.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(first), nix::sys::signal::SIGKILL).unwrap();
    let second = wait_pid(&kv_socket, Some(first));
    assert_ne!(first, second);
    // belayerd stopping leaves the server running.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.id() as i32),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    daemon.wait().unwrap();
    assert_eq!(wait_pid(&kv_socket, None), second);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(second),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
}
