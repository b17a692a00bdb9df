"""Throughput of many sandboxes driven from one asyncio event loop (``belayer.aio``) against
the synchronous client driving them one after another.

Each sandbox runs a short trajectory: create, an action, a read-back, a full checkpoint C_1,
one more action, destroy. The script prints a table (one row per configuration: wall time,
sandboxes per second, execs per second, median and worst trajectory time) and the same
figures as JSON on the last line.

Usage::

    BELAYER_SOCKET=/run/belayer/belayer.sock python3 aio_throughput.py [--sandboxes 64]
        [--pools 1,8,16,64] [--sleep 0]

``--sleep S`` makes the first action ``sleep S`` (an action that waits, as a test run
would); with it the table shows how the pool size bounds the actions in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Dict, List

import belayer
from belayer.aio import AsyncClient

EXECS_PER_SANDBOX = 3


def trajectory_commands(n: int, sleep_s: float) -> List[str]:
    first = f"echo {n} > /root/n" if not sleep_s else f"sleep {sleep_s}; echo {n} > /root/n"
    return [first, "cat /root/n", f"echo {n}b >> /root/n; cat /root/n"]


async def drive(client: AsyncClient, n: int, sleep_s: float) -> float:
    start = time.monotonic()
    first, read, more = trajectory_commands(n, sleep_s)
    async with await client.create_sandbox("busybox") as sb:
        await sb.exec(first, timeout_ms=60_000)
        assert (await sb.exec(read, timeout_ms=60_000)).stdout == f"{n}\n".encode()
        await sb.checkpoint(1, f"L_1 of {n}".encode())
        out = (await sb.exec(more, timeout_ms=60_000)).stdout
        assert out == f"{n}\n{n}b\n".encode(), out
    return time.monotonic() - start


async def run_async(socket: str, sandboxes: int, pool: int, sleep_s: float) -> Dict[str, float]:
    async with AsyncClient(socket, max_connections=pool) as client:
        await client.ping()
        start = time.monotonic()
        per = await asyncio.gather(*(drive(client, n, sleep_s) for n in range(sandboxes)))
        wall = time.monotonic() - start
    return summary(f"aio, max_connections={pool}", wall, list(per), sandboxes)


def run_sync(socket: str, sandboxes: int, sleep_s: float) -> Dict[str, float]:
    per = []
    with belayer.Client(socket) as client:
        start = time.monotonic()
        for n in range(sandboxes):
            t = time.monotonic()
            first, read, more = trajectory_commands(n, sleep_s)
            with client.create_sandbox("busybox") as sb:
                sb.exec(first, 60_000)
                assert sb.exec(read, 60_000).stdout == f"{n}\n".encode()
                sb.checkpoint(1, f"L_1 of {n}".encode())
                assert sb.exec(more, 60_000).stdout == f"{n}\n{n}b\n".encode()
            per.append(time.monotonic() - t)
        wall = time.monotonic() - start
    return summary("sync, sequential", wall, per, sandboxes)


def summary(name: str, wall: float, per: List[float], sandboxes: int) -> Dict[str, float]:
    return {
        "config": name,  # type: ignore[dict-item]
        "sandboxes": sandboxes,
        "wall_s": round(wall, 3),
        "sandboxes_per_s": round(sandboxes / wall, 2),
        "execs_per_s": round(sandboxes * EXECS_PER_SANDBOX / wall, 1),
        "median_trajectory_s": round(statistics.median(per), 3),
        "max_trajectory_s": round(max(per), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=os.environ.get("BELAYER_SOCKET",
                                                           "/run/belayer/belayer.sock"))
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--pools", default="1,8,16,64",
                        help="comma-separated pool sizes (max_connections) to run")
    parser.add_argument("--sleep", type=float, default=0.0,
                        help="seconds the first action of each trajectory sleeps")
    parser.add_argument("--rootfs", default=os.environ.get(
        "BELAYER_TEST_BUSYBOX_ROOTFS", "/var/cache/belayer/images/busybox/rootfs"))
    args = parser.parse_args()

    with belayer.Client(args.socket) as client:
        client.import_image("busybox", args.rootfs, exist_ok=True)
    rows = [run_sync(args.socket, args.sandboxes, args.sleep)]
    for pool in (int(p) for p in args.pools.split(",") if p):
        rows.append(asyncio.run(run_async(args.socket, args.sandboxes, pool, args.sleep)))

    base = rows[0]["wall_s"]
    print(f"{args.sandboxes} sandboxes, each: create, {EXECS_PER_SANDBOX} execs "
          f"(first sleeps {args.sleep} s), checkpoint C_1, destroy")
    print(f"{'configuration':<28}{'wall s':>9}{'sb/s':>8}{'exec/s':>9}"
          f"{'median s':>10}{'max s':>8}{'speed-up':>10}")
    for r in rows:
        print(f"{r['config']:<28}{r['wall_s']:>9.2f}{r['sandboxes_per_s']:>8.2f}"
              f"{r['execs_per_s']:>9.1f}{r['median_trajectory_s']:>10.3f}"
              f"{r['max_trajectory_s']:>8.3f}{base / r['wall_s']:>9.2f}x")
    print(json.dumps({"benchmark": "aio_throughput", "sleep_s": args.sleep, "rows": rows}))


if __name__ == "__main__":
    main()
