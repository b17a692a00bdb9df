"""File transfer between the host and a sandbox (``belayer_upload`` and friends of
``libbelayer``): the methods :class:`~belayer.Client` and :class:`~belayer.Sandbox` gain from
:class:`ClientTransfers` and :class:`SandboxTransfers`, and their :class:`TransferResult`.

Where a tree lands follows ``docker cp``: an existing directory takes the source under its
own name; anything else becomes the destination (its parent must exist; a destination ending
in ``/`` must be an existing directory). Uploads are extracted inside the sandbox by a
process of the sandbox, which resolves the destination inside it and never writes through a
symlink; downloads are extracted here beneath the host destination with the same rules, so a
hostile sandbox cannot make them write anywhere else.
"""

from __future__ import annotations

import io
import os
from ctypes import byref
from dataclasses import dataclass
from typing import IO, Optional, Union

from . import _lib
from .errors import BelayerError

#: A host path: ``str``, ``bytes`` or an ``os.PathLike``.
HostPath = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


@dataclass(frozen=True)
class TransferResult:
    """What a transfer moved: ``files`` (members created or archived: files, directories,
    symlinks, hard links), ``bytes`` of file content, ``skipped`` special files left out of a
    download, ``changed`` files whose size changed while they were packed, and the daemon's
    ``duration_ms``."""

    files: int
    bytes: int
    skipped: int
    changed: int
    duration_ms: float


def _host(path: HostPath) -> bytes:
    """``path`` as the bytes the library takes (no NUL allowed)."""
    raw = os.fsencode(os.fspath(path))
    if b"\0" in raw:
        raise ValueError("a host path must not contain NUL")
    return raw


def _sandbox(path: Union[str, bytes]) -> bytes:
    """A sandbox path as UTF-8 bytes (no NUL allowed)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    raw = path.encode("utf-8") if isinstance(path, str) else bytes(path)
    if b"\0" in raw:
        raise ValueError("a sandbox path must not contain NUL")
    return raw


def _timeout(timeout_ms: int) -> int:
    if not 0 <= timeout_ms < 2**64:
        raise ValueError("timeout_ms must be in 0..2**64 (0: the daemon's default)")
    return timeout_ms


def _result(r: "_lib.TransferResult") -> TransferResult:
    return TransferResult(
        files=r.files,
        bytes=r.bytes,
        skipped=r.skipped,
        changed=r.changed,
        duration_ms=r.duration_ms,
    )


def _fileno(f: object) -> Optional[int]:
    """The descriptor behind a file object, ``None`` when it has none."""
    try:
        return f.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


class ClientTransfers:
    """The file-transfer methods of :class:`~belayer.Client` (``self._lib``,
    ``self._handle``)."""

    _lib: object
    _handle: int

    def _call(self, fn: str, *args: object) -> TransferResult:
        from .client import _check

        out = _lib.TransferResult()
        _check(getattr(self._lib, fn)(self._handle, *args, byref(out)))
        return _result(out)

    def upload(
        self, id: Union[str, bytes], src: HostPath, dst: Union[str, bytes], *, timeout_ms: int = 0
    ) -> TransferResult:
        """Copies the host file, directory or symlink ``src`` (read with this process's
        rights) to ``dst`` in sandbox ``id``.

        Raises :class:`~belayer.errors.NotFoundError` (source, destination or its parent
        missing), :class:`~belayer.errors.NoSpaceError` (the sandbox's disk limit),
        :class:`~belayer.errors.TransferFailedError` (a source that cannot be read),
        :class:`~belayer.errors.TransferTimedOutError`, and the daemon's other errors."""
        return self._call(
            "belayer_upload", _sandbox(id), _host(src), _sandbox(dst), _timeout(timeout_ms)
        )

    def download(
        self, id: Union[str, bytes], src: Union[str, bytes], dst: HostPath, *, timeout_ms: int = 0
    ) -> TransferResult:
        """Copies ``src`` of sandbox ``id`` to the host path ``dst``. Symlinks stay links,
        special files are left out (``skipped``), nothing is written outside ``dst``.

        Raises as :meth:`upload`; :class:`~belayer.errors.TransferFailedError` also for a
        member refused here (what was extracted before stays)."""
        return self._call(
            "belayer_download", _sandbox(id), _sandbox(src), _host(dst), _timeout(timeout_ms)
        )

    def upload_archive(
        self,
        id: Union[str, bytes],
        archive: Union[bytes, bytearray, memoryview, IO[bytes]],
        dst: Union[str, bytes],
        *,
        timeout_ms: int = 0,
    ) -> TransferResult:
        """Extracts the tar ``archive`` (bytes, or a binary file object read from its current
        position to its end) into the existing directory ``dst`` of sandbox ``id``, every
        member under its own name. Members the hardening rules refuse (``..`` or absolute
        names, devices, a symlink where a parent directory must be) raise
        :class:`~belayer.errors.TransferFailedError`."""
        fd = None if isinstance(archive, (bytes, bytearray, memoryview)) else _fileno(archive)
        if fd is not None:
            return self._call(
                "belayer_upload_archive", _sandbox(id), fd, _sandbox(dst), _timeout(timeout_ms)
            )
        data = archive if isinstance(archive, (bytes, bytearray, memoryview)) else archive.read()
        memfd = os.memfd_create("belayer-archive", os.MFD_CLOEXEC)
        try:
            with open(memfd, "w+b", closefd=False) as f:
                f.write(data)
                f.flush()
                f.seek(0)
            return self._call(
                "belayer_upload_archive", _sandbox(id), memfd, _sandbox(dst), _timeout(timeout_ms)
            )
        finally:
            os.close(memfd)

    def download_archive(
        self,
        id: Union[str, bytes],
        src: Union[str, bytes],
        out: Optional[IO[bytes]] = None,
        *,
        timeout_ms: int = 0,
    ) -> Union[bytes, TransferResult]:
        """The tar archive of ``src`` of sandbox ``id`` (one tree named after its last
        component): returned as bytes, or written to the binary file object ``out`` (then the
        :class:`TransferResult` is returned)."""
        fd = None if out is None else _fileno(out)
        if out is not None and fd is not None:
            out.flush()
            return self._call(
                "belayer_download_archive", _sandbox(id), _sandbox(src), fd, _timeout(timeout_ms)
            )
        memfd = os.memfd_create("belayer-archive", os.MFD_CLOEXEC)
        try:
            result = self._call(
                "belayer_download_archive", _sandbox(id), _sandbox(src), memfd, _timeout(timeout_ms)
            )
            with open(memfd, "rb", closefd=False) as f:
                f.seek(0)
                data = f.read()
        finally:
            os.close(memfd)
        if out is not None:
            out.write(data)
            return result
        return data


class SandboxTransfers:
    """The file-transfer methods of :class:`~belayer.Sandbox` (``self.client``, ``self.id``),
    each the :class:`ClientTransfers` method of the same name."""

    client: ClientTransfers
    id: str

    def upload(self, src: HostPath, dst: Union[str, bytes], *, timeout_ms: int = 0) -> TransferResult:
        """See :meth:`ClientTransfers.upload`."""
        return self.client.upload(self.id, src, dst, timeout_ms=timeout_ms)

    def download(self, src: Union[str, bytes], dst: HostPath, *, timeout_ms: int = 0) -> TransferResult:
        """See :meth:`ClientTransfers.download`."""
        return self.client.download(self.id, src, dst, timeout_ms=timeout_ms)

    def upload_archive(
        self, archive: Union[bytes, IO[bytes]], dst: Union[str, bytes], *, timeout_ms: int = 0
    ) -> TransferResult:
        """See :meth:`ClientTransfers.upload_archive`."""
        return self.client.upload_archive(self.id, archive, dst, timeout_ms=timeout_ms)

    def download_archive(
        self, src: Union[str, bytes], out: Optional[IO[bytes]] = None, *, timeout_ms: int = 0
    ) -> Union[bytes, TransferResult]:
        """See :meth:`ClientTransfers.download_archive`."""
        return self.client.download_archive(self.id, src, out, timeout_ms=timeout_ms)


__all__ = ["TransferResult", "ClientTransfers", "SandboxTransfers", "BelayerError"]
