"""Harbor's own runner (``harbor run``, the oracle agent, the task's verifier) on a local task
through the Belayer environment, without and with processes killed from the host mid-run."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("harbor.environments.base")

from harbor_support import HostKiller, harbor_run, recoveries, sandbox_count, start_daemon  # noqa: E402


@pytest.fixture(scope="module")
def harbor_daemon() -> Iterator[object]:
    d = start_daemon()
    yield d
    d.cleanup()


def test_task_reaches_its_reward(harbor_daemon, tmp_path: Path) -> None:
    trial = harbor_run(harbor_daemon.socket, tmp_path, "plain")
    result, record = trial["result"], trial["belayer"]
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    assert record["from"] == "python:3.11-slim-bookworm" and record["image"] == "python"
    assert record["checkpoints"] > 0 and recoveries(record) == []
    assert (trial["dir"] / "verifier" / "test-stdout.txt").read_text().startswith(
        "out.txt: ALPHA BETA GAMMA DELTA EPSILON ; tally: 5; built: hello")
    assert sandbox_count(harbor_daemon) == 0


def test_task_recovers_from_host_kills(harbor_daemon, tmp_path: Path) -> None:
    # First while the oracle's solve.sh runs (before it told the service its state), then while
    # the verifier's test.sh runs: the restored checkpoint must hold the service with the
    # number it keeps only in memory, or the verifier reads no tally and the reward is 0.
    killer = HostKiller(harbor_daemon, ["/solution/solve.sh", "/tests/test.sh"])
    killer.start()
    try:
        trial = harbor_run(harbor_daemon.socket, tmp_path, "killed")
    finally:
        killer.stop()
    result, record = trial["result"], trial["belayer"]
    assert [k["marker"] for k in killer.kills] == ["/solution/solve.sh", "/tests/test.sh"]
    assert all(k["killed"] > 0 for k in killer.kills)
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"] == {"reward": 1.0}
    got = recoveries(record)
    assert len(got) == 2, got
    assert "solve.sh" in got[0]["operation"] and "test.sh" in got[1]["operation"]
    for entry in got:
        assert entry["fault"] in ("external_kill", "sandbox_lost", "sandbox_failed"), entry
        assert entry["restored_prefix"] is not None and entry["processes_match"] is True
        # Only the interrupted action runs again: a checkpoint follows every action.
        assert len(entry["replayed"]) == 1, entry
    assert "restoring" in trial["log"]
    assert sandbox_count(harbor_daemon) == 0
