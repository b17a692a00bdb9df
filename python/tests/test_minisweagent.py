"""belayer.integrations.minisweagent under the real mini-swe-agent from PyPI (the version
python/pyproject.toml pins; scripts/setup.sh installs it): its DefaultAgent loop with its own
prompt templates and its DeterministicModel replaying a trajectory in a real sandbox, once
without a failure and once with a host SIGKILL of every sandbox process mid-trajectory, which
must end with the same files, the same server state and the same message history; the
execute() contract side by side with mini-swe-agent's LocalEnvironment; env, forward_env,
cwd, timeout with partial output; selection by class path from a config."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-config-"))

import minisweagent  # noqa: E402
from minisweagent.agents import get_agent  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_from_spec  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402
from minisweagent.utils.serialize import recursive_merge  # noqa: E402

import belayer  # noqa: E402
from belayer.integrations.minisweagent import (  # noqa: E402
    BelayerAgent,
    BelayerEnvironment,
    SandboxFailure,
    context_of,
    load_context,
)
from conftest import REPO, Daemon  # noqa: E402

ENV_PATH = "belayer.integrations.minisweagent.BelayerEnvironment"
AGENT_PATH = "belayer.integrations.minisweagent.BelayerAgent"
PYTHON_IMAGE = "bookworm-python"
WORK = "/root/work"

# A counter server holding its count in memory (and a token drawn at start-up, to tell the
# same process from a restarted one), reached over a Unix socket.
COUNTER = r"""cat > counter.py <<'EOF'
import os, socket, sys
PATH = "/root/work/counter.sock"
if sys.argv[1] == "serve":
    token, n = os.urandom(8).hex(), 0
    s = socket.socket(socket.AF_UNIX)
    s.bind(PATH)
    s.listen(8)
    while True:
        c, _ = s.accept()
        cmd = c.recv(64).decode()
        n += cmd == "hit"
        c.sendall((token if cmd == "token" else str(n)).encode())
        c.close()
c = socket.socket(socket.AF_UNIX)
c.connect(PATH)
c.sendall(sys.argv[1].encode())
print(c.recv(64).decode())
EOF"""

STEPS = [
    "printf 'alpha\\n' > notes.txt && cat notes.txt",
    COUNTER,
    "(setsid python3 counter.py serve > server.log 2>&1 < /dev/null &)"
    " && for i in $(seq 100); do [ -S counter.sock ] && break; sleep 0.05; done"
    " && python3 counter.py get",
    "python3 counter.py hit && python3 counter.py hit",
    "sed -i 's/alpha/beta/' notes.txt && echo gamma >> notes.txt && cat notes.txt",
    "python3 counter.py hit",
    "sleep 1 && python3 counter.py hit && echo slow >> notes.txt",
    "cat notes.txt && python3 counter.py get",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat notes.txt",
]
#: The action during which (or before which) the failure comes: `sleep 1 && ...`.
FAIL_AT = 7


def outputs() -> List[dict]:
    return [
        make_output(f"THOUGHT: step {i}.\n\n```mswea_bash_command\n{cmd}\n```", [{"command": cmd}])
        for i, cmd in enumerate(STEPS, 1)
    ]


OUTPUTS = outputs()


def default_config() -> Dict[str, Any]:
    """mini-swe-agent's own default.yaml (its prompt templates, observation template, env)."""
    return get_config_from_spec("default.yaml")


def without_timestamps(value: Any) -> Any:
    """``value`` without the ``timestamp`` fields mini-swe-agent stamps on messages."""
    if isinstance(value, dict):
        return {k: without_timestamps(v) for k, v in value.items() if k != "timestamp"}
    if isinstance(value, list):
        return [without_timestamps(v) for v in value]
    return value


def kill_all(socket: str, sandbox: str) -> None:
    """SIGKILLs every process of ``sandbox`` from the host, over a connection of its own."""
    with belayer.Client(socket) as c:
        for pid in c.inspect(sandbox).pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class FaultyEnvironment(BelayerEnvironment):
    """The injection of a host fail-stop at action ``fail_at``: ``"during"`` the action (after
    0.3 s) or ``"before"`` it (once the daemon holds the sandbox as failed)."""

    def __init__(self, *, fail_at: int, when: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_at, self.when, self.actions = fail_at, when, 0
        self.token_before: Optional[str] = None
        self.killer: Optional[threading.Thread] = None

    def execute(self, action: dict, cwd: str = "", *, timeout: Optional[int] = None) -> dict:
        self.actions += 1
        if self.actions == self.fail_at:
            token = self.sandbox.exec(f"cd {WORK} && python3 counter.py token")
            self.token_before = token.text.strip()
            socket = self.config.socket
            if self.when == "before":
                kill_all(socket, self.sandbox_id)
                deadline = time.monotonic() + 20
                while not self.failed():
                    assert time.monotonic() < deadline, "the daemon did not see the failure"
                    time.sleep(0.05)
            else:
                def kill() -> None:
                    time.sleep(0.3)
                    kill_all(socket, self.sandbox_id)

                self.killer = threading.Thread(target=kill)
                self.killer.start()
        try:
            return super().execute(action, cwd, timeout=timeout)
        finally:
            if self.killer is not None:
                self.killer.join()
                self.killer = None


@pytest.fixture(scope="module")
def python_image(daemon: Daemon) -> str:
    with belayer.Client(daemon.socket) as c:
        c.import_image(PYTHON_IMAGE, os.environ.get(
            "BELAYER_TEST_PYTHON_ROOTFS", "/var/cache/belayer/images/bookworm-python/rootfs"),
            exist_ok=True)
    return PYTHON_IMAGE


def run_trajectory(env: BelayerEnvironment) -> Dict[str, Any]:
    """Runs the scripted trajectory to its submission in ``env`` through BelayerAgent and
    returns the agent, its result and the final state of the sandbox."""
    config = default_config()
    model = DeterministicModel(outputs=copy.deepcopy(OUTPUTS),
                               observation_template=config["model"]["observation_template"])
    agent = BelayerAgent(model, env, **config["agent"], checkpoint_every=1)
    result = agent.run("Keep notes and count the hits of a counter server.")
    files = env.sandbox.exec(f"cd {WORK} && find . -type f | sort | xargs sha256sum").text
    server = env.sandbox.exec(f"cd {WORK} && python3 counter.py get && python3 counter.py token")
    count, token = server.text.split()
    return {"agent": agent, "result": result, "files": files, "count": count, "token": token,
            "messages": without_timestamps(agent.messages)}


@pytest.fixture(scope="module")
def reference(daemon: Daemon, python_image: str) -> Dict[str, Any]:
    """The failure-free run."""
    env = BelayerEnvironment(image=python_image, socket=daemon.socket, cwd=WORK,
                             env={"PAGER": "cat"})
    try:
        return run_trajectory(env)
    finally:
        env.cleanup()


def test_pinned_version_is_installed() -> None:
    pin = re.search(r'"mini-swe-agent==([^"]+)"', (REPO / "python/pyproject.toml").read_text())
    assert pin and minisweagent.__version__ == pin.group(1)


def test_failure_free_run_submits(reference: Dict[str, Any]) -> None:
    assert reference["result"]["exit_status"] == "Submitted"
    assert reference["result"]["submission"] == "beta\ngamma\nslow\n"
    assert reference["count"] == "4" and reference["agent"].restores == []
    # system, task, then an assistant message and its observation per step, then the exit.
    assert len(reference["messages"]) == 2 + 2 * (len(STEPS) - 1) + 2
    assert "./notes.txt" in reference["files"] and "./counter.py" in reference["files"]


@pytest.mark.parametrize("when", ["during", "before"])
def test_host_kill_mid_trajectory_restores_to_the_same_end(
    daemon: Daemon, python_image: str, reference: Dict[str, Any], when: str
) -> None:
    env = FaultyEnvironment(fail_at=FAIL_AT, when=when, image=python_image, socket=daemon.socket,
                            cwd=WORK, env={"PAGER": "cat"})
    try:
        run = run_trajectory(env)
        # One failure, restored at the boundary before the failed step (checkpoint_every=1).
        assert run["agent"].restores == [FAIL_AT - 1]
        [failure] = run["agent"].failures
        if when == "during":  # the daemon's verdict on the action the kill hit
            assert failure.fault is not None and failure.fault.kind == "external_kill"
        else:  # found failed by the next action
            assert failure.fault is None
        assert env.sandbox.info().instance == 1
        assert run["result"] == reference["result"]
        assert run["files"] == reference["files"]
        assert run["count"] == reference["count"]
        # The server is the process of before the failure, restored, not a new one.
        assert env.token_before and run["token"] == env.token_before
        assert run["messages"] == reference["messages"]
    finally:
        env.cleanup()


def test_context_round_trips_through_an_agent(busybox_env: BelayerEnvironment) -> None:
    model = DeterministicModel(outputs=copy.deepcopy(OUTPUTS))
    agent = DefaultAgent(model, busybox_env, system_template="s", instance_template="t")
    agent.messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "é"}]
    agent.n_calls, agent.cost, model.current_index = 3, 1.5, 2
    context = context_of(agent)
    other = DefaultAgent(DeterministicModel(outputs=[]), busybox_env, system_template="s",
                         instance_template="t")
    assert load_context(other, context) == 3
    assert (other.messages, other.n_calls, other.cost) == (agent.messages, 3, 1.5)
    assert other.model.current_index == 2
    with pytest.raises(ValueError):
        load_context(other, b"not json")
    with pytest.raises(ValueError):
        load_context(other, b'{"format": "other"}')
    with pytest.raises(ValueError):
        load_context(other, b'{"format": "belayer-minisweagent/1", "messages": []}')


@pytest.fixture()
def busybox_env(daemon: Daemon) -> BelayerEnvironment:
    env = BelayerEnvironment(image="busybox", socket=daemon.socket)
    yield env
    env.cleanup()


def test_execute_matches_local_environment(busybox_env: BelayerEnvironment, tmp_path: Path) -> None:
    """The same dicts as mini-swe-agent's LocalEnvironment: merged output in order, exit
    codes, a timeout with the output so far, the submission."""
    local = LocalEnvironment(cwd=str(tmp_path))
    for command, timeout in [
        ("echo a; echo b >&2; echo c; exit 3", None),
        ("printf 'no newline'", None),
        ("echo start; sleep 5", 1),
        ("echo cut\0; echo here", None),
    ]:
        action = {"command": command}
        ours = busybox_env.execute(action, timeout=timeout)
        theirs = local.execute(action, timeout=timeout)
        assert ours == theirs, command
    timed_out = busybox_env.execute({"command": "echo start; sleep 5"}, timeout=1)
    assert timed_out["output"] == "start\n" and timed_out["returncode"] == -1
    assert timed_out["extra"]["exception_type"] == "TimeoutExpired"
    assert "timed out after 1 seconds" in timed_out["exception_info"]

    submit = {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"}
    caught = []
    for env in (busybox_env, local):
        with pytest.raises(Submitted) as e:
            env.execute(submit)
        caught.append(e.value.messages)
    assert caught[0] == caught[1]
    assert caught[0][0]["extra"]["submission"] == "the patch\n"
    # A failing command that prints the marker does not submit.
    assert busybox_env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false"})[
        "returncode"] == 1


def test_env_forward_env_cwd_and_interpreter(daemon: Daemon, monkeypatch) -> None:
    monkeypatch.setenv("BELAYER_FWD_A", "host-a")
    monkeypatch.setenv("BELAYER_FWD_B", "host-b")
    monkeypatch.delenv("BELAYER_FWD_UNSET", raising=False)
    env = BelayerEnvironment(
        image="busybox", socket=daemon.socket, cwd="/srv/app",
        env={"BELAYER_FWD_B": "config-b", "PLAIN": "x y"},
        forward_env=["BELAYER_FWD_A", "BELAYER_FWD_B", "BELAYER_FWD_UNSET"],
        interpreter=["sh", "-c"],
    )
    try:
        show = {"command": 'pwd; echo "$BELAYER_FWD_A|$BELAYER_FWD_B|$PLAIN|'
                           '${BELAYER_FWD_UNSET-unset}"'}
        out = env.execute(show)
        assert out == {"output": "/srv/app\nhost-a|config-b|x y|unset\n", "returncode": 0,
                       "exception_info": ""}
        assert env.execute(show, "/tmp")["output"].startswith("/tmp\n")
        # A working directory that does not exist: an error the model sees, as with docker.
        missing = env.execute({"command": "true"}, "/no/such/dir")
        assert missing["returncode"] == -1 and "chdir" in missing["exception_info"]
        assert missing["extra"]["exception_type"] == "ExecFailedError"
        vars = env.get_template_vars(extra=1)
        assert vars["cwd"] == "/srv/app" and vars["extra"] == 1 and "machine" in vars
        info = env.serialize()["info"]
        assert info["config"]["environment"]["image"] == "busybox"
        assert info["belayer"]["sandbox"] == env.sandbox_id
    finally:
        env.cleanup()
    env.cleanup()  # idempotent


def test_limits_reach_the_sandbox(daemon: Daemon) -> None:
    env = BelayerEnvironment(image="busybox", socket=daemon.socket, memory_max=256 << 20,
                             pids_max=64, cpus=0.5, disk_max=128 << 20)
    try:
        info = env.sandbox.info()
        assert (info.memory_max, info.pids_max, info.cpus, info.disk_max) == (
            256 << 20, 64, 0.5, 128 << 20)
    finally:
        env.cleanup()
    # Unset limits stay the daemon's defaults; a bad one is refused before any sandbox.
    env = BelayerEnvironment(image="busybox", socket=daemon.socket, pids_max=32)
    try:
        info = env.sandbox.info()
        assert info.pids_max == 32 and info.disk_max is not None  # the daemon's default
    finally:
        env.cleanup()
    with pytest.raises(ValueError, match="cpus"):
        BelayerEnvironment(image="busybox", socket=daemon.socket, cpus=-1.0)


def test_restore_to_an_earlier_prefix(daemon: Daemon) -> None:
    """``restore(prefix=k)`` goes back to the checkpoint of boundary k (the sandbox alive):
    the files and L_k of step k, the later checkpoints kept as a branch; an unknown prefix
    changes nothing."""
    env = BelayerEnvironment(image="busybox", socket=daemon.socket, cwd="/root/w")
    try:
        steps = ["echo 1 > n", "echo 2 > n", "echo 3 > n",
                 "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat n"]
        model = DeterministicModel(outputs=[make_output("ok", [{"command": c}]) for c in steps])
        agent = BelayerAgent(model, env, system_template="s", instance_template="t",
                             checkpoint_every=1, cost_limit=0)
        assert agent.run() == {"exit_status": "Submitted", "submission": "3\n"}
        assert [c.prefix for c in env.sandbox.checkpoints()] == [1, 2, 3]

        with pytest.raises(belayer.NotFoundError):
            env.restore(prefix=7)
        assert env.execute({"command": "cat n"})["output"] == "3\n"

        k, context = env.restore(prefix=1)
        assert k == 1 and load_context(agent, context) == 1
        assert len(agent.messages) == 2 + 2 * 1 and model.current_index == 0
        assert env.execute({"command": "cat n"})["output"] == "1\n"
        assert [c.prefix for c in env.sandbox.checkpoints()] == [1, 2, 3]
        # The agent goes on from step 1 with the model's next answer.
        model.config.outputs[1] = make_output("ok", [{"command": (
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo $(( $(cat n) + 10 ))")}])
        with pytest.raises(Submitted) as submitted:
            agent.step()
        assert submitted.value.messages[0]["extra"]["submission"] == "11\n"
    finally:
        env.cleanup()


def test_selected_by_class_path_from_a_config(daemon: Daemon, tmp_path: Path) -> None:
    """The way mini-swe-agent's run scripts build their parts: a YAML config merged over the
    default one, get_environment and get_agent by class path, the adaptive policy."""
    (tmp_path / "belayer.yaml").write_text(
        "environment:\n"
        f"  environment_class: {ENV_PATH}\n"
        "  image: busybox\n"
        f"  socket: {daemon.socket}\n"
        "  cwd: /root\n"
        "  timeout: 20\n"
        "agent:\n"
        f"  agent_class: {AGENT_PATH}\n"
        "  failure_p: 0.5\n"
    )
    config = recursive_merge(default_config(), get_config_from_spec(str(tmp_path / "belayer.yaml")))
    env = get_environment(config["environment"], default_type="local")
    try:
        assert isinstance(env, BelayerEnvironment) and env.config.timeout == 20
        assert env.config.env["PAGER"] == "cat"  # from default.yaml
        steps = ["cat /etc/passwd > /dev/null", "echo one > state", "cat state",
                 "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat state"]
        model = DeterministicModel(
            outputs=[make_output("ok", [{"command": c}]) for c in steps],
            observation_template=config["model"]["observation_template"])
        agent = get_agent(model, env, config["agent"], default_type="default")
        assert isinstance(agent, BelayerAgent)
        result = agent.run("write one")
        assert result == {"exit_status": "Submitted", "submission": "one\n"}
        # The default: the adaptive policy at every boundary; the read-only first step is clean.
        assert len(agent.decisions) == 3 and agent.decisions[0].reason == "clean"
        saved = agent.serialize()["info"]["config"]
        assert saved["agent_type"].endswith("BelayerAgent")
    finally:
        env.cleanup()


def test_restores_without_a_checkpoint_start_over(daemon: Daemon) -> None:
    """A failure before any checkpoint: the sandbox restarts from its image and the agent
    from the task; once max_restores is spent the failure ends the run."""
    env = BelayerEnvironment(image="busybox", socket=daemon.socket, cwd="/root/w")
    try:
        steps = ["echo one > f", "cat f", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat f"]
        model = DeterministicModel(outputs=[make_output("ok", [{"command": c}]) for c in steps])
        agent = BelayerAgent(model, env, system_template="s", instance_template="t",
                             checkpoint_every=100)
        killed = []

        original = env.execute

        def execute(action: dict, cwd: str = "", *, timeout: Optional[int] = None) -> dict:
            if action["command"] == "cat f" and not killed:
                killed.append(True)
                kill_all(daemon.socket, env.sandbox_id)
                while not env.failed():
                    time.sleep(0.05)
            return original(action, cwd, timeout=timeout)

        env.execute = execute  # type: ignore[method-assign]
        assert agent.run() == {"exit_status": "Submitted", "submission": "one\n"}
        assert agent.restores == [None]
        roles = [m["role"] for m in agent.messages]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant",
                         "exit"]

        agent = BelayerAgent(DeterministicModel(outputs=[make_output("ok", [{"command": "true"}])]),
                             env, system_template="s", instance_template="t", max_restores=0)
        kill_all(daemon.socket, env.sandbox_id)
        while not env.failed():
            time.sleep(0.05)
        with pytest.raises(SandboxFailure):
            agent.run()
        assert agent.messages[-1]["extra"]["exit_status"] == "SandboxFailure"
    finally:
        env.cleanup()


def subprocess_env(daemon: Daemon) -> Dict[str, str]:
    package_root = str(Path(belayer.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "BELAYER_SOCKET": daemon.socket}


def test_import_belayer_leaves_minisweagent_alone(daemon: Daemon) -> None:
    code = "import sys, belayer, belayer.integrations; assert 'minisweagent' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(daemon),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_readme_snippet_runs(daemon: Daemon, python_image: str, tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    start = text.index("## Use from mini-swe-agent")
    block = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert block
    script = tmp_path / "snippet.py"
    script.write_text(block.group(1))
    env = {**subprocess_env(daemon), "MSWEA_SILENT_STARTUP": "1",
           "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "config")}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr + daemon.log()[-4000:]
    assert "Submitted 2" in out.stdout and "restored at prefix 2: 2" in out.stdout
    assert "back at prefix 1: 1" in out.stdout
