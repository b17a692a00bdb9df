"""A real ``belayerd`` on a private socket and state dir for the tests.

The daemon binary is the one built next to the loaded ``libbelayer`` (``target/<profile>``),
or ``$BELAYERD``. Needs root, CRIU and the busybox image of ``scripts/setup.sh``
(``$BELAYER_TEST_BUSYBOX_ROOTFS``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

import belayer

REPO = Path(__file__).resolve().parents[2]


BTRFS_SUPER_MAGIC = 0x9123683E


def state_root() -> Path:
    """Where test daemons keep their state: ``$BELAYER_TEST_STATE_ROOT`` (exported by
    ``scripts/setup.sh``), else ``/var/lib/belayer/test-runs``; it must be on the btrfs file
    system set-up mounts, since ``belayerd`` enforces its default disk limit there."""
    root = Path(os.environ.get("BELAYER_TEST_STATE_ROOT", "/var/lib/belayer/test-runs"))
    parent = root.parent
    fs_type = None
    if parent.is_dir():
        out = subprocess.run(["stat", "-f", "-c", "%t", str(parent)], capture_output=True, text=True)
        fs_type = int(out.stdout.strip() or "0", 16) if out.returncode == 0 else None
    if fs_type != BTRFS_SUPER_MAGIC:
        raise RuntimeError(
            f"test state root {root} is not on btrfs, so belayerd cannot enforce disk quotas "
            "there: run `bash scripts/setup.sh` (it mounts a btrfs image at /var/lib/belayer) "
            "and use the BELAYER_TEST_STATE_ROOT it exports"
        )
    root.mkdir(parents=True, exist_ok=True)
    return root


def busybox_rootfs() -> str:
    return os.environ.get(
        "BELAYER_TEST_BUSYBOX_ROOTFS", "/var/cache/belayer/images/busybox/rootfs"
    )


class Daemon:
    """A ``belayerd`` process; :meth:`stop` kills it (sandboxes survive, as in production).
    ``config``: the text of its TOML config file (default: none, all defaults)."""

    def __init__(self, config: Optional[str] = None) -> None:
        lib_dir = Path(belayer.library_path()).parent
        self.bin_dir = Path(os.environ["BELAYERD"]).parent if "BELAYERD" in os.environ else lib_dir
        self.belayerd = Path(os.environ.get("BELAYERD", lib_dir / "belayerd"))
        if not self.belayerd.is_file():
            raise RuntimeError(f"{self.belayerd} not built: cargo build --workspace --bins")
        self.dir = Path(tempfile.mkdtemp(prefix="belayer-py-", dir=state_root()))
        self.socket = str(self.dir / "belayer.sock")
        self.state_dir = self.dir / "state"
        self.log_path = self.dir / "belayerd.log"
        self.config = "/dev/null"
        if config is not None:
            self.config = str(self.dir / "belayer.toml")
            Path(self.config).write_text(config)
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [str(self.belayerd), "--socket", self.socket, "--state-dir", str(self.state_dir),
             "--config", self.config],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            env={**os.environ, "BELAYER_LOG": "debug"},
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with belayer.Client(self.socket) as c:
                    c.ping()
                return
            except belayer.BelayerError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"belayerd did not start:\n{self.log()}")
                time.sleep(0.02)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        """Removes every sandbox (starting the daemon again if needed), then stops it."""
        if self.proc is None:
            try:
                self.start()
            except RuntimeError:
                pass
        cli = self.bin_dir / "belayer"
        if self.proc is not None and cli.is_file():
            out = subprocess.run(
                [str(cli), "--socket", self.socket, "--json", "sandbox", "ls"],
                capture_output=True, text=True,
            )
            try:
                listed = json.loads(out.stdout or "[]")
            except json.JSONDecodeError:
                listed = []
            for sb in listed:
                subprocess.run([str(cli), "--socket", self.socket, "sandbox", "rm", sb["id"]],
                               capture_output=True)
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    """One daemon for the session, with the busybox image imported."""
    d = Daemon()
    with belayer.Client(d.socket) as c:
        c.import_image("busybox", busybox_rootfs(), exist_ok=True)
    yield d
    d.cleanup()


@pytest.fixture()
def own_daemon() -> Iterator[Daemon]:
    """A daemon of the test's own (the test may kill it)."""
    d = Daemon()
    yield d
    d.cleanup()


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[belayer.Client]:
    with belayer.Client(daemon.socket) as c:
        yield c
