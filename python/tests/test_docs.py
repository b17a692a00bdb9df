"""The README's "Use from Python" snippet and the trajectory example run for real."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import belayer
from conftest import REPO, busybox_rootfs

EXAMPLE = REPO / "python" / "examples" / "drive_trajectory.py"


def readme_block(section: str, lang: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {section}")
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, start)
    assert m, f"no {lang} block in section {section!r}"
    return m.group(1)


def run(args, daemon) -> subprocess.CompletedProcess:
    # The child imports the same package as this test (installed or from the source tree).
    package_root = str(Path(belayer.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "BELAYER_SOCKET": daemon.socket,
           "BELAYER_TEST_BUSYBOX_ROOTFS": busybox_rootfs(), "PYTHONPATH": path}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)


def test_readme_python_snippet_runs(daemon, tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(readme_block("Use from Python", "python"))
    out = run([sys.executable, str(script)], daemon)
    assert out.returncode == 0, out.stdout + out.stderr + daemon.log()[-4000:]


def test_example_drives_a_trajectory_through_a_failure(daemon) -> None:
    out = run([sys.executable, str(EXAMPLE)], daemon)
    assert out.returncode == 0, out.stdout + out.stderr + daemon.log()[-4000:]
    assert '"context_matches": true' in out.stdout
    assert '"environment_matches": true' in out.stdout
