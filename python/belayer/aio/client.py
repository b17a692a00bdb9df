""":class:`AsyncClient` and :class:`AsyncSandbox`: the API of :class:`belayer.Client` and
:class:`belayer.Sandbox` as coroutines, over a :class:`~belayer.aio.pool.ConnectionPool`."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

from ..client import (
    CheckpointInfo,
    Client,
    Decision,
    ExecResult,
    ForkInfo,
    Policy,
    RestoreInfo,
    Sandbox,
    SandboxInfo,
    Text,
)
from ..errors import BelayerError
from .events import AsyncSubscription
from .pool import DEFAULT_MAX_IDLE_S, ConnectionPool, PoolStats, default_max_connections


def _destroy_orphan(conn: Client, sandbox: Sandbox) -> None:
    """Destroys a sandbox created for a caller that was cancelled before it got it."""
    try:
        conn.destroy(sandbox.id)
    except BelayerError:
        pass


class AsyncClient:
    """A client of ``belayerd`` for asyncio programs: every method of :class:`belayer.Client`
    as a coroutine, with many requests in flight at once.

    Requests run on a pool of at most ``max_connections`` daemon connections, opened on
    demand; each request holds one connection while it runs, in a worker thread, and further
    requests wait for a free connection without blocking the event loop. Use one
    ``AsyncClient`` per event loop, as ``async with AsyncClient(socket) as client:`` or closed
    with :meth:`aclose`.

    Cancellation (``task.cancel()``, ``asyncio.wait_for``, ``asyncio.timeout``) raises
    ``CancelledError`` in the caller at once, but the request already sent is not recalled:
    its connection returns to the pool only once the daemon's response has been read, so
    every later request reads its own response. A cancelled :meth:`exec` keeps running in the
    sandbox until it ends or reaches its own ``timeout_ms`` (give actions a timeout to bound
    them); a cancelled :meth:`create_sandbox` destroys the sandbox it created.

    Errors are those of the synchronous methods (:class:`~belayer.errors.BelayerError`
    subclasses), raised from the ``await``. A ``BusyError`` (the daemon closed an idle
    connection to make room, or refused a new one, before handling anything) is retried on
    another connection a few times before it is raised.

    Args:
        socket: the daemon's socket (``None``: ``/run/belayer/belayer.sock``).
        max_connections: the most connections held (``None``:
            :func:`~belayer.aio.pool.default_max_connections`, 64 for root and 24 for other
            users, which fits ``belayerd``'s default connection quotas).
        max_idle_s: a connection idle longer than this many seconds is closed, not reused.
    """

    def __init__(
        self,
        socket: Optional[Text] = None,
        *,
        max_connections: Optional[int] = None,
        max_idle_s: float = DEFAULT_MAX_IDLE_S,
    ) -> None:
        if max_connections is None:
            max_connections = default_max_connections()
        self.socket = socket
        self._pool = ConnectionPool(socket, max_connections, max_idle_s)

    def __repr__(self) -> str:
        return f"AsyncClient({self.socket!r}, max_connections={self._pool.limit})"

    @property
    def max_connections(self) -> int:
        """The most connections this client holds at once."""
        return self._pool.limit

    def stats(self) -> PoolStats:
        """The pool's connection counts now (see :class:`~belayer.aio.pool.PoolStats`)."""
        return self._pool.stats()

    async def _forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``Client.<name>(*args, **kwargs)`` on a pooled connection.

        Raises ``NotImplementedError`` when this version of :class:`belayer.Client` has no
        method ``name``."""
        if not callable(getattr(Client, name, None)):
            raise NotImplementedError(
                f"belayer.Client.{name} does not exist in this version of the belayer package"
            )
        return await self._pool.run(lambda conn: getattr(conn, name)(*args, **kwargs))

    # -- the daemon -------------------------------------------------------------------------

    async def ping(self) -> str:
        """The daemon's version (see :meth:`belayer.Client.ping`)."""
        return await self._forward("ping")

    async def import_image(self, name: Text, source: Text, exist_ok: bool = False) -> None:
        """Imports the rootfs directory or tar archive ``source`` as image ``name`` (see
        :meth:`belayer.Client.import_image`)."""
        await self._forward("import_image", name, source, exist_ok)

    async def gc(self, *args: Any, **kwargs: Any) -> Any:
        """Drops checkpoints by age and/or rollout tag (``older_than_s=None, tag=None``, at
        least one of them); returns a ``GcResult`` (see :meth:`belayer.Client.gc`)."""
        return await self._forward("gc", *args, **kwargs)

    async def kill_processes(self, id: Text, *args: Any, **kwargs: Any) -> Any:
        """Signals every process of sandbox ``id`` from the host, skipping those already gone
        (see :meth:`belayer.Client.kill_processes`); for failure drills."""
        return await self._forward("kill_processes", id, *args, **kwargs)

    # -- sandboxes --------------------------------------------------------------------------

    async def create_sandbox(
        self, image: Text, tag: Optional[Text] = None, **options: Any
    ) -> "AsyncSandbox":
        """Creates and starts a sandbox from ``image``; ``options`` are those of
        :meth:`belayer.Client.create_sandbox` (``env``, ``workdir``, ``memory_max``,
        ``pids_max``, ``cpus``, ``disk_max``, ``userns`` where the package has them). When
        the caller is cancelled before the sandbox is handed over, it is destroyed."""
        created = await self._pool.run(
            lambda conn: conn.create_sandbox(image, tag, **options), abandon=_destroy_orphan
        )
        return AsyncSandbox(self, created.id)

    def sandbox(self, id: str) -> "AsyncSandbox":
        """An :class:`AsyncSandbox` for an existing sandbox id (no request is made)."""
        return AsyncSandbox(self, id)

    async def list_sandboxes(self, *args: Any, **kwargs: Any) -> Any:
        """This uid's sandboxes (see ``belayer.Client.list_sandboxes``)."""
        return await self._forward("list_sandboxes", *args, **kwargs)

    async def inspect(self, id: Text) -> SandboxInfo:
        """Describes sandbox ``id`` (see :meth:`belayer.Client.inspect`)."""
        return await self._forward("inspect", id)

    async def destroy(self, id: Text) -> None:
        """Kills sandbox ``id`` and deletes it with its checkpoints (see
        :meth:`belayer.Client.destroy`)."""
        await self._forward("destroy", id)

    async def exec(
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
        **options: Any,
    ) -> ExecResult:
        """Runs ``command`` with ``/bin/sh -c`` in sandbox ``id`` (arguments, result and
        errors of :meth:`belayer.Client.exec`; further ``options`` are passed on as they
        are). Cancelling the caller does not stop the action: it runs to its end or to
        ``timeout_ms``."""
        return await self._forward(
            "exec",
            id,
            command,
            timeout_ms,
            cwd=cwd,
            env=env,
            output_limit=output_limit,
            merge_stderr=merge_stderr,
            stdin=stdin,
            **options,
        )

    async def upload(self, id: Text, src: Any, dst: Any, **options: Any) -> Any:
        """Copies the host file or directory ``src`` to ``dst`` in sandbox ``id`` (see
        ``belayer.Client.upload``)."""
        return await self._forward("upload", id, src, dst, **options)

    async def download(self, id: Text, src: Any, dst: Any, **options: Any) -> Any:
        """Copies ``src`` of sandbox ``id`` to the host path ``dst`` (see
        ``belayer.Client.download``)."""
        return await self._forward("download", id, src, dst, **options)

    # -- checkpoints ------------------------------------------------------------------------

    async def checkpoint(self, id: Text, prefix: int, context: bytes = b"") -> CheckpointInfo:
        """Takes a full checkpoint C_k of sandbox ``id`` at boundary ``prefix`` with the LLM
        context ``context`` (see :meth:`belayer.Client.checkpoint`)."""
        return await self._forward("checkpoint", id, prefix, context)

    async def maybe_checkpoint(
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
        ``prefix`` (seconds; see :meth:`belayer.Client.maybe_checkpoint`)."""
        return await self._forward(
            "maybe_checkpoint",
            id,
            prefix,
            context,
            step_duration_s=step_duration_s,
            regen_cost_s=regen_cost_s,
            llm_elapsed_s=llm_elapsed_s,
            llm_response_s=llm_response_s,
            policy=policy,
        )

    async def list_checkpoints(self, id: Text, *args: Any, **kwargs: Any) -> Any:
        """The published checkpoints of sandbox ``id`` (see
        ``belayer.Client.list_checkpoints``)."""
        return await self._forward("list_checkpoints", id, *args, **kwargs)

    async def restore(self, id: Text, verify: bool = True, **options: Any) -> RestoreInfo:
        """Restores sandbox ``id`` from its ready checkpoint (or the one chosen by
        ``prefix=K`` where the package has it) into a fresh instance; returns k and L_k (see
        :meth:`belayer.Client.restore`)."""
        return await self._forward("restore", id, verify, **options)

    async def fork(self, id: Text, count: int, **options: Any) -> ForkInfo:
        """Forks ``count`` new sandboxes from a checkpoint C_K of sandbox ``id`` (keywords
        ``prefix``, ``checkpoint``, ``verify``; see :meth:`belayer.Client.fork`)."""
        return await self._forward("fork", id, count, **options)

    # -- the LLM-context log ----------------------------------------------------------------

    async def context_append(self, trajectory: Text, prefix: int, context: bytes) -> int:
        """Appends the LLM context of ``trajectory`` at boundary ``prefix`` (durable on
        return); returns the record id (see :meth:`belayer.Client.context_append`)."""
        return await self._forward("context_append", trajectory, prefix, context)

    async def context_lookup(
        self, trajectory: Text, prefix: Optional[int] = None
    ) -> Tuple[int, bytes]:
        """The context of ``trajectory`` at ``prefix`` (``None``: the latest) as ``(prefix,
        bytes)`` (see :meth:`belayer.Client.context_lookup`)."""
        return await self._forward("context_lookup", trajectory, prefix)

    async def context_remove(self, trajectory: Text) -> None:
        """Removes the context log of ``trajectory`` (see
        :meth:`belayer.Client.context_remove`)."""
        await self._forward("context_remove", trajectory)

    # -- events -----------------------------------------------------------------------------

    async def subscribe(self) -> AsyncSubscription:
        """A new event stream, open on return (a connection of its own, outside the pool)."""
        return await AsyncSubscription(self.socket).open()

    def events(self) -> AsyncSubscription:
        """An event stream opened by its first read or by ``async with``: ``async for ev in
        client.events():`` receives the events published from that moment on."""
        return AsyncSubscription(self.socket)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the client without waiting: later calls and calls waiting for a connection
        raise :class:`~belayer.errors.BadHandleError`; calls in flight end normally and their
        connections close then."""
        self._pool.close()

    async def aclose(self) -> None:
        """:meth:`close`, then waits for the calls in flight to end and every connection to
        close."""
        await self._pool.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncSandbox:
    """One sandbox, bound to an :class:`AsyncClient`. As an async context manager it
    destroys the sandbox on exit: ``async with await client.create_sandbox("busybox") as
    sb:``."""

    def __init__(self, client: AsyncClient, id: str) -> None:
        self.client = client
        self.id = id

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.destroy()
        except BelayerError:
            pass

    async def info(self) -> SandboxInfo:
        """See :meth:`AsyncClient.inspect`."""
        return await self.client.inspect(self.id)

    async def exec(self, command: Text, timeout_ms: int = 0, **options: Any) -> ExecResult:
        """See :meth:`AsyncClient.exec` (the same keyword options)."""
        return await self.client.exec(self.id, command, timeout_ms, **options)

    async def upload(self, src: Any, dst: Any, **options: Any) -> Any:
        """See :meth:`AsyncClient.upload`."""
        return await self.client.upload(self.id, src, dst, **options)

    async def download(self, src: Any, dst: Any, **options: Any) -> Any:
        """See :meth:`AsyncClient.download`."""
        return await self.client.download(self.id, src, dst, **options)

    async def checkpoint(self, prefix: int, context: bytes = b"") -> CheckpointInfo:
        """See :meth:`AsyncClient.checkpoint`."""
        return await self.client.checkpoint(self.id, prefix, context)

    async def maybe_checkpoint(self, prefix: int, context: bytes = b"", **step: Any) -> Decision:
        """See :meth:`AsyncClient.maybe_checkpoint` (the same keyword arguments)."""
        return await self.client.maybe_checkpoint(self.id, prefix, context, **step)

    async def list_checkpoints(self) -> Any:
        """See :meth:`AsyncClient.list_checkpoints`."""
        return await self.client.list_checkpoints(self.id)

    async def checkpoints(self) -> Any:
        """The sandbox's published checkpoints, oldest first (as ``Sandbox.checkpoints``)."""
        return await self.client.list_checkpoints(self.id)

    async def kill_processes(self, *args: Any, **kwargs: Any) -> Any:
        """See :meth:`AsyncClient.kill_processes`."""
        return await self.client.kill_processes(self.id, *args, **kwargs)

    async def restore(self, verify: bool = True, **options: Any) -> RestoreInfo:
        """See :meth:`AsyncClient.restore`."""
        return await self.client.restore(self.id, verify, **options)

    async def fork(self, count: int, **options: Any) -> "list[AsyncSandbox]":
        """Forks ``count`` new sandboxes from a checkpoint C_K of this one (see
        :meth:`AsyncClient.fork`); returns them, bound to the same client, in order."""
        info = await self.client.fork(self.id, count, **options)
        return [AsyncSandbox(self.client, c.id) for c in info.children]

    async def destroy(self) -> None:
        """See :meth:`AsyncClient.destroy`."""
        await self.client.destroy(self.id)


__all__ = ["AsyncClient", "AsyncSandbox"]
