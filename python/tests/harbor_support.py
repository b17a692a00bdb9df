"""Helpers of the Harbor tests: a daemon with the Debian python image as ``python``, Harbor's
own ``harbor run`` on a local task, and a host-side killer of sandbox processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import belayer
from conftest import Daemon

TASK = Path(__file__).resolve().parent / "harbor_task"
ENV_IMPORT_PATH = "belayer.integrations.harbor:BelayerEnvironment"


def python_rootfs() -> str:
    return os.environ.get(
        "BELAYER_TEST_PYTHON_ROOTFS", "/var/cache/belayer/images/bookworm-python/rootfs"
    )


def harbor_run(socket: str, jobs: Path, job: str, *extra: str) -> Dict[str, object]:
    """Runs ``harbor run`` (the venv's console script) on the test task with the oracle agent
    and the Belayer environment; returns the single trial's directory and result JSON."""
    harbor = Path(sys.executable).parent / "harbor"
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_COLOR": "1"}
    cmd = [str(harbor), "run", "-p", str(TASK), "-a", "oracle", "--env", ENV_IMPORT_PATH,
           "--ek", f"socket={socket}", "--ek", "image=python", "-o", str(jobs),
           "--job-name", job, "-y", "-q", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"harbor run failed:\n{out.stdout}\n{out.stderr}"
    trials = [p for p in (jobs / job).iterdir() if (p / "result.json").is_file()]
    assert len(trials) == 1, f"expected one trial in {jobs / job}: {out.stdout}"
    trial = trials[0]
    return {
        "dir": trial,
        "result": json.loads((trial / "result.json").read_text()),
        "belayer": json.loads((trial / "belayer.json").read_text()),
        "log": (trial / "trial.log").read_text(errors="replace"),
    }


class HostKiller(threading.Thread):
    """Watches the daemon's sandboxes from the host; each time a sandbox process whose command
    line contains the next of ``markers`` appears, SIGKILLs every process of that sandbox
    (a process already gone is skipped). ``kills`` records what it did."""

    def __init__(self, daemon: Daemon, markers: List[str]) -> None:
        super().__init__(daemon=True)
        self.daemon_ = daemon
        self.markers = list(markers)
        self.kills: List[Dict[str, object]] = []
        self.done = threading.Event()

    def _sandboxes(self) -> List[str]:
        out = subprocess.run(
            [str(self.daemon_.bin_dir / "belayer"), "--socket", self.daemon_.socket, "--json",
             "sandbox", "ls"], capture_output=True, text=True,
        )
        try:
            return [sb["id"] for sb in json.loads(out.stdout or "[]")]
        except json.JSONDecodeError:
            return []

    @staticmethod
    def _cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return ""

    def run(self) -> None:
        with belayer.Client(self.daemon_.socket) as client:
            ids: List[str] = []
            while self.markers and not self.done.is_set():
                if not ids:
                    ids = self._sandboxes()
                for sb in ids:
                    try:
                        pids = client.inspect(sb).pids
                    except belayer.BelayerError:
                        continue
                    if any(self.markers[0] in self._cmdline(p) for p in pids):
                        killed = 0
                        for pid in pids:
                            try:
                                os.kill(pid, signal.SIGKILL)
                                killed += 1
                            except ProcessLookupError:
                                pass
                        self.kills.append({"marker": self.markers.pop(0), "sandbox": sb,
                                           "killed": killed, "at": time.time()})
                        break
                time.sleep(0.02)

    def stop(self) -> None:
        self.done.set()
        self.join(10)


def start_daemon() -> Daemon:
    """A daemon of the test's own with the python image imported as ``python``."""
    d = Daemon()
    with belayer.Client(d.socket) as c:
        c.import_image("python", python_rootfs(), exist_ok=True)
    return d


def recoveries(record: Dict[str, object]) -> List[Dict[str, object]]:
    return list(record["recoveries"])  # type: ignore[arg-type]


def sandbox_count(daemon: Daemon) -> Optional[int]:
    out = subprocess.run([str(daemon.bin_dir / "belayer"), "--socket", daemon.socket, "--json",
                          "sandbox", "ls"], capture_output=True, text=True)
    try:
        return len(json.loads(out.stdout or "[]"))
    except json.JSONDecodeError:
        return None
