"""File transfer through the Python API against a real daemon: ``upload``/``download`` of
files and directories (``str`` and ``pathlib`` paths), tar archives as bytes and file objects,
hostile archives and sandbox trees that never touch a canary on the host, and typed errors."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

import belayer


@pytest.fixture()
def canary(tmp_path: Path) -> Path:
    d = tmp_path / "canary-dir"
    d.mkdir()
    (d / "canary").write_text("untouched")
    return d


def assert_untouched(canary: Path) -> None:
    assert sorted(p.name for p in canary.iterdir()) == ["canary"]
    assert not (canary / "canary").is_symlink()
    assert (canary / "canary").read_text() == "untouched"


def tar_bytes(*members: tarfile.TarInfo, data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for m in members:
            tf.addfile(m, io.BytesIO(data) if m.isreg() else None)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", size: int = 0) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.size = kind, link, size
    return m


def test_upload_and_download_round_trip(client: belayer.Client, tmp_path: Path) -> None:
    src = tmp_path / "proj"
    (src / "tests").mkdir(parents=True)
    (src / "tests" / "test_x.py").write_text("assert 1\n")
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    os.symlink("tests/test_x.py", src / "link")
    with client.create_sandbox("busybox") as sb:
        r = sb.upload(src, "/root")
        assert isinstance(r, belayer.TransferResult)
        assert (r.files, r.bytes) == (5, 9 + (3 << 20))
        assert sb.exec("cat /root/proj/tests/test_x.py").stdout == b"assert 1\n"
        assert sb.exec("readlink /root/proj/link").stdout == b"tests/test_x.py\n"
        # str paths and a new name; the Client form.
        client.upload(sb.id, str(src / "tests" / "test_x.py"), "/root/renamed.py")
        assert sb.exec("cat /root/renamed.py").stdout == b"assert 1\n"

        out = tmp_path / "out"
        r = sb.download("/root/proj", out)
        assert (out / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
        assert os.readlink(out / "link") == "tests/test_x.py"
        client.download(sb.id, "/root/renamed.py", str(tmp_path / "one.py"))
        assert (tmp_path / "one.py").read_text() == "assert 1\n"

        # Archives: bytes in, bytes out, and file objects both ways.
        sb.exec("mkdir /root/arc")
        sb.upload_archive(tar_bytes(member("a/b.txt", size=3), data=b"abc"), "/root/arc")
        assert sb.exec("cat /root/arc/a/b.txt").stdout == b"abc"
        data = sb.download_archive("/root/arc/a")
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            assert sorted(tf.getnames()) == ["a", "a/b.txt"]
        buf = io.BytesIO()
        assert sb.download_archive("/root/arc/a", buf).files == 2
        assert buf.getvalue()[:512] == data[:512]
        path = tmp_path / "arc.tar"
        with open(path, "wb") as f:
            r = sb.download_archive("/root/arc", f)
            assert r.files == 3
        with open(path, "rb") as f:
            sb.exec("mkdir /root/again")
            sb.upload_archive(f, "/root/again")
        assert sb.exec("cat /root/again/arc/a/b.txt").stdout == b"abc"
        assert client.ping()


def test_hostile_archives_and_trees_never_touch_the_host(
    client: belayer.Client, tmp_path: Path, canary: Path
) -> None:
    with client.create_sandbox("busybox") as sb:
        sb.exec("mkdir /root/t")
        cases = [
            tar_bytes(member("a", tarfile.SYMTYPE, str(canary)),
                      member("a/canary", size=5), data=b"pwned"),
            tar_bytes(member(f"../../../../../..{canary}/canary", size=5), data=b"pwned"),
            tar_bytes(member(f"{canary}/canary", size=5), data=b"pwned"),
            tar_bytes(member("h", tarfile.LNKTYPE, f"{canary}/canary")),
            tar_bytes(member("dev", tarfile.CHRTYPE)),
        ]
        for tar in cases:
            with pytest.raises(belayer.TransferFailedError):
                sb.upload_archive(tar, "/root/t")
        assert_untouched(canary)

        # A sandbox tree of links at the host canary, downloaded twice: the second time the
        # links became a file and a directory, which replace the host links.
        sb.exec(f"mkdir /root/d && ln -s {canary}/canary /root/d/f && ln -s {canary} /root/d/dir")
        out = tmp_path / "out"
        out.mkdir()
        sb.download("/root/d", out)
        assert os.readlink(out / "d" / "f") == f"{canary}/canary"
        sb.exec("rm /root/d/f /root/d/dir && echo pwned > /root/d/f && mkdir /root/d/dir && "
                "echo pwned > /root/d/dir/canary")
        sb.download("/root/d", out)
        assert (out / "d" / "f").read_text() == "pwned\n"
        assert not (out / "d" / "dir").is_symlink()
        assert_untouched(canary)

        # A destination that is a sandbox symlink at the host path: replaced inside.
        sb.exec(f"ln -s {canary} /root/link")
        (tmp_path / "f").write_text("mine")
        sb.upload(tmp_path / "f", "/root/link")
        assert sb.exec("cat /root/link").stdout == b"mine"
        assert_untouched(canary)


def test_errors_are_typed(client: belayer.Client, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with client.create_sandbox("busybox") as sb:
        with pytest.raises(belayer.NotFoundError):
            sb.upload(tmp_path / "missing", "/root")
        with pytest.raises(belayer.NotFoundError):
            sb.upload(tmp_path / "f", "/no/such/dir/f")
        with pytest.raises(belayer.NotFoundError):
            sb.download("/root/missing", tmp_path / "x")
        with pytest.raises(belayer.BadRequestError):
            sb.upload(tmp_path / "f", "relative/path")
        with pytest.raises(ValueError):
            sb.upload(tmp_path / "f", "/root/a\0b")
        with pytest.raises(ValueError):
            sb.upload(tmp_path / "f", "/root", timeout_ms=-1)
        with pytest.raises(belayer.UnknownSandboxError):
            client.upload("no-such-sandbox", tmp_path / "f", "/root")
        assert issubclass(belayer.TransferTimedOutError, TimeoutError)
        # The connection is still usable.
        sb.upload(tmp_path / "f", "/root/f")
        assert sb.exec("cat /root/f").stdout == b"x"
