"""Loading ``libbelayer`` and declaring its C ABI (``belayer.h``) for ctypes.

Internal module: the public API is in :mod:`belayer`.
"""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
from ctypes import (
    POINTER,
    Structure,
    c_bool,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import List, Optional

from .errors import LibraryNotFoundError, UntrustedLibraryError

#: The ABI version these bindings were written for (``BELAYER_ABI_VERSION`` of ``belayer.h``).
ABI_VERSION = 1

LIBRARY_FILE = "libbelayer.so"


class Buf(Structure):
    """``BelayerBuf``: bytes owned by the library until ``belayer_buf_free``."""

    _fields_ = [("data", POINTER(c_uint8)), ("len", c_size_t)]


class ExecResult(Structure):
    """``BelayerExecResult``."""

    _fields_ = [
        ("exit_code", c_int32),
        ("signal", c_int32),
        ("timed_out", c_bool),
        ("truncated", c_bool),
        ("duration_ms", c_double),
        ("stdout_buf", Buf),
        ("stderr_buf", Buf),
    ]


class ExecVerdict(Structure):
    """``BelayerExecVerdict``."""

    _fields_ = [
        ("infra_fault", c_int),
        ("infra_fault_pid", c_int32),
        ("infra_fault_signal", c_int32),
        ("dirty", c_int),
    ]


class ExecOptions(Structure):
    """``BelayerExecOptions``."""

    _fields_ = [
        ("cwd", c_char_p),
        ("env", POINTER(c_char_p)),
        ("env_len", c_size_t),
        ("timeout_ms", c_uint64),
        ("output_limit", c_uint64),
        ("merge_stderr", c_uint32),
        ("stdin_data", POINTER(c_uint8)),
        ("stdin_len", c_size_t),
    ]


class SandboxInfo(Structure):
    """``BelayerSandboxInfo``."""

    _fields_ = [
        ("id", c_void_p),
        ("image", c_void_p),
        ("state", c_void_p),
        ("init_pid", c_int32),
        ("instance", c_uint32),
        ("has_ready_prefix", c_bool),
        ("ready_prefix", c_uint64),
        ("pids", POINTER(c_int32)),
        ("pids_len", c_size_t),
        ("created_unix_ms", c_uint64),
    ]


class CheckpointInfo(Structure):
    """``BelayerCheckpointInfo``."""

    _fields_ = [
        ("prefix", c_uint64),
        ("bytes", c_uint64),
        ("frozen_ms", c_double),
        ("total_ms", c_double),
        ("name", c_void_p),
        ("context_digest", c_void_p),
    ]


class RestoreInfo(Structure):
    """``BelayerRestoreInfo``."""

    _fields_ = [
        ("has_prefix", c_bool),
        ("prefix", c_uint64),
        ("context", Buf),
        ("init_pid", c_int32),
        ("total_ms", c_double),
        ("verified", c_bool),
        ("fs_matches", c_bool),
        ("processes_match", c_bool),
        ("inodes_kept", c_bool),
    ]


class ForkChild(Structure):
    """``BelayerForkChild``."""

    _fields_ = [
        ("id", c_void_p),
        ("init_pid", c_int32),
        ("total_ms", c_double),
        ("verified", c_bool),
        ("fs_matches", c_bool),
        ("processes_match", c_bool),
    ]


class ForkInfo(Structure):
    """``BelayerForkInfo``."""

    _fields_ = [
        ("fork", c_void_p),
        ("checkpoint", c_void_p),
        ("prefix", c_uint64),
        ("context", Buf),
        ("children", POINTER(ForkChild)),
        ("children_len", c_size_t),
        ("total_ms", c_double),
    ]


class CreateOptions(Structure):
    """``BelayerCreateOptions`` (zero: every default)."""

    _fields_ = [
        ("tag", c_char_p),
        ("env", POINTER(c_char_p)),
        ("env_len", c_size_t),
        ("workdir", c_char_p),
        ("memory_max", c_uint64),
        ("pids_max", c_uint64),
        ("cpus", c_double),
        ("disk_max", c_uint64),
        ("userns", c_int),
    ]


class SandboxConfig(Structure):
    """``BelayerSandboxConfig``."""

    _fields_ = [
        ("tag", c_void_p),
        ("workdir", c_void_p),
        ("env", POINTER(c_void_p)),
        ("env_len", c_size_t),
        ("memory_max", c_uint64),
        ("pids_max", c_uint64),
        ("cpus", c_double),
        ("disk_max", c_uint64),
        ("userns", c_int),
        ("cgroup", c_void_p),
    ]


class SandboxEntry(Structure):
    """``BelayerSandboxEntry``."""

    _fields_ = [("info", SandboxInfo), ("config", SandboxConfig)]


class SandboxList(Structure):
    """``BelayerSandboxList``."""

    _fields_ = [("items", POINTER(SandboxEntry)), ("len", c_size_t)]


class CheckpointEntry(Structure):
    """``BelayerCheckpointEntry``."""

    _fields_ = [("info", CheckpointInfo), ("created_unix_ms", c_uint64)]


class CheckpointList(Structure):
    """``BelayerCheckpointList``."""

    _fields_ = [("items", POINTER(CheckpointEntry)), ("len", c_size_t)]


class GcResult(Structure):
    """``BelayerGcResult``."""

    _fields_ = [("removed", c_uint64), ("bytes", c_uint64)]


class TransferResult(Structure):
    """``BelayerTransferResult``."""

    _fields_ = [
        ("files", c_uint64),
        ("bytes", c_uint64),
        ("skipped", c_uint64),
        ("changed", c_uint64),
        ("duration_ms", c_double),
    ]


class Step(Structure):
    """``BelayerStep`` (seconds; negative = unset)."""

    _fields_ = [
        ("step_duration_s", c_double),
        ("regen_cost_s", c_double),
        ("llm_elapsed_s", c_double),
        ("llm_response_s", c_double),
    ]


class Policy(Structure):
    """``BelayerPolicy`` (negative numbers and a NULL kind = default)."""

    _fields_ = [
        ("kind", c_char_p),
        ("failure_p", c_double),
        ("failure_rate_per_s", c_double),
        ("checkpoint_timeout_s", c_double),
        ("cooldown_s", c_double),
    ]


class Decision(Structure):
    """``BelayerDecision``."""

    _fields_ = [
        ("checkpointed", c_bool),
        ("reason", c_int),
        ("p", c_double),
        ("regen_cost_s", c_double),
        ("c_s", c_double),
        ("q", c_double),
        ("benefit", c_double),
        ("visible_cost", c_double),
        ("checkpoint_prefix", c_uint64),
        ("checkpoint_bytes", c_uint64),
        ("checkpoint_frozen_ms", c_double),
        ("checkpoint_total_ms", c_double),
    ]


class Event(Structure):
    """``BelayerEvent``."""

    _fields_ = [
        ("kind", c_int),
        ("sandbox", c_void_p),
        ("prefix", c_uint64),
        ("reason", c_void_p),
    ]


def _newest(paths: List[Path]) -> List[Path]:
    """The existing ``paths``, newest first (a fresh debug build beats a stale release one)."""
    existing = [p for p in paths if p.is_file()]
    return sorted(existing, key=lambda p: p.stat().st_mtime, reverse=True)


#: Directories the dynamic loader searches after ``$LD_LIBRARY_PATH`` and its cache.
SYSTEM_DIRS = (
    "/lib",
    "/usr/lib",
    "/lib64",
    "/usr/lib64",
    "/usr/local/lib",
)


def _multiarch_dirs() -> List[Path]:
    """``/usr/lib/<triplet>`` and ``/lib/<triplet>`` of this machine (Debian multiarch)."""
    machine = os.uname().machine
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(machine)
    if triplet is None:
        return []
    return [Path("/lib") / triplet, Path("/usr/lib") / triplet]


def _ld_library_path_dirs() -> List[Path]:
    """The absolute directories of ``$LD_LIBRARY_PATH``. Empty and relative entries (which
    the loader would resolve against the current directory) are skipped."""
    value = os.environ.get("LD_LIBRARY_PATH", "")
    return [Path(d) for d in value.split(":") if d and os.path.isabs(d)]


def _ldconfig_paths() -> List[Path]:
    """Absolute paths of ``libbelayer.so`` in the loader's cache (``ldconfig -p``)."""
    for ldconfig in ("/sbin/ldconfig", "/usr/sbin/ldconfig"):
        if not os.path.isfile(ldconfig):
            continue
        try:
            out = subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        found = []
        for line in out.splitlines():
            name, sep, target = line.strip().partition(" => ")
            if sep and name.split(" ", 1)[0] == LIBRARY_FILE and os.path.isabs(target):
                found.append(Path(target))
        return found
    return []


def system_candidates() -> List[Path]:
    """Where the dynamic loader would find ``libbelayer.so``, as absolute paths:
    ``$LD_LIBRARY_PATH`` (absolute entries only), the ld.so cache, then the system library
    directories."""
    dirs = _ld_library_path_dirs()
    found = [d / LIBRARY_FILE for d in dirs]
    found += _ldconfig_paths()
    found += [d / LIBRARY_FILE for d in (*_multiarch_dirs(), *map(Path, SYSTEM_DIRS))]
    return found


def candidates() -> List[Path]:
    """Where the library is looked for, in order (see the package README). With
    ``$BELAYER_LIB`` set, only there (a file, or a directory holding ``libbelayer.so``).
    Otherwise: next to the package, then ``$CARGO_TARGET_DIR/{release,debug}`` when that
    variable is set (the newer of the two builds first), then the dynamic loader's search path
    (:func:`system_candidates`). Nothing relative to the current directory and no walk up
    parent directories: a library planted there never loads."""
    env = os.environ.get("BELAYER_LIB")
    if env:
        p = Path(env)
        return [p / LIBRARY_FILE if p.is_dir() else p]
    here = Path(__file__).resolve().parent
    found: List[Path] = [here / LIBRARY_FILE]
    target = os.environ.get("CARGO_TARGET_DIR")
    if target and os.path.isabs(target):
        root = Path(target)
        found += _newest([root / profile / LIBRARY_FILE for profile in ("release", "debug")])
    found += system_candidates()
    return found


def _untrusted(path: Path, what: str, st: os.stat_result) -> Optional[str]:
    """Why ``path`` (a ``what``: file or directory, status ``st``) may not be trusted, or
    ``None``: it must belong to root or to this process's user and be writable by neither
    group nor others (a directory with the sticky bit, like ``/tmp``, may be)."""
    uid = os.geteuid()
    if st.st_uid not in (0, uid):
        return f"{what} {path} is owned by uid {st.st_uid} (neither root nor uid {uid})"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if writable and not sticky_dir:
        who = {
            stat.S_IWGRP: "its group",
            stat.S_IWOTH: "others",
        }.get(writable, "its group and others")
        return f"{what} {path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_trusted(path: Path, st: Optional[os.stat_result] = None) -> None:
    """Refuses a library that someone other than root or this user could have written or
    could replace: the file itself (``st``: its status, e.g. from ``fstat`` of the descriptor
    about to be loaded) and every directory above its resolved path.

    Raises :class:`UntrustedLibraryError` naming the path and the reason."""
    real = Path(os.path.realpath(path))
    reason = _untrusted(real, "library", st if st is not None else os.stat(real))
    for parent in real.parents:
        reason = reason or _untrusted(parent, "directory", os.stat(parent))
    if reason is not None:
        raise UntrustedLibraryError(
            f"refusing to load {path}: {reason}; fix its owner and mode, or point "
            "BELAYER_LIB at a trusted copy",
            path=str(path),
        )


def find_library() -> str:
    """The path of ``libbelayer``: the first existing candidate (see :func:`candidates`).

    Raises :class:`LibraryNotFoundError` when there is none (or ``$BELAYER_LIB`` names
    nothing), :class:`UntrustedLibraryError` when the candidate found fails
    :func:`check_trusted` (a later candidate is not tried then)."""
    env = os.environ.get("BELAYER_LIB")
    found = candidates()
    if env and not found[0].is_file():
        raise LibraryNotFoundError(
            f"BELAYER_LIB={env} does not name {LIBRARY_FILE} or a directory holding it"
        )
    for path in found:
        if path.is_file():
            check_trusted(path)
            return str(path)
    raise LibraryNotFoundError(
        "libbelayer.so not found: build it with `cargo build -p belayer-capi` and set "
        "BELAYER_LIB to the library (or its directory) or CARGO_TARGET_DIR to the target "
        "directory, or install it next to the package or in a system library directory"
    )


def _open_checked(path: str) -> ctypes.CDLL:
    """Loads the library file at ``path`` through a descriptor whose ``fstat`` passed
    :func:`check_trusted`, so the file checked is the file loaded (no swap in between)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedLibraryError(f"refusing to load {path}: not a regular file", path=path)
        check_trusted(Path(path), st)
        return ctypes.CDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _declare(lib: ctypes.CDLL) -> None:
    client = c_uint64
    u8p = c_char_p  # const uint8_t * passed from bytes (NULL = None)
    sigs = {
        "belayer_abi_version": ([], c_uint32),
        "belayer_version": ([], c_char_p),
        "belayer_status_name": ([c_int], c_char_p),
        "belayer_last_error": ([], c_char_p),
        "belayer_string_free": ([POINTER(c_void_p)], None),
        "belayer_buf_free": ([POINTER(Buf)], None),
        "belayer_connect": ([c_char_p, POINTER(c_uint64)], c_int),
        "belayer_close": ([client], c_int),
        "belayer_ping": ([client, POINTER(c_void_p)], c_int),
        "belayer_image_import": ([client, c_char_p, c_char_p], c_int),
        "belayer_image_pull": ([client, c_char_p, c_char_p, c_char_p, c_char_p, c_int], c_int),
        "belayer_sandbox_create": ([client, c_char_p, c_char_p, POINTER(c_void_p)], c_int),
        "belayer_sandbox_inspect": ([client, c_char_p, POINTER(SandboxInfo)], c_int),
        "belayer_sandbox_info_free": ([POINTER(SandboxInfo)], None),
        "belayer_sandbox_destroy": ([client, c_char_p], c_int),
        "belayer_sandbox_create_with": (
            [client, c_char_p, POINTER(CreateOptions), POINTER(c_void_p)],
            c_int,
        ),
        "belayer_sandbox_inspect_with": ([client, c_char_p, POINTER(SandboxEntry)], c_int),
        "belayer_sandbox_entry_free": ([POINTER(SandboxEntry)], None),
        "belayer_sandbox_list": ([client, POINTER(SandboxList)], c_int),
        "belayer_sandbox_list_free": ([POINTER(SandboxList)], None),
        "belayer_checkpoint_list": ([client, c_char_p, POINTER(CheckpointList)], c_int),
        "belayer_checkpoint_list_free": ([POINTER(CheckpointList)], None),
        "belayer_gc": ([client, c_int64, c_char_p, POINTER(GcResult)], c_int),
        "belayer_exec": ([client, c_char_p, c_char_p, c_uint64, POINTER(ExecResult)], c_int),
        "belayer_exec_with": (
            [
                client,
                c_char_p,
                c_char_p,
                POINTER(ExecOptions),
                POINTER(ExecResult),
                POINTER(ExecVerdict),
            ],
            c_int,
        ),
        "belayer_exec_result_free": ([POINTER(ExecResult)], None),
        "belayer_checkpoint": (
            [client, c_char_p, c_uint64, u8p, c_size_t, POINTER(CheckpointInfo)],
            c_int,
        ),
        "belayer_checkpoint_info_free": ([POINTER(CheckpointInfo)], None),
        "belayer_maybe_checkpoint": (
            [
                client,
                c_char_p,
                c_uint64,
                u8p,
                c_size_t,
                POINTER(Step),
                POINTER(Policy),
                POINTER(Decision),
            ],
            c_int,
        ),
        "belayer_restore": ([client, c_char_p, c_bool, POINTER(RestoreInfo)], c_int),
        "belayer_restore_info_free": ([POINTER(RestoreInfo)], None),
        "belayer_restore_to": (
            [client, c_char_p, c_uint64, c_bool, POINTER(RestoreInfo), POINTER(c_uint64)],
            c_int,
        ),
        "belayer_restore_checkpoint": (
            [client, c_char_p, c_char_p, c_bool, POINTER(RestoreInfo)],
            c_int,
        ),
        "belayer_fork": (
            [client, c_char_p, c_char_p, c_bool, c_uint64, c_uint32, c_bool, POINTER(ForkInfo)],
            c_int,
        ),
        "belayer_fork_info_free": ([POINTER(ForkInfo)], None),
        "belayer_context_append": (
            [client, c_char_p, c_uint64, u8p, c_size_t, POINTER(c_uint64)],
            c_int,
        ),
        "belayer_context_lookup": (
            [client, c_char_p, c_int64, POINTER(c_uint64), POINTER(Buf)],
            c_int,
        ),
        "belayer_context_remove": ([client, c_char_p], c_int),
        "belayer_subscribe": ([c_char_p, POINTER(c_uint64)], c_int),
        "belayer_next_event": ([c_uint64, c_int64, POINTER(Event)], c_int),
        "belayer_event_free": ([POINTER(Event)], None),
        "belayer_unsubscribe": ([c_uint64], c_int),
        "belayer_upload": (
            [client, c_char_p, c_char_p, c_char_p, c_uint64, POINTER(TransferResult)],
            c_int,
        ),
        "belayer_download": (
            [client, c_char_p, c_char_p, c_char_p, c_uint64, POINTER(TransferResult)],
            c_int,
        ),
        "belayer_upload_archive": (
            [client, c_char_p, c_int, c_char_p, c_uint64, POINTER(TransferResult)],
            c_int,
        ),
        "belayer_download_archive": (
            [client, c_char_p, c_char_p, c_int, c_uint64, POINTER(TransferResult)],
            c_int,
        ),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


_LIB: Optional[ctypes.CDLL] = None
_PATH: Optional[str] = None


def load() -> ctypes.CDLL:
    """The loaded library (found, checked for trust and ABI version on first use).

    Raises :class:`LibraryNotFoundError` or :class:`UntrustedLibraryError`."""
    global _LIB, _PATH
    if _LIB is None:
        path = find_library()
        lib = _open_checked(path)
        try:
            _declare(lib)
        except AttributeError as e:
            raise LibraryNotFoundError(f"{path} is not a libbelayer these bindings know: {e}") from e
        version = lib.belayer_abi_version()
        if version != ABI_VERSION:
            raise LibraryNotFoundError(
                f"{path} has C ABI version {version}, these bindings need {ABI_VERSION}"
            )
        _LIB, _PATH = lib, path
    return _LIB


def path() -> str:
    """Path of the loaded library."""
    load()
    assert _PATH is not None
    return _PATH


def take_string(ptr: c_void_p) -> str:
    """Copies a library-owned ``char *`` out and frees it."""
    if not ptr.value:
        return ""
    try:
        return ctypes.string_at(ptr.value).decode("utf-8", "replace")
    finally:
        load().belayer_string_free(ctypes.byref(ptr))


def string_field(value: Optional[int]) -> str:
    """Reads a ``char *`` field of a result struct (freed with the struct)."""
    return ctypes.string_at(value).decode("utf-8", "replace") if value else ""


def buf_bytes(buf: Buf) -> bytes:
    """Copies a ``BelayerBuf`` out (not freeing it)."""
    return ctypes.string_at(buf.data, buf.len) if buf.len else b""
