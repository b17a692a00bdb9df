"""The asynchronous face of one Belayer sandbox, as the Harbor environment uses it.

Every call runs the synchronous :class:`belayer.Client` in a worker thread
(:func:`asyncio.to_thread`), so a Harbor event loop driving many environments never blocks on
the daemon. This is the one module to change when the environment moves to ``belayer.aio``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Mapping, Optional, Union

import belayer

from . import exec_transfer


class SandboxBackend:
    """One connection to ``belayerd`` and at most one sandbox on it.

    Args:
        socket: the daemon's socket (``None``: the library's default,
            ``/run/belayer/belayer.sock``).
    """

    def __init__(self, socket: Optional[str]) -> None:
        self.socket = socket
        self.client: Optional[belayer.Client] = None
        self.id: Optional[str] = None

    async def _call(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def connect(self) -> str:
        """Opens the connection; returns the daemon's version. Raises
        :class:`belayer.DaemonConnectionError` when it is unreachable."""
        self.client = await self._call(belayer.Client, self.socket)
        return await self._call(self.client.ping)

    def _sb(self) -> str:
        if self.client is None or self.id is None:
            raise RuntimeError("the Belayer sandbox is not started")
        return self.id

    async def import_image(self, name: str, source: str) -> None:
        """Imports rootfs directory or tar ``source`` as image ``name`` unless it exists."""
        assert self.client is not None
        await self._call(self.client.import_image, name, source, True)

    async def create(self, image: str, tag: Optional[str]) -> str:
        """Creates and starts the sandbox from ``image``; returns its id."""
        assert self.client is not None
        sandbox = await self._call(self.client.create_sandbox, image, tag)
        self.id = sandbox.id
        return sandbox.id

    async def exec(
        self,
        command: str,
        *,
        timeout_ms: int = 0,
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        stdin: Optional[bytes] = None,
        output_limit: Optional[int] = None,
    ) -> belayer.ExecResult:
        """One action (see :meth:`belayer.Client.exec`)."""
        assert self.client is not None
        return await self._call(
            self.client.exec, self._sb(), command, timeout_ms, cwd=cwd, env=env, stdin=stdin,
            output_limit=output_limit,
        )

    async def checkpoint(self, prefix: int, context: bytes) -> belayer.CheckpointInfo:
        """A full checkpoint C_k at boundary ``prefix``."""
        assert self.client is not None
        return await self._call(self.client.checkpoint, self._sb(), prefix, context)

    async def maybe_checkpoint(
        self, prefix: int, context: bytes, step_duration_s: float,
        policy: Optional[belayer.Policy],
    ) -> belayer.Decision:
        """Feeds the sandbox's checkpoint policy one step (seconds)."""
        assert self.client is not None
        return await self._call(
            self.client.maybe_checkpoint, self._sb(), prefix, context,
            step_duration_s=step_duration_s, policy=policy,
        )

    async def restore(self) -> belayer.RestoreInfo:
        """Restores the ready checkpoint into a fresh instance (verified)."""
        assert self.client is not None
        return await self._call(self.client.restore, self._sb(), True)

    async def state(self) -> str:
        """The sandbox's state as the daemon reports it (``running``, ``failed``, ...)."""
        assert self.client is not None
        return (await self._call(self.client.inspect, self._sb())).state

    async def upload(self, src: Union[str, Path], dst: str) -> None:
        """Copies host ``src`` to sandbox ``dst`` with ``docker cp`` semantics (a ``src``
        ending in ``/.`` copies a directory's contents)."""
        assert self.client is not None
        upload = getattr(self.client, "upload", None)
        if upload is not None:
            await self._call(upload, self._sb(), str(src), dst)
        else:
            await exec_transfer.upload(self, str(src), dst)

    async def download(self, src: str, dst: Union[str, Path]) -> None:
        """Copies sandbox ``src`` to host ``dst`` with ``docker cp`` semantics."""
        assert self.client is not None
        download = getattr(self.client, "download", None)
        if download is not None:
            await self._call(download, self._sb(), src, str(dst))
        else:
            await exec_transfer.download(self, src, str(dst))

    async def destroy(self) -> None:
        """Destroys the sandbox with its checkpoints."""
        if self.client is not None and self.id is not None:
            await self._call(self.client.destroy, self.id)
            self.id = None

    async def close(self) -> None:
        """Closes the connection (the sandbox, if any, stays)."""
        if self.client is not None:
            client, self.client = self.client, None
            await self._call(client.close)
