//! Tests of the memory server over its socket: admission, leases, flushes, versions.

use belayer_ipc::memory::{AttachRequest, LeaseMode, MemClient, MemClientError, MemErrorCode};

use super::*;

fn layout() -> Layout {
    Layout::from_toml(
        "[[region]]\nname = \"meta\"\nsize = 4096\n[kv]\nblock_size = 4096\nblock_count = 4\n",
    )
    .unwrap()
}

#[test]
fn start_refuses_bad_configs_and_live_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kv.sock");
    let weights = MemoryServerConfig::new(Role::Weights, Backend::Host, layout(), &socket);
    assert!(matches!(
        MemoryServer::start(weights),
        Err(MemoryServerError::Layout { .. })
    ));
    let bad_worker =
        MemoryServerConfig::new(Role::Kv, Backend::Host, layout(), &socket).worker("a b", 0);
    assert!(matches!(
        MemoryServer::start(bad_worker),
        Err(MemoryServerError::BadWorkerId { .. })
    ));
    let server = MemoryServer::start(MemoryServerConfig::new(
        Role::Kv,
        Backend::Host,
        layout(),
        &socket,
    ))
    .unwrap();
    assert!(matches!(
        MemoryServer::start(MemoryServerConfig::new(
            Role::Kv,
            Backend::Host,
            layout(),
            &socket
        )),
        Err(MemoryServerError::Bind(BindError::InUse { .. }))
    ));
    let info = server.info();
    assert_eq!(
        (info.role, info.regions, info.attachments),
        (Role::Kv, 2, 0)
    );
    server.shutdown();
    assert!(!socket.exists());
    fs::write(&socket, b"x").unwrap();
    assert!(matches!(
        MemoryServer::start(MemoryServerConfig::new(
            Role::Kv,
            Backend::Host,
            layout(),
            &socket
        )),
        Err(MemoryServerError::Bind(BindError::NotASocket { .. }))
    ));
}

#[test]
fn registration_binds_worker_ids_to_uids() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kv.sock");
    let config = MemoryServerConfig::new(Role::Kv, Backend::Host, layout(), &socket)
        .worker("someone-else", 1000)
        .require_registration(true);
    let server = MemoryServer::start(config).unwrap();
    let mut client = MemClient::connect(&socket).unwrap();
    let hash = layout().hash();
    for worker in ["unregistered", "someone-else"] {
        match client.attach_layout(worker, &layout(), LeaseMode::Read) {
            Err(MemClientError::Refused {
                code: MemErrorCode::UnknownWorker,
                ..
            }) => {}
            other => panic!("{worker}: {other:?}"),
        }
    }
    client.register_worker("me", 0).unwrap();
    let mapping = client
        .attach(AttachRequest {
            worker: "me".to_owned(),
            layout_hash: hash,
            mode: LeaseMode::Read,
            regions: vec!["kv".to_owned()],
        })
        .unwrap();
    assert_eq!(mapping.regions().len(), 1);
    assert_eq!(server.info().attachments, 1);
    client.detach(mapping).unwrap();
    assert!(matches!(
        client.detach_id(99),
        Err(MemClientError::Refused {
            code: MemErrorCode::UnknownAttachment,
            ..
        })
    ));
    assert!(matches!(
        client.bump_version(),
        Err(MemClientError::Refused {
            code: MemErrorCode::Unsupported,
            ..
        })
    ));
    assert!(matches!(
        client.flush("meta"),
        Err(MemClientError::Refused {
            code: MemErrorCode::Unsupported,
            ..
        })
    ));
    server.shutdown();
}
