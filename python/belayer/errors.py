"""Exceptions raised by the bindings, one per ``BELAYER_E_*`` status code of ``belayer.h``.

Every exception is a :class:`BelayerError` carrying the status ``code``, its C name
(``status``) and the library's message (``belayer_last_error()`` of the failing call).
"""

from __future__ import annotations

import builtins
from typing import Dict, Type


class BelayerError(Exception):
    """A libbelayer call failed.

    Attributes:
        code: the negative status code (``BELAYER_E_*``).
        status: its name, e.g. ``"BELAYER_E_UNKNOWN_SANDBOX"``.
        message: the library's description of the failure.
    """

    code: int = 0

    def __init__(self, code: int, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.code = code
        self.status = status
        self.message = message


class InvalidArgumentError(BelayerError, ValueError):
    """A NULL pointer, a string that is not UTF-8, or a value out of range."""


class DaemonConnectionError(BelayerError, builtins.ConnectionError):
    """The daemon (or memory server) could not be reached or the connection broke."""


class RefusedError(BelayerError):
    """The memory server refused the request."""


class MapError(BelayerError):
    """Mapping memory failed."""


class OwnerGoneError(BelayerError):
    """The memory server is gone."""


class CudaError(BelayerError):
    """A CUDA driver call failed, or no driver is present."""


class LayoutError(BelayerError):
    """A memory layout file is unreadable or invalid."""


class BadHandleError(BelayerError):
    """A handle is unknown: never issued, or already closed."""


class EventTimeoutError(BelayerError, builtins.TimeoutError):
    """No event arrived in time."""


class ProtocolError(BelayerError):
    """The daemon answered something the library does not expect (version skew)."""


class BadRequestError(BelayerError, ValueError):
    """The daemon found the request malformed or its arguments invalid."""


class UnknownSandboxError(BelayerError, LookupError):
    """No sandbox with that id."""


class UnknownImageError(BelayerError, LookupError):
    """No image with that name."""


class AlreadyExistsError(BelayerError):
    """The name is already taken."""


class InUseError(BelayerError):
    """The thing is in use."""


class InvalidStateError(BelayerError):
    """The sandbox is not in a state that allows the request."""


class CorruptCheckpointError(BelayerError):
    """A checkpoint failed verification."""


class CheckpointFailedError(BelayerError):
    """Taking a checkpoint failed; the previous one is still ready."""


class RestoreFailedError(BelayerError):
    """Restoring failed."""


class ExecFailedError(BelayerError):
    """Running an action failed (not the action's own non-zero exit)."""


class PermissionDeniedError(BelayerError, PermissionError):
    """The daemon refused this process."""


class UnsupportedError(BelayerError):
    """A kernel or tool feature is missing."""


class InternalError(BelayerError):
    """Anything else on the daemon's side."""


class NotFoundError(BelayerError, LookupError):
    """The looked-up record does not exist."""


class BusyError(BelayerError):
    """The daemon is at a connection or event-stream limit (or closed this idle connection to
    make room); the request was not handled: connect again later."""


class RestoreTimedOutError(RestoreFailedError):
    """A CRIU restore ran past its time limit and was killed; the sandbox is failed and its
    ready checkpoint untouched: restoring again may succeed."""


class TransferFailedError(BelayerError):
    """A file transfer failed: an archive member refused by the hardening rules (a ``..`` or
    absolute name, a device node, a symlink where a parent directory must be), a source that
    cannot be read, the helper killed, the transfer cancelled."""


class NoSpaceError(BelayerError):
    """The sandbox's disk limit (or the host file system, for a download) ran out during a
    transfer."""


class TransferTimedOutError(BelayerError, builtins.TimeoutError):
    """A file transfer ran past its timeout, or its helper made no progress for 30 s."""


class RegistryUnreachableError(BelayerError, builtins.ConnectionError):
    """A registry could not be reached (refused, unknown host, timeout, TLS)."""


class RegistryDeniedError(BelayerError, builtins.PermissionError):
    """A registry refused the credentials (or asked for some)."""


class CorruptImageError(BelayerError):
    """An image's content failed verification or was refused (a blob whose digest does not
    match, a truncated or missing blob, a hostile layer); nothing of it was kept."""


class ImageChangedError(BelayerError):
    """A restore was refused: the sandbox's image now has another digest than the one its
    checkpoint was taken on."""


class PanicError(BelayerError):
    """The library caught an internal panic."""


class LibraryNotFoundError(BelayerError, builtins.OSError):
    """No usable ``libbelayer.so`` was found where the package looks for it (see the package
    README), or the one found is not a libbelayer of this C ABI version. Raised by the Python
    side (``code`` 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "LIBRARY_NOT_FOUND", message)


class UntrustedLibraryError(BelayerError, builtins.PermissionError):
    """A ``libbelayer.so`` was found but refused: the file, or a directory above it, belongs
    to a user other than root and the current one, or is writable by group or others (someone
    else could have planted or could swap it). Raised before the library is loaded (``code``
    0); ``path`` is the candidate refused."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(0, "UNTRUSTED_LIBRARY", message)
        self.path = path


#: Status code -> exception class.
ERRORS: Dict[int, Type[BelayerError]] = {
    -1: InvalidArgumentError,
    -2: DaemonConnectionError,
    -3: RefusedError,
    -4: MapError,
    -5: OwnerGoneError,
    -6: CudaError,
    -7: LayoutError,
    -8: BadHandleError,
    -9: EventTimeoutError,
    -10: ProtocolError,
    -20: BadRequestError,
    -21: UnknownSandboxError,
    -22: UnknownImageError,
    -23: AlreadyExistsError,
    -24: InUseError,
    -25: InvalidStateError,
    -26: CorruptCheckpointError,
    -27: CheckpointFailedError,
    -28: RestoreFailedError,
    -29: ExecFailedError,
    -30: PermissionDeniedError,
    -31: UnsupportedError,
    -32: InternalError,
    -33: NotFoundError,
    -34: BusyError,
    -35: RestoreTimedOutError,
    -36: TransferFailedError,
    -37: NoSpaceError,
    -38: TransferTimedOutError,
    -39: RegistryUnreachableError,
    -40: RegistryDeniedError,
    -41: CorruptImageError,
    -42: ImageChangedError,
    -99: PanicError,
}
