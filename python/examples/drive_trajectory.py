#!/usr/bin/env python3
"""Drives one recorded agent trajectory (``agent/cli/trajectories/*.jsonl``) through Belayer from
Python, the way an RL framework would: after every action the step's timing goes to the
adaptive checkpoint policy (which checkpoints when a failure would cost more than the
checkpoint's visible cost), the LLM context goes to the context log, and in the middle of
step ``--fail-at`` (after its action, before its boundary) the sandbox is killed from outside. The driver then waits for the
``sandbox_failed`` event, restores the ready checkpoint C_k into a fresh sandbox, takes back
the LLM context L_k and regenerates from k + 1.

It checks recovery alignment: after the restore, the environment holds exactly the effects of
steps 1..k (a marker file written by every step) and the returned context is the one logged
at k. Prints a JSON summary; exits 0 when everything matched.

Usage: drive_trajectory.py [--socket S] [--trajectory FILE] [--fail-at N] [--policy KIND]
                           [--failure-p P] [--image NAME --rootfs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import belayer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRAJECTORY = (
    REPO / "agent" / "cli" / "trajectories" / "tbmini__grid-pattern-transform__2025-08-07__20-46-16.jsonl"
)
MARKER = "/root/.belayer-steps"


def load(path: Path) -> List[Dict[str, Any]]:
    """The steps of a recorded trajectory, in order."""
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return sorted(steps, key=lambda s: s["step"])


def shell(step: Dict[str, Any]) -> str:
    """The shell command of a recorded action (editor actions become file writes)."""
    kind, cmd = step.get("kind"), step.get("cmd", "")
    if kind == "edit":
        path = cmd.split(" ", 1)[1] if " " in cmd else "/tmp/edited"
        return f"mkdir -p \"$(dirname '{path}')\" && echo '# edited' >> '{path}'"
    if kind == "read":
        path = cmd.split(" ", 1)[1] if " " in cmd else "/"
        return f"cat '{path}' 2>/dev/null | head -n 100; true"
    if kind == "sweagent-tool":
        return "true"
    return cmd


def kill_from_outside(client: belayer.Client, sandbox: str) -> None:
    """SIGKILLs every process of the sandbox from the host (a fail-stop)."""
    client.kill_processes(sandbox)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=os.environ.get("BELAYER_SOCKET"))
    ap.add_argument("--trajectory", type=Path, default=DEFAULT_TRAJECTORY)
    ap.add_argument("--fail-at", type=int, default=0, help="step to fail at (default: 2/3 in)")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--failure-p", type=float, default=0.05)
    ap.add_argument("--image", default="busybox")
    ap.add_argument(
        "--rootfs",
        default=os.environ.get(
            "BELAYER_TEST_BUSYBOX_ROOTFS", "/var/cache/belayer/images/busybox/rootfs"
        ),
    )
    ap.add_argument("--action-timeout-ms", type=int, default=10_000)
    args = ap.parse_args()

    steps = load(args.trajectory)
    fail_at = args.fail_at or max(2, len(steps) * 2 // 3)
    trajectory = f"py-{args.trajectory.stem[:40]}-{os.getpid()}".replace("__", "-")
    policy = belayer.Policy(kind=args.policy, failure_p=args.failure_p)
    summary: Dict[str, Any] = {"trajectory": args.trajectory.name, "steps": len(steps),
                               "fail_at": fail_at, "checkpoints": [], "decisions": 0}
    started = time.monotonic()

    with belayer.Client(args.socket) as client, client.subscribe() as events:
        client.import_image(args.image, args.rootfs, exist_ok=True)
        with client.create_sandbox(args.image, tag="drive-trajectory") as sb:
            messages: List[Dict[str, Any]] = []
            failed = False
            i = 1
            while i <= len(steps):
                step = steps[i - 1]
                # The "LLM" answers with the recorded action; the environment runs it.
                messages.append({"role": "assistant", "step": i, "action": step.get("cmd", "")})
                result = sb.exec(shell(step), timeout_ms=args.action_timeout_ms)
                sb.exec(f"echo {i} >> {MARKER}")
                messages.append({"role": "tool", "step": i, "exit": result.exit_code,
                                 "output": result.text[-200:]})

                if i == fail_at and not failed:
                    # A fail-stop in the middle of step i: its action ran, its boundary was
                    # never reached. Recovery goes back to the last ready checkpoint k < i.
                    failed = True
                    kill_from_outside(client, sb.id)
                    ev = events.wait_for("sandbox_failed", sb.id)
                    restored = sb.restore(verify=True)
                    k = restored.prefix or 0
                    expected = client.context_lookup(trajectory, k)[1] if k else b""
                    markers = sb.exec(f"cat {MARKER} 2>/dev/null").text.split()
                    summary.update(
                        failure_reason=ev.reason,
                        restored_prefix=k,
                        restore_ms=round(restored.total_ms, 1),
                        regenerated_steps=i - k,
                        context_matches=restored.context == expected,
                        environment_matches=markers == [str(j) for j in range(1, k + 1)],
                        restore_verified=(restored.verified and restored.fs_matches
                                          and restored.processes_match) if k else True,
                    )
                    messages = json.loads(restored.context) if k else []
                    i = k + 1
                    continue

                context = json.dumps(messages).encode()
                client.context_append(trajectory, i, context)
                llm_s = float(step.get("llm_s") or 0.0)
                exec_s = float(step.get("exec_s") or 0.0)
                decision = sb.maybe_checkpoint(
                    i, context, step_duration_s=llm_s + exec_s, llm_response_s=llm_s,
                    policy=policy,
                )
                summary["decisions"] += 1
                if decision.checkpointed:
                    summary["checkpoints"].append(i)
                    events.wait_for("checkpoint_ready", sb.id)
                i += 1
            final = sb.exec(f"cat {MARKER}").text.split()
            summary["final_environment_matches"] = final == [str(j) for j in range(1, len(steps) + 1)]
        # The trajectory is done: its context log is no longer needed and would count against
        # this uid's context budget in the daemon.
        client.context_remove(trajectory)
    summary["wall_s"] = round(time.monotonic() - started, 2)
    print(json.dumps(summary, indent=2))
    ok = all(summary.get(key, False) for key in (
        "context_matches", "environment_matches", "restore_verified", "final_environment_matches"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
