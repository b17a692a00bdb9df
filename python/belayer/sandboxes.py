"""Sandboxes as a whole: creation with its options, inspection, listings, restore of a chosen
checkpoint, checkpoint garbage collection, and faults injected from the host. The methods are
those of :class:`belayer.Client` (through :class:`SandboxMethods`); the result types are
re-exported by :mod:`belayer`."""

from __future__ import annotations

import ctypes
import math
import os
import signal
from ctypes import byref, c_uint64, c_void_p
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional

from . import _lib
from ._status import Text, check, text_arg
from .actions import env_entries

if TYPE_CHECKING:
    from .client import Sandbox

#: ``BELAYER_USERNS_*`` of ``belayer.h`` and their names.
USERNS_MODES = {"private": 1, "host": 2}
_USERNS_NAMES = {v: k for k, v in USERNS_MODES.items()}

_U64 = 2**64


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the daemon sees it.

    Attributes:
        id: sandbox id (kept across restores).
        image: image name (the lower layer).
        state: ``running``, ``checkpointing``, ``restoring`` or ``failed``.
        init_pid: host pid of the init, ``None`` when it is not alive.
        instance: 0 for the original instance, +1 per restore.
        ready_prefix: prefix k of the ready checkpoint, ``None`` when none.
        pids: host pids of every process of the sandbox.
        created_unix_ms: creation time, milliseconds since the epoch.
        tag: rollout tag, ``None`` when none.
        env: environment of every action.
        workdir: default working directory of actions, ``None``: ``/``.
        memory_max: ``memory.max`` in bytes, ``None``: unlimited.
        pids_max: ``pids.max``, ``None``: unlimited.
        cpus: CPU bandwidth limit in CPUs, ``None``: unlimited.
        disk_max: disk limit of the upper layer in bytes, ``None``: unlimited.
        userns: ``"private"`` or ``"host"`` (``None``: not reported).
        cgroup: the sandbox cgroup, a path below the cgroup mount.

    The limits are those in force: the daemon's defaults filled in where the creation left
    them open.
    """

    id: str
    image: str
    state: str
    init_pid: Optional[int]
    instance: int
    ready_prefix: Optional[int]
    pids: List[int]
    created_unix_ms: int
    tag: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    workdir: Optional[str] = None
    memory_max: Optional[int] = None
    pids_max: Optional[int] = None
    cpus: Optional[float] = None
    disk_max: Optional[int] = None
    userns: Optional[str] = None
    cgroup: str = ""


@dataclass(frozen=True)
class CheckpointInfo:
    """A published checkpoint C_k (sizes in bytes, times in milliseconds).
    ``created_unix_ms`` (publication time, milliseconds since the epoch) is set in listings
    (:meth:`SandboxMethods.list_checkpoints`), ``None`` in the answer of a checkpoint."""

    prefix: int
    bytes: int
    frozen_ms: float
    total_ms: float
    name: str
    context_digest: str
    created_unix_ms: Optional[int] = None


@dataclass(frozen=True)
class RestoreInfo:
    """Result of a restore: prefix k (``None``: restarted from the base image) and the LLM
    context L_k recorded with the checkpoint. ``inodes_kept``: the upper layer came back from
    the checkpoint's snapshot, so files the sandbox wrote kept their inode numbers and times.
    ``fs_matches`` and ``processes_match`` are the verification's results, ``None`` when the
    restore was not verified (``verified`` false), never ``False`` for a check not made.
    ``dropped``: how many checkpoints the restore dropped: 0 since checkpoints form a tree
    (those after a restored earlier one stay as a branch)."""

    prefix: Optional[int]
    context: bytes
    init_pid: int
    total_ms: float
    verified: bool
    fs_matches: Optional[bool]
    processes_match: Optional[bool]
    inodes_kept: bool = False
    dropped: int = 0


@dataclass(frozen=True)
class GcResult:
    """What :meth:`SandboxMethods.gc` removed: ``removed`` checkpoints, ``bytes`` freed.
    Unpacks as ``removed, freed = client.gc(...)``."""

    removed: int
    bytes: int

    def __iter__(self) -> Iterator[int]:
        return iter((self.removed, self.bytes))


def _limit(value: Optional[int], name: str, minimum: int = 1) -> int:
    """A limit for the C struct (0: the daemon's default), checked against what ``uint64_t``
    holds."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, not {type(value).__name__}")
    if not minimum <= value < _U64:
        raise ValueError(f"{name} must be in {minimum}..2**64 (None: the daemon's default)")
    return value


class CreateOptions:
    """A ``BelayerCreateOptions`` with the buffers it points at, kept alive as long as this.

    Raises:
        ValueError: a bad ``env`` entry, a NUL in a string, ``workdir`` not absolute, a limit
            out of range, ``cpus`` not a positive finite number, an unknown ``userns``.
    """

    def __init__(
        self,
        tag: Optional[Text],
        env: Optional[Mapping[Text, Text]],
        workdir: Optional[Text],
        memory_max: Optional[int],
        pids_max: Optional[int],
        cpus: Optional[float],
        disk_max: Optional[int],
        userns: Optional[str],
    ) -> None:
        tag_b, workdir_b = text_arg(tag), text_arg(workdir)
        for name, value in (("tag", tag_b), ("workdir", workdir_b)):
            if value is not None and b"\0" in value:
                raise ValueError(f"{name} must not contain NUL")
        if workdir_b is not None and not workdir_b.startswith(b"/"):
            raise ValueError("workdir must be an absolute path")
        c_cpus = 0.0
        if cpus is not None:
            if isinstance(cpus, bool) or not isinstance(cpus, (int, float)):
                raise ValueError(f"cpus must be a number, not {type(cpus).__name__}")
            if not (math.isfinite(cpus) and cpus > 0):
                raise ValueError("cpus must be a positive finite number (None: the default)")
            c_cpus = float(cpus)
        if userns is not None and userns not in USERNS_MODES:
            raise ValueError(f"userns must be one of {sorted(USERNS_MODES)}, not {userns!r}")
        entries = env_entries(env)
        self._env = (ctypes.c_char_p * max(len(entries), 1))(*entries)
        self.struct = _lib.CreateOptions(
            tag=tag_b,
            env=ctypes.cast(self._env, ctypes.POINTER(ctypes.c_char_p)),
            env_len=len(entries),
            workdir=workdir_b,
            memory_max=_limit(memory_max, "memory_max"),
            pids_max=_limit(pids_max, "pids_max"),
            cpus=c_cpus,
            disk_max=_limit(disk_max, "disk_max"),
            userns=0 if userns is None else USERNS_MODES[userns],
        )


def _string(ptr: Optional[int]) -> Optional[str]:
    return _lib.string_field(ptr) if ptr else None


def sandbox_info(entry: Any) -> SandboxInfo:
    """The :class:`SandboxInfo` of a filled ``BelayerSandboxEntry`` (copies everything)."""
    info, config = entry.info, entry.config
    env: Dict[str, str] = {}
    for i in range(config.env_len):
        key, _, value = _lib.string_field(config.env[i]).partition("=")
        env[key] = value
    return SandboxInfo(
        id=_lib.string_field(info.id),
        image=_lib.string_field(info.image),
        state=_lib.string_field(info.state),
        init_pid=info.init_pid if info.init_pid >= 0 else None,
        instance=info.instance,
        ready_prefix=info.ready_prefix if info.has_ready_prefix else None,
        pids=[info.pids[i] for i in range(info.pids_len)],
        created_unix_ms=info.created_unix_ms,
        tag=_string(config.tag),
        env=env,
        workdir=_string(config.workdir),
        memory_max=config.memory_max or None,
        pids_max=config.pids_max or None,
        cpus=config.cpus or None,
        disk_max=config.disk_max or None,
        userns=_USERNS_NAMES.get(config.userns),
        cgroup=_lib.string_field(config.cgroup),
    )


def checkpoint_info(info: Any, created_unix_ms: Optional[int] = None) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a filled ``BelayerCheckpointInfo``."""
    return CheckpointInfo(
        prefix=info.prefix,
        bytes=info.bytes,
        frozen_ms=info.frozen_ms,
        total_ms=info.total_ms,
        name=_lib.string_field(info.name),
        context_digest=_lib.string_field(info.context_digest),
        created_unix_ms=created_unix_ms,
    )


class SandboxMethods:
    """The calls of :class:`belayer.Client` about sandboxes as a whole (a mixin: it uses the
    client's library and handle)."""

    _lib: Any
    _handle: int

    def create_sandbox(
        self,
        image: Text,
        tag: Optional[Text] = None,
        *,
        env: Optional[Mapping[Text, Text]] = None,
        workdir: Optional[Text] = None,
        memory_max: Optional[int] = None,
        pids_max: Optional[int] = None,
        cpus: Optional[float] = None,
        disk_max: Optional[int] = None,
        userns: Optional[str] = None,
    ) -> "Sandbox":
        """Creates and starts a sandbox from ``image``.

        Args:
            tag: rollout tag (``[A-Za-z0-9._-]{1,64}``), for :meth:`gc`.
            env: environment of every action (keys non-empty, without ``=``).
            workdir: absolute working directory of every action inside the sandbox (an
                action's ``cwd`` overrides it). Not created: while it does not exist, actions
                without their own ``cwd`` raise :class:`~belayer.errors.ExecFailedError`.
            memory_max: ``memory.max`` in bytes (at least 1 MiB).
            pids_max: most processes and threads at once.
            cpus: CPU bandwidth in CPUs, e.g. ``1.5``.
            disk_max: bytes the sandbox's upper layer may allocate (at least 1 MiB).
            userns: ``"private"`` (root inside is an unprivileged host uid) or ``"host"``
                (root only).

        ``None`` leaves an option to the daemon (its defaults, which are also the ceilings of
        a non-root caller).

        Raises:
            ValueError: an option this package refuses before any request (see
                :class:`CreateOptions`).
            BadRequestError: an option the daemon refuses (a bad tag, limits below their
                minimum, ...). PermissionDeniedError: over a non-root caller's ceilings.
        """
        opts = CreateOptions(tag, env, workdir, memory_max, pids_max, cpus, disk_max, userns)
        out = c_void_p()
        check(
            self._lib.belayer_sandbox_create_with(
                self._handle, text_arg(image), byref(opts.struct), byref(out)
            )
        )
        return self.sandbox(_lib.take_string(out))  # type: ignore[attr-defined,no-any-return]

    def inspect(self, id: Text) -> SandboxInfo:
        """Describes sandbox ``id``: state, processes, ready prefix and how it was created
        (tag, env, workdir, limits, user namespace, cgroup)."""
        entry = _lib.SandboxEntry()
        try:
            check(self._lib.belayer_sandbox_inspect_with(self._handle, text_arg(id), byref(entry)))
            return sandbox_info(entry)
        finally:
            self._lib.belayer_sandbox_entry_free(byref(entry))

    def list_sandboxes(self) -> List[SandboxInfo]:
        """Every sandbox this caller may see (root: all of them), oldest first."""
        listing = _lib.SandboxList()
        try:
            check(self._lib.belayer_sandbox_list(self._handle, byref(listing)))
            return [sandbox_info(listing.items[i]) for i in range(listing.len)]
        finally:
            self._lib.belayer_sandbox_list_free(byref(listing))

    def list_checkpoints(self, id: Text) -> List[CheckpointInfo]:
        """The ready checkpoints of sandbox ``id`` (up to the ready one), oldest first, with
        their publication times."""
        listing = _lib.CheckpointList()
        try:
            check(self._lib.belayer_checkpoint_list(self._handle, text_arg(id), byref(listing)))
            return [
                checkpoint_info(listing.items[i].info, listing.items[i].created_unix_ms)
                for i in range(listing.len)
            ]
        finally:
            self._lib.belayer_checkpoint_list_free(byref(listing))

    def gc(self, older_than_s: Optional[int] = None, tag: Optional[Text] = None) -> GcResult:
        """Drops checkpoints of this caller's sandboxes (root: of all): those older than
        ``older_than_s`` seconds (each sandbox keeps its ready one), and every checkpoint of
        the sandboxes tagged ``tag``, ready ones included.

        Raises:
            ValueError: neither criterion, or ``older_than_s`` not in ``0..2**63``.
        """
        if older_than_s is None and tag is None:
            raise ValueError("gc needs older_than_s or tag")
        age = -1
        if older_than_s is not None:
            if isinstance(older_than_s, bool) or not isinstance(older_than_s, int):
                raise ValueError("older_than_s must be an int")
            if not 0 <= older_than_s < 2**63:
                raise ValueError("older_than_s must be in 0..2**63")
            age = older_than_s
        out = _lib.GcResult()
        check(self._lib.belayer_gc(self._handle, age, text_arg(tag), byref(out)))
        return GcResult(removed=out.removed, bytes=out.bytes)

    def restore(
        self,
        id: Text,
        verify: bool = True,
        prefix: Optional[int] = None,
        checkpoint: Optional[Text] = None,
    ) -> RestoreInfo:
        """Restores sandbox ``id`` into a fresh instance from its ready checkpoint; with
        ``prefix``, from its checkpoint of that action boundary on the ready checkpoint's line
        (it and its ancestors); with ``checkpoint``, from the checkpoint of that name
        (``CheckpointInfo.name``, on any branch of the sandbox's tree). The restored one
        becomes the ready checkpoint; the checkpoints taken after it stay, as a branch.
        Returns k and the LLM context L_k. ``verify`` also checks the restored state (without
        it the three checks are ``None``).

        Raises:
            NotFoundError: no such checkpoint (nothing was touched).
            ValueError: ``prefix`` not in ``0..2**64``, or both ``prefix`` and ``checkpoint``.
        """
        if prefix is not None and checkpoint is not None:
            raise ValueError("give prefix or checkpoint, not both")
        info = _lib.RestoreInfo()
        dropped = c_uint64(0)
        try:
            if checkpoint is not None:
                check(
                    self._lib.belayer_restore_checkpoint(
                        self._handle, text_arg(id), text_arg(checkpoint), verify, byref(info)
                    )
                )
            elif prefix is None:
                check(self._lib.belayer_restore(self._handle, text_arg(id), verify, byref(info)))
            else:
                if isinstance(prefix, bool) or not isinstance(prefix, int):
                    raise ValueError("prefix must be an int")
                if not 0 <= prefix < _U64:
                    raise ValueError("prefix must be in 0..2**64")
                check(
                    self._lib.belayer_restore_to(
                        self._handle, text_arg(id), prefix, verify, byref(info), byref(dropped)
                    )
                )
            return RestoreInfo(
                prefix=info.prefix if info.has_prefix else None,
                context=_lib.buf_bytes(info.context),
                init_pid=info.init_pid,
                total_ms=info.total_ms,
                verified=bool(info.verified),
                fs_matches=bool(info.fs_matches) if info.verified else None,
                processes_match=bool(info.processes_match) if info.verified else None,
                inodes_kept=bool(info.inodes_kept),
                dropped=dropped.value,
            )
        finally:
            self._lib.belayer_restore_info_free(byref(info))

    def kill_processes(self, id: Text, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` from the host to every process of sandbox ``id``, as a failure from
        outside would (fault injection: SIGKILL is a fail-stop that the daemon then reports
        and :meth:`restore` recovers from). Needs the right to signal them (root). Processes
        that are gone by the time their signal is sent (the rest of the sandbox dies with its
        init) are skipped; returns how many were signalled."""
        sent = 0
        for pid in self.inspect(id).pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                continue
            sent += 1
        return sent
