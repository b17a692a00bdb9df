"""A bounded pool of daemon connections for one event loop.

Each connection is a synchronous :class:`belayer.Client` (one library handle, one request at a
time). A call takes a free connection, runs the blocking library call in a worker thread of
the pool's own executor (the library is loaded with :class:`ctypes.CDLL`, which releases the
GIL for the duration of every foreign call, so the loop and the other workers keep running),
and gives the connection back when the call ends.

Invariants (all pool state is touched only on the loop's thread):

* A connection is back in the pool only after its library call has returned in its worker
  thread, whatever happened to the coroutine that awaited it (cancelled, timed out), so the
  response on a connection is always read by the call that sent the request.
* A connection whose call failed at the transport level (the daemon closed it or sent
  something unexpected, or it was closed to make room: ``BusyError``) is closed and replaced.
* A new connection is pinged once before its first use, so refusals at admission (the daemon
  at its connection limit, a peer it does not serve) surface there, where nothing was
  handled yet.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional, Tuple, TypeVar

from .. import _lib
from ..client import Client, Text
from ..errors import BadHandleError, BelayerError, BusyError, InvalidArgumentError

T = TypeVar("T")

#: How often a call that met ``BusyError`` (the daemon handled nothing) is tried again.
BUSY_RETRIES = 3
#: After the daemon refused a new connection, seconds during which the pool stays at the size
#: it had then instead of opening more.
BUSY_BACKOFF_S = 1.0
#: Connections idle longer than this many seconds are closed instead of reused (the daemon
#: closes connections idle for its ``idle_timeout``, 3600 s by default).
DEFAULT_MAX_IDLE_S = 600.0


def default_max_connections() -> int:
    """The default pool size: 64 for root, 24 for other users.

    ``belayerd`` serves at most 256 connections at once by default, 32 of them kept for root,
    and at most 32 per non-root uid (``max_connections*`` in its config). Root has no per-uid
    cap, so 64 connections fit with room for other clients. A non-root user also needs
    connections for its synchronous clients, the CLI and its event streams (each a connection
    too, up to 8), so its pool keeps 8 of its 32 free; a bigger pool would make the daemon
    close the user's own idle connections to make room (``BusyError``), which the pool
    absorbs, but at the cost of reconnects.
    """
    return 64 if os.geteuid() == 0 else 24


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool (counts of connections, and of calls waiting for one).

    Attributes:
        limit: the most connections the pool opens (``max_connections``).
        open: connections open or being opened (``in_use + idle + opening``).
        in_use: connections whose library call is running (possibly for a cancelled caller).
        idle: connections ready for the next call.
        opening: connections being opened (connect and ping).
        waiting: calls waiting for a connection.
    """

    limit: int
    open: int
    in_use: int
    idle: int
    opening: int
    waiting: int


def _reusable(exc: Optional[BaseException]) -> bool:
    """Whether a connection stays usable after its call ended with ``exc``: a result, a daemon
    error reply on the request (codes -20 and below, but ``BusyError``, which is sent when the
    daemon closes the connection) or an argument refused before any request."""
    if exc is None:
        return True
    if isinstance(exc, BusyError):
        return False
    if isinstance(exc, BelayerError):
        return isinstance(exc, InvalidArgumentError) or -99 < exc.code <= -20
    return isinstance(exc, (ValueError, TypeError))


def _close_quietly(conn: Client) -> None:
    try:
        conn.close()
    except BelayerError:
        pass


class _Flight:
    """Hand-over state of one call whose result has an owner (a created sandbox): either the
    awaiting coroutine takes the result, or, when it was cancelled first, the worker thread
    cleans it up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.delivered = False


class ConnectionPool:
    """At most ``limit`` connections to the daemon at ``socket``, opened on demand.

    Bound to the event loop of its first call; a call from another loop raises
    ``RuntimeError``. Calls beyond the free connections wait (on the loop, never blocking it)
    in arrival order.

    Args:
        socket: the daemon's socket (``None``: the library's default).
        limit: the most connections held at once (at least 1).
        max_idle_s: a connection idle longer than this is closed rather than reused, seconds.
    """

    def __init__(self, socket: Optional[Text], limit: int, max_idle_s: float) -> None:
        if limit < 1:
            raise ValueError(f"max_connections must be at least 1, got {limit}")
        _lib.load()  # on this thread, before any worker needs it
        self.socket = socket
        self.limit = limit
        self.max_idle_s = max_idle_s
        self._executor = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="belayer-aio")
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._idle: List[Tuple[Client, float]] = []
        self._waiters: Deque["asyncio.Future[Client]"] = deque()
        self._count = 0
        self._opening = 0
        self._busy_cap = limit
        self._busy_until = 0.0
        self._closed = False
        self._drained: Optional[asyncio.Event] = None
        self._undoing: "set[asyncio.Task[None]]" = set()

    # -- state ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stats(self) -> PoolStats:
        """Current counts (see :class:`PoolStats`)."""
        idle = len(self._idle)
        return PoolStats(
            limit=self.limit,
            open=self._count,
            in_use=self._count - idle - self._opening,
            idle=idle,
            opening=self._opening,
            waiting=sum(1 for w in self._waiters if not w.done()),
        )

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._drained = asyncio.Event()
        elif self._loop is not loop:
            raise RuntimeError("this AsyncClient belongs to another event loop")
        return loop

    def _closed_error(self) -> BadHandleError:
        return BadHandleError(-8, "BELAYER_E_BAD_HANDLE", "the AsyncClient is closed")

    def _cap(self) -> int:
        if time.monotonic() < self._busy_until:
            return min(self.limit, self._busy_cap)
        return self.limit

    # -- taking and giving back connections (loop thread) ---------------------------------

    def _dispatch(self) -> None:
        """Hands idle connections to waiters in order, then opens connections for the waiters
        left, within the cap."""
        while self._waiters and self._waiters[0].done():
            self._waiters.popleft()
        now = time.monotonic()
        while self._waiters and self._idle:
            conn, since = self._idle.pop()
            if now - since > self.max_idle_s:
                self._discard(conn)
                continue
            waiter = self._waiters.popleft()
            if waiter.done():
                self._idle.append((conn, since))
                continue
            waiter.set_result(conn)
        waiting = sum(1 for w in self._waiters if not w.done())
        while waiting > self._opening and self._count < self._cap() and not self._closed:
            self._count += 1
            self._opening += 1
            cfut = self._executor.submit(self._open)
            cfut.add_done_callback(self._from_thread(self._opened))

    def _open(self) -> Client:
        if self._closed:
            raise self._closed_error()
        conn = Client(self.socket)
        try:
            conn.ping()
        except BaseException:
            _close_quietly(conn)
            raise
        return conn

    def _from_thread(
        self, fn: Callable[["Future[T]"], None], conn: Optional[Client] = None
    ) -> Callable[["Future[T]"], None]:
        """A done-callback for a worker's future that runs ``fn(future)`` on the loop. When the
        loop is gone already, the connection the call used (``conn``) or returned is closed
        right there instead."""
        loop = self._loop
        assert loop is not None

        def callback(cfut: "Future[T]") -> None:
            try:
                loop.call_soon_threadsafe(fn, cfut)
            except RuntimeError:
                orphan = conn
                if orphan is None and not cfut.cancelled() and cfut.exception() is None:
                    value = cfut.result()
                    orphan = value if isinstance(value, Client) else None
                if orphan is not None:
                    _close_quietly(orphan)

        return callback

    def _opened(self, cfut: "Future[Client]") -> None:
        self._opening -= 1
        if cfut.cancelled() or cfut.exception() is not None:
            self._count -= 1
            exc = None if cfut.cancelled() else cfut.exception()
            if isinstance(exc, BusyError) and self._count > 0:
                self._note_busy()
            elif exc is not None:
                # Nothing would serve the waiters now: each gets the error.
                for waiter in self._waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)
                self._waiters.clear()
            self._settle()
            return
        self._give(cfut.result())

    def _note_busy(self) -> None:
        """The daemon is at its connection limit (it refused a connection, or closed one of
        ours to make room): make do with the connections held, for a while."""
        self._busy_cap = max(1, self._count)
        self._busy_until = time.monotonic() + BUSY_BACKOFF_S
        assert self._loop is not None
        self._loop.call_later(BUSY_BACKOFF_S, self._dispatch)

    def _give(self, conn: Client) -> None:
        if self._closed:
            self._discard(conn)
        else:
            self._idle.append((conn, time.monotonic()))
        self._settle()

    def _discard(self, conn: Client) -> None:
        _close_quietly(conn)
        self._count -= 1

    def _settle(self) -> None:
        if self._closed:
            if self._count == 0 and self._drained is not None:
                self._drained.set()
        else:
            self._dispatch()

    async def _acquire(self) -> Client:
        if self._closed:
            raise self._closed_error()
        assert self._loop is not None
        waiter: "asyncio.Future[Client]" = self._loop.create_future()
        self._waiters.append(waiter)
        self._dispatch()
        try:
            conn = await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give(waiter.result())
            raise
        if self._closed:
            self._give(conn)
            raise self._closed_error()
        return conn

    # -- calls ------------------------------------------------------------------------------

    async def run(
        self,
        fn: Callable[[Client], T],
        abandon: Optional[Callable[[Client, T], None]] = None,
    ) -> T:
        """Runs ``fn(connection)`` in a worker thread on a connection of the pool and returns
        its result (or raises its exception).

        When the awaiting task is cancelled, ``fn`` still runs to its end (unless it had not
        started: then it never runs) and only then is the connection given back; its result
        is dropped, or, with ``abandon``, passed to ``abandon(connection, result)`` (in a
        worker thread, on a connection) to undo it. A ``BusyError`` (the daemon closed the
        connection to make room, or refused a new one; it handled nothing) is retried on
        another connection up to :data:`BUSY_RETRIES` times.

        Raises :class:`~belayer.errors.BadHandleError` once the pool is closed.
        """
        loop = self._bind()
        for attempt in range(BUSY_RETRIES + 1):
            try:
                return await self._run_once(loop, fn, abandon)
            except BusyError:
                if attempt == BUSY_RETRIES or self._closed:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    async def _run_once(
        self,
        loop: asyncio.AbstractEventLoop,
        fn: Callable[[Client], T],
        abandon: Optional[Callable[[Client, T], None]],
    ) -> T:
        conn = await self._acquire()
        flight = _Flight()

        def work() -> T:
            if self._closed:
                raise self._closed_error()
            value = fn(conn)
            if abandon is not None:
                with flight.lock:
                    if not flight.abandoned:
                        flight.delivered = True
                        return value
                abandon(conn, value)
            return value

        def finished(cfut: "Future[T]") -> None:
            exc = None if cfut.cancelled() else cfut.exception()
            if _reusable(exc):
                self._give(conn)
                return
            self._discard(conn)
            if isinstance(exc, BusyError):
                self._note_busy()
            self._settle()

        cfut = self._executor.submit(work)
        cfut.add_done_callback(self._from_thread(finished, conn))
        try:
            return await asyncio.wrap_future(cfut, loop=loop)
        except asyncio.CancelledError:
            if abandon is not None:
                with flight.lock:
                    flight.abandoned = True
                    late = flight.delivered
                if late:
                    # The worker handed the result over just before the cancellation: undo it
                    # from a task of its own.
                    cfut.add_done_callback(self._from_thread(self._undo(abandon)))
            raise

    def _undo(self, abandon: Callable[[Client, T], None]) -> Callable[["Future[T]"], None]:
        def undo(cfut: "Future[T]") -> None:
            if cfut.cancelled() or cfut.exception() is not None or self._closed:
                return
            value = cfut.result()
            task = asyncio.ensure_future(self.run(lambda c: abandon(c, value)))
            self._undoing.add(task)
            task.add_done_callback(self._undone)

        return undo

    def _undone(self, task: "asyncio.Task[None]") -> None:
        self._undoing.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an undo that failed has no one to tell

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the pool without waiting: later calls and calls waiting for a connection
        raise :class:`~belayer.errors.BadHandleError` (as do calls queued for a worker thread),
        idle connections close now and busy ones as soon as their call ends. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(self._closed_error())
        self._waiters.clear()
        for conn, _ in self._idle:
            self._discard(conn)
        self._idle.clear()
        self._executor.shutdown(wait=False)
        self._settle()

    async def aclose(self) -> None:
        """:meth:`close`, then waits until every connection is closed (calls in flight run to
        their end first; cancelling this wait leaves them to close on their own)."""
        self.close()
        if self._count > 0 and self._drained is not None:
            await self._drained.wait()
