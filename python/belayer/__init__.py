"""Belayer for Python: sandboxes with full checkpoints at action boundaries and restore after
a fail-stop, for agentic-RL rollouts, over ``libbelayer`` (pure ctypes, no compile step).

Example::

    import belayer

    with belayer.Client("/run/belayer/belayer.sock") as client:
        with client.create_sandbox("busybox") as sb:
            sb.exec("echo one > /root/state")
            sb.checkpoint(1, b"context after action 1")
            ...                       # the sandbox fails
            restored = sb.restore()   # restored.prefix == 1, restored.context == b"..."

Every failure raises a :class:`BelayerError` subclass chosen by the library's status code
(see :mod:`belayer.errors`). The library is located as described in :mod:`belayer._lib`
(``BELAYER_LIB`` overrides). For asyncio programs, :mod:`belayer.aio` has the same API as
coroutines (imported on first use of ``belayer.aio``).
"""

from ._lib import ABI_VERSION
from .client import (
    CheckpointInfo,
    Client,
    Decision,
    Event,
    ExecResult,
    ForkChild,
    ForkInfo,
    GcResult,
    InfraFault,
    Policy,
    RestoreInfo,
    Sandbox,
    SandboxInfo,
    Subscription,
    TransferResult,
    abi_version,
    library_path,
    library_version,
)
from .errors import *  # noqa: F401,F403  (the exception classes)
from .errors import BelayerError

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Imports the :mod:`belayer.aio` submodule on first access of ``belayer.aio`` (the
    synchronous API does not load asyncio)."""
    if name == "aio":
        import importlib

        return importlib.import_module(".aio", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ABI_VERSION",
    "BelayerError",
    "CheckpointInfo",
    "Client",
    "Decision",
    "Event",
    "ExecResult",
    "ForkChild",
    "ForkInfo",
    "GcResult",
    "InfraFault",
    "Policy",
    "RestoreInfo",
    "Sandbox",
    "SandboxInfo",
    "Subscription",
    "TransferResult",
    "abi_version",
    "library_path",
    "library_version",
]
