#!/usr/bin/env python3
"""Per-step latency of a trivial action through mini-swe-agent, side by side in one run:
``execute({"command": "true"})`` of mini-swe-agent's ``LocalEnvironment`` (a subprocess on the
host) and of ``belayer.integrations.minisweagent.BelayerEnvironment`` (merged output, env and
cwd as the agent sends them), and the raw ``Sandbox.exec("true")`` under it. The variants
take turns within each round, so drift of the machine hits all of them alike.

Prints a table (milliseconds) and the same figures as JSON (``--json FILE``; ``-`` for
stdout). Needs root, a built ``belayerd`` and ``libbelayer.so`` (``BELAYERD``, ``BELAYER_LIB``
or ``CARGO_TARGET_DIR``), mini-swe-agent (``scripts/setup.sh`` installs the pinned one) and
the busybox image of ``scripts/setup.sh``. Without ``--socket`` a private daemon is started
on the test state root (as ``python/tests/conftest.py`` does) and removed afterwards.

Usage: python3 bench/python/exec_latency.py [-n 50] [--socket SOCK] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python"), str(REPO / "python" / "tests")]
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-config-"))

import belayer  # noqa: E402
from belayer.integrations.minisweagent import BelayerEnvironment  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402

WARMUP = 5


def summary(samples_ms: List[float]) -> Dict[str, float]:
    """Median, 10th and 90th percentile and mean of ``samples_ms``, milliseconds."""
    deciles = statistics.quantiles(samples_ms, n=10)
    return {
        "median_ms": statistics.median(samples_ms),
        "p10_ms": deciles[0],
        "p90_ms": deciles[-1],
        "mean_ms": statistics.fmean(samples_ms),
        "runs": len(samples_ms),
    }


def measure(variants: Dict[str, Callable[[], object]], runs: int) -> Dict[str, List[float]]:
    """Runs every variant ``WARMUP`` times, then ``runs`` rounds of one call each."""
    for call in variants.values():
        for _ in range(WARMUP):
            call()
    samples: Dict[str, List[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, call in variants.items():
            start = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - start) * 1000)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=50, help="rounds (default 50)")
    parser.add_argument("--socket", help="socket of a running belayerd (default: start one)")
    parser.add_argument("--rootfs", default=os.environ.get(
        "BELAYER_TEST_BUSYBOX_ROOTFS", "/var/cache/belayer/images/busybox/rootfs"))
    parser.add_argument("--json", default="-", help="where the JSON goes (default: stdout)")
    args = parser.parse_args()

    daemon = None
    socket = args.socket
    if socket is None:
        from conftest import Daemon

        daemon = Daemon()
        socket = daemon.socket
    local_dir = tempfile.mkdtemp(prefix="exec-latency-")
    env = None
    try:
        env = BelayerEnvironment(image="busybox", image_source=args.rootfs, socket=socket,
                                 cwd="/root", env={"PAGER": "cat"})
        local = LocalEnvironment(cwd=local_dir, env={"PAGER": "cat"})
        action = {"command": "true"}
        raw = belayer.Client(socket)
        sandbox = raw.sandbox(env.sandbox_id)
        variants: Dict[str, Callable[[], object]] = {
            "minisweagent LocalEnvironment.execute": lambda: local.execute(action),
            "BelayerEnvironment.execute": lambda: env.execute(action),
            "belayer Sandbox.exec (raw)": lambda: sandbox.exec("true"),
        }
        samples = measure(variants, args.runs)
        raw.close()
    finally:
        if env is not None:
            env.cleanup()
        if daemon is not None:
            daemon.cleanup()
        os.rmdir(local_dir)

    results = {name: summary(s) for name, s in samples.items()}
    base = results["minisweagent LocalEnvironment.execute"]["median_ms"]
    for r in results.values():
        r["vs_local"] = r["median_ms"] / base
    width = max(map(len, results))
    title = 'execute("true")'
    print(f"{title:<{width}}  median_ms  p10_ms  p90_ms  vs_local", file=sys.stderr)
    for name, r in results.items():
        print(f"{name:<{width}}  {r['median_ms']:9.2f}  {r['p10_ms']:6.2f}  {r['p90_ms']:6.2f}"
              f"  {r['vs_local']:7.2f}x", file=sys.stderr)
    report = {"benchmark": "exec_latency", "command": "true", "runs": args.runs,
              "cpus": os.cpu_count(), "results": results}
    text = json.dumps(report, indent=2)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
