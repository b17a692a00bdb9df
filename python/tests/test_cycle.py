"""A full cycle through the Python API against a real daemon: create, exec, checkpoint,
kill from outside, events, restore, verify; the policy and the context log."""

from __future__ import annotations

import time

import pytest

import belayer


def kill_all(client: belayer.Client, sandbox: str) -> None:
    # Pids gone with the init meanwhile are skipped (the rest of the sandbox dies with it).
    assert client.kill_processes(sandbox) >= 1


def test_library_is_found_and_matches_the_bindings() -> None:
    assert belayer.abi_version() == belayer.ABI_VERSION
    assert belayer.library_version() == "0.1.0"
    assert belayer.library_path().endswith("libbelayer.so")


def test_full_cycle_with_events(client: belayer.Client) -> None:
    assert client.ping()
    with client.subscribe() as events, client.create_sandbox("busybox", tag="py") as sb:
        r = sb.exec("echo one > /root/state && echo out && echo err >&2")
        assert (r.exit_code, r.stdout, r.stderr, r.ok) == (0, b"out\n", b"err\n", True)
        assert sb.exec("exit 7").exit_code == 7
        ck = sb.checkpoint(1, b"context at 1")
        assert ck.prefix == 1 and ck.bytes > 0 and len(ck.context_digest) == 64
        assert events.wait_for("checkpoint_ready", sb.id).prefix == 1
        sb.exec("echo two >> /root/state")
        info = sb.info()
        assert info.state == "running" and info.ready_prefix == 1 and info.pids

        kill_all(client, sb.id)
        failed = events.wait_for("sandbox_failed", sb.id)
        assert failed.reason
        restored = sb.restore()
        assert restored.prefix == 1 and restored.context == b"context at 1"
        assert restored.verified and restored.fs_matches and restored.processes_match
        assert sb.exec("cat /root/state").stdout == b"one\n"
        assert sb.info().instance == 1
        # Not verified: no verdict, rather than a failed one.
        unverified = sb.restore(verify=False)
        assert unverified.prefix == 1 and not unverified.verified
        assert unverified.fs_matches is None and unverified.processes_match is None


def test_maybe_checkpoint_follows_the_policy(client: belayer.Client) -> None:
    with client.create_sandbox("busybox") as sb:
        never = belayer.Policy(kind="never", failure_p=0.5)
        d = sb.maybe_checkpoint(1, b"c1", step_duration_s=30.0, policy=never)
        assert not d.checkpointed and d.reason == "never" and d.regen_cost_s == 30.0
        adaptive = belayer.Policy(kind="adaptive", failure_p=0.5)
        sb.exec("echo two > /root/state")
        d = sb.maybe_checkpoint(2, b"c2", step_duration_s=30.0, llm_response_s=20.0,
                                policy=adaptive)
        assert d.checkpointed and d.reason == "benefit" and d.checkpoint_prefix == 2
        assert sb.info().ready_prefix == 2
        d = sb.maybe_checkpoint(3, step_duration_s=30.0)
        assert d.regen_cost_s == 30.0  # reset by the checkpoint
        with pytest.raises(belayer.BadRequestError, match="sometimes"):
            sb.maybe_checkpoint(4, step_duration_s=1.0, policy=belayer.Policy(kind="sometimes"))
        # A tiny failure probability: the adaptive policy skips.
        sb.exec("echo five > /root/state")
        d = sb.maybe_checkpoint(5, step_duration_s=1.0, regen_cost_s=1.0,
                                policy=belayer.Policy(failure_p=1e-6))
        assert not d.checkpointed and d.reason == "cost"


def test_maybe_checkpoint_skips_clean_steps(client: belayer.Client) -> None:
    """The daemon records each action's dirtiness: a read-only step is skipped as clean, a
    writing one checkpoints."""
    with client.create_sandbox("busybox") as sb:
        eager = belayer.Policy(kind="adaptive", failure_p=0.5)
        assert sb.exec("cat /etc/passwd").ok
        d = sb.maybe_checkpoint(1, b"c1", step_duration_s=1.0, regen_cost_s=1000.0, policy=eager)
        assert not d.checkpointed and d.reason == "clean"
        assert sb.exec("echo one > /root/state").ok
        d = sb.maybe_checkpoint(2, b"c2", step_duration_s=1.0, regen_cost_s=1000.0)
        assert d.checkpointed and d.reason == "benefit" and d.checkpoint_prefix == 2
        assert sb.exec("cat /root/state").stdout == b"one\n"
        d = sb.maybe_checkpoint(3, b"c3", step_duration_s=1.0, regen_cost_s=1000.0)
        assert not d.checkpointed and d.reason == "clean"


def test_context_log_round_trips(client: belayer.Client) -> None:
    traj = f"py-ctx-{time.monotonic_ns()}"
    first = client.context_append(traj, 1, b"first")
    second = client.context_append(traj, 2, bytes(range(256)))
    assert second > first
    assert client.context_lookup(traj, 1) == (1, b"first")
    assert client.context_lookup(traj) == (2, bytes(range(256)))
    with pytest.raises(belayer.NotFoundError):
        client.context_lookup(traj, 7)
    with pytest.raises(belayer.NotFoundError):
        client.context_lookup("never-written-" + traj)
    with pytest.raises(belayer.BadRequestError):
        client.context_append("../escape", 1, b"x")


def test_a_removed_context_log_is_gone_and_starts_over(client: belayer.Client) -> None:
    traj = f"py-ctx-rm-{time.monotonic_ns()}"
    first = client.context_append(traj, 1, b"first")
    client.context_append(traj, 2, b"second")
    client.context_remove(traj)
    with pytest.raises(belayer.NotFoundError):
        client.context_lookup(traj)
    with pytest.raises(belayer.NotFoundError):
        client.context_remove(traj)
    with pytest.raises(belayer.BadRequestError):
        client.context_remove("../escape")
    # A new log: its first record where the old one's was, the old boundaries gone.
    assert client.context_append(traj, 1, b"again") == first
    with pytest.raises(belayer.NotFoundError):
        client.context_lookup(traj, 2)
    client.context_remove(traj)


def test_calls_from_several_threads(client: belayer.Client) -> None:
    import threading

    errors = []

    def ping() -> None:
        try:
            for _ in range(20):
                client.ping()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ping) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
