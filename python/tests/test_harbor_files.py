"""Files through the Belayer Harbor environment: ``upload_dir``/``download_dir`` with the
semantics of Harbor's docker environment (``docker cp SRC/. DST``: created with its parents,
merged into an existing directory) on nested trees with a file over 1 MiB, and a hostile
sandbox planting symlinks to host paths in what ``download_dir`` fetches."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Dict, Iterator

import pytest

pytest.importorskip("harbor.environments.base")

from harbor_support import make_env, start_daemon  # noqa: E402


@pytest.fixture(scope="module")
def harbor_daemon() -> Iterator[object]:
    d = start_daemon()
    yield d
    d.cleanup()


def snapshot(root: Path) -> Dict[str, str]:
    """Every entry below ``root`` (not followed): ``relative path -> "dir" | "link:TARGET" |
    sha256 of the file``."""
    out: Dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "link:" + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def sandbox_snapshot_command(root: str) -> str:
    """A shell command printing ``snapshot``'s entries for sandbox directory ``root``, one
    ``path<TAB>kind`` line each."""
    return (f"cd {root} && find . -mindepth 1 | sort | while read -r p; do "
            "if [ -L \"$p\" ]; then echo \"${p#./}\tlink:$(readlink \"$p\")\"; "
            "elif [ -d \"$p\" ]; then echo \"${p#./}\tdir\"; "
            "else echo \"${p#./}\t$(sha256sum < \"$p\" | cut -d' ' -f1)\"; fi; done")


def test_directories_round_trip_nested_and_large(harbor_daemon, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a" / "b" / "c" / "deep.txt").write_text("deep\n")
    (src / "big.bin").write_bytes(os.urandom((3 << 20) + 123))  # over the old 1 MiB cap
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("a/b")
    more = tmp_path / "more"
    (more / "a").mkdir(parents=True)
    (more / "a" / "other.txt").write_text("other\n")
    (more / "big.bin").write_bytes(os.urandom(2 << 20))
    down = tmp_path / "down"
    (down / "a").mkdir(parents=True)
    (down / "keep.txt").write_text("host file\n")

    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path)
        await env.start(force_build=False)
        try:
            # Absent, parents included: the contents become the directory.
            await env.upload_dir(src, "/data/new/tree")
            r = await env.exec(sandbox_snapshot_command("/data/new/tree"))
            got = dict(line.split("\t") for line in r.stdout.splitlines())
            assert got == snapshot(src), r.stderr
            assert (await env.exec("/data/new/tree/run.sh")).stdout == "ran\n"
            # Existing: merged (directories merge, files replaced, the rest kept).
            await env.upload_dir(more, "/data/new/tree")
            expected = {**snapshot(src), **snapshot(more)}
            r = await env.exec(sandbox_snapshot_command("/data/new/tree"))
            assert dict(line.split("\t") for line in r.stdout.splitlines()) == expected
            # A file over 1 MiB alone, into an existing directory under its own name.
            await env.upload_file(src / "big.bin", "/data/")
            r = await env.exec("sha256sum < /data/big.bin")
            assert r.stdout.split()[0] == snapshot(src)["big.bin"]

            # Back to the host, merged into a directory that holds files of its own.
            await env.download_dir("/data/new/tree", down)
            assert snapshot(down) == {**expected, "keep.txt": snapshot(down)["keep.txt"]}
            assert (down / "keep.txt").read_text() == "host file\n"
            assert os.readlink(down / "link") == "a/b" and os.access(down / "run.sh", os.X_OK)
            assert not [p for p in down.iterdir() if p.name.startswith(".belayer-")]
            # Into a directory that does not exist yet.
            await env.download_dir("/data/new/tree/a", tmp_path / "fresh" / "a")
            assert snapshot(tmp_path / "fresh" / "a") == snapshot(down / "a")
            await env.download_file("/data/big.bin", tmp_path / "files" / "big.bin")
            assert (tmp_path / "files" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
        finally:
            await env.stop(delete=True)

    asyncio.run(main())


def test_download_dir_never_writes_through_planted_symlinks(harbor_daemon, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret.txt").write_text("host secret\n")
    before = snapshot(canary)
    down = tmp_path / "down"

    async def main() -> None:
        env = make_env(harbor_daemon, tmp_path)
        await env.start(force_build=False)
        try:
            # Links to host paths: copied as links, never followed.
            await env.exec(f"mkdir -p /out && ln -s {canary} /out/hostdir && "
                           f"ln -s {canary}/secret.txt /out/secret && echo x > /out/plain")
            await env.download_dir("/out", down)
            assert os.readlink(down / "hostdir") == str(canary)
            assert os.readlink(down / "secret") == f"{canary}/secret.txt"
            # The same names as a directory and a file now: the second download replaces
            # the links the first one left, it does not write through them.
            await env.exec("rm /out/hostdir /out/secret && mkdir /out/hostdir && "
                           "echo pwned > /out/hostdir/secret.txt && echo pwned > /out/hostdir/new"
                           " && echo pwned > /out/secret")
            await env.download_dir("/out", down)
            assert not (down / "hostdir").is_symlink() and not (down / "secret").is_symlink()
            assert (down / "hostdir" / "secret.txt").read_text() == "pwned\n"
            assert (down / "secret").read_text() == "pwned\n"
            # A source directory that is a symlink resolves inside the sandbox: to a sandbox
            # directory, or (a host path the sandbox does not have) to nothing.
            await env.exec(f"ln -s /out /alias && ln -s {canary} /hostalias")
            await env.download_dir("/alias", tmp_path / "alias")
            assert (tmp_path / "alias" / "plain").read_text() == "x\n"
            with pytest.raises(NotADirectoryError):
                await env.download_dir("/hostalias", tmp_path / "hostalias")
            assert not any((tmp_path / "hostalias").iterdir())
        finally:
            await env.stop(delete=True)

    asyncio.run(main())
    assert snapshot(canary) == before
