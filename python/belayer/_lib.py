"""Loading ``libbelayer`` and declaring its C ABI (``belayer.h``) for ctypes.

Internal module: the public API is in :mod:`belayer`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
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


def candidates() -> List[Path]:
    """Where the library is looked for, in order (see the package README): ``$BELAYER_LIB``,
    next to the package, ``$CARGO_TARGET_DIR/{release,debug}``, then ``target/{release,debug}``
    in the current directory, the package's directory and their parents (within one target
    directory the newer of the two builds comes first)."""
    found: List[Path] = []
    env = os.environ.get("BELAYER_LIB")
    if env:
        p = Path(env)
        found.append(p / LIBRARY_FILE if p.is_dir() else p)
    here = Path(__file__).resolve().parent
    found.append(here / LIBRARY_FILE)
    roots: List[Path] = []
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        roots.append(Path(target))
    for start in (Path.cwd().resolve(), here):
        roots += [d / "target" for d in (start, *start.parents)]
    for root in roots:
        found += _newest([root / profile / LIBRARY_FILE for profile in ("release", "debug")])
    return found


def find_library() -> str:
    """The path (or loader name) of ``libbelayer``; raises ``OSError`` when none is found."""
    env = os.environ.get("BELAYER_LIB")
    if env and not candidates()[0].is_file():
        raise OSError(f"BELAYER_LIB={env} does not name {LIBRARY_FILE} or a directory holding it")
    for path in candidates():
        if path.is_file():
            return str(path)
    name = ctypes.util.find_library("belayer")
    if name:
        return name
    raise OSError(
        "libbelayer.so not found: build it with `cargo build -p belayer-capi` or set "
        "BELAYER_LIB to the library (or its directory)"
    )


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
        "belayer_sandbox_create": ([client, c_char_p, c_char_p, POINTER(c_void_p)], c_int),
        "belayer_sandbox_inspect": ([client, c_char_p, POINTER(SandboxInfo)], c_int),
        "belayer_sandbox_info_free": ([POINTER(SandboxInfo)], None),
        "belayer_sandbox_destroy": ([client, c_char_p], c_int),
        "belayer_exec": ([client, c_char_p, c_char_p, c_uint64, POINTER(ExecResult)], c_int),
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
        "belayer_context_append": (
            [client, c_char_p, c_uint64, u8p, c_size_t, POINTER(c_uint64)],
            c_int,
        ),
        "belayer_context_lookup": (
            [client, c_char_p, c_int64, POINTER(c_uint64), POINTER(Buf)],
            c_int,
        ),
        "belayer_subscribe": ([c_char_p, POINTER(c_uint64)], c_int),
        "belayer_next_event": ([c_uint64, c_int64, POINTER(Event)], c_int),
        "belayer_event_free": ([POINTER(Event)], None),
        "belayer_unsubscribe": ([c_uint64], c_int),
    }
    for name, (argtypes, restype) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype


_LIB: Optional[ctypes.CDLL] = None
_PATH: Optional[str] = None


def load() -> ctypes.CDLL:
    """The loaded library (loaded and checked on first use)."""
    global _LIB, _PATH
    if _LIB is None:
        path = find_library()
        lib = ctypes.CDLL(path)
        _declare(lib)
        version = lib.belayer_abi_version()
        if version != ABI_VERSION:
            raise OSError(
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
