"""The parts of ``scripts/zdtm.py`` (the CRIU zdtm conformance runner) that need no daemon:
reading zdtm's Makefile and ``.desc`` files the way zdtm does, and grouping failures by cause.
The Makefile tests read CRIU's source tree (``$BELAYER_CRIU_SRC``, default the one
``scripts/setup.sh`` unpacks) and are skipped without it; nothing in it is written."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CRIU_SRC = Path(os.environ.get("BELAYER_CRIU_SRC", "/var/cache/belayer/criu-4.2.1"))
ZDTM = CRIU_SRC / "test" / "zdtm"


def _load():
    spec = importlib.util.spec_from_file_location("zdtm_runner", REPO / "scripts" / "zdtm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["zdtm_runner"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


zdtm = _load()
needs_src = pytest.mark.skipif(not (ZDTM / "static" / "Makefile").is_file(),
                               reason=f"no CRIU source tree at {CRIU_SRC}")


@needs_src
def test_discover_starts_tests_as_the_makefile_rules_do():
    tests = {t.name: t for t in zdtm.discover(ZDTM)}
    assert len(tests) > 400
    assert tests["sleeping00"].args == ["--pidfile=sleeping00.pid", "--outfile=sleeping00.out"]
    assert tests["pipe02"].kind == "nofile"
    assert tests["write_read00"].args[-1] == "--filename=write_read00.test"
    assert tests["cwd00"].args[-1] == "--dirname=cwd00.test"
    assert tests["chroot"].args[-2:] == ["--dirname=chroot.dir.test", "--filename=chroot.test"]
    # The special rules at the bottom of the Makefile.
    assert tests["env00"].args[-1] == "--envname=ENV_00_TEST"
    assert tests["umask00"].args[-1] == "--mask=0345"
    assert tests["fifo-rowo-pair"].args[-2:] == [
        "--name_master=fifo-rowo-pair.master.test", "--name_slave=fifo-rowo-pair.slave.test"]
    assert tests["conntracks"].kind == "state"
    # test/zdtm.desc excludes route_rules.
    assert "route_rules" not in tests
    assert "noauto" in tests["conntracks"].flags()


def test_desc_is_read_as_a_literal_never_evaluated(tmp_path):
    good = tmp_path / "a.desc"
    good.write_text("{'flags': 'suid excl', 'opts': '--link-remap'}\n")
    assert zdtm.read_desc(good) == ({"flags": "suid excl", "opts": "--link-remap"}, None)
    evil = tmp_path / "b.desc"
    evil.write_text("__import__('os').system('touch %s')" % (tmp_path / "pwned"))
    desc, err = zdtm.read_desc(evil)
    assert desc == {} and err and not (tmp_path / "pwned").exists()
    assert zdtm.read_desc(tmp_path / "absent.desc") == ({}, None)


def test_failures_group_by_cause_not_by_test():
    a = ("13:39:10.410: 5: ERR: pty00.c:47: open(/dev/ptmx) failed (errno = 2 (No such file "
         "or directory)) 13:39:10.411: 4: ERR: test.c:320: Test exited unexpectedly with code 1")
    b = a.replace("pty00.c:47", "pty02.c:37").replace("10.410", "11.000")
    assert zdtm.reason_key("start-failed", a) == zdtm.reason_key("start-failed", b)
    log = ("(00.004989) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
           "Operation not permitted\n"
           "(00.038408)      6: Error (soccr/soccr.c:94): Can't turn TCP repair mode ON: "
           "Operation not permitted\n"
           "(00.062755) Error (criu/cr-restore.c:2331): Restoring FAILED.\n")
    cause = zdtm.criu_cause(log)
    assert cause == "soccr/soccr.c: Can't turn TCP repair mode ON: Operation not permitted"
    daemon = ("CRIU restore of sandbox sb-3a2639cd4cb0 failed: ... Error (criu/cr-restore.c:2331):"
              " Restoring FAILED. | Error (criu/cgroup.c:2055): cg: cgroupd: recv req error")
    assert "TCP repair" in zdtm.reason_key("restore-failed", daemon, cause)
    assert "cgroupd" in zdtm.reason_key("restore-failed", daemon)
