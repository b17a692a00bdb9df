"""``BelayerEnvironment``: a Harbor environment whose container is a Belayer sandbox.

Harbor selects it by import path, ``--env belayer.integrations.harbor:BelayerEnvironment``
(Harbor's ``EnvironmentType`` is a closed enum; import paths are its mechanism for
environments outside its tree, and :meth:`BelayerEnvironment.type` reports ``"belayer"``).

Every operation that may change the sandbox (exec, upload, Dockerfile build step) is an action
with boundary k = 1, 2, ...; after each one the environment checkpoints C_k (``checkpoint``
option). When an action reports an infrastructure fault (its processes killed from the host,
the OOM killer, the sandbox init gone) or finds the sandbox failed, the environment restores
the ready checkpoint and re-runs, from that state, every action after it, the interrupted one
last; Harbor sees only the re-run's result. See :mod:`.journal`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import belayer
from harbor.environments.base import BaseEnvironment, ExecResult, SandboxBuildFailedError
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from pydantic import Field

from . import dockerfile
from .backend import SandboxBackend
from .journal import ExecOp, Journal, Op, UploadOp

DEFAULT_SOCKET = "/run/belayer/belayer.sock"


class BelayerOptions(EnvironmentOptions):
    """The environment's kwargs (``--ek NAME=VALUE`` on Harbor's command line)."""

    socket: Optional[str] = Field(
        default=None,
        description="belayerd's socket (default: $BELAYER_SOCKET, else "
        "/run/belayer/belayer.sock).",
    )
    image: str = Field(
        default="python",
        description="Belayer image that stands for the task's Dockerfile FROM or docker_image "
        "when `images` does not name one.",
    )
    images: Dict[str, str] = Field(
        default_factory=dict,
        description="Docker image reference -> Belayer image name.",
    )
    image_source: Optional[str] = Field(
        default=None,
        description="Rootfs directory or tar archive imported as the chosen image when the "
        "daemon has none of that name.",
    )
    checkpoint: Literal["always", "adaptive", "never"] = Field(
        default="always",
        description="always: checkpoint after every action that changed the sandbox; "
        "adaptive: Belayer's policy decides (maybe_checkpoint); never: only replay from the "
        "base image.",
    )
    failure_p: Optional[float] = Field(
        default=None, ge=0.0, le=1.0,
        description="Failure probability per action for the adaptive policy.",
    )
    pids_max: Optional[int] = Field(
        default=None, ge=1,
        description="Most processes and threads of the sandbox at once (Harbor's task "
        "config has no such limit; default: the daemon's).",
    )
    max_restores: int = Field(
        default=3, ge=0, description="Restores tried for one operation before giving up."
    )
    keep_sandbox: bool = Field(
        default=False, description="Leave the sandbox (and its checkpoints) after stop()."
    )


class _Fault(Exception):
    """An infrastructure fault hit an operation: restore and replay."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class BelayerEnvironment(BaseEnvironment):
    """A Harbor environment backed by one Belayer sandbox (see the module docs).

    The sandbox's image: the task's ``docker_image`` (when Harbor would use the prebuilt
    image) or its Dockerfile's ``FROM`` reference, mapped through the ``images`` option, else
    the ``image`` option (default ``python``). A Dockerfile is honoured as far as
    :mod:`.dockerfile` describes (its ``RUN``/``COPY`` steps run as actions at start); compose
    files, host bind mounts and GPUs are refused.

    Commands run as Docker's do: ``bash -c COMMAND`` when the image has bash (else
    ``/bin/sh -c``), in ``cwd`` or the task's ``workdir`` or the Dockerfile's ``WORKDIR``, with
    the persistent, Dockerfile and per-call environment; a non-root ``user`` through
    ``runuser -u NAME`` (numeric: ``setpriv`` with that uid as uid and gid). Operations on one
    environment run one at a time, so each is one action boundary.
    """

    options_model = BelayerOptions
    options: BelayerOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._plan: Optional[dockerfile.BuildPlan] = None
        super().__init__(*args, **kwargs)
        if self._host_mounts:
            raise ValueError(
                "Belayer sandboxes cannot bind host paths: drop the environment mounts "
                "(Harbor copies logs out of the sandbox instead)"
            )
        socket = self.options.socket or os.environ.get("BELAYER_SOCKET") or DEFAULT_SOCKET
        self._backend = SandboxBackend(socket)
        self._journal = Journal()
        self._lock = asyncio.Lock()
        self._bash = False
        self._image_user: Optional[str] = None
        self._image_env: Dict[str, str] = {}
        self._image_workdir: Optional[str] = None
        self._policy_sent = False
        #: Boundary k of the ready checkpoint (``None``: none yet, a restore restarts the image).
        self._ready: Optional[int] = None
        self._record: Dict[str, Any] = {
            "sandbox": None, "image": None, "socket": socket,
            "checkpoint_policy": self.options.checkpoint,
            "actions": 0, "checkpoints": 0, "recoveries": [],
        }

    @staticmethod
    def type() -> str:
        return "belayer"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        # The sandbox's network namespace is its own with only `lo` (never internet access),
        # it mounts nothing from the host and has no GPUs.
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        """The task's ``cpus`` (fractions too) and ``memory_mb`` are hard ceilings of the
        sandbox's cgroup (``cpu.max``, ``memory.max``), as with Harbor's docker environment;
        there are no reservations. ``storage_mb`` caps the sandbox's upper layer."""
        return EnvironmentResourceCapabilities(
            cpu_limit=True, memory_limit=True, fractional_cpus=True
        )

    def _limits(self) -> Dict[str, Any]:
        """The task's resources (after Harbor's overrides and enforcement modes) as
        ``create_sandbox`` limits: ``cpus``, ``memory_mb`` -> ``memory_max`` and
        ``storage_mb`` -> ``disk_max`` (MiB, as Docker's ``M``), and the ``pids_max`` option."""
        limits: Dict[str, Any] = {}
        if (cpus := self._effective_cpus) is not None:
            limits["cpus"] = float(cpus)
        if (memory_mb := self._effective_memory_mb) is not None:
            limits["memory_max"] = int(memory_mb) << 20
        if (storage_mb := self._effective_storage_mb) is not None:
            limits["disk_max"] = int(storage_mb) << 20
        if self.options.pids_max is not None:
            limits["pids_max"] = self.options.pids_max
        return limits

    @classmethod
    def preflight(cls, kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Validates the options and checks that libbelayer loads and belayerd answers."""
        super().preflight(kwargs)
        options = BelayerOptions.model_validate(kwargs or {})
        socket = options.socket or os.environ.get("BELAYER_SOCKET") or DEFAULT_SOCKET
        try:
            with belayer.Client(socket) as client:
                client.ping()
        except belayer.BelayerError as e:
            raise SystemExit(f"Belayer environment: belayerd at {socket} unusable: {e}")

    def _validate_definition(self) -> None:
        if (self.environment_dir / COMPOSE_FILE_NAME).exists():
            raise SandboxBuildFailedError(
                f"{COMPOSE_FILE_NAME}: a Belayer sandbox is one container; compose is unsupported"
            )
        require_agent_environment_definition(
            self.environment_dir, docker_image=self.task_env_config.docker_image
        )
        path = self.environment_dir / DOCKERFILE_NAME
        if path.exists():
            try:
                self._plan = dockerfile.parse(path.read_text(), self.environment_dir)
            except dockerfile.UnsupportedDockerfileError as e:
                raise SandboxBuildFailedError(f"{path}: {e}") from e

    # ----------------------------------------------------------------- lifecycle

    def _image_name(self, ref: str) -> str:
        return self.options.images.get(ref, self.options.image)

    async def start(self, force_build: bool) -> None:
        prebuilt = should_use_prebuilt_docker_image(
            self.environment_dir, docker_image=self.task_env_config.docker_image,
            force_build=force_build,
        )
        plan = None if prebuilt else self._plan
        ref = self.task_env_config.docker_image if plan is None else plan.base
        image = self._image_name(ref or "")
        self._record["image"] = image
        self._record["from"] = ref
        await self._backend.connect()
        if self.options.image_source:
            await self._backend.import_image(image, self.options.image_source)
        limits = self._limits()
        self._record["limits"] = limits
        try:
            sandbox = await self._backend.create(image, limits)
        except (belayer.UnknownImageError, belayer.NotFoundError) as e:
            raise SandboxBuildFailedError(
                f"no Belayer image {image!r} for {ref!r}: import one (`belayer image import "
                f"{image} ROOTFS`), pass --ek image_source=ROOTFS, or map it with --ek "
                f"images='{{\"{ref}\": \"NAME\"}}' ({e})"
            ) from e
        self._record["sandbox"] = sandbox
        self.logger.debug(f"Belayer sandbox {sandbox} from image {image} (for {ref})")
        probe = await self._backend.exec("command -v bash")
        self._bash = probe.exit_code == 0
        if plan is not None:
            await self._build(plan)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def _build(self, plan: dockerfile.BuildPlan) -> None:
        for step in plan.steps:
            if isinstance(step, dockerfile.Copy):
                # As Docker's COPY: a directory's contents go into the destination, files
                # into it when it names a directory (created), else to it.
                if step.into_dir:
                    await self.exec(f"mkdir -p {shlex.quote(step.dest)}", user="root")
                for src in step.sources:
                    if src.is_dir():
                        await self._upload(str(src), step.dest, contents=True)
                    else:
                        into = step.dest + "/" if step.into_dir else step.dest
                        await self._upload(str(src), into)
                continue
            result = await self._exec_op(
                step.command, step.cwd, step.env or None, 0, step.user, shell=False
            )
            if result.return_code != 0:
                raise SandboxBuildFailedError(
                    f"RUN {step.command!r} exited with {result.return_code}: "
                    f"{(result.stderr or result.stdout or '').strip()[-2000:]}"
                )
        self._image_env = dict(plan.env)
        self._image_user = plan.user
        self._image_workdir = plan.workdir

    async def stop(self, delete: bool) -> None:
        try:
            self._write_record()
            if self.options.keep_sandbox:
                self.logger.info(f"Belayer sandbox {self._backend.id} kept (keep_sandbox)")
            else:
                try:
                    await self._backend.destroy()
                except belayer.BelayerError as e:
                    self.logger.warning(f"Belayer sandbox destroy failed: {e}")
        finally:
            self._journal.clear()
            await self._backend.close()

    def _write_record(self) -> None:
        """Writes what the environment did (checkpoints, recoveries) to
        ``TRIAL_DIR/belayer.json``."""
        try:
            path = self.trial_paths.trial_dir / "belayer.json"
            path.write_text(json.dumps(self._record, indent=2) + "\n")
        except OSError as e:
            self.logger.warning(f"cannot write the Belayer record: {e}")

    # ----------------------------------------------------------------- exec

    def _wrap(self, command: str, user: Any, shell: bool) -> str:
        argv: List[str] = []
        if user not in (None, "root", 0, "0"):
            if isinstance(user, int) or str(user).isdigit():
                argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]
            else:
                argv = ["runuser", "-u", str(user), "--"]
        if shell and self._bash:
            argv += ["bash", "-c", command]
        elif argv:
            argv += ["/bin/sh", "-c", command]
        else:
            return command
        return "exec " + shlex.join(argv)

    async def exec(
        self,
        command: str,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout_sec: Optional[int] = None,
        user: Optional[Any] = None,
    ) -> ExecResult:
        merged = {**self._image_env, **(self._merge_env(env) or {})}
        user = self._resolve_user(user)
        if user is None:
            user = self._image_user
        cwd = cwd or self.task_env_config.workdir or self._image_workdir
        timeout_ms = int(timeout_sec * 1000) if timeout_sec else 0
        result = await self._exec_op(command, cwd, merged or None, timeout_ms, user, shell=True)
        return result

    async def _exec_op(
        self, command: str, cwd: Optional[str], env: Optional[Dict[str, str]],
        timeout_ms: int, user: Any, *, shell: bool,
    ) -> ExecResult:
        async with self._lock:
            op = ExecOp(self._journal.next_index(), self._wrap(command, user, shell), cwd, env,
                        timeout_ms, label=command)
            raw = await self._perform(op)
        if raw.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_ms / 1000:g} seconds")
        return ExecResult(
            stdout=raw.stdout.decode("utf-8", "replace") or None,
            stderr=raw.stderr.decode("utf-8", "replace") or None,
            return_code=raw.exit_code,
        )

    # ----------------------------------------------------------------- actions and recovery

    async def _fault_or_raise(self, error: BaseException) -> None:
        """Raises :class:`_Fault` when the sandbox failed under ``error``, else ``error``."""
        try:
            state = await self._backend.state()
        except belayer.BelayerError:
            raise error
        if state == "failed":
            raise _Fault("sandbox_failed", str(error)) from error
        raise error

    async def _run(self, op: Op) -> Any:
        """Runs ``op`` once; raises :class:`_Fault` on an infrastructure fault."""
        try:
            if isinstance(op, ExecOp):
                result = await self._backend.exec(
                    op.command, timeout_ms=op.timeout_ms, cwd=op.cwd, env=op.env
                )
                if result.infra_fault is not None:
                    raise _Fault(result.infra_fault.kind, f"pid {result.infra_fault.pid}")
                return result
            if op.contents:
                await self._backend.upload_contents(op.source(), op.dst)
            else:
                await self._backend.upload(op.source(), op.dst)
            return None
        except _Fault:
            raise
        except (belayer.BelayerError, OSError) as e:
            await self._fault_or_raise(e)

    async def _perform(self, op: Op) -> Any:
        """Runs action ``op`` at its boundary k, recovering from faults, then checkpoints."""
        self._journal.add(op)
        self._record["actions"] += 1
        try:
            result = await self._run(op)
        except _Fault as fault:
            result = await self._recover(f"action {op.index} ({op.describe()})", fault)
        if isinstance(op, ExecOp) and result.dirty is False:
            # The sandbox is as it was before: nothing to checkpoint or replay.
            self._journal.drop(op)
            return result
        await self._checkpoint(op, getattr(result, "duration_ms", 0.0) / 1000.0)
        return result

    async def _recover(self, what: str, fault: _Fault) -> Any:
        """Restores the ready checkpoint and replays the journal's actions after it; returns
        the last one's result (``None`` when there was none to replay). ``what`` names the
        interrupted operation. Raises ``RuntimeError`` after ``max_restores`` failed tries or
        when the restored checkpoint is older than the journal."""
        for attempt in range(1, self.options.max_restores + 1):
            self.logger.warning(f"Belayer: {fault.kind} during {what}; restoring (try {attempt})")
            started = time.monotonic()
            info = await self._backend.restore()
            restored = -1 if info.prefix is None else info.prefix
            if restored < (-1 if self._ready is None else self._ready):
                raise RuntimeError(
                    f"Belayer: restored checkpoint k={info.prefix} is older than the ready "
                    f"one k={self._ready}; the actions between are lost"
                )
            replay = self._journal.after(info.prefix)
            self._journal.covered(restored)
            self._ready = info.prefix
            entry = {
                "operation": what, "fault": fault.kind, "restored_prefix": info.prefix,
                "replayed": [o.index for o in replay], "restore_ms": round(info.total_ms, 1),
                "verified": info.verified, "fs_matches": info.fs_matches,
                "processes_match": info.processes_match,
            }
            self._record["recoveries"].append(entry)
            try:
                result = None
                for replayed in replay:
                    result = await self._run(replayed)
            except _Fault as again:
                entry["replay_fault"] = again.kind
                fault = again
                continue
            entry["recovered_ms"] = round((time.monotonic() - started) * 1000, 1)
            self._write_record()
            return result
        self._write_record()
        raise RuntimeError(
            f"Belayer: {what} still failing after {self.options.max_restores} restores "
            f"({fault.kind})"
        )

    def _context(self, op: Op) -> bytes:
        return json.dumps({"action": op.index, "operation": op.describe()}).encode()

    async def _checkpoint(self, op: Op, duration_s: float) -> None:
        """Takes C_k after ``op`` as the ``checkpoint`` option says. When the sandbox fails
        meanwhile, recovers and tries again; a checkpoint that fails on a running sandbox is
        logged and skipped (the previous one stays ready, the journal keeps ``op``)."""
        mode = self.options.checkpoint
        if mode == "never":
            return
        for _ in range(self.options.max_restores + 1):
            try:
                if mode == "always":
                    await self._backend.checkpoint(op.index, self._context(op))
                    published = True
                else:
                    policy = None
                    if not self._policy_sent:
                        policy = belayer.Policy("adaptive", failure_p=self.options.failure_p)
                    decision = await self._backend.maybe_checkpoint(
                        op.index, self._context(op), duration_s, policy
                    )
                    self._policy_sent = True
                    published = decision.checkpointed
                if published:
                    self._record["checkpoints"] += 1
                    self._ready = op.index
                    self._journal.covered(op.index)
                return
            except belayer.BelayerError as e:
                try:
                    await self._fault_or_raise(e)
                except _Fault as fault:
                    await self._recover(f"checkpoint {op.index}", fault)
                    if op not in self._journal.ops:
                        return  # the restored checkpoint holds op already
                    continue
                except belayer.BelayerError as other:
                    self.logger.warning(f"Belayer: checkpoint {op.index} skipped: {other}")
                    return
        raise RuntimeError(f"Belayer: checkpoint after action {op.index} kept failing")

    # ----------------------------------------------------------------- files

    async def _upload(self, src: str, dst: str, *, contents: bool = False) -> None:
        async with self._lock:
            op = UploadOp(self._journal.next_index(), src, dst, contents)
            if self.options.checkpoint != "always":
                op.stage()
            await self._perform(op)

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        await self._upload(str(source_path), target_path)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """What ``source_dir`` holds into ``target_dir`` (created, or merged into), as
        Harbor's docker environment does (``docker cp SRC/. main:DST``)."""
        await self._upload(str(source_dir), target_dir, contents=True)

    async def _download(self, src: str, dst: Path | str, *, contents: bool = False) -> None:
        async with self._lock:
            for _ in range(self.options.max_restores + 1):
                try:
                    if contents:
                        await self._backend.download_contents(src, dst)
                    else:
                        await self._backend.download(src, dst)
                    return
                except (belayer.BelayerError, OSError) as e:
                    try:
                        await self._fault_or_raise(e)
                    except _Fault as fault:
                        await self._recover(f"download {src!r}", fault)
            raise RuntimeError(f"Belayer: download of {src!r} kept failing")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        await self._download(source_path, target_path)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """What ``source_dir`` holds into the host directory ``target_dir`` (created, or
        merged into), as Harbor's docker environment does (``docker cp main:SRC/. DST``);
        symlinks stay links and nothing is written outside ``target_dir`` (see
        :mod:`.dircopy`)."""
        await self._download(source_dir, target_dir, contents=True)
