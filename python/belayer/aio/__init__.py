"""Belayer for asyncio programs: one event loop drives many sandboxes at once.

Example::

    import asyncio
    from belayer.aio import AsyncClient

    async def rollout(client: AsyncClient, n: int) -> bytes:
        async with await client.create_sandbox("busybox") as sb:
            await sb.exec(f"echo {n} > /root/n", timeout_ms=10_000)
            await sb.checkpoint(1, b"context after step 1")
            return (await sb.exec("cat /root/n")).stdout

    async def main() -> None:
        async with AsyncClient("/run/belayer/belayer.sock") as client:
            print(await asyncio.gather(*(rollout(client, n) for n in range(64))))

    asyncio.run(main())

:class:`AsyncClient` has every method of :class:`belayer.Client` as a coroutine, run on a
bounded pool of daemon connections (:mod:`belayer.aio.pool`) in worker threads (the library
releases the GIL while it waits for the daemon); :class:`AsyncSandbox` those of
:class:`belayer.Sandbox`; :class:`AsyncSubscription` is an async iterator of daemon events.
All are cancellation-safe: a cancelled call never leaves its connection with an unread
response. A cancelled ``exec`` keeps running in the sandbox until its own ``timeout_ms``.
"""

from .client import AsyncClient, AsyncSandbox
from .events import AsyncSubscription
from .pool import ConnectionPool, PoolStats, default_max_connections

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AsyncSubscription",
    "ConnectionPool",
    "PoolStats",
    "default_max_connections",
]
