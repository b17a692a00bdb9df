"""File transfer through actions, for daemons whose client has no ``upload``/``download``:
a tar stream on the action's stdin (at most the daemon's stdin bound, 1 MiB by default) or its
stdout, unpacked by the sandbox's own ``tar``. Only the ``docker cp`` cases the Harbor
environment uses are covered: a file or a directory to a path, and ``DIR/.`` (contents).

Archives read from the sandbox are extracted on the host with :func:`tarfile.data_filter`
(no absolute paths, no ``..``, no links leaving the destination, no device nodes)."""

from __future__ import annotations

import io
import os
import posixpath
import shlex
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

#: Bytes of one download's tar stream kept from the action's stdout.
DOWNLOAD_LIMIT = 256 << 20


def _reset_owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _pack(src: str, contents: bool) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if contents:
            for child in sorted(os.listdir(src)):
                tar.add(os.path.join(src, child), arcname=child, filter=_reset_owner)
        else:
            tar.add(src, arcname=os.path.basename(src.rstrip("/")), filter=_reset_owner)
    return buf.getvalue()


async def _run(backend: Any, command: str, **kwargs: Any) -> bytes:
    result = await backend.exec(command, **kwargs)
    if result.infra_fault is not None or result.exit_code != 0:
        raise OSError(
            f"transfer action failed (exit {result.exit_code}, fault {result.infra_fault}): "
            f"{result.stderr.decode('utf-8', 'replace').strip()}"
        )
    if result.truncated:
        raise OSError(f"transfer archive exceeds {DOWNLOAD_LIMIT} bytes")
    return result.stdout


async def upload(backend: Any, src: str, dst: str) -> None:
    """Host ``src`` (``DIR/.``: the directory's contents) to sandbox path ``dst``."""
    contents = src.endswith("/.")
    src = src[:-2] if contents else src
    data = _pack(src, contents)
    q = shlex.quote(dst)
    if contents:
        command = f"mkdir -p {q} && tar -xf - -C {q}"
    else:
        name = shlex.quote(os.path.basename(src.rstrip("/")))
        # Into an existing directory under the source's name, else under dst's own name.
        command = (
            f"if [ -d {q} ]; then tar -xf - -C {q}; else "
            f"t=$(mktemp -d {shlex.quote(posixpath.dirname(dst) or '/')}/.belayer-cp.XXXXXX) && "
            f"tar -xf - -C \"$t\" && mv -f \"$t\"/{name} {q} && rmdir \"$t\"; fi"
        )
    await _run(backend, command, stdin=data)


async def download(backend: Any, src: str, dst: str) -> None:
    """Sandbox ``src`` (``DIR/.``: the directory's contents) to host path ``dst``."""
    contents = src.endswith("/.")
    src = src[:-2] if contents else src
    if contents:
        command = f"tar -cf - -C {shlex.quote(src)} ."
    else:
        parent, name = posixpath.split(src.rstrip("/"))
        command = f"tar -cf - -C {shlex.quote(parent or '/')} {shlex.quote(name)}"
    data = await _run(backend, command, output_limit=DOWNLOAD_LIMIT)
    target = Path(dst)
    with tempfile.TemporaryDirectory(prefix="belayer-cp-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(tmp, filter=lambda m, p: None if m.isdev() else
                           tarfile.data_filter(m, p))
        if contents:
            target.mkdir(parents=True, exist_ok=True)
            for child in os.listdir(tmp):
                _move(Path(tmp) / child, target / child)
        else:
            name = posixpath.basename(src.rstrip("/"))
            dest = target / name if target.is_dir() else target
            _move(Path(tmp) / name, dest)


def _move(src: Path, dst: Path) -> None:
    """Moves ``src`` onto ``dst``, merging directories and replacing files."""
    if src.is_dir() and not src.is_symlink() and dst.is_dir() and not dst.is_symlink():
        for child in os.listdir(src):
            _move(src / child, dst / child)
        return
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)
    elif dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.move(str(src), str(dst))
