"""Status codes of library calls and string arguments, shared by the modules of the API.

Internal module: the public API is in :mod:`belayer`.
"""

from __future__ import annotations

from typing import Optional, Union

from . import _lib
from .errors import ERRORS, BelayerError

#: A string argument: ``str`` (encoded as UTF-8) or raw ``bytes`` (passed as they are).
Text = Union[str, bytes]


def check(rc: int) -> None:
    """Raises the exception of status code ``rc`` (nothing for ``BELAYER_OK``)."""
    if rc == 0:
        return
    lib = _lib.load()
    message = (lib.belayer_last_error() or b"").decode("utf-8", "replace")
    status = (lib.belayer_status_name(rc) or b"").decode()
    raise ERRORS.get(rc, BelayerError)(rc, status, message)


def text_arg(text: Optional[Text]) -> Optional[bytes]:
    """``text`` as the bytes of a C string argument (``None`` stays NULL)."""
    if text is None or isinstance(text, bytes):
        return text
    return text.encode("utf-8")
