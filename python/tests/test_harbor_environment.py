"""The Belayer Harbor environment driven directly (start, exec, files, stop), its recovery
from host-side kills between and during actions, the task's resource limits, a cancelled
action, and the Dockerfile subset it honours (directory copies: test_harbor_files.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("harbor.environments.base")

from harbor.environments.base import SandboxBuildFailedError  # noqa: E402

import belayer  # noqa: E402
from belayer.integrations.harbor import (  # noqa: E402
    BelayerEnvironment,
    UnsupportedDockerfileError,
)
from belayer.integrations.harbor import dockerfile  # noqa: E402
from harbor_support import make_env, start_daemon  # noqa: E402


@pytest.fixture(scope="module")
def harbor_daemon() -> Iterator[object]:
    d = start_daemon()
    yield d
    d.cleanup()


def kill_all(daemon, sandbox: str) -> int:
    killed = 0
    with belayer.Client(daemon.socket) as c:
        for pid in c.inspect(sandbox).pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def test_exec_files_and_idle_kill(harbor_daemon, tmp_path: Path) -> None:
    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path)
        await env.start(force_build=False)
        try:
            r = await env.exec("echo $0 $X; pwd; echo err >&2", cwd="/tmp", env={"X": "1"})
            assert (r.return_code, r.stdout, r.stderr) == (0, "bash 1\n/tmp\n", "err\n")
            r = await env.exec("id -u; exit 3", user="nobody")
            assert (r.return_code, r.stdout) == (3, "65534\n")
            with pytest.raises(RuntimeError, match="timed out"):
                await env.exec("sleep 5", timeout_sec=1)

            src = tmp_path / "src"
            (src / "sub").mkdir(parents=True)
            (src / "sub" / "a.txt").write_text("A")
            (src / "b.sh").write_text("#!/bin/sh\necho B\n")
            (src / "b.sh").chmod(0o755)
            await env.upload_dir(src, "/work")
            await env.upload_file(src / "b.sh", "/usr/local/bin/bee")
            assert (await env.exec("bee && cat /work/sub/a.txt")).stdout == "B\nA"
            await env.exec("mkdir -p /out/d && echo x > /out/d/x && echo y > /out/y")
            await env.download_dir("/out", tmp_path / "down")
            await env.download_file("/out/y", tmp_path / "y.txt")
            assert (tmp_path / "down" / "d" / "x").read_text() == "x\n"
            assert (tmp_path / "y.txt").read_text() == "y\n"

            # A background process and a file, then every process killed between actions:
            # the next action finds the sandbox failed, restores and runs.
            await env.exec("setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /pid")
            assert kill_all(harbor_daemon, env._backend.id) > 0
            r = await env.exec("kill -0 $(cat /pid) && cat /out/y")
            assert (r.return_code, r.stdout) == (0, "y\n")
            assert [e["fault"] for e in env._record["recoveries"]] == ["sandbox_failed"]
        finally:
            await env.stop(delete=True)
        assert (tmp_path / "trial" / "belayer.json").is_file()

    asyncio.run(main())


def test_adaptive_policy_replays_uncovered_actions(harbor_daemon, tmp_path: Path) -> None:
    # failure_p = 0: the adaptive policy never checkpoints, so a kill during the third action
    # restarts the base image and replays all three, the staged upload included.
    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path, checkpoint="adaptive", failure_p=0.0)
        await env.start(force_build=False)
        try:
            f = tmp_path / "f.txt"
            f.write_text("uploaded")
            await env.upload_file(f, "/f.txt")
            f.unlink()  # the replay must use the staged copy
            await env.exec("echo one >> /log")

            async def kill_soon() -> None:
                await asyncio.sleep(0.5)
                await asyncio.to_thread(kill_all, harbor_daemon, env._backend.id)

            killer = asyncio.create_task(kill_soon())
            r = await env.exec("sleep 1.5; echo two >> /log; cat /f.txt /log")
            await killer
            assert (r.return_code, r.stdout) == (0, "uploadedone\ntwo\n")
            (entry,) = env._record["recoveries"]
            assert entry["fault"] == "external_kill" and entry["restored_prefix"] is None
            assert len(entry["replayed"]) >= 3
        finally:
            await env.stop(delete=True)

    asyncio.run(main())


def test_task_resources_become_sandbox_limits(harbor_daemon, tmp_path: Path) -> None:
    assert BelayerEnvironment.resource_capabilities().model_dump() == {
        "cpu_limit": True, "cpu_request": False, "memory_limit": True,
        "memory_request": False, "fractional_cpus": True}

    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path, pids_max=200,
                       env_config={"cpus": 1.5, "memory_mb": 768, "storage_mb": 2048})
        await env.start(force_build=False)
        try:
            info = await env._backend.info()
            assert (info.cpus, info.memory_max, info.disk_max, info.pids_max) == (
                1.5, 768 << 20, 2048 << 20, 200)
            # No internet inside, as declared: the network namespace has only `lo`.
            assert env.capabilities.disable_internet
            r = await env.exec("cat /proc/net/dev")
            names = [ln.split(":")[0].strip() for ln in r.stdout.splitlines()[2:]]
            assert names == ["lo"], r.stdout
            assert env._record["limits"] == {"cpus": 1.5, "memory_max": 768 << 20,
                                             "disk_max": 2048 << 20, "pids_max": 200}
        finally:
            await env.stop(delete=True)

    asyncio.run(main())
    # Reservations are not offered: Harbor refuses the modes that need them.
    from harbor.models.trial.config import ResourceMode

    (tmp_path / "request").mkdir()
    with pytest.raises(ValueError, match="CPU resource requests"):
        make_env(harbor_daemon, tmp_path / "request", env_config={"cpus": 1},
                 cpu_enforcement_policy=ResourceMode.REQUEST)


def test_stop_after_a_cancelled_action(harbor_daemon, tmp_path: Path) -> None:
    # Harbor cancels the agent's task on its timeout, then stops the environment: the
    # cancelled action still holds its connection, stop destroys the sandbox on the other
    # one (killing the action) and closes the client without hanging.
    async def main() -> str:
        env = make_env(harbor_daemon, tmp_path)
        await env.start(force_build=False)
        task = asyncio.create_task(env.exec("sleep 1000"))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        sandbox = env._backend.id
        started = time.monotonic()
        await env.stop(delete=True)
        assert time.monotonic() - started < 10
        return sandbox

    sandbox = asyncio.run(main())
    with belayer.Client(harbor_daemon.socket) as c:
        assert sandbox not in [sb.id for sb in c.list_sandboxes()]


def test_dockerfile_steps_run_at_start(harbor_daemon, tmp_path: Path) -> None:
    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path, "FROM debian:12\nWORKDIR /app\n"
                       "ENV A=1 B=\"two words\"\nRUN echo \"$A $B\" > made\nUSER nobody\n")
        await env.start(force_build=False)
        try:
            r = await env.exec("cat made; id -u; echo $B")
            assert r.stdout == "1 two words\n65534\ntwo words\n"
        finally:
            await env.stop(delete=True)

    asyncio.run(main())


def test_refusals(harbor_daemon, tmp_path: Path) -> None:
    with pytest.raises(SandboxBuildFailedError, match="ARG"):
        make_env(harbor_daemon, tmp_path, "ARG V=1\nFROM debian\n")
    (tmp_path / "environment" / "Dockerfile").unlink()
    (tmp_path / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    with pytest.raises(SandboxBuildFailedError, match="compose"):
        make_env(harbor_daemon, tmp_path)
    (tmp_path / "environment" / "docker-compose.yaml").unlink()

    async def missing_image() -> None:
        env = make_env(harbor_daemon, tmp_path, image="no-such-image")
        try:
            with pytest.raises(SandboxBuildFailedError, match="belayer image import"):
                await env.start(force_build=False)
        finally:
            await env.stop(delete=True)

    asyncio.run(missing_image())


@pytest.mark.parametrize("text, match", [
    ("RUN true\n", "first instruction must be FROM"),
    ("FROM a\nFROM b\n", "multi-stage"),
    ("FROM a\nSHELL [\"/bin/bash\", \"-c\"]\n", "SHELL is not supported"),
    ("FROM a\nCOPY --from=b /x /y\n", "flags"),
    ("FROM a\nADD https://example.com/x /x\n", "URL"),
    ("FROM a\nCOPY ../secret /x\n", "outside the build context"),
    ("FROM a\nCOPY *.txt /x/\n", "wildcards"),
    ("FROM a\nENV P=$PATH:/x\n", "substitution"),
    ("FROM a\nRUN --mount=type=cache,target=/c true\n", "RUN flags"),
])
def test_dockerfile_outside_the_subset(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(UnsupportedDockerfileError, match=match):
        dockerfile.parse(text, tmp_path)


def test_dockerfile_subset(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "d").mkdir()
    plan = dockerfile.parse(
        "# comment\nFROM python:3.12 AS base\nWORKDIR /app\nENV K=v\nCOPY a.txt d ./dst/\n"
        "RUN apt-get update && \\\n    echo ok\nRUN [\"echo\", \"a b\"]\nWORKDIR sub\n"
        "EXPOSE 80\nCMD [\"x\"]\n",
        tmp_path,
    )
    assert plan.base == "python:3.12" and plan.workdir == "/app/sub" and plan.env == {"K": "v"}
    copy = plan.steps[1]
    assert isinstance(copy, dockerfile.Copy) and copy.dest == "/app/dst" and copy.into_dir
    runs = [s for s in plan.steps if isinstance(s, dockerfile.Run)]
    assert runs[1].command == "apt-get update && echo ok" and runs[1].cwd == "/app"
    assert runs[1].env == {"K": "v"} and runs[2].command == "echo 'a b'"


def test_import_belayer_leaves_harbor_alone() -> None:
    import subprocess
    import sys

    code = ("import sys, belayer; bad = [m for m in sys.modules if m == 'harbor' or "
            "m.startswith(('harbor.', 'belayer.integrations'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
