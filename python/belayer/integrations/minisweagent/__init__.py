"""Belayer under mini-swe-agent (``pip install 'belayer[minisweagent]'``, the pinned
version): :class:`BelayerEnvironment` runs the agent's commands in a sandbox with the contract
of mini-swe-agent's docker environment, :class:`BelayerAgent` checkpoints at action
boundaries and resumes from the restored prefix k after a sandbox failure.

In a mini-swe-agent config::

    environment:
      environment_class: belayer.integrations.minisweagent.BelayerEnvironment
      image: bookworm-python
    agent:
      agent_class: belayer.integrations.minisweagent.BelayerAgent
      checkpoint_every: 1

See the repository README, section "Use from mini-swe-agent".
"""

from .agent import CONTEXT_FORMAT, BelayerAgent, BelayerAgentConfig, context_of, load_context
from .environment import (
    SUBMIT_MARKER,
    BelayerEnvironment,
    BelayerEnvironmentConfig,
    SandboxFailure,
)

__all__ = [
    "BelayerAgent",
    "BelayerAgentConfig",
    "BelayerEnvironment",
    "BelayerEnvironmentConfig",
    "CONTEXT_FORMAT",
    "SUBMIT_MARKER",
    "SandboxFailure",
    "context_of",
    "load_context",
]
