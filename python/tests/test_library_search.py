"""Where ``libbelayer`` is looked for: never relative to the current directory or its parents
(a library planted there must not run), and a found library that others could have written is
refused with a typed error before it is loaded.

The planted libraries are real shared objects built with the system ``cc``; their constructor
writes a marker file, so any load of them, however brief, shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest

import belayer
from belayer import _lib

PACKAGE_PARENT = str(Path(belayer.__file__).resolve().parent.parent)

PLANTED_C = r"""
#include <fcntl.h>
#include <unistd.h>

__attribute__((constructor)) static void planted(void) {
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        (void)!write(fd, "loaded\n", 7);
        close(fd);
    }
}

unsigned int belayer_abi_version(void) { return 1; }
"""


def build_planted(dest: Path, marker: Path) -> Path:
    """Builds a fake ``libbelayer.so`` at ``dest`` whose constructor appends to ``marker``."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.fail("the system C compiler `cc` is needed (scripts/setup.sh installs it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    source = dest.parent / "planted.c"
    source.write_text(PLANTED_C)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", f'-DMARKER="{marker}"', "-o", str(dest), str(source)],
        check=True,
    )
    source.unlink()
    dest.chmod(0o755)
    return dest


LOAD_SCRIPT = textwrap.dedent(
    """
    import belayer
    try:
        print("LOADED", belayer.library_path())
    except belayer.BelayerError as e:
        print("ERROR", type(e).__name__, e)
    """
)


def load_in_subprocess(cwd: Path, env: Dict[str, Optional[str]]) -> str:
    """Imports belayer and loads the library in a fresh interpreter with working directory
    ``cwd`` and the environment changed by ``env`` (``None`` removes a variable); returns its
    last output line."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = PACKAGE_PARENT
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    out = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT],
        cwd=cwd,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    return lines[-1]


@pytest.fixture()
def planted(tmp_path: Path):
    """``<tmp>/target/debug`` and ``<tmp>/a/target/release`` hold planted libraries; returns
    ``(tmp, cwd <tmp>/a/b, marker)``."""
    marker = tmp_path / "marker"
    build_planted(tmp_path / "target" / "debug" / "libbelayer.so", marker)
    build_planted(tmp_path / "a" / "target" / "release" / "libbelayer.so", marker)
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    # The planted libraries work: loading one on purpose runs its constructor (and the
    # bindings then refuse it, as it lacks the ABI).
    probe = tmp_path / "probe-marker"
    build_planted(tmp_path / "probe" / "libbelayer.so", probe)
    line = load_in_subprocess(cwd, {"BELAYER_LIB": str(tmp_path / "probe" / "libbelayer.so")})
    assert line.startswith("ERROR LibraryNotFoundError") and "not a libbelayer" in line, line
    assert probe.read_text() == "loaded\n"
    return tmp_path, cwd, marker


def test_libraries_planted_under_the_working_directory_never_load(planted) -> None:
    tmp, cwd, marker = planted
    # As the test suite runs: CARGO_TARGET_DIR names the real build, found first.
    line = load_in_subprocess(cwd, {"BELAYER_LIB": None})
    assert not marker.exists(), f"a planted library ran: {line}"
    if os.environ.get("CARGO_TARGET_DIR"):
        assert line.startswith("LOADED"), line
        assert not line.split(" ", 1)[1].startswith(str(tmp)), line
    # Nothing explicit at all: still never the planted ones (a typed error if nothing else).
    line = load_in_subprocess(cwd, {"BELAYER_LIB": None, "CARGO_TARGET_DIR": None,
                                     "LD_LIBRARY_PATH": None})
    assert not marker.exists(), f"a planted library ran: {line}"
    assert line.startswith("LOADED") or line.startswith("ERROR LibraryNotFoundError"), line
    # A relative CARGO_TARGET_DIR or LD_LIBRARY_PATH (resolved against the working
    # directory) is ignored too.
    line = load_in_subprocess(cwd, {"BELAYER_LIB": None, "CARGO_TARGET_DIR": "../../target",
                                     "LD_LIBRARY_PATH": ":../target/release:"})
    assert not marker.exists(), f"a planted library ran: {line}"


def test_candidates_hold_nothing_relative_to_the_working_directory(planted, monkeypatch) -> None:
    tmp, cwd, _ = planted
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("BELAYER_LIB", raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", ":.:../target/release")
    for path in _lib.candidates():
        assert path.is_absolute(), path
        assert not str(path).startswith(str(tmp)), path


def test_a_group_writable_library_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    lib = build_planted(tmp_path / "lib" / "libbelayer.so", marker)
    lib.chmod(0o775)
    line = load_in_subprocess(tmp_path, {"BELAYER_LIB": str(lib)})
    assert line.startswith("ERROR UntrustedLibraryError"), line
    assert f"refusing to load {lib}" in line and "writable by its group" in line, line
    assert not marker.exists()
    # The same through the directory form of BELAYER_LIB, and in-process.
    line = load_in_subprocess(tmp_path, {"BELAYER_LIB": str(lib.parent)})
    assert line.startswith("ERROR UntrustedLibraryError"), line
    with pytest.raises(belayer.UntrustedLibraryError) as e:
        _lib.check_trusted(lib)
    assert e.value.path == str(lib) and isinstance(e.value, PermissionError)
    assert not marker.exists()


def test_a_library_of_another_user_or_in_a_writable_directory_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    lib = build_planted(tmp_path / "lib" / "libbelayer.so", marker)
    if os.geteuid() == 0:
        os.chown(lib, 65534, 65534)
        line = load_in_subprocess(tmp_path, {"BELAYER_LIB": str(lib)})
        assert line.startswith("ERROR UntrustedLibraryError"), line
        assert "owned by uid 65534" in line, line
        os.chown(lib, 0, 0)
    # A library of ours in a directory others may write to (they could swap it).
    (tmp_path / "lib").chmod(0o777)
    line = load_in_subprocess(tmp_path, {"BELAYER_LIB": str(lib)})
    assert line.startswith("ERROR UntrustedLibraryError"), line
    assert f"directory {tmp_path / 'lib'} is writable by its group and others" in line, line
    assert not marker.exists()


def test_the_real_library_was_found_and_checked() -> None:
    path = Path(belayer.library_path())
    assert path.is_absolute() and path.name == "libbelayer.so"
    _lib.check_trusted(path)
    assert belayer.abi_version() == belayer.ABI_VERSION
