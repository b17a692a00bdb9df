"""Daemon events for asyncio: :class:`AsyncSubscription`, an async iterator over a
:class:`belayer.Subscription` (its own connection, read by a worker thread of its own)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import AsyncIterator, Optional

from .. import _lib
from ..client import Event, Subscription, Text
from ..errors import BadHandleError, BelayerError, EventTimeoutError

#: Longest single wait of the worker thread for an event, seconds: a read abandoned by its
#: caller ends within this time, and the stream's timeouts are this precise.
POLL_S = 0.25


class AsyncSubscription:
    """A stream of daemon events (sandbox failed, checkpoint ready) for one event loop.

    The stream is opened by ``async with`` (or :meth:`open`, or the first read) and receives
    the events published from then on. ``async for ev in subscription`` yields them forever.
    Cancellation-safe: a read cancelled (or timed out by ``asyncio.wait_for``) while the
    worker thread waits keeps that wait, and an event it brings is the answer of the next
    read, so no event is lost. Read it from one task at a time.

    Each subscription is a connection of its own: ``belayerd`` serves at most 8 event streams
    per non-root uid by default (``BusyError`` beyond).

    Args:
        socket: the daemon's socket (``None``: the library's default).
    """

    def __init__(self, socket: Optional[Text] = None) -> None:
        _lib.load()
        self.socket = socket
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="belayer-events")
        self._opening: Optional["Future[Subscription]"] = None
        self._sub: Optional[Subscription] = None
        self._pending: Optional["Future[Optional[Event]]"] = None
        self._closed = False

    async def open(self) -> "AsyncSubscription":
        """Connects and subscribes (once; later calls return at once). Raises
        :class:`~belayer.errors.DaemonConnectionError`, :class:`~belayer.errors.BusyError`."""
        if self._closed:
            raise BadHandleError(-8, "BELAYER_E_BAD_HANDLE", "the subscription is closed")
        if self._sub is None:
            if self._opening is None:
                self._opening = self._executor.submit(Subscription, self.socket)
            opening = self._opening
            try:
                sub = await asyncio.wrap_future(opening)
            except asyncio.CancelledError:
                if opening.cancelled():
                    self._opening = None
                raise
            except BaseException:
                self._opening = None
                raise
            if self._closed:
                _close_quietly(sub)
                raise BadHandleError(-8, "BELAYER_E_BAD_HANDLE", "the subscription is closed")
            self._sub = sub
        return self

    async def next(self, timeout: Optional[float] = None) -> Optional[Event]:
        """The next event, or ``None`` when none came within ``timeout`` seconds (``None``:
        wait forever)."""
        await self.open()
        sub = self._sub
        assert sub is not None
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            if self._pending is None:
                wait = POLL_S
                if deadline is not None:
                    wait = min(POLL_S, max(0.0, deadline - time.monotonic()))
                self._pending = self._executor.submit(sub.next, wait)
            pending = self._pending
            try:
                event = await asyncio.wrap_future(pending)
            except asyncio.CancelledError:
                if pending.cancelled():
                    self._pending = None
                raise
            except BaseException:
                self._pending = None
                raise
            self._pending = None
            if event is not None:
                return event
            if deadline is not None and time.monotonic() >= deadline:
                return None

    async def wait_for(self, kind: str, sandbox: str, timeout: float = 20.0) -> Event:
        """Waits for an event of ``kind`` about ``sandbox``, skipping others; raises
        :class:`~belayer.errors.EventTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EventTimeoutError(-9, "BELAYER_E_TIMEOUT", f"no {kind} event for {sandbox}")
            event = await self.next(left)
            if event is not None and event.kind == kind and event.sandbox == sandbox:
                return event

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._closed:
            raise StopAsyncIteration
        event = await self.next(None)
        assert event is not None
        return event

    def close(self) -> None:
        """Ends the stream without waiting (a read in flight ends within :data:`POLL_S`, then
        the connection closes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        sub, self._sub = self._sub, None
        if sub is not None:
            if self._pending is not None and not self._pending.done():
                self._pending.add_done_callback(lambda _: _close_quietly(sub))
            else:
                _close_quietly(sub)
        elif self._opening is not None:
            self._opening.add_done_callback(_close_opened)
        self._executor.shutdown(wait=False)

    async def aclose(self) -> None:
        """:meth:`close`, then waits for the worker thread's read in flight to end."""
        pending = self._pending
        self.close()
        if pending is not None and not pending.done():
            await asyncio.wait([asyncio.wrap_future(pending)])

    async def __aenter__(self) -> "AsyncSubscription":
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _close_quietly(sub: Subscription) -> None:
    try:
        sub.close()
    except BelayerError:
        pass


def _close_opened(opening: "Future[Subscription]") -> None:
    if not opening.cancelled() and opening.exception() is None:
        _close_quietly(opening.result())
