"""Every option of an action through the Python API against a real daemon: stdin, env, cwd,
merged output with its limit, the fault and dirtiness fields; bad options raise before any
request."""

from __future__ import annotations

import pytest

import belayer


def test_stdin_env_cwd_and_merged_output(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        data = bytes(range(256)) + b"\0\0"
        r = sb.exec("cat", stdin=data, timeout_ms=30_000)
        assert (r.exit_code, r.stdout, r.stderr) == (0, data, b"")
        assert r.infra_fault is None
        assert r.dirty is not True, "reading stdin changes nothing"

        r = sb.exec('pwd; echo "$WHO"', cwd="/tmp", env={"WHO": "py"})
        assert r.stdout == b"/tmp\npy\n"

        r = sb.exec("echo a; echo b >&2; echo c", merge_stderr=True)
        assert (r.stdout, r.stderr, r.truncated) == (b"a\nb\nc\n", b"", False)
        r = sb.exec("echo aaaa; echo bbbb >&2; echo cccc", merge_stderr=True, output_limit=10)
        assert (r.stdout, r.truncated) == (b"aaaa\nbbbb\n", True)

        r = sb.exec("echo x > /root/file")
        assert r.dirty is True

        # Old spellings keep working.
        assert client.exec(sb.id, "echo hi", 10_000).stdout == b"hi\n"
        assert sb.exec("echo hi", 10_000).text == "hi\n"


def test_bad_options_raise(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        for env in ({"": "x"}, {"A=B": "x"}):
            with pytest.raises(ValueError):
                sb.exec("true", env=env)
        with pytest.raises(ValueError):
            sb.exec("true", output_limit=0)
        # Values the C types would wrap or cut, and stdin that is not bytes.
        for bad in (
            {"timeout_ms": 2**64},
            {"output_limit": 2**64 + 5},
            {"stdin": 5},
            {"stdin": "text"},
            {"cwd": "/tm\0p"},
            {"env": {"A": "x\0y"}},
        ):
            with pytest.raises(ValueError):
                sb.exec("true", **bad)  # type: ignore[arg-type]
        with pytest.raises(belayer.BadRequestError):
            sb.exec("true", cwd="relative")
        with pytest.raises(belayer.BadRequestError, match="stdin"):
            sb.exec("cat", stdin=b"x" * ((1 << 20) + 1))
        assert sb.exec("echo still").stdout == b"still\n"


def test_infra_fault_converts() -> None:
    from belayer import _lib
    from belayer.actions import result

    r = _lib.ExecResult()
    v = _lib.ExecVerdict()
    v.infra_fault, v.infra_fault_pid, v.infra_fault_signal, v.dirty = 1, 42, 9, -1
    out = result(r, v)
    assert out.infra_fault == belayer.InfraFault("external_kill", 42, 9)
    assert out.dirty is None
    v.infra_fault, v.infra_fault_pid, v.infra_fault_signal, v.dirty = 3, -1, 0, 0
    out = result(r, v)
    assert out.infra_fault == belayer.InfraFault("sandbox_lost", None, None)
    assert out.dirty is False
