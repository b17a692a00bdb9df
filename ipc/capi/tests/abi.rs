//! Bad input across the ABI without a daemon: null pointers, invalid UTF-8, unknown and freed
//! handles, a daemon that goes away, a server without an event stream. Every case must give
//! a status code and a message, never a crash.

use std::ffi::{c_char, CStr, CString};
use std::ptr;
use std::sync::Arc;

use belayer::*;
use belayer_ipc::{Handler, PeerCred, Request, Response, Server, ServerConfig};

/// Answers Ping; everything else is `Done`; no event stream.
struct Pong;

impl Handler for Pong {
    fn handle(&self, _peer: &PeerCred, request: Request) -> Response {
        match request {
            Request::Ping => Response::Pong {
                version: "test".into(),
            },
            _ => Response::Done,
        }
    }
}

fn last_error() -> String {
    // SAFETY: never null; valid until the next failing call on this thread.
    unsafe { CStr::from_ptr(belayer_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

#[test]
fn null_pointers_are_invalid_arguments() {
    let mut client: BelayerClient = 0;
    // SAFETY: null arguments are what is tested; the other pointers are valid.
    unsafe {
        assert_eq!(
            belayer_connect(ptr::null(), ptr::null_mut()),
            BELAYER_E_INVALID_ARGUMENT
        );
        assert!(last_error().contains("out"));
        assert_eq!(
            belayer_sandbox_create(1, ptr::null(), ptr::null(), ptr::null_mut()),
            BELAYER_E_INVALID_ARGUMENT
        );
        assert!(last_error().contains("image"));
        let step = BelayerStep {
            step_duration_s: 1.0,
            regen_cost_s: -1.0,
            llm_elapsed_s: 0.0,
            llm_response_s: -1.0,
        };
        let mut d = BelayerDecision::default();
        assert_eq!(
            belayer_maybe_checkpoint(
                1,
                c"sb".as_ptr(),
                1,
                ptr::null(),
                0,
                ptr::null(),
                ptr::null(),
                &mut d
            ),
            BELAYER_E_INVALID_ARGUMENT
        );
        assert!(last_error().contains("step"));
        assert_eq!(
            belayer_context_remove(1, ptr::null()),
            BELAYER_E_INVALID_ARGUMENT
        );
        assert!(last_error().contains("trajectory"));
        // A NULL buffer with a non-zero length.
        assert_eq!(
            belayer_context_append(1, c"t".as_ptr(), 1, ptr::null(), 3, ptr::null_mut()),
            BELAYER_E_INVALID_ARGUMENT
        );
        // Arguments are checked before the handle: still no crash with a valid step.
        assert_eq!(
            belayer_maybe_checkpoint(
                1,
                c"sb".as_ptr(),
                1,
                ptr::null(),
                0,
                &step,
                ptr::null(),
                ptr::null_mut()
            ),
            BELAYER_E_INVALID_ARGUMENT
        );
        assert_eq!(client, 0);
        assert_eq!(
            belayer_connect(c"/nonexistent/x.sock".as_ptr(), &mut client),
            BELAYER_E_CONNECT
        );
        assert_eq!(client, 0);
    }
}

#[test]
fn invalid_utf8_is_an_invalid_argument() {
    let bad: [u8; 3] = [0xc3, 0x28, 0];
    let mut client: BelayerClient = 0;
    // SAFETY: a NUL-terminated (invalid UTF-8) string and a valid out-pointer.
    let rc = unsafe { belayer_connect(bad.as_ptr().cast::<c_char>(), &mut client) };
    assert_eq!(rc, BELAYER_E_INVALID_ARGUMENT);
    assert!(last_error().contains("not UTF-8"), "{}", last_error());
}

#[test]
fn closed_handles_and_a_vanished_daemon_give_status_codes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.sock");
    let server = Server::bind(ServerConfig::new(&path))
        .unwrap()
        .spawn(Arc::new(Pong))
        .unwrap();
    let socket = c(path.to_str().unwrap());
    let mut client: BelayerClient = 0;
    let mut version: *mut c_char = ptr::null_mut();
    // SAFETY: valid strings and out-pointers; every handed-out string is freed once.
    unsafe {
        assert_eq!(belayer_connect(socket.as_ptr(), &mut client), BELAYER_OK);
        assert_ne!(client, 0);
        assert_eq!(belayer_ping(client, &mut version), BELAYER_OK);
        assert_eq!(CStr::from_ptr(version).to_str().unwrap(), "test");
        belayer_string_free(&mut version);
        assert!(version.is_null());

        // An answer of the wrong kind is a protocol error, not a crash.
        let mut info = std::mem::zeroed::<BelayerSandboxInfo>();
        assert_eq!(
            belayer_sandbox_inspect(client, c"sb".as_ptr(), &mut info),
            BELAYER_E_PROTOCOL
        );
        belayer_sandbox_info_free(&mut info);

        // No event stream on this server.
        let mut sub: BelayerSubscription = 0;
        assert_eq!(
            belayer_subscribe(socket.as_ptr(), &mut sub),
            BELAYER_E_UNSUPPORTED
        );
        assert_eq!(sub, 0);

        // The daemon goes away: calls fail with BELAYER_E_CONNECT and a message.
        server.shutdown().unwrap();
        assert_eq!(belayer_ping(client, ptr::null_mut()), BELAYER_E_CONNECT);
        assert!(last_error().contains("d.sock"), "{}", last_error());
        assert_eq!(belayer_ping(client, ptr::null_mut()), BELAYER_E_CONNECT);

        // Closing twice, and using a closed handle.
        assert_eq!(belayer_close(client), BELAYER_OK);
        assert_eq!(belayer_close(client), BELAYER_E_BAD_HANDLE);
        assert_eq!(belayer_ping(client, ptr::null_mut()), BELAYER_E_BAD_HANDLE);
        assert!(last_error().contains(&client.to_string()));
        // A client handle is not a subscription handle.
        let mut ev = std::mem::zeroed::<BelayerEvent>();
        assert_eq!(belayer_next_event(client, 0, &mut ev), BELAYER_E_BAD_HANDLE);
        belayer_event_free(&mut ev);
    }
}

#[test]
fn handles_work_from_several_threads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.sock");
    let _server = Server::bind(ServerConfig::new(&path))
        .unwrap()
        .spawn(Arc::new(Pong))
        .unwrap();
    let socket = c(path.to_str().unwrap());
    let mut client: BelayerClient = 0;
    // SAFETY: valid string and out-pointer.
    let rc = unsafe { belayer_connect(socket.as_ptr(), &mut client) };
    assert_eq!(rc, BELAYER_OK);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..50 {
                    // SAFETY: a null version pointer is allowed.
                    assert_eq!(unsafe { belayer_ping(client, ptr::null_mut()) }, BELAYER_OK);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(belayer_close(client), BELAYER_OK);
}

#[test]
fn exec_result_keeps_the_layout_of_abi_version_1() {
    use std::mem::{offset_of, size_of};
    // The struct of ABI version 1, unchanged: the verdict has its own struct.
    assert_eq!(offset_of!(BelayerExecResult, exit_code), 0);
    assert_eq!(offset_of!(BelayerExecResult, signal), 4);
    assert_eq!(offset_of!(BelayerExecResult, timed_out), 8);
    assert_eq!(offset_of!(BelayerExecResult, truncated), 9);
    assert_eq!(offset_of!(BelayerExecResult, duration_ms), 16);
    assert_eq!(offset_of!(BelayerExecResult, stdout_buf), 24);
    assert_eq!(offset_of!(BelayerExecResult, stderr_buf), 40);
    assert_eq!(size_of::<BelayerExecResult>(), 56);
    assert_eq!(size_of::<BelayerExecVerdict>(), 16);
}

#[test]
fn bad_exec_options_are_invalid_arguments_before_any_request() {
    let no_env = BelayerExecOptions {
        cwd: ptr::null(),
        env: ptr::null(),
        env_len: 0,
        timeout_ms: 0,
        output_limit: 0,
        merge_stderr: 0,
        stdin_data: ptr::null(),
        stdin_len: 0,
    };
    let cases: [(Vec<&std::ffi::CStr>, &str); 3] = [
        (vec![c"=x"], "opts.env[0]"),
        (vec![c"A=1", c"NOVALUE"], "opts.env[1]"),
        (vec![c""], "opts.env[0]"),
    ];
    for (env, needle) in cases {
        let ptrs: Vec<*const c_char> = env.iter().map(|s| s.as_ptr()).collect();
        let opts = BelayerExecOptions {
            env: ptrs.as_ptr(),
            env_len: ptrs.len(),
            ..no_env
        };
        // SAFETY: valid strings, options and out-pointer; the result is freed.
        unsafe {
            let mut out = std::mem::zeroed::<BelayerExecResult>();
            let mut verdict = std::mem::zeroed::<BelayerExecVerdict>();
            // A made-up handle: the options are checked before the handle is used.
            let rc = belayer_exec_with(
                99,
                c"sb".as_ptr(),
                c"true".as_ptr(),
                &opts,
                &mut out,
                &mut verdict,
            );
            assert_eq!(rc, BELAYER_E_INVALID_ARGUMENT, "{needle}");
            assert!(last_error().contains(needle), "{}", last_error());
            assert_eq!(verdict.dirty, BELAYER_DIRTY_UNKNOWN);
            assert_eq!(verdict.infra_fault, BELAYER_INFRA_FAULT_NONE);
            belayer_exec_result_free(&mut out);
        }
    }
    for (opts, needle) in [
        (
            BelayerExecOptions {
                env_len: 2,
                ..no_env
            },
            "opts.env",
        ),
        (
            BelayerExecOptions {
                stdin_len: 5,
                ..no_env
            },
            "opts.stdin_data",
        ),
    ] {
        // SAFETY: the null pointers with non-zero counts are what is tested.
        unsafe {
            let mut out = std::mem::zeroed::<BelayerExecResult>();
            let rc = belayer_exec_with(
                99,
                c"sb".as_ptr(),
                c"true".as_ptr(),
                &opts,
                &mut out,
                ptr::null_mut(),
            );
            assert_eq!(rc, BELAYER_E_INVALID_ARGUMENT);
            assert!(last_error().contains(needle), "{}", last_error());
        }
    }
}
