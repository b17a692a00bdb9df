#!/usr/bin/env python3
"""CRIU conformance of Belayer: CRIU's own zdtm static tests, run through Belayer.

Each selected test runs in its own sandbox of an image that is the python image plus the built
static tests under ``/zdtm/static`` (``scripts/zdtm.sh`` builds both):

1. start: ``cd /zdtm/static && ./T --pidfile=T.pid --outfile=T.out [...]`` as the ``%.pid``
   rules of ``test/zdtm/static/Makefile`` say (``--filename=T.test`` for TST_FILE,
   ``--dirname=T.test`` for TST_DIR, both for TST_DIR_FILE, and the special rules at the bottom
   of that Makefile), with the environment ``test/zdtm.py`` gives a test of the host flavour
   (tests without the ``suid`` flag drop to uid 18943). The test daemonizes and its parent
   writes ``T.pid`` once the test is ready, then exits, which ends the action;
2. ``checkpoint`` (prefix 1) through belayerd;
3. SIGKILL of every sandbox process (the pids ``inspect`` lists) from the host, then waiting
   until the daemon sees the sandbox failed;
4. ``restore``;
5. SIGTERM to the pid in ``T.pid`` and waiting (``--timeout``, default 30 s) for ``T.out``,
   which the test writes when it exits: ``PASS`` in it is a pass.

Classes: ``pass``; ``fail`` (the test's own message); ``checkpoint-failed`` and
``restore-failed`` (the daemon's error text, first 300 characters); ``start-failed`` (the test
did not get ready in a sandbox: its output); ``timeout`` (no ``T.out`` in time); ``skipped``
(the ``.desc`` says it cannot apply here: ``noauto``, ``crfail``, another ``arch``, a CRIU
``feature`` this host lacks, a failing ``.checkskip``; or the binary did not build). Tests
flagged ``excl`` run alone after the others.

The runner starts its own belayerd (private socket and state dir under
/var/lib/belayer/scratch/zdtm-*), imports the image, and removes every sandbox and stops the
daemon at the end, on Ctrl-C and on SIGTERM. Exit status: 0 whatever the tests did; 1 when the
runner itself broke (daemon did not start, image import failed, daemon died and could not be
restarted); 130 when interrupted.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

try:
    import belayer
    from belayer import BelayerError
    from belayer.errors import DaemonConnectionError, UnknownSandboxError
except ImportError as e:  # pragma: no cover - reported to the user
    sys.exit(f"zdtm: cannot import the belayer package ({e}); "
             "run: python3 -m pip install --no-deps --force-reinstall ./python")

CLASSES = ["pass", "fail", "checkpoint-failed", "restore-failed", "start-failed", "timeout",
           "skipped"]
REASON_CHARS = 300
SCRATCH = Path("/var/lib/belayer/scratch")
IMAGE = "zdtm"
GUEST_DIR = "/zdtm/static"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The environment test/zdtm.py gives a test of the host flavour (no freezer: thread bomb 5);
# tests without the `suid` flag also get the ids they drop to after their set-up.
BASE_ENV = {"TMPDIR": "/tmp", "ZDTM_THREAD_BOMB": "5", "PATH": GUEST_PATH}
USER_ENV = {"ZDTM_UID": "18943", "ZDTM_GID": "58467", "ZDTM_GROUPS": "27495 48244"}
ARCH = {"x86_64": "x86_64", "aarch64": "aarch64", "ppc64le": "ppc64le",
        "s390x": "s390x"}.get(os.uname().machine, os.uname().machine)


def log(msg: str) -> None:
    print(f"[zdtm] {msg}", file=sys.stderr, flush=True)


def clip(text: str, n: int = REASON_CHARS) -> str:
    """``text`` on one line, at most ``n`` characters."""
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 3] + "..."


def sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


# ---------------------------------------------------------------------------------------------
# Test discovery


@dataclass
class Test:
    """One zdtm static test: its name, how to start it and its ``.desc``."""

    name: str
    kind: str  # nofile, file, dir, dir_file, special, state
    args: List[str]  # arguments after ./NAME (the pid variants' rule, or `start` for state)
    desc: dict
    desc_error: Optional[str] = None

    def flags(self) -> List[str]:
        return str(self.desc.get("flags", "")).split()


@dataclass
class Result:
    """The outcome of one test (times in seconds and milliseconds as named)."""

    name: str
    cls: str
    reason: str = ""
    flags: List[str] = field(default_factory=list)
    opts: str = ""
    duration_s: float = 0.0
    checkpoint_ms: Optional[float] = None
    checkpoint_bytes: Optional[int] = None
    restore_ms: Optional[float] = None
    restore_verified: Optional[bool] = None
    restore_fs_matches: Optional[bool] = None
    restore_processes_match: Optional[bool] = None
    output: str = ""
    criu_log: str = ""
    criu_cause: str = ""


def make_vars(static: Path, names: List[str]) -> Dict[str, List[str]]:
    """The values of the make variables ``names`` in ``static/Makefile``, as make computes them
    (conditionals included). ``DEP`` is overridden so that no dependency file is included or
    remade: nothing in ``static`` is written."""
    printer = "".join(f"\t@echo '{n}=' $({n})\n" for n in names)
    with tempfile.NamedTemporaryFile("w", suffix=".mk", delete=False) as f:
        f.write(f"zdtm-runner-print-vars:\n{printer}")
        mk = f.name
    try:
        out = subprocess.run(
            ["make", "-s", "--no-print-directory", "-C", str(static), "-f", "Makefile", "-f", mk,
             "DEP=zdtm-runner-none", "zdtm-runner-print-vars"],
            capture_output=True, text=True, timeout=60, check=True,
            env=dict(os.environ, MAKEFLAGS=""),
        ).stdout
    finally:
        os.unlink(mk)
    values: Dict[str, List[str]] = {}
    for line in out.splitlines():
        key, sep, rest = line.partition("= ")
        if sep and key in names:
            values[key] = rest.split()
        elif line.endswith("=") and line[:-1] in names:
            values[line[:-1]] = []
    missing = [n for n in names if n not in values]
    if missing:
        raise RuntimeError(f"make did not print {missing}: {out[-500:]}")
    return values


SPECIAL_RULE = re.compile(r"^([A-Za-z0-9_.+-]+)\.pid:\s*\1\s*$")


def special_rules(makefile: Path) -> Dict[str, List[str]]:
    """``NAME -> arguments`` of the explicit ``NAME.pid: NAME`` rules of the Makefile (env00,
    umask00, fifo-rowo-pair, ...), with make's automatic variables substituted."""
    lines = makefile.read_text().splitlines()
    rules: Dict[str, List[str]] = {}
    for i, line in enumerate(lines[:-1]):
        m = SPECIAL_RULE.match(line)
        nxt = lines[i + 1]
        if not m or not nxt.startswith("\t"):
            continue
        name = m.group(1)
        recipe = nxt.strip()
        recipe = recipe.replace("$(<D)/$(<F)", f"./{name}").replace("$@", f"{name}.pid")
        recipe = recipe.replace("$<", name)
        words = recipe.split()
        if words and words[0] == f"./{name}":
            rules[name] = words[1:]
    return rules


def read_desc(path: Path) -> Tuple[dict, Optional[str]]:
    """The ``.desc`` of a test (a Python literal; empty or absent: ``{}``)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}, None
    if not text.strip():
        return {}, None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        return {}, f"unreadable .desc: {e}"
    return (value, None) if isinstance(value, dict) else ({}, "the .desc is not a dict")


def discover(zdtm: Path) -> List[Test]:
    """Every static test of the Makefile (minus the exclusions of test/zdtm.desc), sorted."""
    static = zdtm / "static"
    v = make_vars(static, ["TST_NOFILE", "TST_FILE", "TST_DIR", "TST_DIR_FILE", "TST",
                           "TST_STATE"])
    special = special_rules(static / "Makefile")
    excluded = {"route_rules"}  # test/zdtm.desc: 'exclude': ['static/route_rules', ...]
    zdesc, _ = read_desc(zdtm.parent / "zdtm.desc")
    for e in zdesc.get("exclude", []) if isinstance(zdesc.get("exclude"), list) else []:
        if isinstance(e, str) and e.startswith("static/"):
            excluded.add(e[len("static/"):])
    tests: Dict[str, Test] = {}

    def add(name: str, kind: str, args: List[str]) -> None:
        if name in excluded or name in tests:
            return
        desc, err = read_desc(static / f"{name}.desc")
        tests[name] = Test(name, kind, args, desc, err)

    base = lambda n: [f"--pidfile={n}.pid", f"--outfile={n}.out"]  # noqa: E731
    for n in v["TST_NOFILE"]:
        add(n, "nofile", base(n))
    for n in v["TST_FILE"]:
        add(n, "file", base(n) + [f"--filename={n}.test"])
    for n in v["TST_DIR"]:
        add(n, "dir", base(n) + [f"--dirname={n}.test"])
    for n in v["TST_DIR_FILE"]:
        add(n, "dir_file", base(n) + [f"--dirname={n}.dir.test", f"--filename={n}.test"])
    for n in v["TST"]:
        if n in special:
            add(n, "special", special[n])
        else:
            add(n, "special", base(n))
    for n in v["TST_STATE"]:
        add(n, "state", [f"--statefile={n}.state", f"--outfile={n}.out", "start"])
    return sorted(tests.values(), key=lambda t: t.name)


# ---------------------------------------------------------------------------------------------
# Skips


class Skipper:
    """Decides, as test/zdtm.py does, which tests cannot apply here."""

    def __init__(self, criu: str, zdtm: Path, image: Path) -> None:
        self.criu = criu
        self.static = zdtm / "static"
        self.guest_static = image / GUEST_DIR.lstrip("/")
        self.features: Dict[str, bool] = {}
        self.lock = threading.Lock()

    def feature(self, name: str) -> bool:
        with self.lock:
            if name not in self.features:
                try:
                    r = subprocess.run([self.criu, "check", "--feature", name],
                                       capture_output=True, timeout=60)
                    self.features[name] = r.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    self.features[name] = False
            return self.features[name]

    def why(self, t: Test) -> Optional[str]:
        """Why ``t`` is skipped, or ``None``."""
        flags = t.flags()
        if not (self.guest_static / t.name).is_file():
            return "not built here (see the make log)"
        if "noauto" in flags:
            return "noauto: manual run only"
        if "crfail" in flags:
            return "crfail: its checkpoint is meant to fail"
        arch = t.desc.get("arch")
        if arch and arch != ARCH:
            return f"arch {arch} only"
        for feat in str(t.desc.get("feature", "")).split():
            if not self.feature(feat):
                return f"criu check --feature {feat} fails on this host"
        chs = self.static / f"{t.name}.checkskip"
        if os.access(chs, os.X_OK):
            try:
                r = subprocess.run([str(chs)], cwd=self.static, capture_output=True,
                                   timeout=30)
                if r.returncode != 0:
                    said = (r.stdout + r.stderr).decode(errors="replace")
                    return f"{t.name}.checkskip failed: {clip(said, 120)}"
            except (OSError, subprocess.TimeoutExpired) as e:
                return f"{t.name}.checkskip did not run: {e}"
        return None


# ---------------------------------------------------------------------------------------------
# The daemon


class Daemon:
    """A private belayerd: socket and state dir in a fresh scratch dir; its own session, so a
    Ctrl-C on the terminal reaches only the runner, which then cleans up through it."""

    def __init__(self, binary: str, criu: str, keep: bool, log_copy: Optional[str]) -> None:
        self.binary = binary
        self.criu = criu
        self.keep = keep
        self.log_copy = log_copy
        SCRATCH.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="zdtm-", dir=SCRATCH))
        self.socket = str(self.dir / "belayer.sock")
        self.state = self.dir / "state"
        self.log = self.dir / "belayerd.log"
        self.proc: Optional[subprocess.Popen] = None
        self.restarts = 0

    def start(self) -> None:
        logf = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen(
                [self.binary, "--socket", self.socket, "--state-dir", str(self.state),
                 "--config", "/dev/null"],
                env=dict(os.environ, BELAYER_CRIU=self.criu, NO_COLOR="1"),
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            logf.close()
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"belayerd exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with belayer.Client(self.socket) as c:
                    c.ping()
                return
            except BelayerError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"belayerd did not answer in 30 s: {self.log_tail()}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 2000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return re.sub(r"\x1b\[[0-9;]*m", "", text)[-n:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def remove(self) -> None:
        """Removes the scratch dir (after unmounting whatever is still mounted below it)."""
        if self.log_copy:
            try:
                shutil.copyfile(self.log, self.log_copy)
            except OSError as e:
                log(f"cannot copy the daemon log to {self.log_copy}: {e}")
        if self.keep:
            log(f"kept {self.dir}")
            return
        prefix = str(self.dir) + "/"
        mounts = []
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    mp = line.split()[4].replace("\\040", " ")
                    if mp.startswith(prefix):
                        mounts.append(mp)
        except OSError:
            pass
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.dir.exists():
            log(f"could not remove all of {self.dir}")


# ---------------------------------------------------------------------------------------------
# One test


def criu_cause(criu_log: str) -> str:
    """The first error of a CRIU log that names a cause: not CRIU's summary lines, not the
    RLIMIT_NOFILE complaint every run in a sandbox logs."""
    for ln in criu_log.splitlines():
        m = re.search(r"Error \((\S+?)(?::\d+)?\): (.*)", ln)
        if not m or _CRIU_NOISE.search(m.group(2)):
            continue
        return clip(f"{m.group(1)}: {m.group(2)}", 200)
    return ""


_CRIU_NOISE = re.compile(r"FAILED\.|failed with -\d+|exited, status=|RLIMIT_NOFILE for self|"
                         r"cgroupd: recv req error")


class Stop(Exception):
    """The run is being interrupted."""


class Runner:
    """Runs tests through one daemon; tracks live sandboxes so that :meth:`cleanup` can remove
    them whatever happens."""

    def __init__(self, daemon: Daemon, timeout: float, control: bool = False) -> None:
        self.daemon = daemon
        self.timeout = timeout
        self.control = control
        self.stop = threading.Event()
        self.live: Dict[str, List[int]] = {}
        self.lock = threading.Lock()

    def _track(self, sid: str, pids: Optional[List[int]] = None) -> None:
        with self.lock:
            self.live[sid] = pids or self.live.get(sid, [])

    def _untrack(self, sid: str) -> None:
        with self.lock:
            self.live.pop(sid, None)

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise Stop()

    def run(self, t: Test) -> Result:
        """Runs test ``t`` in a new sandbox and removes the sandbox."""
        r = Result(t.name, "fail", flags=t.flags(), opts=str(t.desc.get("opts", "")))
        start = time.monotonic()
        try:
            with belayer.Client(self.daemon.socket) as c:
                try:
                    sb = c.create_sandbox(IMAGE)
                except BelayerError as e:
                    r.cls, r.reason = "start-failed", clip(f"sandbox create: {self._msg(e)}")
                    return r
                self._track(sb.id)
                try:
                    self._steps(c, sb.id, t, r)
                finally:
                    try:
                        c.destroy(sb.id)
                        self._untrack(sb.id)
                    except BelayerError as e:
                        if not self.stop.is_set():  # else cleanup() removed it already
                            log(f"{t.name}: destroying sandbox {sb.id} failed: {e}")
        except BelayerError as e:
            # The connection itself broke (daemon gone?).
            r.cls, r.reason = "fail", clip(f"runner: {e}")
        finally:
            r.duration_s = round(time.monotonic() - start, 2)
        return r

    def _msg(self, e: BelayerError) -> str:
        """The daemon's error text, the private scratch dir shortened to ``<scratch>``."""
        text = e.message.replace(str(self.daemon.dir), "<scratch>")
        if isinstance(e, DaemonConnectionError):
            text = f"belayerd connection lost: {text}"
        return text

    def _criu_log(self, e: BelayerError) -> str:
        """The errors and the last lines of the CRIU log the daemon's message points at (read
        before the sandbox, and its log, is removed)."""
        m = re.search(r"\(log (/[^)]+\.log)\)", e.message)
        if not m or not m.group(1).startswith(str(self.daemon.dir) + "/"):
            return ""
        try:
            with open(m.group(1), errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as err:
            return f"(cannot read {m.group(1)}: {err})"
        errors = [ln for ln in lines if re.search(r"\b(Error|Warn)\b", ln)]
        return "\n".join(errors[-40:] + ["-- last lines --"] + lines[-30:])

    def _exec(self, c: belayer.Client, sid: str, cmd: str, timeout_s: float):
        return c.exec(sid, f"cd {GUEST_DIR} && {cmd}", int(timeout_s * 1000))

    def _files(self, c: belayer.Client, sid: str, t: Test, suffixes: List[str]) -> str:
        """The tails of ``T<suffix>`` files that exist in the sandbox, labelled."""
        parts = " ".join(sh_quote(t.name + s) for s in suffixes)
        cmd = (f"for f in {parts}; do [ -s \"$f\" ] && {{ echo \"== $f\"; tail -c 1500 \"$f\"; }}; "
               "done; true")
        try:
            return self._exec(c, sid, cmd, 10).text
        except BelayerError as e:
            return f"(cannot read the test's files: {e.message})"

    def _start(self, c: belayer.Client, sid: str, t: Test, r: Result, envs: str, args: str,
               tmo: float) -> bool:
        """Step 1: starts the test; ``False`` (with ``r`` filled in) when it did not get ready.
        Its output goes to a file: the daemonized test must not hold the action's output."""
        name = t.name
        res = self._exec(c, sid, f"env {envs} ./{sh_quote(name)} {args} >{sh_quote(name)}"
                         f".start.log 2>&1 </dev/null; echo \"exit=$?\"", tmo)
        if t.kind == "state":
            ok = res.ok and "exit=0" in res.text
            ready = ok
        else:
            chk = self._exec(c, sid, f"p=$(cat {sh_quote(name)}.pid 2>/dev/null) && "
                             "[ -n \"$p\" ] && kill -0 \"$p\" && echo \"pid=$p\"", 10)
            ready = res.ok and "exit=0" in res.text and "pid=" in chk.text
        if not ready:
            out = self._files(c, sid, t, [".start.log", ".out", ".out.inprogress"])
            how = "timed out" if res.timed_out else res.text.strip() or f"exit {res.exit_code}"
            r.cls = "start-failed"
            r.reason = clip(f"{how}: {out}")
            r.output = out
            return False
        return True

    def _steps(self, c: belayer.Client, sid: str, t: Test, r: Result) -> None:
        name = t.name
        env = dict(BASE_ENV)
        if "suid" not in t.flags():
            env.update(USER_ENV)
        envs = " ".join(f"{k}={sh_quote(v)}" for k, v in env.items())
        args = " ".join(sh_quote(a) for a in t.args)
        tmo = float(t.desc.get("timeout") or 30)
        self._check_stop()
        try:
            ready = self._start(c, sid, t, r, envs, args, tmo)
        except BelayerError as e:
            r.cls = "start-failed"
            r.reason = clip(f"the sandbox failed while the test started: {self._msg(e)}")
            return
        if not ready:
            return
        self._check_stop()
        if not self.control:
            self._fail_over(c, sid, name, r)
            if r.cls in ("checkpoint-failed", "restore-failed"):
                return
        self._check_stop()
        self._verdict(c, sid, t, r, envs)

    def _fail_over(self, c: belayer.Client, sid: str, name: str, r: Result) -> None:
        """Steps 2 to 4: checkpoint, SIGKILL from the host, restore (``r.cls`` says a failure)."""
        # 2. Checkpoint.
        try:
            ck = c.checkpoint(sid, 1, f"zdtm {name}".encode())
            r.checkpoint_ms, r.checkpoint_bytes = round(ck.total_ms, 1), ck.bytes
        except BelayerError as e:
            r.cls, r.reason = "checkpoint-failed", clip(self._msg(e))
            r.output, r.criu_log = self._msg(e), self._criu_log(e)
            r.criu_cause = criu_cause(r.criu_log)
            return
        self._check_stop()
        # 3. Fail-stop: SIGKILL every sandbox process from the host.
        info = c.inspect(sid)
        self._track(sid, list(info.pids))
        for pid in info.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while c.inspect(sid).state != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        self._check_stop()
        # 4. Restore.
        try:
            ri = c.restore(sid, True)
            r.restore_ms = round(ri.total_ms, 1)
            r.restore_verified, r.restore_fs_matches = ri.verified, ri.fs_matches
            r.restore_processes_match = ri.processes_match
        except BelayerError as e:
            r.cls, r.reason = "restore-failed", clip(self._msg(e))
            r.output, r.criu_log = self._msg(e), self._criu_log(e)
            r.criu_cause = criu_cause(r.criu_log)
            return
        self._track(sid, list(c.inspect(sid).pids))

    def _verdict(self, c: belayer.Client, sid: str, t: Test, r: Result, envs: str) -> None:
        """Step 5: stops the test and reads its verdict into ``r``."""
        name = t.name
        # 5. Stop the test and read its verdict.
        try:
            if t.kind == "state":
                stop_args = " ".join(sh_quote(a) for a in t.args[:-1] + ["stop"])
                self._exec(c, sid, f"env {envs} ./{sh_quote(name)} {stop_args} "
                           f">>{sh_quote(name)}.start.log 2>&1 </dev/null", self.timeout)
                killed = "state test: stop run"
            else:
                k = self._exec(c, sid, f"kill -TERM \"$(cat {sh_quote(name)}.pid)\" 2>&1 && "
                               "echo sent", 10)
                killed = "sent" if "sent" in k.text else f"SIGTERM not delivered: {k.text.strip()}"
            n = max(1, int(self.timeout / 0.1))
            w = self._exec(c, sid, f"i=0; while [ ! -e {sh_quote(name)}.out ] && [ $i -lt {n} ]; "
                           f"do sleep 0.1; i=$((i+1)); done; cat {sh_quote(name)}.out",
                           self.timeout + 15)
        except BelayerError as e:
            r.cls = "restore-failed"
            r.reason = clip(f"the restored sandbox does not run actions: {self._msg(e)}")
            return
        if w.ok:
            out = w.text
            r.output = out[-3000:]
            if "PASS" in [s.strip() for s in out.split()]:
                r.cls, r.reason = "pass", ""
            else:
                r.cls = "fail"
                why = [ln.strip() for ln in out.splitlines() if re.search(r"\b(FAIL|ERR):", ln)]
                r.reason = clip(" | ".join(why) if why else out.strip()[-REASON_CHARS:]
                                or "empty .out")
            return
        try:
            alive = self._exec(c, sid, f"kill -0 \"$(cat {sh_quote(name)}.pid)\" 2>/dev/null "
                               "&& echo alive || echo gone", 10).text.strip()
        except BelayerError as e:
            alive = f"unknown ({self._msg(e)})"
        out = self._files(c, sid, t, [".out.inprogress", ".start.log"])
        r.output = out
        if alive == "alive" and killed == "sent":
            r.cls = "timeout"
            r.reason = clip(f"no {name}.out {self.timeout:g} s after SIGTERM (test still "
                            f"running); {out}")
        else:
            r.cls = "fail"
            r.reason = clip(f"no {name}.out ({killed}; test process {alive} after restore); "
                            f"{out}")

    def cleanup(self) -> None:
        """Removes every sandbox still tracked: destroy through the daemon (bounded), then
        SIGKILL of their last known pids from the host for those that would not go."""
        with self.lock:
            live = dict(self.live)
        if not live:
            return
        log(f"removing {len(live)} sandbox(es)")

        def destroy(sid: str) -> None:
            try:
                with belayer.Client(self.daemon.socket) as c:
                    try:
                        for pid in c.inspect(sid).pids:
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                    except BelayerError:
                        pass
                    c.destroy(sid)
                self._untrack(sid)
            except BelayerError as e:
                if isinstance(e, UnknownSandboxError):
                    self._untrack(sid)
                else:
                    log(f"destroy {sid}: {e}")

        threads = [threading.Thread(target=destroy, args=(s,), daemon=True) for s in live]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        with self.lock:
            left = dict(self.live)
        for sid, pids in left.items():
            log(f"sandbox {sid} would not go: SIGKILL of its pids {pids}")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# ---------------------------------------------------------------------------------------------
# Grouping failures by reason (--summarize)

_CRIU_ERR = re.compile(r"Error \((criu/[^)]*)\): ([^|]*)")
_TEST_ERR = re.compile(r"(?:ERR|FAIL): ([\w.+-]+\.c):\d+: ([^|]*?)(?= \d\d:\d\d:\d\d\.\d+:|$| ==)")


def reason_key(cls: str, reason: str, cause: str = "") -> str:
    """A reason with what varies between tests (ids, pids, numbers, file names of the test)
    taken out, so that failures of one cause share a key."""
    text = reason
    # CRIU's own summary lines ("Restoring FAILED.", "Dump files ... failed with -1") say
    # least: the first other error names the cause.
    errs = [m for m in _CRIU_ERR.finditer(text)
            if not re.search(r"FAILED\.|failed with -\d+", m.group(2))] or \
        list(_CRIU_ERR.finditer(text))
    if cls in ("checkpoint-failed", "restore-failed") and cause:
        text = re.sub(r"^(\S+?)(:\d+)?: ", r"\1: ", cause)
    elif cls in ("checkpoint-failed", "restore-failed") and errs:
        where = re.sub(r":\d+$", "", errs[0].group(1))
        text = f"{where}: {errs[0].group(2)}"
    elif re.search(r"sh: \d+: [\w.+-]+: not found", text):
        text = "command missing in the image: " + ", ".join(
            sorted(set(re.findall(r"sh: \d+: ([\w.+-]+): not found", text))))
    elif "error while loading shared libraries" in text:
        text = "library missing in the image: " + ", ".join(
            sorted(set(re.findall(r"loading shared libraries: ([\w.+-]+?)\.so", text))))
    else:
        m = _TEST_ERR.search(text)
        if m:
            text = m.group(2)
        elif cls == "timeout":
            text = "no .out after SIGTERM"
    text = re.sub(r"sb-[0-9a-f]+", "sb-*", text)
    text = re.sub(r"\b\d+\b", "N", text)
    text = re.sub(r"\s+", " ", text).strip()
    return f"{cls}: {clip(text, 110)}"


def summarize(path: str) -> int:
    """Prints the summary of a --json file and its failures grouped by reason (Markdown)."""
    d = json.loads(Path(path).read_text())
    counts = d["summary"]
    print(f"{d['ran']} run of {d['selected']} selected (skipped {counts.get('skipped', 0)}), "
          f"wall {d['wall_s']:.0f} s, jobs {d['jobs']}\n")
    print("| class | count |\n|---|---:|")
    for k in CLASSES:
        print(f"| {k} | {counts.get(k, 0)} |")
    groups: Dict[str, List[str]] = {}
    for t in d["tests"]:
        if t["class"] in ("pass", "skipped"):
            continue
        groups.setdefault(reason_key(t["class"], t["reason"], t.get("criu_cause", "")),
                          []).append(t["name"])
    print("\nFailures by reason (most common first):\n")
    for key, names in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"- **{key}** ({len(names)}): {', '.join(sorted(names))}")
    skips: Dict[str, List[str]] = {}
    for t in d["tests"]:
        if t["class"] == "skipped":
            skips.setdefault(re.sub(r"^[\w.+-]+\.checkskip", "T.checkskip", t["reason"]),
                             []).append(t["name"])
    print("\nSkipped:\n")
    for key, names in sorted(skips.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"- {key} ({len(names)}): {', '.join(sorted(names))}")
    return 0


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: List[str]) -> argparse.Namespace:
    repo = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zdtm-dir", default="/var/cache/belayer/zdtm-build/test/zdtm",
                   help="built test/zdtm dir (its static/Makefile and .desc files are read)")
    p.add_argument("--image-dir", default="/var/cache/belayer/zdtm-image/rootfs",
                   help="rootfs to import: the python image plus /zdtm/static (zdtm.sh makes it)")
    p.add_argument("--belayerd", default=str(repo / "target/release/belayerd"),
                   help="belayerd binary (default: target/release/belayerd of the repository)")
    p.add_argument("--criu", default=os.environ.get("BELAYER_CRIU", "/usr/local/sbin/criu"))
    p.add_argument("--only", help="comma-separated test names")
    p.add_argument("--pattern", help="regular expression the test names must match (search)")
    p.add_argument("--jobs", type=int, default=2, help="sandboxes in parallel (default 2)")
    p.add_argument("--json", help="write every test's class and reason there")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for T.out after SIGTERM (default 30)")
    p.add_argument("--list", action="store_true", help="print the selected tests and exit")
    p.add_argument("--control", action="store_true",
                   help="skip checkpoint, kill and restore (steps 2 to 4): which tests fail in a "
                        "sandbox without any failure")
    p.add_argument("--keep-state", action="store_true",
                   help="keep the scratch dir (daemon state and log) at the end")
    p.add_argument("--daemon-log", help="copy the daemon's log there at the end")
    p.add_argument("--summarize", metavar="JSON",
                   help="print the summary and the failures grouped by reason of a --json file "
                        "(Markdown) and exit; runs nothing")
    a = p.parse_args(argv)
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    return a


def select(tests: List[Test], a: argparse.Namespace) -> List[Test]:
    if a.only:
        want = [n.strip() for n in a.only.split(",") if n.strip()]
        known = {t.name for t in tests}
        unknown = [n for n in want if n not in known]
        if unknown:
            raise SystemExit(f"zdtm: unknown test(s): {', '.join(unknown)}")
        tests = [t for t in tests if t.name in want]
    if a.pattern:
        rx = re.compile(a.pattern)
        tests = [t for t in tests if rx.search(t.name)]
    return tests


class Interrupted(Exception):
    pass


def main(argv: List[str]) -> int:
    a = parse_args(argv)
    if a.summarize:
        return summarize(a.summarize)
    zdtm = Path(a.zdtm_dir)
    image = Path(a.image_dir)
    tests = select(discover(zdtm), a)
    if a.list:
        for t in tests:
            print(f"{t.name}\t{t.kind}\t{' '.join(t.args)}\t{t.desc}")
        return 0
    if not (image / GUEST_DIR.lstrip("/")).is_dir():
        log(f"{image}{GUEST_DIR} missing: make the image with scripts/zdtm.sh")
        return 1
    if not os.access(a.belayerd, os.X_OK):
        log(f"no belayerd at {a.belayerd} (build it, or pass --belayerd)")
        return 1

    def on_term(signum, frame):  # SIGTERM/SIGHUP: clean up as on Ctrl-C
        raise Interrupted()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    t0 = time.monotonic()
    skipper = Skipper(a.criu, zdtm, image)
    results: List[Result] = []
    todo: List[Test] = []
    for t in tests:
        why = skipper.why(t)
        if t.desc_error and why is None:
            log(f"{t.name}: {t.desc_error} (run with defaults)")
        if why:
            results.append(Result(t.name, "skipped", why, t.flags(), str(t.desc.get("opts", ""))))
        else:
            todo.append(t)
    parallel = [t for t in todo if "excl" not in t.flags()]
    serial = [t for t in todo if "excl" in t.flags()]
    total = len(tests)
    done_n = [0]
    print_lock = threading.Lock()

    def report(r: Result) -> None:
        with print_lock:
            done_n[0] += 1
            extra = f": {r.reason}" if r.reason else ""
            if r.criu_cause:
                extra += f"\n{'':24s}cause in the CRIU log: {r.criu_cause}"
            print(f"[{done_n[0]:4d}/{total}] {r.cls:17s} {r.name} ({r.duration_s:.1f} s){extra}",
                  flush=True)

    for r in results:
        report(r)

    daemon = Daemon(a.belayerd, a.criu, a.keep_state, a.daemon_log)
    runner = Runner(daemon, a.timeout, a.control)
    broke: Optional[str] = None
    interrupted = False
    workers: List[threading.Thread] = []
    try:
        log(f"belayerd {a.belayerd}, state {daemon.dir}")
        daemon.start()
        with belayer.Client(daemon.socket) as c:
            ti = time.monotonic()
            c.import_image(IMAGE, str(image))
            log(f"image {image} imported in {time.monotonic() - ti:.1f} s; "
                f"{len(parallel)} tests in {a.jobs} job(s), then {len(serial)} excl test(s) alone")

        queue = list(parallel)
        qlock = threading.Lock()
        state_lock = threading.Lock()

        def worker() -> None:
            nonlocal broke
            while not runner.stop.is_set():
                with qlock:
                    if not queue:
                        return
                    t = queue.pop(0)
                try:
                    r = runner.run(t)
                except Stop:
                    return
                except Exception as e:  # a runner bug: keep going, say so
                    r = Result(t.name, "fail", clip(f"runner error: {e!r}"), t.flags())
                if runner.stop.is_set():
                    return  # interrupted mid-test: not a result
                if not daemon.alive():
                    with state_lock:
                        if not daemon.alive() and not runner.stop.is_set():
                            code = daemon.proc.returncode if daemon.proc else "?"
                            r.reason = clip(f"belayerd died (exit {code}) during this test | "
                                            f"{r.reason}")
                            log(f"belayerd died (exit {code}); restarting it (log: "
                                f"{daemon.log_tail(300)!r})")
                            try:
                                daemon.restarts += 1
                                if daemon.restarts > 3:
                                    raise RuntimeError("died more than 3 times")
                                daemon.start()
                            except Exception as e:
                                broke = f"belayerd died and did not restart: {e}"
                                runner.stop.set()
                with print_lock:
                    results.append(r)
                report(r)

        for group, jobs in ((parallel, a.jobs), (serial, 1)):
            if runner.stop.is_set():
                break
            queue[:] = group
            threads = [threading.Thread(target=worker, daemon=True) for _ in range(jobs)]
            workers.extend(threads)
            for th in threads:
                th.start()
            for th in threads:
                while th.is_alive():
                    th.join(0.5)
    except (KeyboardInterrupt, Interrupted):
        interrupted = True
        log("interrupted: cleaning up")
        runner.stop.set()
        # Workers stop at their next step and remove their own sandbox; what is left after
        # this grace time is removed by runner.cleanup() below.
        deadline = time.monotonic() + 10
        for th in workers:
            while th.is_alive() and time.monotonic() < deadline:
                try:
                    th.join(0.5)
                except (KeyboardInterrupt, Interrupted):
                    pass
    except Exception as e:
        broke = f"{type(e).__name__}: {e}"
        runner.stop.set()
    finally:
        # Ctrl-C again during the clean-up must not leave sandboxes behind either.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        runner.cleanup()
        daemon.stop()
        daemon.remove()

    wall = time.monotonic() - t0
    counts = {k: 0 for k in CLASSES}
    for r in results:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    ran = sum(counts[k] for k in CLASSES if k != "skipped")
    print()
    print(f"zdtm static through Belayer: {len(results)} of {total} tests, {ran} run, "
          f"wall {wall:.0f} s, jobs {a.jobs}")
    print(f"  {'class':18s} count")
    for k in CLASSES:
        print(f"  {k:18s} {counts[k]:5d}")
    if daemon.restarts:
        print(f"  belayerd restarts: {daemon.restarts}")
    if a.json:
        out = {
            "summary": counts,
            "selected": total,
            "finished": len(results),
            "ran": ran,
            "wall_s": round(wall, 1),
            "jobs": a.jobs,
            "timeout_s": a.timeout,
            "belayerd": a.belayerd,
            "criu": a.criu,
            "zdtm_dir": str(zdtm),
            "image_dir": str(image),
            "daemon_restarts": daemon.restarts,
            "interrupted": interrupted,
            "runner_error": broke,
            "tests": sorted((dict(asdict(r), **{"class": r.cls}) for r in results),
                            key=lambda d: d["name"]),
        }
        for d in out["tests"]:
            d.pop("cls", None)
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        log(f"wrote {a.json}")
    if broke:
        log(f"the runner broke: {broke}")
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
