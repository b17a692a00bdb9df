"""The asynchronous face of one Belayer sandbox, as the Harbor environment uses it.

Every call goes through a :class:`belayer.aio.AsyncClient` of the environment's own (at most
:data:`CONNECTIONS` daemon connections), so a Harbor event loop driving many environments
never blocks on the daemon, and a cancelled call (Harbor's timeouts cancel the agent's task)
never leaves a connection with an unread response: the environment's ``stop`` still gets a
connection and destroys the sandbox, which kills an action still running in it.

File transfer is Belayer's own (``upload``/``download``, ``docker cp`` placement); the
``DIR/.`` forms Harbor's docker environment uses for directories are in :mod:`.dircopy`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import belayer
from belayer.aio import AsyncClient, AsyncSandbox

from . import dircopy

#: Daemon connections of one environment: its operations run one at a time, so one carries
#: them, and the second serves ``stop`` (destroy) while a cancelled action still holds the
#: first.
CONNECTIONS = 2
#: Seconds :meth:`SandboxBackend.close` waits for calls still in flight.
CLOSE_WAIT_S = 10.0


class SandboxBackend:
    """One :class:`~belayer.aio.AsyncClient` and at most one sandbox on it.

    Args:
        socket: the daemon's socket (``None``: the library's default,
            ``/run/belayer/belayer.sock``).
    """

    def __init__(self, socket: Optional[str]) -> None:
        self.socket = socket
        self.client: Optional[AsyncClient] = None
        self.sandbox: Optional[AsyncSandbox] = None

    @property
    def id(self) -> Optional[str]:
        """The sandbox's id, ``None`` before :meth:`create` and after :meth:`destroy`."""
        return None if self.sandbox is None else self.sandbox.id

    def _sb(self) -> AsyncSandbox:
        if self.sandbox is None:
            raise RuntimeError("the Belayer sandbox is not started")
        return self.sandbox

    def _client(self) -> AsyncClient:
        if self.client is None:
            raise RuntimeError("the Belayer environment is not connected")
        return self.client

    async def connect(self) -> str:
        """Opens the client; returns the daemon's version. Raises
        :class:`belayer.DaemonConnectionError` when it is unreachable."""
        if self.client is None:
            self.client = AsyncClient(self.socket, max_connections=CONNECTIONS)
        return await self.client.ping()

    async def import_image(self, name: str, source: str) -> None:
        """Imports rootfs directory or tar ``source`` as image ``name`` unless it exists."""
        await self._client().import_image(name, source, True)

    async def create(self, image: str, limits: Mapping[str, Any]) -> str:
        """Creates and starts the sandbox from ``image`` with ``limits`` (keyword arguments
        of :meth:`belayer.Client.create_sandbox`: ``memory_max``, ``pids_max``, ``cpus``,
        ``disk_max``); returns its id. A create cancelled before it returns destroys the
        sandbox it made."""
        self.sandbox = await self._client().create_sandbox(image, None, **limits)
        return self.sandbox.id

    async def info(self) -> belayer.SandboxInfo:
        """The sandbox as the daemon describes it (state, limits in force, ...)."""
        return await self._sb().info()

    async def exec(
        self,
        command: str,
        *,
        timeout_ms: int = 0,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> belayer.ExecResult:
        """One action (see :meth:`belayer.Client.exec`)."""
        return await self._sb().exec(command, timeout_ms, cwd=cwd, env=env)

    async def checkpoint(self, prefix: int, context: bytes) -> belayer.CheckpointInfo:
        """A full checkpoint C_k at boundary ``prefix``."""
        return await self._sb().checkpoint(prefix, context)

    async def maybe_checkpoint(
        self, prefix: int, context: bytes, step_duration_s: float,
        policy: Optional[belayer.Policy],
    ) -> belayer.Decision:
        """Feeds the sandbox's checkpoint policy one step (seconds)."""
        return await self._sb().maybe_checkpoint(
            prefix, context, step_duration_s=step_duration_s, policy=policy
        )

    async def restore(self) -> belayer.RestoreInfo:
        """Restores the ready checkpoint into a fresh instance (verified)."""
        return await self._sb().restore(True)

    async def state(self) -> str:
        """The sandbox's state as the daemon reports it (``running``, ``failed``, ...)."""
        return (await self._sb().info()).state

    async def upload(self, src: Union[str, Path], dst: str) -> None:
        """Copies host file, directory or symlink ``src`` to sandbox ``dst`` (``docker cp
        SRC ID:DST``)."""
        await self._sb().upload(str(src), dst)

    async def upload_contents(self, src: Union[str, Path], dst: str) -> None:
        """Copies what host directory ``src`` holds into sandbox directory ``dst``
        (``docker cp SRC/. ID:DST``); see :func:`.dircopy.upload_contents`."""
        await dircopy.upload_contents(self._sb(), Path(src), dst)

    async def download(self, src: str, dst: Union[str, Path]) -> None:
        """Copies sandbox ``src`` to host ``dst`` (``docker cp ID:SRC DST``)."""
        await self._sb().download(src, str(dst))

    async def download_contents(self, src: str, dst: Union[str, Path]) -> None:
        """Copies what sandbox directory ``src`` holds into host directory ``dst``
        (``docker cp ID:SRC/. DST``); see :func:`.dircopy.download_contents`."""
        await dircopy.download_contents(self._sb(), src, Path(dst))

    async def destroy(self) -> None:
        """Destroys the sandbox with its checkpoints (an action running in it is killed)."""
        if self.sandbox is not None:
            await self.sandbox.destroy()
            self.sandbox = None

    async def close(self) -> None:
        """Closes the client: later calls fail at once; waits up to :data:`CLOSE_WAIT_S`
        seconds for calls in flight (a cancelled action in a kept sandbox) to end, after
        which their connections close when they do. The sandbox, if any, stays."""
        if self.client is not None:
            client, self.client = self.client, None
            try:
                await asyncio.wait_for(client.aclose(), CLOSE_WAIT_S)
            except asyncio.TimeoutError:
                pass
