"""Fork: N new sandboxes restored from one checkpoint C_K of a running sandbox (GRPO's
samples of one prompt, tree search branching at a step). The method is
:meth:`belayer.Client.fork` (through :class:`ForkMethods`); :meth:`belayer.Sandbox.fork`
binds it to one sandbox."""

from __future__ import annotations

from ctypes import byref
from dataclasses import dataclass
from typing import Any, List, Optional

from . import _lib
from ._status import Text, check, text_arg

#: Most children one fork may ask for.
MAX_FORK_COUNT = 256


@dataclass(frozen=True)
class ForkChild:
    """One child of a fork: its sandbox ``id``, the host pid of its init, its restore time
    (ms) and, when verified, whether its files and processes match the checkpoint (``None``
    when not verified)."""

    id: str
    init_pid: int
    total_ms: float
    verified: bool
    fs_matches: Optional[bool]
    processes_match: Optional[bool]


@dataclass(frozen=True)
class ForkInfo:
    """Result of a fork: its id (``fk-<12 hex>``), the checkpoint forked from (its name and
    action boundary K), L_K (``context``), the children in order, and the time from the
    request until every child ran (ms)."""

    fork: str
    checkpoint: str
    prefix: int
    context: bytes
    children: List[ForkChild]
    total_ms: float


class ForkMethods:
    """:meth:`fork`, mixed into :class:`belayer.Client`."""

    _lib: Any
    _handle: int

    def fork(
        self,
        id: Text,
        count: int,
        prefix: Optional[int] = None,
        checkpoint: Optional[Text] = None,
        verify: bool = True,
    ) -> ForkInfo:
        """Forks ``count`` (1 to 256) new sandboxes from a checkpoint C_K of sandbox ``id``,
        which keeps running: its ready checkpoint, or that of action boundary ``prefix`` on
        the ready checkpoint's line, or the one named ``checkpoint`` (any branch). Each child
        is restored into an instance of its own (namespaces, cgroup, upper layer, limits,
        user-namespace range), belongs to the caller and has its own copy of C_K as its
        ready checkpoint. All or nothing: when it raises, no child exists. ``verify`` checks
        each child's restored state.

        Raises:
            ValueError: a count out of range, ``prefix`` not in ``0..2**64``, or both
                ``prefix`` and ``checkpoint``.
            NotFoundError: no such checkpoint, or none ready.
            PermissionDeniedError: past the caller's ``max_sandboxes_per_uid``.
        """
        if prefix is not None and checkpoint is not None:
            raise ValueError("give prefix or checkpoint, not both")
        if isinstance(count, bool) or not isinstance(count, int):
            raise ValueError("count must be an int")
        if not 1 <= count <= MAX_FORK_COUNT:
            raise ValueError(f"count must be in 1..{MAX_FORK_COUNT}")
        if prefix is not None:
            if isinstance(prefix, bool) or not isinstance(prefix, int):
                raise ValueError("prefix must be an int")
            if not 0 <= prefix < 2**64:
                raise ValueError("prefix must be in 0..2**64")
        info = _lib.ForkInfo()
        try:
            check(
                self._lib.belayer_fork(
                    self._handle,
                    text_arg(id),
                    text_arg(checkpoint),
                    prefix is not None,
                    prefix or 0,
                    count,
                    verify,
                    byref(info),
                )
            )
            children = [
                ForkChild(
                    id=_lib.string_field(c.id),
                    init_pid=c.init_pid,
                    total_ms=c.total_ms,
                    verified=bool(c.verified),
                    fs_matches=bool(c.fs_matches) if c.verified else None,
                    processes_match=bool(c.processes_match) if c.verified else None,
                )
                for c in (info.children[i] for i in range(info.children_len))
            ]
            return ForkInfo(
                fork=_lib.string_field(info.fork),
                checkpoint=_lib.string_field(info.checkpoint),
                prefix=info.prefix,
                context=_lib.buf_bytes(info.context),
                children=children,
                total_ms=info.total_ms,
            )
        finally:
            self._lib.belayer_fork_info_free(byref(info))
