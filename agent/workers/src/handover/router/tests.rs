//! Tests of the router: epoch fencing, persisted prefixes, load-aware picking.

use super::*;

#[test]
fn register_fences_previous_epoch() {
    let r = Router::new(RouterConfig::default()).unwrap();
    let e1 = r.register("g0", "127.0.0.1:1");
    let e2 = r.register("g0", "127.0.0.1:2");
    assert!(e2 > e1);
    assert!(matches!(
        r.unregister("g0", e1),
        Err(RouterError::UnknownEngine { .. })
    ));
    assert!(matches!(
        r.unregister("nope", 1),
        Err(RouterError::UnknownEngine { .. })
    ));
    r.unregister("g0", e2).unwrap();
    assert_eq!(r.slots()[0].addr, None);
    r.mark_unhealthy("g0", "test");
    assert_eq!(r.alerts().len(), 1);
    assert!(!r.slots()[0].healthy);
}

#[test]
fn prefixes_are_persisted_in_the_context_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ctx.log");
    let r = Router::new(RouterConfig {
        context_log: Some(path.clone()),
        ..RouterConfig::default()
    })
    .unwrap();
    r.persist("r1", &[1, 2]);
    r.persist("r1", &[1, 2, 3, 4]);
    assert_eq!(r.persisted_prefix("r1").unwrap(), vec![1, 2, 3, 4]);
    assert_eq!(r.persisted_prefix("r2"), None);
    drop(r);
    let (log, _) = ContextLog::open(&path).unwrap();
    assert_eq!(
        log.longest_token_prefix("r1", "r1").unwrap().unwrap(),
        [1, 2, 3, 4]
    );
}

#[test]
fn pick_is_load_aware_and_times_out() {
    let r = Router::new(RouterConfig {
        wait_ms: 50,
        ..RouterConfig::default()
    })
    .unwrap();
    assert!(matches!(r.pick(), Err(RouterError::NoEngine { .. })));
    r.register("a", "127.0.0.1:1");
    r.register("b", "127.0.0.1:2");
    let x = r.pick().unwrap();
    let y = r.pick().unwrap();
    assert_ne!(x, y);
    r.release(&x);
    assert_eq!(r.pick().unwrap(), x);
}
