"""``belayer.aio`` against a real daemon: every call as a coroutine, typed errors raised from
the ``await``, requests really in flight at once (the library releases the GIL), and 64
sandboxes driven from one event loop. Cancellation, pool limits and closing are in
``test_aio_cancel.py``."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import time
from pathlib import Path
from typing import List, Tuple

import pytest

import belayer
from belayer import _lib
from belayer.aio import AsyncClient, AsyncSandbox, AsyncSubscription
from conftest import Daemon, busybox_rootfs

#: Methods of ``belayer.Client`` the async client forwards that may be missing from this
#: version of the package (then the async method raises ``NotImplementedError``).
NEWER = ("list_sandboxes", "list_checkpoints", "gc", "upload", "download")


def test_library_releases_the_gil() -> None:
    lib = _lib.load()
    assert type(lib) is ctypes.CDLL, "a PyDLL would hold the GIL during every call"
    assert not lib.belayer_exec_with._flags_ & ctypes._FUNCFLAG_PYTHONAPI


def test_every_call(daemon: Daemon, tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=4) as client:
            assert await client.ping() == belayer.Client(daemon.socket).ping()
            await client.import_image("busybox", busybox_rootfs(), exist_ok=True)
            with pytest.raises(belayer.AlreadyExistsError):
                await client.import_image("busybox", busybox_rootfs())

            sb = await client.create_sandbox("busybox", "aio-every-call")
            assert isinstance(sb, AsyncSandbox)
            async with sb:
                info = await sb.info()
                assert (info.id, info.image, info.state) == (sb.id, "busybox", "running")
                assert (await client.inspect(sb.id)).id == sb.id

                r = await sb.exec("echo one > /root/state; cat", stdin=b"in", timeout_ms=10_000)
                assert (r.exit_code, r.stdout, r.dirty) == (0, b"in", True)
                r = await client.exec(sb.id, 'pwd; echo "$W"; echo e >&2', cwd="/tmp",
                                      env={"W": "x"}, merge_stderr=True)
                assert r.stdout == b"/tmp\nx\ne\n"
                r = await sb.exec("exit 3")
                assert r.exit_code == 3, "a non-zero exit is reported, not raised"

                c1 = await sb.checkpoint(1, b"L_1")
                assert c1.prefix == 1
                d = await sb.maybe_checkpoint(2, b"L_2", step_duration_s=30.0,
                                              policy=belayer.Policy("always"))
                assert d.checkpointed and d.checkpoint_prefix == 2
                d = await client.maybe_checkpoint(sb.id, 3, b"L_3", step_duration_s=1.0,
                                                  policy=belayer.Policy("never"))
                assert not d.checkpointed

                await sb.exec("echo two >> /root/state")
                restored = await sb.restore()
                assert (restored.prefix, restored.context, restored.verified) == (2, b"L_2", True)
                assert (await sb.exec("cat /root/state")).stdout == b"one\n"
                restored = await client.restore(sb.id, verify=False)
                assert restored.prefix == 2 and restored.fs_matches is None

                same = client.sandbox(sb.id)
                assert (await same.exec("cat /root/state")).stdout == b"one\n"

                info = await client.fork(sb.id, 2, prefix=1, verify=False)
                assert (info.prefix, info.context, len(info.children)) == (1, b"L_1", 2)
                kids = await sb.fork(1)
                for kid in [client.sandbox(c.id) for c in info.children] + kids:
                    assert (await kid.exec("cat /root/state")).stdout == b"one\n"
                    await kid.destroy()
            with pytest.raises(belayer.UnknownSandboxError):
                await client.inspect(sb.id)

            traj = f"aio-{os.getpid()}"
            r1 = await client.context_append(traj, 1, b"ctx-1")
            r2 = await client.context_append(traj, 2, b"ctx-2")
            assert r2 > r1
            assert await client.context_lookup(traj) == (2, b"ctx-2")
            assert await client.context_lookup(traj, 1) == (1, b"ctx-1")
            await client.context_remove(traj)
            with pytest.raises(belayer.NotFoundError):
                await client.context_lookup(traj)

            sb2 = await client.create_sandbox("busybox")
            await client.destroy(sb2.id)
            with pytest.raises(belayer.UnknownSandboxError):
                await client.destroy(sb2.id)

    asyncio.run(main())


def test_newer_methods_forward_or_say_they_are_missing(daemon: Daemon, tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket) as client:
            missing = [name for name in NEWER if not hasattr(belayer.Client, name)]
            args = {"list_checkpoints": ("x",), "upload": ("x", "a", "b"),
                    "download": ("x", "a", "b")}
            for name in missing:
                with pytest.raises(NotImplementedError, match=name):
                    await getattr(client, name)(*args.get(name, ()))
            async with await client.create_sandbox("busybox") as sb:
                if "list_sandboxes" not in missing:
                    listed = await client.list_sandboxes()
                    assert sb.id in [s.id for s in listed]
                if "list_checkpoints" not in missing:
                    await sb.checkpoint(1, b"one")
                    listed = await sb.list_checkpoints()
                    assert [c.prefix for c in listed] == [1]
                    assert [c.prefix for c in await client.list_checkpoints(sb.id)] == [1]
                    r = await sb.restore(prefix=1)
                    assert r.prefix == 1
                if "upload" not in missing and "download" not in missing:
                    src = tmp_path / "up.txt"
                    src.write_bytes(b"payload")
                    await sb.upload(str(src), "/root/up.txt")
                    assert (await sb.exec("cat /root/up.txt")).stdout == b"payload"
                    await client.download(sb.id, "/root/up.txt", str(tmp_path / "down.txt"))
                    assert (tmp_path / "down.txt").read_bytes() == b"payload"
                await sb.kill_processes()
                assert [c.prefix for c in await sb.checkpoints()] == [1]
            if "gc" not in missing:
                removed, _ = await client.gc(older_than_s=0)
                assert removed >= 0
                with pytest.raises(ValueError, match="older_than_s or tag"):
                    await client.gc()

    asyncio.run(main())


def test_errors_raise_typed_from_the_await(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=2) as client:
            with pytest.raises(belayer.UnknownSandboxError):
                await client.exec("no-such-sandbox", "true")
            with pytest.raises(belayer.UnknownImageError):
                await client.create_sandbox("no-such-image")
            async with await client.create_sandbox("busybox") as sb:
                with pytest.raises(ValueError):
                    await sb.exec("true", env={"A=B": "x"})
                with pytest.raises(belayer.BadRequestError):
                    await sb.exec("true", cwd="relative")
                with pytest.raises(belayer.NotFoundError):
                    await client.context_lookup(f"never-written-{os.getpid()}")
                before = client.stats()
                # Error replies leave their connections usable: none was replaced.
                assert (await sb.exec("echo ok")).stdout == b"ok\n"
                assert client.stats().open == before.open

    asyncio.run(main())


def test_requests_are_in_flight_at_once(daemon: Daemon) -> None:
    """An action waits for a file the host creates only after other requests have been
    answered: they ran while it was in flight, and the loop was never blocked."""

    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=2) as client:
            async with await client.create_sandbox("busybox") as a, \
                    await client.create_sandbox("busybox") as b:
                root = Path(f"/proc/{(await a.info()).init_pid}/root")
                waiting = asyncio.ensure_future(a.exec(
                    "i=0; while [ ! -e /tmp/go ] && [ $i -lt 400 ]; do sleep 0.05; "
                    "i=$((i+1)); done; [ -e /tmp/go ] && echo met",
                    timeout_ms=60_000,
                ))
                for k in range(3):
                    assert (await b.exec(f"echo {k}")).stdout == f"{k}\n".encode()
                assert not waiting.done()
                assert client.stats().in_use == 1
                (root / "tmp" / "go").write_text("")
                assert (await waiting).stdout == b"met\n"

    asyncio.run(main())


async def _drive(client: AsyncClient, n: int) -> Tuple[str, List[bytes]]:
    """One sandbox's short trajectory: actions, a checkpoint, more actions."""
    async with await client.create_sandbox("busybox") as sb:
        out = []
        await sb.exec(f"echo {n} > /root/n", timeout_ms=30_000)
        out.append((await sb.exec("cat /root/n", timeout_ms=30_000)).stdout)
        c = await sb.checkpoint(1, f"L_1 of {n}".encode())
        assert c.prefix == 1
        out.append((await sb.exec(f"echo {n}b >> /root/n; cat /root/n",
                                  timeout_ms=30_000)).stdout)
        return sb.id, out


def _drive_sync(client: belayer.Client, n: int) -> List[bytes]:
    with client.create_sandbox("busybox") as sb:
        out = []
        sb.exec(f"echo {n} > /root/n", 30_000)
        out.append(sb.exec("cat /root/n", 30_000).stdout)
        sb.checkpoint(1, f"L_1 of {n}".encode())
        out.append(sb.exec(f"echo {n}b >> /root/n; cat /root/n", 30_000).stdout)
        return out


def test_sixty_four_sandboxes_from_one_loop(daemon: Daemon) -> None:
    n = 64

    async def main() -> float:
        async with AsyncClient(daemon.socket) as client:
            start = time.monotonic()
            results = await asyncio.gather(*(_drive(client, i) for i in range(n)))
            wall = time.monotonic() - start
            assert client.stats().in_use == 0
        assert len({sid for sid, _ in results}) == n
        for i, (_, out) in enumerate(results):
            assert out == [f"{i}\n".encode(), f"{i}\n{i}b\n".encode()], (i, out)
        return wall

    concurrent = asyncio.run(main())
    start = time.monotonic()
    with belayer.Client(daemon.socket) as client:
        for i in range(n):
            assert _drive_sync(client, i) == [f"{i}\n".encode(), f"{i}\n{i}b\n".encode()]
    sequential = time.monotonic() - start
    print(f"\n{n} sandboxes (create, 3 execs, checkpoint, destroy): one event loop "
          f"{concurrent:.2f} s, sequential sync client {sequential:.2f} s, "
          f"ratio {sequential / concurrent:.2f}x")


def test_events_async_iterator(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket) as client:
            async with client.events() as events:
                assert isinstance(events, AsyncSubscription)
                async with await client.create_sandbox("busybox") as sb:
                    await sb.checkpoint(1, b"one")
                    ready = await events.wait_for("checkpoint_ready", sb.id)
                    assert ready.prefix == 1
                    os.kill((await sb.info()).init_pid, signal.SIGKILL)
                    async for ev in events:
                        if ev.kind == "sandbox_failed" and ev.sandbox == sb.id:
                            break
                    assert (await sb.restore()).prefix == 1
            sub = await client.subscribe()
            assert await sub.next(0.1) is None
            await sub.aclose()
            with pytest.raises(belayer.BadHandleError):
                await sub.next(0.1)

    asyncio.run(main())
