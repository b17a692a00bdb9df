"""Checkpoints at action boundaries and resume after a restore for mini-swe-agent's
``DefaultAgent``: :class:`BelayerAgent`, :func:`context_of`, :func:`load_context`.

Boundary k is the agent's number of model calls after a step whose actions ran (``n_calls``);
L_k is :func:`context_of` the agent there: its messages and counters as JSON. A restore gives
back (k, L_k) and :func:`load_context` puts the agent where it was at boundary k, so the loop
goes on from prefix k as if the steps after it had never run.
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional

from minisweagent.agents.default import AgentConfig, DefaultAgent

import belayer

from .environment import BelayerEnvironment, SandboxFailure

#: The ``format`` field of L_k as :func:`context_of` writes it.
CONTEXT_FORMAT = "belayer-minisweagent/1"


def context_of(agent: DefaultAgent) -> bytes:
    """L_k of ``agent``: UTF-8 JSON of its messages, ``n_calls``, ``cost``, the count of
    format errors in a row and, for mini-swe-agent's replay models (``DeterministicModel``
    and its siblings, which count their position in ``current_index``), the model's
    position (``None`` for other models, which keep no state between calls). It travels in
    one request frame of the daemon (16 MiB by default), which bounds the history's size.

    Raises:
        TypeError: a message holds a value JSON cannot encode (``DefaultAgent.save`` would
            fail on it too).
    """
    return json.dumps(
        {
            "format": CONTEXT_FORMAT,
            "messages": agent.messages,
            "n_calls": agent.n_calls,
            "cost": agent.cost,
            "n_consecutive_format_errors": agent.n_consecutive_format_errors,
            "model_position": getattr(agent.model, "current_index", None),
        },
        separators=(",", ":"),
    ).encode()


def load_context(agent: DefaultAgent, context: bytes) -> int:
    """Puts ``agent`` back at the boundary ``context`` (an L_k of :func:`context_of`) was
    taken at: its messages, counters and replay-model position; returns k (``n_calls``).

    Raises:
        ValueError: ``context`` is not an L_k of this format.
    """
    try:
        state = json.loads(context)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"context is not JSON: {e}") from e
    if not isinstance(state, dict) or state.get("format") != CONTEXT_FORMAT:
        raise ValueError(f"context is not a {CONTEXT_FORMAT} context")
    try:
        messages, n_calls, cost = state["messages"], int(state["n_calls"]), float(state["cost"])
        format_errors = int(state["n_consecutive_format_errors"])
        position = state["model_position"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"context lacks a field of {CONTEXT_FORMAT}: {e!r}") from e
    if not isinstance(messages, list):
        raise ValueError("context messages are not a list")
    agent.messages, agent.n_calls, agent.cost = messages, n_calls, cost
    agent.n_consecutive_format_errors = format_errors
    if position is not None and hasattr(agent.model, "current_index"):
        agent.model.current_index = int(position)
    return n_calls


class BelayerAgentConfig(AgentConfig):
    """``AgentConfig`` plus when to checkpoint and how often to restore."""

    checkpoint_every: int = 0
    """0 (the default): after every step, feed the daemon's adaptive policy the step's timing
    (``maybe_checkpoint``), which takes C_k when a failure would cost more than the checkpoint
    and skips steps that changed nothing; N > 0: a full checkpoint at every N-th boundary."""
    failure_p: Optional[float] = None
    """Failure probability per step for the adaptive policy; ``None``: the daemon's default
    (0.01)."""
    max_restores: int = 3
    """Restores per ``run`` before a :class:`SandboxFailure` ends the run."""


class BelayerAgent(DefaultAgent):
    """``DefaultAgent`` over a :class:`BelayerEnvironment`: checkpoints at action boundaries
    and, when the sandbox fails, restores it and resumes from the restored prefix k within the
    same ``run`` (the failed step's messages are dropped, the model is asked again at k).
    Selected in a config by ``agent_class: belayer.integrations.minisweagent.BelayerAgent``.

    Attributes:
        restores: the prefix each restore of the current ``run`` came back at (``None``: the
            start of the task).
        failures: the sandbox failures of the current ``run``, in order.
        decisions: the policy's answers at each boundary (adaptive policy only).
    """

    env: BelayerEnvironment

    def __init__(
        self,
        model: Any,
        env: BelayerEnvironment,
        *,
        config_class: type = BelayerAgentConfig,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, env, config_class=config_class, **kwargs)
        self.restores: List[Optional[int]] = []
        self.failures: List[SandboxFailure] = []
        self.decisions: List[belayer.Decision] = []
        self._start_context: Optional[bytes] = None
        self._llm_s = 0.0
        self._policy_set = False

    def run(self, task: str = "", **kwargs: Any) -> dict:
        """``DefaultAgent.run``, resuming after each sandbox failure (up to
        ``max_restores``); a further failure ends the run with its exception."""
        self.restores = []
        self.failures = []
        self.decisions = []
        self._start_context = None
        return super().run(task, **kwargs)

    def query(self) -> dict:
        """``DefaultAgent.query``, timed (the LLM response time feeds the policy)."""
        start = time.monotonic()
        try:
            return super().query()
        finally:
            self._llm_s = time.monotonic() - start

    def step(self) -> list:
        """One step, then its boundary; after a :class:`SandboxFailure` in either, the
        restore and the reload of L_k (nothing of the failed step is kept)."""
        if self._start_context is None:
            self._start_context = context_of(self)  # L_0: the task, before any action
        start = time.monotonic()
        try:
            out = super().step()
            self.boundary(time.monotonic() - start)
            return out
        except SandboxFailure as failure:
            self.recover(failure)
            return []

    def boundary(self, step_s: float) -> None:
        """Checkpoints (or asks the policy) at boundary k = ``n_calls`` with L_k.

        Args:
            step_s: the step's wall-clock duration (model and actions), seconds.
        """
        k = self.n_calls
        every = self.config.checkpoint_every
        if every > 0:
            if k % every == 0:
                self.env.checkpoint(k, context_of(self))
            return
        policy = None
        if not self._policy_set:
            policy = belayer.Policy("adaptive", failure_p=self.config.failure_p)
            self._policy_set = True
        self.decisions.append(
            self.env.maybe_checkpoint(
                k, context_of(self), step_duration_s=step_s, llm_response_s=self._llm_s,
                policy=policy,
            )
        )

    def recover(self, failure: SandboxFailure) -> int:
        """Restores the sandbox and reloads the agent at the restored prefix (the start of
        the task when no checkpoint was ready); returns the prefix.

        Raises:
            SandboxFailure: ``failure`` itself, once ``max_restores`` restores were made.
        """
        self.failures.append(failure)
        if len(self.restores) >= self.config.max_restores:
            raise failure
        self.logger.warning(f"{failure}; restoring")
        k, context = self.env.restore()
        self.restores.append(k)
        assert self._start_context is not None
        return load_context(self, context if k is not None else self._start_context)
