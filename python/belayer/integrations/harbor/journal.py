"""The actions of a Harbor environment since its ready checkpoint, for replay after a restore.

Every operation that may change the sandbox (an exec, an upload, a build step) gets the next
action boundary k and stays in the :class:`Journal` until a checkpoint C_k (or a later one)
is published. After a fault the environment restores the ready checkpoint C_j and replays the
journal's operations with k > j in order: the interrupted operation runs again from the
restored state, and so do the ones before it that no checkpoint covered yet.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union


@dataclass
class ExecOp:
    """A command as the sandbox's ``/bin/sh -c`` runs it (already wrapped for shell and user),
    with its working directory, environment and timeout (ms, 0: none)."""

    index: int
    command: str
    cwd: Optional[str]
    env: Optional[Dict[str, str]]
    timeout_ms: int
    #: What Harbor asked for, for the record.
    label: str = ""

    def describe(self) -> str:
        return f"exec {self.label[:200]!r}"

    def discard(self) -> None:
        """Nothing to release."""


@dataclass
class UploadOp:
    """A host file or directory copied into the sandbox (``docker cp`` semantics: ``src``
    ending in ``/.`` copies a directory's contents). ``staged`` holds a private copy of the
    source once :meth:`stage` ran, so a replay does not depend on the caller's files."""

    index: int
    src: str
    dst: str
    staged: Optional[str] = field(default=None, repr=False)
    _stage_root: Optional[str] = field(default=None, repr=False)

    def describe(self) -> str:
        return f"upload {self.src!r} -> {self.dst!r}"

    def source(self) -> str:
        """The path to copy from: the staged copy when there is one."""
        return self.staged if self.staged is not None else self.src

    def stage(self) -> None:
        """Copies the source aside (symlinks as links) into a private temporary directory."""
        contents = self.src.endswith("/.")
        path = Path(self.src[:-2] if contents else self.src)
        root = tempfile.mkdtemp(prefix="belayer-harbor-stage-")
        copy = os.path.join(root, path.name or "root")
        if path.is_dir() and not path.is_symlink():
            shutil.copytree(path, copy, symlinks=True)
        else:
            shutil.copy2(path, copy, follow_symlinks=False)
        self._stage_root = root
        self.staged = copy + "/." if contents else copy

    def discard(self) -> None:
        """Removes the staged copy."""
        if self._stage_root is not None:
            shutil.rmtree(self._stage_root, ignore_errors=True)
            self._stage_root = self.staged = None


Op = Union[ExecOp, UploadOp]


class Journal:
    """The operations not covered by the ready checkpoint, in boundary order."""

    def __init__(self) -> None:
        self.ops: List[Op] = []
        self.last = 0

    def next_index(self) -> int:
        """Allocates the next action boundary k (1, 2, ...)."""
        self.last += 1
        return self.last

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def covered(self, prefix: int) -> None:
        """Drops (and releases) the operations that checkpoint C_prefix holds."""
        keep = []
        for op in self.ops:
            if op.index <= prefix:
                op.discard()
            else:
                keep.append(op)
        self.ops = keep

    def drop(self, op: Op) -> None:
        """Drops one operation that left the sandbox as it was (nothing to replay)."""
        if op in self.ops:
            self.ops.remove(op)
            op.discard()

    def after(self, prefix: Optional[int]) -> List[Op]:
        """The operations a restore to C_prefix (``None``: the base image) must replay."""
        floor = -1 if prefix is None else prefix
        return [op for op in self.ops if op.index > floor]

    def clear(self) -> None:
        self.covered(self.last)
