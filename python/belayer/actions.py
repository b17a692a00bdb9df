"""Actions: the result types of :meth:`belayer.Client.exec` and the conversion of its options
to and its result from the C ABI (``belayer_exec_with``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Union

from . import _lib

#: ``BELAYER_INFRA_FAULT_*`` codes of ``belayer.h`` and their names.
INFRA_FAULT_KINDS = {1: "external_kill", 2: "oom", 3: "sandbox_lost"}


@dataclass(frozen=True)
class InfraFault:
    """An infrastructure failure that hit an action: its output is not the task's own
    behaviour and should be withheld from the model's context; restore instead.

    Attributes:
        kind: ``"external_kill"`` (a fatal signal from outside the sandbox), ``"oom"`` (the
            OOM killer) or ``"sandbox_lost"`` (the sandbox init died); ``"unknown"`` for a
            kind this package does not know (a newer library).
        pid: host pid of the process it hit, ``None`` when unknown.
        signal: the killing signal, ``None`` when unknown.
    """

    kind: str
    pid: Optional[int] = None
    signal: Optional[int] = None


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one action.

    Attributes:
        exit_code: exit code; 128 + signal when killed by a signal.
        signal: terminating signal, ``None`` when none.
        timed_out: the timeout killed the action.
        truncated: stdout or stderr (the merged stream with ``merge_stderr``) was cut at the
            output limit.
        duration_ms: wall-clock duration, milliseconds.
        stdout: captured stdout (everything, with ``merge_stderr``).
        stderr: captured stderr (empty with ``merge_stderr``).
        infra_fault: the infrastructure failure that hit the action, ``None`` when none.
        dirty: whether the action changed the sandbox (files, processes); ``None`` when the
            daemon cannot tell.
    """

    exit_code: int
    signal: Optional[int]
    timed_out: bool
    truncated: bool
    duration_ms: float
    stdout: bytes
    stderr: bytes
    infra_fault: Optional[InfraFault] = None
    dirty: Optional[bool] = None

    @property
    def ok(self) -> bool:
        """Whether the action exited with 0."""
        return self.exit_code == 0

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")


def _encode(text: Union[str, bytes]) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8")


def env_entries(env: Optional[Mapping[Union[str, bytes], Union[str, bytes]]]) -> List[bytes]:
    """``env`` as ``KEY=VALUE`` C strings; raises :class:`ValueError` for an empty key, a key
    with ``=`` and a NUL anywhere."""
    entries: List[bytes] = []
    for key, value in (env or {}).items():
        k = _encode(key)
        if not k or b"=" in k or b"\0" in k:
            raise ValueError(f"env key {key!r} must be non-empty and without '=' or NUL")
        v = _encode(value)
        if b"\0" in v:
            raise ValueError(f"env value of {key!r} must not contain NUL")
        entries.append(k + b"=" + v)
    return entries


class Options:
    """A ``BelayerExecOptions`` with the buffers it points at, kept alive as long as this."""

    def __init__(
        self,
        timeout_ms: int,
        cwd: Optional[Union[str, bytes]],
        env: Optional[Mapping[Union[str, bytes], Union[str, bytes]]],
        output_limit: Optional[int],
        merge_stderr: bool,
        stdin: Optional[bytes],
    ) -> None:
        if not 0 <= timeout_ms < 2**64:
            raise ValueError("timeout_ms must be in 0..2**64 (0: none)")
        if output_limit is not None and not 0 < output_limit < 2**64:
            raise ValueError("output_limit must be in 1..2**64 (None: the daemon's default)")
        if stdin is not None and not isinstance(stdin, (bytes, bytearray, memoryview)):
            raise ValueError(f"stdin must be bytes, not {type(stdin).__name__}")
        if cwd is not None and b"\0" in _encode(cwd):
            raise ValueError("cwd must not contain NUL")
        entries = env_entries(env)
        self._env = (ctypes.c_char_p * max(len(entries), 1))(*entries)
        data = bytes(stdin or b"")
        self._stdin = (ctypes.c_uint8 * max(len(data), 1)).from_buffer_copy(data or b"\0")
        self.struct = _lib.ExecOptions(
            cwd=None if cwd is None else _encode(cwd),
            env=ctypes.cast(self._env, ctypes.POINTER(ctypes.c_char_p)),
            env_len=len(entries),
            timeout_ms=timeout_ms,
            output_limit=output_limit or 0,
            merge_stderr=1 if merge_stderr else 0,
            stdin_data=ctypes.cast(self._stdin, ctypes.POINTER(ctypes.c_uint8)),
            stdin_len=len(data),
        )


def result(r: Any, v: Any) -> ExecResult:
    """The :class:`ExecResult` of a filled ``BelayerExecResult`` and ``BelayerExecVerdict``
    (copies the buffers)."""
    fault = None
    if v.infra_fault:
        fault = InfraFault(
            kind=INFRA_FAULT_KINDS.get(v.infra_fault, "unknown"),
            pid=v.infra_fault_pid if v.infra_fault_pid >= 0 else None,
            signal=v.infra_fault_signal or None,
        )
    return ExecResult(
        exit_code=r.exit_code,
        signal=r.signal or None,
        timed_out=bool(r.timed_out),
        truncated=bool(r.truncated),
        duration_ms=r.duration_ms,
        stdout=_lib.buf_bytes(r.stdout_buf),
        stderr=_lib.buf_bytes(r.stderr_buf),
        infra_fault=fault,
        dirty=None if v.dirty < 0 else bool(v.dirty),
    )
