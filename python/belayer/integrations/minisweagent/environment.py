"""The mini-swe-agent environment backed by one Belayer sandbox: :class:`BelayerEnvironment`.

It keeps the contract of mini-swe-agent's ``DockerEnvironment`` (``execute(action, cwd,
timeout=)`` returning ``output``/``returncode``/``exception_info`` and, after an error,
``extra``), so prompts and observation templates written for docker work unchanged, and adds
the full checkpoint C_k at action boundary k with the LLM context L_k and the restore after a
fail-stop. An infrastructure failure of the sandbox is never shown to the model: it raises
:class:`SandboxFailure`, which :class:`~belayer.integrations.minisweagent.BelayerAgent`
answers with a restore.
"""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
from typing import Any, Dict, List, Optional, Tuple

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

import belayer

#: The first output line by which a command submits (mini-swe-agent's finishing protocol).
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

#: The configuration's sandbox limits, keyword arguments of ``Client.create_sandbox``.
LIMIT_FIELDS = ("memory_max", "pids_max", "cpus", "disk_max")


class SandboxFailure(Exception):
    """The sandbox failed under an action or between actions (a host-side kill, the OOM
    killer, a lost init): the state is gone, the output is not the task's behaviour. Restore
    with :meth:`BelayerEnvironment.restore`.

    Attributes:
        sandbox: the sandbox id.
        fault: the daemon's verdict for the action, ``None`` when the sandbox was found failed
            outside an action (or by a checkpoint).
    """

    def __init__(self, sandbox: str, fault: Optional[belayer.InfraFault], detail: str) -> None:
        super().__init__(f"sandbox {sandbox} failed: {detail}")
        self.sandbox = sandbox
        self.fault = fault


class BelayerEnvironmentConfig(BaseModel):
    """Settings of :class:`BelayerEnvironment` (the ``environment:`` section of a
    mini-swe-agent config). The first five mean what they mean for ``DockerEnvironment``."""

    image: str
    """Belayer image the sandbox starts from (``belayer image import NAME ROOTFS``)."""
    cwd: str = "/"
    """Working directory of the commands (absolute; created at start when missing, as
    ``docker run -w`` does)."""
    env: Dict[str, str] = {}
    """Environment variables set for every command."""
    forward_env: List[str] = []
    """Host environment variables passed to every command when set on the host; ``env``
    wins a conflict."""
    timeout: int = 30
    """Seconds a command may run before its process group is killed."""
    interpreter: List[str] = []
    """Argument vector the command is appended to, e.g. ``["bash", "-lc"]`` as docker's
    default; empty: the command runs under ``/bin/sh -c``, like ``LocalEnvironment``."""
    socket: Optional[str] = None
    """Socket of ``belayerd``; ``None``: ``/run/belayer/belayer.sock``."""
    tag: Optional[str] = None
    """Free-form tag recorded with the sandbox (``belayer sandbox ls`` shows it)."""
    image_source: Optional[str] = None
    """Rootfs directory or tar archive imported as ``image`` when no image has that name."""
    output_limit: Optional[int] = None
    """Bytes of merged output kept per command; ``None``: the daemon's default."""
    verify_restore: bool = True
    """Verify the restored file system and processes against the checkpoint."""
    memory_max: Optional[int] = None
    """Memory limit of the sandbox (``memory.max``), bytes, at least 1 MiB; ``None``: the
    daemon's default."""
    pids_max: Optional[int] = None
    """Most processes and threads of the sandbox at once; ``None``: the daemon's default."""
    cpus: Optional[float] = None
    """CPU bandwidth limit of the sandbox, in CPUs (e.g. ``1.5``); ``None``: the daemon's
    default."""
    disk_max: Optional[int] = None
    """Bytes the sandbox's upper layer may allocate, at least 1 MiB; ``None``: the daemon's
    default."""


class BelayerEnvironment:
    """Runs the agent's commands in a Belayer sandbox; see :class:`BelayerEnvironmentConfig`
    for the keyword arguments. Selected in a config by its class path,
    ``environment_class: belayer.integrations.minisweagent.BelayerEnvironment``.

    Raises:
        ValueError: a limit out of range (see :meth:`belayer.Client.create_sandbox`).
        belayer.BelayerError: the daemon is unreachable or refuses the sandbox (limits
            below the daemon's minimum: ``BadRequestError``).
    """

    def __init__(
        self,
        *,
        config_class: type = BelayerEnvironmentConfig,
        logger: Optional[logging.Logger] = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.sandbox: Optional[belayer.Sandbox] = None
        self.config = config_class(**kwargs)
        self.client = belayer.Client(self.config.socket)
        if self.config.image_source is not None:
            self.client.import_image(self.config.image, self.config.image_source, exist_ok=True)
        self.sandbox = self.client.create_sandbox(
            self.config.image, self.config.tag, **self._limits()
        )
        self.logger.info(f"Started sandbox {self.sandbox.id} from image {self.config.image}")
        self._prepare()

    def _limits(self) -> Dict[str, Any]:
        """The configured limits that are set (the rest stay the daemon's defaults)."""
        limits = {k: getattr(self.config, k) for k in LIMIT_FIELDS}
        return {k: v for k, v in limits.items() if v is not None}

    def _prepare(self) -> None:
        """Creates the working directory of a fresh sandbox."""
        if self.config.cwd not in ("", "/"):
            self._exec(f"mkdir -p {shlex.quote(self.config.cwd)}", "/", self.config.timeout)

    @property
    def sandbox_id(self) -> str:
        """The id of the sandbox."""
        assert self.sandbox is not None, "sandbox not started"
        return self.sandbox.id

    def command_env(self) -> Dict[str, str]:
        """The variables a command gets on top of the sandbox's own: ``forward_env`` entries
        set on the host, then ``env``."""
        forwarded = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        return {**forwarded, **self.config.env}

    def _exec(self, command: str, cwd: str, timeout: float) -> belayer.ExecResult:
        if self.config.interpreter:
            command = shlex.join([*self.config.interpreter, command])
        try:
            r = self.client.exec(
                self.sandbox_id,
                command,
                max(1, round(timeout * 1000)),
                cwd=cwd,
                env=self.command_env(),
                output_limit=self.config.output_limit,
                merge_stderr=True,
            )
        except (belayer.InvalidStateError, belayer.ExecFailedError) as e:
            if self.failed():
                raise SandboxFailure(self.sandbox_id, None, str(e)) from e
            raise
        if r.infra_fault is not None:
            detail = f"{r.infra_fault.kind} under an action"
            raise SandboxFailure(self.sandbox_id, r.infra_fault, detail)
        return r

    def failed(self) -> bool:
        """Whether the daemon holds the sandbox as failed (a restore is needed)."""
        return self.client.inspect(self.sandbox_id).state == "failed"

    def execute(
        self, action: dict, cwd: str = "", *, timeout: Optional[int] = None
    ) -> Dict[str, Any]:
        """Runs ``action["command"]`` and returns what ``DockerEnvironment.execute`` returns:
        ``{"output", "returncode", "exception_info"}`` with stdout and stderr merged in order,
        or after an error (a timeout: ``TimeoutExpired`` with the output so far; a missing
        ``cwd``; a NUL in the command) ``returncode`` -1, the error in ``exception_info`` and ``extra`` with
        ``exception_type`` and ``exception``.

        Args:
            action: the parsed action; its ``command`` runs.
            cwd: absolute working directory; empty: the configured ``cwd``.
            timeout: seconds; ``None`` or 0: the configured ``timeout``.

        Raises:
            SandboxFailure: an infrastructure failure hit the action or the sandbox is failed.
            minisweagent.exceptions.Submitted: the output starts with the submit marker and
                the command exited with 0.
            belayer.DaemonConnectionError: the daemon is unreachable.
        """
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        timeout = timeout or self.config.timeout
        try:
            if "\0" in command:
                raise ValueError("embedded null byte")  # as subprocess says
            r = self._exec(command, cwd, timeout)
            text = r.stdout.decode("utf-8", errors="replace")
            if r.timed_out:
                raise subprocess.TimeoutExpired(command, timeout, output=text)
            output: Dict[str, Any] = {
                "output": text,
                "returncode": r.exit_code,
                "exception_info": "",
            }
        except (subprocess.TimeoutExpired, belayer.ExecFailedError, ValueError) as e:
            raw = getattr(e, "output", None)
            output = {
                "output": raw if isinstance(raw, str) else "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: Dict[str, Any]) -> None:
        """Raises ``Submitted`` when the output submits, after making sure the sandbox did not
        fail under the submitting command (its state is the final one)."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            if self.failed():
                raise SandboxFailure(self.sandbox_id, None, "failed under the submitting command")
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def checkpoint(self, k: int, context: bytes) -> belayer.CheckpointInfo:
        """Takes the full checkpoint C_k at action boundary ``k`` with the LLM context
        ``context`` (L_k, bytes); it becomes the sandbox's ready checkpoint.

        Raises:
            SandboxFailure: the sandbox is failed (the previous checkpoint stays ready).
            belayer.CheckpointFailedError: the checkpoint failed on a live sandbox.
        """
        try:
            return self.client.checkpoint(self.sandbox_id, k, context)
        except belayer.BelayerError as e:
            if self.failed():
                raise SandboxFailure(self.sandbox_id, None, str(e)) from e
            raise

    def maybe_checkpoint(self, k: int, context: bytes, **step: Any) -> belayer.Decision:
        """Feeds the daemon's checkpoint policy the step that reached boundary ``k``; it takes
        C_k (with ``context``) when the policy says so. ``step``: the keyword arguments of
        :meth:`belayer.Client.maybe_checkpoint` (``step_duration_s`` in seconds, ...).

        Raises:
            SandboxFailure: the sandbox is failed.
        """
        try:
            return self.client.maybe_checkpoint(self.sandbox_id, k, context, **step)
        except belayer.BelayerError as e:
            if self.failed():
                raise SandboxFailure(self.sandbox_id, None, str(e)) from e
            raise

    def restore(self, prefix: Optional[int] = None) -> Tuple[Optional[int], bytes]:
        """Restores the sandbox's ready checkpoint C_k into a fresh instance and returns
        ``(k, L_k)``; ``(None, b"")`` when there was none and the sandbox restarted from its
        image (the working directory is created again).

        Args:
            prefix: restore the checkpoint of this earlier boundary instead (one of
                ``self.sandbox.checkpoints()``), to go back to that step: it becomes the
                ready checkpoint and the later ones stay as a branch. The sandbox need not have
                failed; reload the agent with the returned L_k
                (:func:`~belayer.integrations.minisweagent.load_context`).

        Raises:
            belayer.NotFoundError: no ready checkpoint has ``prefix`` (nothing was touched).
            belayer.RestoreFailedError: the restore failed.
            belayer.CorruptCheckpointError: the verification failed (``verify_restore``).
        """
        info = self.sandbox.restore(verify=self.config.verify_restore, prefix=prefix)
        self.logger.info(f"Restored sandbox {self.sandbox_id} at prefix {info.prefix}")
        if info.prefix is None:
            self._prepare()
        return info.prefix, info.context

    def get_template_vars(self, **kwargs: Any) -> Dict[str, Any]:
        """The configuration and the host's ``platform.uname()`` fields (what
        ``DockerEnvironment`` gives templates), then ``kwargs``."""
        return recursive_merge(self.config.model_dump(), platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict:
        """The configuration and class path, for the trajectory file, plus the sandbox id."""
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                },
                "belayer": {"sandbox": self.sandbox.id if self.sandbox else None},
            }
        }

    def cleanup(self) -> None:
        """Destroys the sandbox with its checkpoints and closes the connection (idempotent)."""
        sandbox, self.sandbox = getattr(self, "sandbox", None), None
        client = getattr(self, "client", None)
        if sandbox is not None:
            try:
                sandbox.destroy()
            except belayer.BelayerError as e:
                self.logger.warning(f"Could not destroy sandbox {sandbox.id}: {e}")
        if client is not None and not getattr(client, "_closed", True):
            client.close()

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
