//! Unit tests of the daemon configuration.

use super::*;

#[test]
fn parses_and_rejects_unknown_keys() {
    let c: Config = toml::from_str("state_dir = \"/tmp/x\"\ntest_hooks = true\n").unwrap();
    assert_eq!(c.state_dir, PathBuf::from("/tmp/x"));
    assert!(c.test_hooks);
    assert!(toml::from_str::<Config>("bogus = 1\n").is_err());
    let c: Config = toml::from_str(
        "[[memory_server]]\nrole = \"kv\"\nlayout = \"/l.toml\"\nsocket = \"/run/kv.sock\"\n",
    )
    .unwrap();
    assert_eq!(
        c.memory_servers[0].device,
        belayer_ipc::memory::Backend::Host
    );
    let bad = toml::from_str::<Config>(
        "[[memory_server]]\nrole = \"gpu\"\nlayout = \"/l\"\nsocket = \"/s\"\n",
    )
    .unwrap_err();
    assert!(bad.to_string().contains("gpu"), "{bad}");
    assert!(c.validate().is_ok());
}

#[test]
fn validate_catches_bad_values() {
    let mut c = Config::default();
    assert!(c.validate().is_ok());
    for (level, ok) in [
        (Some(3), true),
        (Some(19), true),
        (Some(-5), true),
        (Some(0), false),
        (Some(23), false),
        (Some(i32::MAX), false),
    ] {
        let c = Config {
            blob_zstd_level: level,
            ..Config::default()
        };
        assert_eq!(c.validate().is_ok(), ok, "blob_zstd_level {level:?}");
    }
    let c2 = Config {
        dump_stage_dir: "run/stage".into(),
        ..Config::default()
    };
    assert!(c2.validate().is_err());
    for (kdat, stage) in [
        ("/run/x", "/run/x"),
        ("/var/lib/belayer", "/run/s"),
        ("/var/lib", "/run/s"),
        ("/", "/run/s"),
        ("/run/k", "/var/lib/belayer/stage"),
    ] {
        let c = Config {
            criu_kdat_dir: kdat.into(),
            dump_stage_dir: stage.into(),
            ..Config::default()
        };
        assert!(c.validate().is_err(), "kdat {kdat}, stage {stage}");
    }
    c.cgroup_parent = "../x".into();
    assert!(c.validate().is_err());
    for bad in [
        Config {
            userns: "shared".into(),
            ..Config::default()
        },
        Config {
            userns_count: u32::MAX,
            ..Config::default()
        },
        Config {
            default_cpus: f64::NAN,
            ..Config::default()
        },
        Config {
            dump_stage_bytes: 1 << 20,
            criu_ghost_limit_bytes: 2 << 20,
            ..Config::default()
        },
    ] {
        assert!(bad.validate().is_err());
    }
    let mut c = Config {
        default_disk_max_bytes: 4096,
        ..Config::default()
    };
    assert!(c.validate().is_err());
    c.default_disk_max_bytes = 0;
    assert!(c.validate().is_ok());
    // Without a stage, ghosts go to the state dir: any limit.
    c.dump_stage_bytes = 0;
    c.criu_ghost_limit_bytes = u64::MAX;
    assert!(c.validate().is_ok());
}

#[test]
fn context_limits_have_defaults_and_bounds() {
    let c = Config::default();
    assert_eq!(c.context_budget_bytes, 1 << 30);
    assert_eq!(c.context_root_budget_bytes, 0);
    assert_eq!(c.context_max_bytes, belayer_context::MAX_CONTEXT_BYTES);
    let c: Config = toml::from_str(
        "context_budget_bytes = 0\ncontext_root_budget_bytes = 4096\ncontext_max_bytes = 10\n",
    )
    .unwrap();
    assert!(c.validate().is_ok());
    let limits = crate::service::contexts::ContextLimits::from_config(&c);
    assert_eq!(limits.uid_budget_bytes, None);
    assert_eq!(limits.root_budget_bytes, Some(4096));
    assert_eq!(limits.max_context_bytes, 10);
    for max in [0, belayer_context::MAX_CONTEXT_BYTES + 1] {
        let bad = Config {
            context_max_bytes: max,
            ..Config::default()
        };
        assert!(bad.validate().is_err(), "{max}");
    }
}

#[test]
fn criu_time_limit_is_base_plus_per_gib() {
    let d = Config::default();
    assert_eq!(d.criu_time_limit(0), Duration::from_secs(60));
    assert_eq!(d.criu_time_limit(3 << 30), Duration::from_secs(72));
    let c: Config =
        toml::from_str("criu_time_limit_base_ms = 20\ncriu_time_limit_per_gib_ms = 0\n").unwrap();
    assert_eq!(c.criu_time_limit(5 << 30), Duration::from_millis(20));
    let zero: Config = toml::from_str("criu_time_limit_base_ms = 0\n").unwrap();
    assert!(zero.validate().is_err());
}

#[test]
fn disk_limit_defaults_to_10_gib() {
    assert_eq!(Config::default().default_disk_max_bytes, 10 << 30);
    let c: Config = toml::from_str("default_disk_max_bytes = 0\n").unwrap();
    assert_eq!(c.default_disk_max_bytes, 0);
}

#[test]
fn connection_limits_come_from_their_keys_and_are_checked() {
    let c: Config = toml::from_str(
        "max_connections = 100\nmax_connections_per_uid = 10\nroot_reserved_connections = 5\n\
         max_subscriptions = 20\nmax_subscriptions_per_uid = 2\n\
         root_reserved_subscriptions = 1\nframe_timeout_ms = 2000\nidle_timeout_s = 60\n\
         send_timeout_ms = 3000\n",
    )
    .unwrap();
    assert!(c.validate().is_ok());
    let limits = c.connection_limits();
    assert_eq!(
        (limits.connections.total, limits.connections.per_uid),
        (100, 10)
    );
    assert_eq!(limits.connections.root_reserved, 5);
    assert_eq!(limits.subscriptions.non_root_total(), 19);
    assert_eq!(limits.frame_timeout, Duration::from_secs(2));
    assert_eq!(limits.idle_timeout, Duration::from_secs(60));
    assert_eq!(limits.send_timeout, Duration::from_secs(3));
    assert_eq!(
        Config::default().connection_limits(),
        ConnectionLimits::default()
    );
    let mut bad = Config::default();
    bad.root_reserved_connections = bad.max_connections;
    assert!(matches!(bad.validate(), Err(ConfigError::Limits { .. })));
    bad = Config::default();
    bad.idle_timeout_s = 0;
    assert!(matches!(bad.validate(), Err(ConfigError::Limits { .. })));
}

#[test]
fn metrics_listen_is_an_address_and_loopback_unless_allowed() {
    let c: Config = toml::from_str("metrics_listen = \"127.0.0.1:9464\"\n").unwrap();
    assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
    assert!(c.validate().is_ok());
    let c: Config = toml::from_str("metrics_listen = \"[::1]:9464\"\n").unwrap();
    assert!(c.validate().is_ok());
    assert!(toml::from_str::<Config>("metrics_listen = \"localhost\"\n").is_err());
    let mut c: Config = toml::from_str("metrics_listen = \"10.0.0.5:9464\"\n").unwrap();
    match c.validate() {
        Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "metrics_listen"),
        other => panic!("{other:?}"),
    }
    c.metrics_allow_remote = true;
    assert!(c.validate().is_ok());
    assert_eq!(Config::default().metrics_listen, None);
}
