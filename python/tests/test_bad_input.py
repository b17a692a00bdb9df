"""Bad input across the ABI gives exceptions with status codes and messages, never a crash:
NULL pointers, invalid UTF-8, unknown and closed handles, a daemon that went away."""

from __future__ import annotations

import ctypes

import pytest

import belayer
from belayer import _lib


def last_error() -> str:
    return _lib.load().belayer_last_error().decode()


def test_null_pointers_give_invalid_argument() -> None:
    lib = _lib.load()
    assert lib.belayer_connect(None, None) == -1
    assert "out" in last_error()
    r = _lib.ExecResult()
    assert lib.belayer_exec(1, None, b"true", 0, ctypes.byref(r)) == -1
    assert "id" in last_error()
    assert lib.belayer_checkpoint(1, b"sb", 1, None, 5, None) == -1
    assert "context" in last_error()
    assert lib.belayer_next_event(1, 0, None) == -1
    # Free functions accept NULL and zeroed structs.
    lib.belayer_exec_result_free(None)
    lib.belayer_exec_result_free(ctypes.byref(r))
    lib.belayer_buf_free(None)


def test_invalid_utf8_is_rejected(client: belayer.Client) -> None:
    with pytest.raises(belayer.InvalidArgumentError, match="not UTF-8") as e:
        client.exec(b"\xff\xfe", "true")
    assert e.value.code == -1 and e.value.status == "BELAYER_E_INVALID_ARGUMENT"
    with pytest.raises(belayer.InvalidArgumentError):
        client.context_append(b"traj-\xc3\x28", 1, b"x")
    with pytest.raises(belayer.InvalidArgumentError):
        belayer.Client(b"/tmp/\xff.sock")


def test_unknown_sandbox_and_image(client: belayer.Client) -> None:
    with pytest.raises(belayer.UnknownSandboxError, match="no-such"):
        client.exec("no-such-sandbox", "true")
    with pytest.raises(belayer.UnknownImageError):
        client.create_sandbox("no-such-image")


def test_closed_and_made_up_handles(daemon) -> None:
    c = belayer.Client(daemon.socket)
    c.close()
    with pytest.raises(belayer.BadHandleError, match=str(c.handle)):
        c.ping()
    with pytest.raises(belayer.BadHandleError):
        c.close()
    lib = _lib.load()
    assert lib.belayer_close(0) == -8
    assert lib.belayer_ping(987654321, None) == -8
    sub = belayer.Subscription(daemon.socket)
    sub.close()
    with pytest.raises(belayer.BadHandleError):
        sub.next(0)


def test_unreachable_and_vanished_daemon(own_daemon) -> None:
    with pytest.raises(belayer.DaemonConnectionError, match="nonexistent"):
        belayer.Client("/nonexistent/belayer.sock")
    c = belayer.Client(own_daemon.socket)
    sub = c.subscribe()
    assert c.ping()
    own_daemon.stop()
    with pytest.raises(belayer.DaemonConnectionError) as e:
        c.ping()
    assert isinstance(e.value, ConnectionError)
    with pytest.raises(belayer.DaemonConnectionError):
        c.ping()
    with pytest.raises(belayer.DaemonConnectionError):
        sub.next(5)
    sub.close()
    c.close()


def test_library_search_order(tmp_path, monkeypatch) -> None:
    from belayer import _lib as lib

    monkeypatch.setenv("BELAYER_LIB", str(tmp_path))
    assert lib.candidates()[0] == tmp_path / "libbelayer.so"
    with pytest.raises(OSError, match="BELAYER_LIB"):
        lib.find_library()
    monkeypatch.setenv("BELAYER_LIB", belayer.library_path())
    assert lib.find_library() == belayer.library_path()
