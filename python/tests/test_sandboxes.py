"""Sandboxes as a whole through the Python API against a real daemon: creation with env,
workdir and limits (shown by inspect, enforced by the kernel), listings of sandboxes and
checkpoints, restore of a chosen checkpoint, gc by tag and by age, and host-side kills that
never trip over processes already gone. Bad options raise before any request."""

from __future__ import annotations

import math
import time

import pytest

import belayer


def wait_state(sb: belayer.Sandbox, state: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sb.info().state != state:
        assert time.monotonic() < deadline, f"{sb.id} not {state}"
        time.sleep(0.02)


def test_create_options_show_in_inspect_and_apply(client: belayer.Client) -> None:
    with client.create_sandbox(
        "busybox",
        tag="py-opts",
        env={"MODE": "strict", "EMPTY": ""},
        workdir="/srv/task",
        memory_max=64 << 20,
        pids_max=12,
        cpus=0.5,
        disk_max=32 << 20,
        userns="private",
    ) as sb:
        info = sb.info()
        assert (info.tag, info.workdir, info.userns) == ("py-opts", "/srv/task", "private")
        assert info.env == {"MODE": "strict", "EMPTY": ""}
        assert (info.memory_max, info.pids_max, info.cpus, info.disk_max) == (
            64 << 20, 12, 0.5, 32 << 20)
        assert info.cgroup.endswith(sb.id) and info.state == "running" and info.pids
        # The workdir is not created: an action without its own cwd fails like a bad cwd.
        with pytest.raises(belayer.ExecFailedError, match="/srv/task"):
            sb.exec("pwd")
        assert sb.exec("mkdir -p /srv/task", cwd="/").ok
        assert sb.exec('pwd; echo "$MODE"').stdout == b"/srv/task\nstrict\n"
        assert sb.exec("pwd", cwd="/tmp").stdout == b"/tmp\n"
        # pids_max is enforced: a fork bomb stops at 12 processes (counted with builtins).
        r = sb.exec("(for i in $(seq 40); do sleep 60 & done) 2>/dev/null; "
                    "set -- /proc/[0-9]*; echo $#")
        assert 5 < int(r.stdout) <= 12, r
        sb.exec("kill -9 -1 2>/dev/null; true")
        # Kept across a restore.
        sb.checkpoint(1, b"k1")
        sb.kill_processes()
        wait_state(sb, "failed")
        sb.restore()
        again = sb.info()
        assert (again.workdir, again.env, again.pids_max) == (info.workdir, info.env, 12)
        assert sb.exec("pwd").stdout == b"/srv/task\n"


def test_bad_create_options_raise_before_any_request(client: belayer.Client) -> None:
    before = {s.id for s in client.list_sandboxes()}
    for bad in (
        {"env": {"": "x"}},
        {"env": {"A=B": "x"}},
        {"env": {"A": "x\0y"}},
        {"workdir": "relative"},
        {"workdir": "/a\0b"},
        {"tag": "t\0"},
        {"memory_max": 0},
        {"memory_max": 2**64},
        {"memory_max": True},
        {"memory_max": 1.5},
        {"pids_max": -1},
        {"disk_max": "1G"},
        {"cpus": 0},
        {"cpus": -1.0},
        {"cpus": math.nan},
        {"cpus": math.inf},
        {"cpus": "2"},
        {"userns": "shared"},
    ):
        with pytest.raises(ValueError):
            client.create_sandbox("busybox", **bad)  # type: ignore[arg-type]
    # What the daemon refuses is a BadRequestError (also a ValueError).
    with pytest.raises(belayer.BadRequestError):
        client.create_sandbox("busybox", tag="not a tag!")
    with pytest.raises(belayer.BadRequestError):
        client.create_sandbox("busybox", memory_max=4096)
    with pytest.raises(belayer.UnknownImageError):
        client.create_sandbox("no-such-image")
    assert {s.id for s in client.list_sandboxes()} == before


def test_listings(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as a, client.create_sandbox("busybox") as b:
        listed = client.list_sandboxes()
        ids = [s.id for s in listed]
        assert a.id in ids and b.id in ids
        assert ids.index(a.id) < ids.index(b.id), "oldest first"
        mine = next(s for s in listed if s.id == a.id)
        assert mine.state == "running" and mine.image == "busybox" and mine.pids_max
        assert a.checkpoints() == []
        before = int(time.time() * 1000)
        a.checkpoint(1, b"c1")
        a.checkpoint(2, b"c2")
        cps = a.checkpoints()
        assert [c.prefix for c in cps] == [1, 2]
        assert client.list_checkpoints(a.id) == cps
        assert all(c.created_unix_ms and c.created_unix_ms >= before - 1000 for c in cps)
        assert cps[0].name != cps[1].name and len(cps[0].context_digest) == 64
        assert b.checkpoints() == []
    with pytest.raises(belayer.UnknownSandboxError):
        client.list_checkpoints("sb-000000000000")


def test_restore_of_a_chosen_checkpoint(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        for k in (1, 2, 3):
            sb.exec(f"echo k{k} >> /root/log")
            sb.checkpoint(k, f"ctx{k}".encode())
        r = sb.restore(prefix=2)
        assert (r.prefix, r.context, r.dropped) == (2, b"ctx2", 0)
        assert r.verified and r.fs_matches and r.processes_match
        assert sb.exec("cat /root/log").stdout == b"k1\nk2\n"
        # C_3 stays, as a branch of the tree.
        assert [c.prefix for c in sb.checkpoints()] == [1, 2, 3]
        assert sb.info().ready_prefix == 2
        with pytest.raises(belayer.NotFoundError, match="prefix 4"):
            sb.restore(prefix=4)
        for bad in (-1, 2**64, "1", True):
            with pytest.raises(ValueError):
                sb.restore(prefix=bad)  # type: ignore[arg-type]
        # Not verified: the three checks are absent, not failed.
        r = sb.restore(verify=False, prefix=1)
        assert (r.prefix, r.dropped, r.verified) == (1, 0, False)
        assert r.fs_matches is None and r.processes_match is None
        assert sb.exec("cat /root/log").stdout == b"k1\n"
        r = sb.restore(verify=False)
        assert (r.prefix, r.dropped, r.fs_matches) == (1, 0, None)
        # C_3 is on another branch now: not by prefix, by its name.
        with pytest.raises(belayer.NotFoundError, match="prefix 3"):
            sb.restore(prefix=3)
        c3 = [c for c in sb.checkpoints() if c.prefix == 3][0]
        r = sb.restore(checkpoint=c3.name)
        assert (r.prefix, r.context, r.fs_matches) == (3, b"ctx3", True)
        assert sb.exec("cat /root/log").stdout == b"k1\nk2\nk3\n"
        with pytest.raises(belayer.NotFoundError, match="c000099-k1"):
            sb.restore(checkpoint="c000099-k1")
        with pytest.raises(ValueError):
            sb.restore(prefix=1, checkpoint=c3.name)


def test_gc_by_tag_and_by_age(client: belayer.Client) -> None:
    with pytest.raises(ValueError):
        client.gc()
    for bad in (-1, 2**63, "10", 1.5):
        with pytest.raises(ValueError):
            client.gc(older_than_s=bad)  # type: ignore[arg-type]
    tag = f"py-gc-{time.monotonic_ns()}"
    with client.create_sandbox("busybox", tag=tag) as tagged, \
            client.create_sandbox("busybox") as other:
        for sb in (tagged, other):
            sb.checkpoint(1, b"c1")
            sb.exec("echo x > /root/x")
            sb.checkpoint(2, b"c2")
        result = client.gc(tag=tag)
        removed, freed = result
        assert (removed, freed) == (result.removed, result.bytes)
        assert removed == 2 and freed > 0
        assert tagged.checkpoints() == [] and tagged.info().ready_prefix is None
        assert [c.prefix for c in other.checkpoints()] == [1, 2]
        # By age: everything old enough goes except each sandbox's ready checkpoint.
        result = client.gc(older_than_s=0)
        assert result.removed >= 1
        assert [c.prefix for c in other.checkpoints()] == [2]
        assert other.restore().prefix == 2


def test_kill_processes_never_trips_over_gone_processes(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        sb.exec("for i in 1 2 3 4 5 6; do sleep 1000 & done")
        sb.checkpoint(1, b"c1")
        for _ in range(4):
            # The init dies first or in the middle: the other processes die with it, and
            # signalling a pid already gone is skipped, not raised.
            assert sb.kill_processes() >= 1
            wait_state(sb, "failed")
            sb.kill_processes()  # whatever is left, if anything: never raises
            assert sb.restore(verify=False).prefix == 1
            assert len(sb.info().pids) >= 7
