"""The subset of a task's ``environment/Dockerfile`` that a Belayer sandbox can honour.

There is no image builder: a Dockerfile is read as a base image plus a list of build steps that
run as actions in a fresh sandbox of that image when the environment starts.

Honoured: one ``FROM ref [AS name]`` (the first instruction; ``ref`` is mapped to an imported
Belayer image), ``RUN`` (shell form through ``/bin/sh -c``, as Docker does, or exec form),
``WORKDIR``, ``ENV``, ``USER``, and ``COPY``/``ADD`` of files and directories from the build
context (the task's ``environment/`` directory) without flags, wildcards, URLs or archives.
Ignored (they change neither files nor how commands run): ``LABEL``, ``MAINTAINER``,
``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``VOLUME``, ``STOPSIGNAL``, ``HEALTHCHECK``. Anything else
(``ARG``, ``SHELL``, ``ONBUILD``, a second ``FROM``, ``$`` substitution in ``ENV``, ``WORKDIR``,
``USER`` or ``COPY``) raises :class:`UnsupportedDockerfileError` naming the line.
"""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union


class UnsupportedDockerfileError(ValueError):
    """A Dockerfile instruction a Belayer sandbox cannot honour; the message names the line."""


@dataclass(frozen=True)
class Run:
    """A ``RUN`` step: ``command`` for ``/bin/sh -c`` in ``cwd`` with ``env`` as ``user``
    (``None``: root)."""

    command: str
    cwd: str
    env: Dict[str, str]
    user: Optional[str]


@dataclass(frozen=True)
class Copy:
    """A ``COPY``/``ADD`` step: host ``sources`` (inside the build context) to the absolute
    sandbox path ``dest``; ``into_dir``: ``dest`` names a directory that receives them."""

    sources: List[Path]
    dest: str
    into_dir: bool


Step = Union[Run, Copy]


@dataclass
class BuildPlan:
    """What a Dockerfile asks for: the ``FROM`` reference, the build steps in order, and the
    final ``WORKDIR``, ``ENV`` and ``USER`` (the defaults of later commands)."""

    base: str
    steps: List[Step] = field(default_factory=list)
    workdir: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    user: Optional[str] = None


_IGNORED = {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "VOLUME", "STOPSIGNAL",
            "HEALTHCHECK"}
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


def _logical_lines(text: str) -> List[tuple]:
    """(first line number, instruction text) pairs: comments dropped, continuations joined."""
    out: List[tuple] = []
    buf: List[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf.append(line[:-1])
            continue
        buf.append(line)
        out.append((start, " ".join(part.strip() for part in buf).strip()))
        buf = []
    if buf:
        out.append((start, " ".join(buf).strip()))
    return out


def _no_substitution(value: str, where: str) -> str:
    if "$" in value:
        raise UnsupportedDockerfileError(f"{where}: variable substitution is not supported")
    return value


def _env_pairs(args: str, where: str) -> Dict[str, str]:
    words = shlex.split(args)
    if not words:
        raise UnsupportedDockerfileError(f"{where}: ENV needs a name and a value")
    if "=" not in words[0]:
        # The legacy form: ENV NAME value with spaces
        name, _, value = args.partition(" ")
        return {name: _no_substitution(value.strip(), where)}
    pairs = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or not name:
            raise UnsupportedDockerfileError(f"{where}: expected NAME=value, got {word!r}")
        pairs[name] = _no_substitution(value, where)
    return pairs


def _copy_step(keyword: str, args: str, context: Path, cwd: str, where: str) -> Copy:
    if args.startswith("["):
        words = json.loads(args)
    else:
        words = shlex.split(args)
    if any(w.startswith("--") for w in words):
        raise UnsupportedDockerfileError(f"{where}: COPY/ADD flags are not supported")
    if len(words) < 2:
        raise UnsupportedDockerfileError(f"{where}: COPY/ADD needs a source and a destination")
    *sources, dest = [_no_substitution(w, where) for w in words]
    root = context.resolve()
    paths = []
    for src in sources:
        if "://" in src:
            raise UnsupportedDockerfileError(f"{where}: ADD of a URL is not supported")
        if any(ch in src for ch in "*?["):
            raise UnsupportedDockerfileError(f"{where}: wildcards in COPY/ADD are not supported")
        if keyword == "ADD" and src.endswith(_ARCHIVES):
            raise UnsupportedDockerfileError(f"{where}: ADD of an archive is not supported")
        path = (root / src.lstrip("/")).resolve()
        if path != root and root not in path.parents:
            raise UnsupportedDockerfileError(f"{where}: {src!r} is outside the build context")
        if not path.exists():
            raise UnsupportedDockerfileError(f"{where}: {src!r} not found in the build context")
        paths.append(path)
    into_dir = dest.endswith("/") or len(paths) > 1
    dest = posixpath.normpath(posixpath.join(cwd, dest))
    return Copy(sources=paths, dest=dest, into_dir=into_dir)


def parse(text: str, context: Path) -> BuildPlan:
    """Reads Dockerfile ``text`` whose build context is the directory ``context``.

    Raises:
        UnsupportedDockerfileError: an instruction outside the subset described above.
    """
    plan: Optional[BuildPlan] = None
    cwd = "/"
    env: Dict[str, str] = {}
    user: Optional[str] = None
    workdir_set = False
    for number, line in _logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        where = f"Dockerfile line {number} ({keyword})"
        if plan is None:
            if keyword != "FROM":
                raise UnsupportedDockerfileError(f"{where}: the first instruction must be FROM")
            words = args.split()
            if not words or len(words) not in (1, 3) or words[0].startswith("--"):
                raise UnsupportedDockerfileError(f"{where}: expected FROM image [AS name]")
            plan = BuildPlan(base=_no_substitution(words[0], where))
            continue
        if keyword == "FROM":
            raise UnsupportedDockerfileError(f"{where}: multi-stage builds are not supported")
        if keyword == "RUN":
            if args.startswith("--"):
                raise UnsupportedDockerfileError(f"{where}: RUN flags are not supported")
            command = shlex.join(json.loads(args)) if args.startswith("[") else args
            plan.steps.append(Run(command=command, cwd=cwd, env=dict(env), user=user))
        elif keyword == "WORKDIR":
            cwd = posixpath.normpath(posixpath.join(cwd, _no_substitution(args, where)))
            workdir_set = True
            plan.steps.append(Run(command=f"mkdir -p {shlex.quote(cwd)}", cwd="/", env={},
                                  user=None))
        elif keyword == "ENV":
            env.update(_env_pairs(args, where))
        elif keyword == "USER":
            name = _no_substitution(args, where)
            user = None if name in ("root", "0", "0:0") else name
        elif keyword in ("COPY", "ADD"):
            plan.steps.append(_copy_step(keyword, args, context, cwd, where))
        elif keyword in _IGNORED:
            continue
        else:
            raise UnsupportedDockerfileError(f"{where}: {keyword} is not supported")
    if plan is None:
        raise UnsupportedDockerfileError("Dockerfile has no FROM instruction")
    plan.workdir = cwd if workdir_set else None
    plan.env = env
    plan.user = user
    return plan
