"""The ``DIR/.`` forms of ``docker cp`` that Harbor's docker environment uses for directories,
on top of Belayer's ``upload``/``download`` (which place one tree as ``docker cp SRC DST``
does: into an existing directory under its own name, else as ``DST``).

* :func:`upload_contents` is ``docker cp SRC/. main:DST``: what ``SRC`` holds lands in ``DST``,
  created when missing (parents included, as the tar fallback of Harbor's docker environment
  does), merged when it exists (directories merge, files and symlinks are replaced).
* :func:`download_contents` is ``docker cp main:SRC/. DST``: what the sandbox's ``SRC`` holds
  lands in the host directory ``DST`` (created when missing), merged the same way. A ``SRC``
  that is a symlink in the sandbox is followed there, inside the sandbox's root.

The sandbox is hostile. Uploads are extracted by the sandbox's own side of Belayer's
transfer, which resolves ``DST`` inside the sandbox's root and never writes through a
symlink. Downloads are extracted by ``libbelayer`` beneath a fresh private directory inside
``DST`` (symlinks stay links, nothing is written outside it), then moved into ``DST`` with
``rename``: a directory of the download merges only into a real directory of ``DST``
(``lstat``), anything else at a name (a symlink a previous download left, a file) is removed
and replaced, never followed, so no file outside ``DST`` is written, whatever links the
sandbox planted.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import shutil
import stat
import tempfile
from pathlib import Path
from typing import List, Tuple

from belayer.aio import AsyncSandbox

#: Milliseconds the small shell probes of these copies may run in the sandbox.
PROBE_TIMEOUT_MS = 60_000


async def _probe(sb: AsyncSandbox, script: str, what: str) -> str:
    """Runs ``script`` in the sandbox; its stdout, stripped. Raises ``OSError`` naming
    ``what`` when it fails (an infrastructure fault included: the caller tells faults
    apart by the sandbox's state)."""
    r = await sb.exec(script, PROBE_TIMEOUT_MS)
    if r.infra_fault is not None or r.exit_code != 0 or r.timed_out:
        detail = r.stderr.decode("utf-8", "replace").strip()
        fault = f", {r.infra_fault.kind}" if r.infra_fault is not None else ""
        raise OSError(f"{what}: exit {r.exit_code}{fault}: {detail}")
    return r.stdout.decode("utf-8", "replace").strip()


async def upload_contents(sb: AsyncSandbox, src: Path, dst: str) -> None:
    """Copies what host directory ``src`` holds into sandbox directory ``dst`` (see the module
    docs). ``src`` itself is followed when it is a symlink, as ``SRC/.`` is by ``docker cp``.

    Raises:
        NotADirectoryError: ``src`` is not a directory, or ``dst`` exists and is not one.
        OSError: the sandbox could not create ``dst``'s parents.
        belayer.BelayerError: the upload's errors (see :meth:`belayer.Client.upload`).
    """
    src = Path(os.path.realpath(src))
    if not src.is_dir():
        raise NotADirectoryError(f"{src} is not a directory")
    q = shlex.quote(dst)
    parent = shlex.quote(posixpath.dirname(dst.rstrip("/")) or "/")
    kind = await _probe(
        sb,
        f"if [ -d {q} ]; then echo dir; elif [ -e {q} ] || [ -L {q} ]; then echo other; "
        f"else mkdir -p -- {parent} && echo absent; fi",
        f"prepare {dst!r}",
    )
    if kind == "other":
        raise NotADirectoryError(f"{dst!r} exists in the sandbox and is not a directory")
    if kind == "absent":
        # The tree becomes dst: one transfer.
        await sb.upload(str(src), dst)
        return
    into = dst.rstrip("/") + "/"
    for name in sorted(os.listdir(src)):
        await sb.upload(str(src / name), into)


async def download_contents(sb: AsyncSandbox, src: str, dst: Path) -> None:
    """Copies what sandbox directory ``src`` holds into host directory ``dst`` (see the module
    docs).

    Raises:
        NotADirectoryError: ``src`` is not a directory in the sandbox (nor a symlink to one
            there).
        OSError: a host file system error while the download is moved into ``dst``.
        belayer.BelayerError: the download's errors (see :meth:`belayer.Client.download`).
    """
    dst.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".belayer-download-", dir=dst))
    try:
        top = await _download_tree(sb, src, staging)
        _merge(top, dst)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


async def _download_tree(sb: AsyncSandbox, src: str, staging: Path) -> Path:
    """Downloads directory ``src`` into ``staging``; returns the downloaded tree's root."""
    await sb.download(src, str(staging))
    top = staging / posixpath.basename(src.rstrip("/"))
    mode = os.lstat(top).st_mode
    if stat.S_ISDIR(mode):
        return top
    if not stat.S_ISLNK(mode):
        raise NotADirectoryError(f"{src!r} is not a directory in the sandbox")
    # A symlink: follow it inside the sandbox (its own mount namespace and root).
    os.unlink(top)
    q = shlex.quote(src)
    try:
        real = await _probe(sb, f"cd -P -- {q} && pwd -P", f"resolve {src!r}")
    except OSError as e:
        raise NotADirectoryError(f"{src!r} is not a directory in the sandbox: {e}") from e
    if real in ("", "/"):
        raise NotADirectoryError(f"{src!r} resolves to {real!r} in the sandbox")
    await sb.download(real, str(staging))
    top = staging / posixpath.basename(real)
    if not stat.S_ISDIR(os.lstat(top).st_mode):
        raise NotADirectoryError(f"{src!r} changed while it was copied")
    return top


def _is_real_dir(path: Path) -> bool:
    """Whether ``path`` is a directory itself (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _remove(path: Path) -> None:
    """Removes whatever is at ``path`` (a real directory with its contents; a symlink as the
    link); nothing there is fine."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _merge(src: Path, dst: Path) -> None:
    """Moves the children of directory ``src`` into directory ``dst``: directories into real
    directories recursively, everything else by replacing what is at its name. Iterative;
    the download's depth bound bounds the walk."""
    stack: List[Tuple[Path, Path]] = [(src, dst)]
    while stack:
        source, target = stack.pop()
        with os.scandir(source) as entries:
            children = list(entries)
        for entry in children:
            into = target / entry.name
            if entry.is_dir(follow_symlinks=False) and _is_real_dir(into):
                stack.append((Path(entry.path), into))
                continue
            _remove(into)
            os.rename(entry.path, into)
