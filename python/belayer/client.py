"""The Python API over libbelayer: :class:`Client`, :class:`Sandbox`, :class:`Subscription`
and the result types."""

from __future__ import annotations

import signal
import time
from ctypes import byref, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Callable, Iterator, List, Mapping, Optional, Tuple

from . import _lib
from ._status import Text
from ._status import check as _check
from ._status import text_arg as _c
from .actions import ExecResult, InfraFault, Options, result  # noqa: F401 (re-exported)
from .errors import BelayerError, EventTimeoutError
from .forks import ForkChild, ForkInfo, ForkMethods
from .sandboxes import CheckpointInfo, GcResult, RestoreInfo, SandboxInfo, SandboxMethods
from .transfer import ClientTransfers, SandboxTransfers, TransferResult  # noqa: F401

REASONS = {
    0: "benefit",
    1: "cost",
    2: "cooldown",
    3: "always",
    4: "never",
    5: "every_n",
    6: "restart",
    7: "clean",
}

EVENT_KINDS = {1: "sandbox_failed", 2: "checkpoint_ready"}


def abi_version() -> int:
    """The C ABI version of the loaded library (``belayer_abi_version()``)."""
    return int(_lib.load().belayer_abi_version())


def library_version() -> str:
    """The version of the loaded library."""
    return _lib.load().belayer_version().decode()


def library_path() -> str:
    """Path of the loaded library."""
    return _lib.path()


@dataclass(frozen=True)
class Policy:
    """The checkpoint policy of a sandbox (``None`` fields keep the daemon's defaults).

    Attributes:
        kind: ``adaptive``, ``always``, ``never``, ``every:N`` or ``restart``.
        failure_p: fixed failure probability per step, in [0, 1].
        failure_rate_per_s: fail-stop rate per second (used when ``failure_p`` is None).
        checkpoint_timeout_s: a longer checkpoint starts the cooldown, seconds.
        cooldown_s: cooldown after a timed-out checkpoint, seconds.
    """

    kind: str = "adaptive"
    failure_p: Optional[float] = None
    failure_rate_per_s: Optional[float] = None
    checkpoint_timeout_s: Optional[float] = None
    cooldown_s: Optional[float] = None


@dataclass(frozen=True)
class Decision:
    """What :meth:`Client.maybe_checkpoint` decided (seconds, probabilities).

    ``checkpoint`` is the published checkpoint when one was taken.
    """

    checkpointed: bool
    reason: str
    p: float
    regen_cost_s: float
    c_s: float
    q: float
    benefit: float
    visible_cost: float
    checkpoint_prefix: Optional[int]
    checkpoint_bytes: int
    checkpoint_total_ms: float


@dataclass(frozen=True)
class Event:
    """A daemon event: ``kind`` is ``"sandbox_failed"`` (with ``reason``) or
    ``"checkpoint_ready"`` (with ``prefix``)."""

    kind: str
    sandbox: str
    prefix: int
    reason: Optional[str]


def _neg(v: Optional[float]) -> float:
    return -1.0 if v is None else float(v)


class _Handle:
    """A library handle given back exactly once: by :meth:`close`, on leaving a ``with``
    block, or when a forgotten object is collected. Subclasses name the library function that
    releases it in ``_release``."""

    _release = ""

    def _open(self, opener: Callable[..., int], *args: object) -> None:
        handle = c_uint64(0)
        self._closed = True
        _check(opener(*args, byref(handle)))
        self._handle = handle.value
        self._closed = False

    def close(self) -> None:
        """Releases the handle. Closing twice raises :class:`~belayer.errors.BadHandleError`."""
        self._closed = True
        _check(getattr(self._lib, self._release)(self._handle))

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                getattr(self._lib, self._release)(self._handle)
            except Exception:
                pass

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except BelayerError:
            pass


class Client(_Handle, SandboxMethods, ForkMethods, ClientTransfers):
    """A connection to ``belayerd`` (file transfer: :class:`~belayer.transfer.ClientTransfers`).

    Usable as a context manager (closes on exit). One request runs at a time per client;
    calls from several threads are serialized by the library (ctypes releases the GIL while
    they run). Raises :class:`~belayer.errors.DaemonConnectionError` when the daemon is
    unreachable.

    Args:
        socket: the daemon's socket (``None``: ``/run/belayer/belayer.sock``).
    """

    _release = "belayer_close"

    def __init__(self, socket: Optional[Text] = None) -> None:
        self._lib = _lib.load()
        self.socket = socket
        self._open(self._lib.belayer_connect, _c(socket))

    @property
    def handle(self) -> int:
        """The library handle of this connection."""
        return self._handle

    def ping(self) -> str:
        """The daemon's version."""
        out = c_void_p()
        _check(self._lib.belayer_ping(self._handle, byref(out)))
        return _lib.take_string(out)

    def import_image(self, name: Text, source: Text, exist_ok: bool = False) -> None:
        """Imports the rootfs directory or tar archive ``source`` as image ``name``, owned by
        this process's uid; an existing image is fine when ``exist_ok``. ``oci:DIR[:TAG]``
        (an OCI image layout) and ``docker-archive:FILE[:REF]`` import an OCI image as
        shared layers (:class:`CorruptImageError` when a digest does not match).

        The library opens ``source`` with this process's rights and passes the descriptor to
        the daemon, which reads only what this process may read (a directory is walked as its
        uid and groups): an unreadable entry raises :class:`PermissionDeniedError`, a device
        node outside the source's ``/dev`` :class:`BadRequestError`."""
        rc = self._lib.belayer_image_import(self._handle, _c(name), _c(source))
        if exist_ok and rc == -23:
            return
        _check(rc)

    def pull_image(
        self,
        reference: Text,
        name: Optional[Text] = None,
        username: Optional[Text] = None,
        password: Optional[Text] = None,
        insecure: bool = False,
        exist_ok: bool = False,
    ) -> None:
        """Pulls ``reference`` (``HOST[:PORT]/REPO[:TAG]`` or ``...@sha256:DIGEST``) from its
        OCI distribution registry as image ``name`` (default: the reference), with basic
        credentials when given; loopback registries (and ``insecure``) use plain HTTP.
        Raises :class:`RegistryUnreachableError`, :class:`RegistryDeniedError`,
        :class:`NotFoundError`, :class:`CorruptImageError`; an existing image is fine when
        ``exist_ok``."""
        if (username is None) != (password is None):
            raise ValueError("username and password go together")
        rc = self._lib.belayer_image_pull(
            self._handle,
            _c(reference),
            None if name is None else _c(name),
            None if username is None else _c(username),
            None if password is None else _c(password),
            1 if insecure else 0,
        )
        if exist_ok and rc == -23:
            return
        _check(rc)

    def sandbox(self, id: str) -> "Sandbox":
        """A :class:`Sandbox` object for an existing sandbox id (no request is made)."""
        return Sandbox(self, id)

    def destroy(self, id: Text) -> None:
        """Kills sandbox ``id`` and deletes it with its checkpoints."""
        _check(self._lib.belayer_sandbox_destroy(self._handle, _c(id)))

    def exec(
        self,
        id: Text,
        command: Text,
        timeout_ms: int = 0,
        *,
        cwd: Optional[Text] = None,
        env: Optional[Mapping[Text, Text]] = None,
        output_limit: Optional[int] = None,
        merge_stderr: bool = False,
        stdin: Optional[bytes] = None,
    ) -> ExecResult:
        """Runs ``command`` with ``/bin/sh -c`` in sandbox ``id``. A non-zero exit is
        reported, not raised.

        Args:
            timeout_ms: kill the action's process group after this many ms; 0: no timeout.
            cwd: absolute working directory inside the sandbox (default ``/``).
            env: extra environment variables (keys non-empty, without ``=``).
            output_limit: bytes kept of stdout and of stderr (of the merged stream with
                ``merge_stderr``); ``None``: the daemon's default.
            merge_stderr: stdout and stderr as one ordered stream, as on a terminal:
                everything comes back in ``stdout``, ``stderr`` is empty.
            stdin: bytes the action reads on its stdin (the daemon bounds them, by default
                at 1 MiB: :class:`BadRequestError` beyond); ``None``: end of file at once.

        Raises:
            ValueError: a bad ``env`` entry, a NUL in ``cwd`` or ``env``, ``stdin`` that is not
                bytes, a timeout or limit out of range.
        """
        opts = Options(timeout_ms, cwd, env, output_limit, merge_stderr, stdin)
        r = _lib.ExecResult()
        v = _lib.ExecVerdict()
        try:
            _check(
                self._lib.belayer_exec_with(
                    self._handle, _c(id), _c(command), byref(opts.struct), byref(r), byref(v)
                )
            )
            return result(r, v)
        finally:
            self._lib.belayer_exec_result_free(byref(r))

    def checkpoint(self, id: Text, prefix: int, context: bytes = b"") -> CheckpointInfo:
        """Takes a full checkpoint C_k of sandbox ``id`` at boundary ``prefix`` with the LLM
        context ``context``."""
        info = _lib.CheckpointInfo()
        try:
            _check(
                self._lib.belayer_checkpoint(
                    self._handle, _c(id), prefix, context or None, len(context), byref(info)
                )
            )
            return CheckpointInfo(
                prefix=info.prefix,
                bytes=info.bytes,
                frozen_ms=info.frozen_ms,
                total_ms=info.total_ms,
                name=_lib.string_field(info.name),
                context_digest=_lib.string_field(info.context_digest),
            )
        finally:
            self._lib.belayer_checkpoint_info_free(byref(info))

    def maybe_checkpoint(
        self,
        id: Text,
        prefix: int,
        context: bytes = b"",
        *,
        step_duration_s: float,
        regen_cost_s: Optional[float] = None,
        llm_elapsed_s: float = 0.0,
        llm_response_s: Optional[float] = None,
        policy: Optional[Policy] = None,
    ) -> Decision:
        """Feeds the checkpoint policy of sandbox ``id`` the step that reached boundary
        ``prefix``; the daemon checkpoints (with ``context``) when the policy says so.

        The daemon knows from its tracer whether any action changed the sandbox since its
        ready checkpoint (or since it was created or restored): when nothing did, the adaptive
        policy skips with reason ``"clean"`` (the ready checkpoint already holds this state).

        Args:
            step_duration_s: d_t, the step's wall-clock duration (LLM plus action), seconds.
            regen_cost_s: C_t, seconds; ``None``: the daemon sums the step durations since
                the last checkpoint.
            llm_elapsed_s: x, how long the next LLM response already runs, seconds.
            llm_response_s: this step's LLM response time, fed into the distribution of T.
            policy: sets or replaces the sandbox's policy; ``None`` keeps it (default:
                adaptive, p = 0.01 per step).
        """
        step = _lib.Step(float(step_duration_s), _neg(regen_cost_s), float(llm_elapsed_s),
                         _neg(llm_response_s))
        c_policy = None
        if policy is not None:
            c_policy = _lib.Policy(
                _c(policy.kind),
                _neg(policy.failure_p),
                _neg(policy.failure_rate_per_s),
                _neg(policy.checkpoint_timeout_s),
                _neg(policy.cooldown_s),
            )
        d = _lib.Decision()
        _check(
            self._lib.belayer_maybe_checkpoint(
                self._handle,
                _c(id),
                prefix,
                context or None,
                len(context),
                byref(step),
                byref(c_policy) if c_policy is not None else None,
                byref(d),
            )
        )
        return Decision(
            checkpointed=bool(d.checkpointed),
            reason=REASONS.get(d.reason, "unknown"),
            p=d.p,
            regen_cost_s=d.regen_cost_s,
            c_s=d.c_s,
            q=d.q,
            benefit=d.benefit,
            visible_cost=d.visible_cost,
            checkpoint_prefix=d.checkpoint_prefix if d.checkpointed else None,
            checkpoint_bytes=d.checkpoint_bytes,
            checkpoint_total_ms=d.checkpoint_total_ms,
        )

    def context_append(self, trajectory: Text, prefix: int, context: bytes) -> int:
        """Appends the LLM context of ``trajectory`` at boundary ``prefix`` to its log
        (durable on return); returns the record id."""
        record = c_uint64(0)
        _check(
            self._lib.belayer_context_append(
                self._handle, _c(trajectory), prefix, context or None, len(context),
                byref(record)
            )
        )
        return record.value

    def context_lookup(self, trajectory: Text, prefix: Optional[int] = None) -> Tuple[int, bytes]:
        """The context of ``trajectory`` at ``prefix`` (``None``: the latest boundary) as
        ``(prefix, bytes)``; raises :class:`~belayer.errors.NotFoundError`."""
        out_prefix = c_uint64(0)
        buf = _lib.Buf()
        try:
            _check(
                self._lib.belayer_context_lookup(
                    self._handle,
                    _c(trajectory),
                    -1 if prefix is None else prefix,
                    byref(out_prefix),
                    byref(buf),
                )
            )
            return out_prefix.value, _lib.buf_bytes(buf)
        finally:
            self._lib.belayer_buf_free(byref(buf))

    def context_remove(self, trajectory: Text) -> None:
        """Removes the context log of ``trajectory`` with all its records, giving what it was
        charged back to its owner's context budget; a later :meth:`context_append` starts a
        new log. Raises :class:`~belayer.errors.NotFoundError` (also for another uid's
        trajectory) and :class:`~belayer.errors.BadRequestError` (an invalid id)."""
        _check(self._lib.belayer_context_remove(self._handle, _c(trajectory)))

    def subscribe(self) -> "Subscription":
        """A new event stream (on its own connection to the same socket)."""
        return Subscription(self.socket)


class Sandbox(SandboxTransfers):
    """One sandbox, bound to a :class:`Client`. As a context manager it destroys the
    sandbox on exit. File transfer: :class:`~belayer.transfer.SandboxTransfers`."""

    def __init__(self, client: Client, id: str) -> None:
        self.client = client
        self.id = id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.destroy()
        except BelayerError:
            pass

    def info(self) -> SandboxInfo:
        """See :meth:`Client.inspect`."""
        return self.client.inspect(self.id)

    def checkpoints(self) -> List[CheckpointInfo]:
        """See :meth:`Client.list_checkpoints`."""
        return self.client.list_checkpoints(self.id)

    def kill_processes(self, sig: int = signal.SIGKILL) -> int:
        """See :meth:`Client.kill_processes`."""
        return self.client.kill_processes(self.id, sig)

    def exec(
        self,
        command: Text,
        timeout_ms: int = 0,
        *,
        cwd: Optional[Text] = None,
        env: Optional[Mapping[Text, Text]] = None,
        output_limit: Optional[int] = None,
        merge_stderr: bool = False,
        stdin: Optional[bytes] = None,
    ) -> ExecResult:
        """See :meth:`Client.exec`."""
        return self.client.exec(
            self.id,
            command,
            timeout_ms,
            cwd=cwd,
            env=env,
            output_limit=output_limit,
            merge_stderr=merge_stderr,
            stdin=stdin,
        )

    def checkpoint(self, prefix: int, context: bytes = b"") -> CheckpointInfo:
        """See :meth:`Client.checkpoint`."""
        return self.client.checkpoint(self.id, prefix, context)

    def maybe_checkpoint(self, prefix: int, context: bytes = b"", **step: object) -> Decision:
        """See :meth:`Client.maybe_checkpoint`."""
        return self.client.maybe_checkpoint(self.id, prefix, context, **step)  # type: ignore[arg-type]

    def restore(
        self, verify: bool = True, prefix: Optional[int] = None, checkpoint: Optional[Text] = None
    ) -> RestoreInfo:
        """See :meth:`Client.restore`."""
        return self.client.restore(self.id, verify, prefix, checkpoint)

    def fork(
        self,
        count: int,
        prefix: Optional[int] = None,
        checkpoint: Optional[Text] = None,
        verify: bool = True,
    ) -> List["Sandbox"]:
        """Forks ``count`` new sandboxes from a checkpoint C_K of this one (see
        :meth:`Client.fork`, which also returns L_K and the fork's timings); returns them,
        bound to the same client, in order."""
        info = self.client.fork(self.id, count, prefix, checkpoint, verify)
        return [Sandbox(self.client, c.id) for c in info.children]

    def destroy(self) -> None:
        """See :meth:`Client.destroy`."""
        self.client.destroy(self.id)


class Subscription(_Handle):
    """A stream of daemon events (sandbox failed, checkpoint ready) published after it was
    opened. Iterating yields events forever; use :meth:`next` for a timeout. A context
    manager (closes on exit). Read it from one thread at a time."""

    _release = "belayer_unsubscribe"

    def __init__(self, socket: Optional[Text] = None) -> None:
        self._lib = _lib.load()
        self._open(self._lib.belayer_subscribe, _c(socket))

    def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or ``None`` when none came within ``timeout`` seconds
        (``None``: wait forever)."""
        ev = _lib.Event()
        timeout_ms = -1 if timeout is None else max(0, int(timeout * 1000))
        try:
            try:
                _check(self._lib.belayer_next_event(self._handle, timeout_ms, byref(ev)))
            except EventTimeoutError:
                return None
            return Event(
                kind=EVENT_KINDS.get(ev.kind, "unknown"),
                sandbox=_lib.string_field(ev.sandbox),
                prefix=ev.prefix,
                reason=_lib.string_field(ev.reason) or None,
            )
        finally:
            self._lib.belayer_event_free(byref(ev))

    def wait_for(self, kind: str, sandbox: str, timeout: float = 20.0) -> Event:
        """Waits for an event of ``kind`` about ``sandbox``; raises
        :class:`~belayer.errors.EventTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EventTimeoutError(-9, "BELAYER_E_TIMEOUT", f"no {kind} event for {sandbox}")
            ev = self.next(min(left, 0.5))
            if ev is not None and ev.kind == kind and ev.sandbox == sandbox:
                return ev

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self.next(None)
            if ev is not None:
                yield ev



__all__ = [
    "Client",
    "Sandbox",
    "Subscription",
    "ExecResult",
    "SandboxInfo",
    "CheckpointInfo",
    "RestoreInfo",
    "ForkInfo",
    "ForkChild",
    "GcResult",
    "Policy",
    "Decision",
    "Event",
    "TransferResult",
    "abi_version",
    "library_version",
    "library_path",
]
