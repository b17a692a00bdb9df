"""``Client.fork`` and ``Sandbox.fork`` against the real daemon: children restored from a
checkpoint C_K of a running sandbox, each diverging on its own, with L_K; bad arguments
raise before or from the daemon and leave nothing."""

from __future__ import annotations

import pytest

import belayer


def test_fork_children_diverge_and_carry_l_k(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        for k in (1, 2):
            sb.exec(f"echo k{k} >> /root/log")
            sb.checkpoint(k, f"ctx{k}".encode())
        sb.exec("echo after >> /root/log")
        info = client.fork(sb.id, 3, prefix=1)
        assert (info.prefix, info.context, info.checkpoint) == (1, b"ctx1", "c000001-k1")
        assert info.fork.startswith("fk-") and info.total_ms > 0
        assert len({c.id for c in info.children}) == 3
        kids = [client.sandbox(c.id) for c in info.children]
        try:
            for c in info.children:
                assert c.verified and c.fs_matches and c.processes_match and c.init_pid > 0
            for i, kid in enumerate(kids):
                kid.exec(f"echo child{i} >> /root/log")
            for i, kid in enumerate(kids):
                assert kid.exec("cat /root/log").stdout == f"k1\nchild{i}\n".encode()
                assert [c.prefix for c in kid.checkpoints()] == [1]
            assert sb.exec("cat /root/log").stdout == b"k1\nk2\nafter\n"
        finally:
            for kid in kids:
                kid.destroy()
        # Sandbox.fork: the ready checkpoint by default, Sandbox objects back.
        children = sb.fork(2, verify=False)
        try:
            assert len(children) == 2
            for kid in children:
                assert kid.exec("cat /root/log").stdout == b"k1\nk2\n"
        finally:
            for kid in children:
                kid.destroy()


def test_bad_forks_raise_and_leave_nothing(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        with pytest.raises(belayer.NotFoundError, match="no ready checkpoint"):
            sb.fork(1)
        sb.checkpoint(1, b"c1")
        before = {s.id for s in client.list_sandboxes()}
        for bad in (0, 257, -1, "2", True, 1.0):
            with pytest.raises(ValueError):
                sb.fork(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            sb.fork(1, prefix=1, checkpoint="c000001-k1")
        with pytest.raises(belayer.NotFoundError):
            sb.fork(1, prefix=9)
        with pytest.raises(belayer.NotFoundError):
            sb.fork(1, checkpoint="c000099-k1")
        with pytest.raises(belayer.UnknownSandboxError):
            client.fork("sb-000000000000", 1)
        assert {s.id for s in client.list_sandboxes()} == before
