"""``belayer.aio`` when callers go away: cancelled and timed-out calls never leave a stale
response on a connection, the pool neither leaks nor exceeds its size, closing with calls in
flight is safe, a cancelled create destroys its sandbox, the daemon's connection limit is
absorbed, and event reads survive cancellation without losing an event."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from typing import List

import pytest

import belayer
from belayer.aio import AsyncClient
from conftest import Daemon, busybox_rootfs


async def settle(client: AsyncClient, timeout: float = 30.0) -> None:
    """Waits until no connection of ``client`` is in use or being opened."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while client.stats().in_use or client.stats().opening:
        assert loop.time() < deadline, client.stats()
        await asyncio.sleep(0.01)


def sandbox_ids(daemon: Daemon) -> List[str]:
    out = subprocess.run(
        [str(daemon.bin_dir / "belayer"), "--socket", daemon.socket, "--json", "sandbox", "ls"],
        capture_output=True, text=True, check=True,
    )
    return [sb["id"] for sb in json.loads(out.stdout or "[]")]


@pytest.mark.parametrize("pool", [1, 4])
def test_cancelled_exec_leaves_no_stale_response(daemon: Daemon, pool: int) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=pool) as client:
            async with await client.create_sandbox("busybox") as slow, \
                    await client.create_sandbox("busybox") as other:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(slow.exec("sleep 2; echo slow", timeout_ms=30_000),
                                           0.1)
                # The cancelled request still holds its connection.
                assert client.stats().in_use == 1
                # Other calls at once, on the same client (with pool=1: the same connection,
                # once the sleep's response has been read): each gets its own answer.
                version, r, info = await asyncio.gather(
                    client.ping(), other.exec("echo mine"), client.inspect(other.id)
                )
                assert isinstance(version, str) and version
                assert r.stdout == b"mine\n"
                assert info.id == other.id
                # The sandbox runs one action at a time: its next one waits for the sleep.
                assert (await slow.exec("echo after")).stdout == b"after\n"

                task = asyncio.ensure_future(slow.exec("sleep 1; echo cancelled"))
                await asyncio.sleep(0.1)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                if sys.version_info >= (3, 11):
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.1):
                            await other.exec("sleep 1; echo timed-out")
                assert (await other.exec("echo last")).stdout == b"last\n"
                await settle(client)
                stats = client.stats()
                assert stats.open <= pool and stats.waiting == 0 and stats.idle == stats.open

    asyncio.run(main())


def test_random_cancellations_never_mix_responses(daemon: Daemon) -> None:
    rng = random.Random(15)

    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=5) as client:
            sandboxes = [await client.create_sandbox("busybox") for _ in range(5)]
            try:
                tasks = []
                for i in range(60):
                    sb = sandboxes[i % len(sandboxes)]
                    delay = rng.choice(["0", "0.02", "0.05"])
                    tasks.append(asyncio.ensure_future(
                        sb.exec(f"sleep {delay}; echo {i}", timeout_ms=30_000)))
                for t in tasks:
                    if rng.random() < 0.4:
                        asyncio.get_running_loop().call_later(rng.random() * 0.5, t.cancel)
                done = await asyncio.gather(*tasks, return_exceptions=True)
                answered = 0
                for i, r in enumerate(done):
                    if isinstance(r, asyncio.CancelledError):
                        continue
                    assert isinstance(r, belayer.ExecResult), r
                    assert r.stdout == f"{i}\n".encode()
                    answered += 1
                assert answered > 0
                await settle(client)
                again = await asyncio.gather(
                    *(sb.exec(f"echo again {k}") for k, sb in enumerate(sandboxes)))
                assert [r.stdout for r in again] == [
                    f"again {k}\n".encode() for k in range(len(sandboxes))]
                assert client.stats().open <= 5
            finally:
                for sb in sandboxes:
                    await sb.destroy()

    asyncio.run(main())


def test_more_requests_than_connections(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=3) as client:
            sandboxes = [await client.create_sandbox("busybox") for _ in range(4)]
            seen = []

            async def watch() -> None:
                while True:
                    seen.append(client.stats())
                    await asyncio.sleep(0.005)

            watcher = asyncio.ensure_future(watch())
            try:
                results = await asyncio.gather(*(
                    sandboxes[i % 4].exec(f"sleep 0.02; echo {i}", timeout_ms=30_000)
                    for i in range(40)))
                assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(40)]
            finally:
                watcher.cancel()
                for sb in sandboxes:
                    await sb.destroy()
            assert max(s.open for s in seen) <= 3
            assert max(s.waiting for s in seen) > 0
            assert client.stats().in_use == 0

    asyncio.run(main())


def test_closing_with_calls_in_flight(daemon: Daemon) -> None:
    async def main() -> None:
        client = AsyncClient(daemon.socket, max_connections=2)
        a = await client.create_sandbox("busybox")
        b = await client.create_sandbox("busybox")
        try:
            running = [asyncio.ensure_future(sb.exec(f"sleep 0.5; echo {sb.id}"))
                       for sb in (a, b)]
            queued = [asyncio.ensure_future(client.ping()) for _ in range(3)]
            await asyncio.sleep(0.1)
            assert client.stats().waiting == 3
            await client.aclose()
            assert client.stats().open == 0
            for sb, t in zip((a, b), running):
                assert (await t).stdout == f"{sb.id}\n".encode()
            for t in queued:
                with pytest.raises(belayer.BadHandleError):
                    await t
            with pytest.raises(belayer.BadHandleError):
                await client.ping()
            await client.aclose()  # idempotent
        finally:
            with belayer.Client(daemon.socket) as sync:
                for sb in (a, b):
                    sync.destroy(sb.id)

        # close() without waiting, and the loop ending while a call is in flight.
        client = AsyncClient(daemon.socket, max_connections=1)
        sb = await client.create_sandbox("busybox")
        task = asyncio.ensure_future(sb.exec("sleep 0.3; echo x"))
        await asyncio.sleep(0.05)
        client.close()
        assert (await task).stdout == b"x\n"
        with belayer.Client(daemon.socket) as sync:
            sync.destroy(sb.id)

    asyncio.run(main())


def test_cancelled_create_destroys_its_sandbox(daemon: Daemon) -> None:
    if not (daemon.bin_dir / "belayer").is_file():
        pytest.skip("the belayer CLI is not built next to belayerd")
    before = set(sandbox_ids(daemon))

    async def main() -> None:
        async with AsyncClient(daemon.socket, max_connections=2) as client:
            cancelled = 0
            for delay in (0.0, 0.001, 0.005, 0.01, 0.02, 0.04):
                try:
                    sb = await asyncio.wait_for(client.create_sandbox("busybox"), delay)
                except asyncio.TimeoutError:
                    cancelled += 1
                else:
                    await sb.destroy()
            assert cancelled > 0
            await settle(client)
            for _ in range(200):  # an undo after a late hand-over runs as a task of its own
                if set(sandbox_ids(daemon)) == before:
                    break
                await asyncio.sleep(0.05)

    asyncio.run(main())
    assert set(sandbox_ids(daemon)) == before


def test_pool_absorbs_the_daemon_connection_limit() -> None:
    daemon = Daemon(config="max_connections = 4\nroot_reserved_connections = 1\n")
    try:
        with belayer.Client(daemon.socket) as sync:
            sync.import_image("busybox", busybox_rootfs(), exist_ok=True)

        async def main() -> None:
            async with AsyncClient(daemon.socket, max_connections=12) as client:
                sandboxes = [await client.create_sandbox("busybox") for _ in range(4)]
                # More calls at once than the daemon serves connections: refused connections
                # (BusyError before anything was handled) shrink the pool for a while.
                results = await asyncio.gather(*(
                    sandboxes[i % 4].exec(f"sleep 0.1; echo {i}", timeout_ms=30_000)
                    for i in range(16)))
                assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(16)]
                assert client.stats().open <= 4
                await settle(client)
                # Another connection makes the daemon close one of the pool's idle ones to
                # make room; the call that meets it is tried again on another connection.
                with belayer.Client(daemon.socket) as other:
                    assert other.ping()
                    results = await asyncio.gather(*(
                        sandboxes[i % 4].exec(f"echo {i}") for i in range(8)))
                    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(8)]
                for sb in sandboxes:
                    await sb.destroy()

        asyncio.run(main())
    finally:
        daemon.cleanup()


def test_event_reads_survive_cancellation(daemon: Daemon) -> None:
    async def main() -> None:
        async with AsyncClient(daemon.socket) as client:
            async with await client.subscribe() as events, \
                    await client.create_sandbox("busybox") as sb:
                for _ in range(3):
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(events.next(), 0.05)
                reader = asyncio.ensure_future(events.next())
                await asyncio.sleep(0.05)
                await sb.checkpoint(1, b"one")
                reader.cancel()
                try:
                    got = await reader  # it finished before the cancellation reached it
                except asyncio.CancelledError:
                    got = await events.next(10)  # the abandoned read's event comes next
                assert got is not None
                assert (got.kind, got.sandbox, got.prefix) == ("checkpoint_ready", sb.id, 1)

    asyncio.run(main())
