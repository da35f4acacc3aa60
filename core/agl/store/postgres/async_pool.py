"""Connections for the PostgreSQL store's async calls: psycopg's ``AsyncConnection`` on one event loop.

Why: the store server runs a networked store's calls on worker threads, and on a small machine the hop to
a thread and back (two cross-thread wake-ups) costs more server CPU than the call itself: ~280 µs a request
on the development VM, ~1.1 ms per rollout (``benchmarks/server_overhead.py``). Running the calls inline
on the event loop saves that but makes every request wait for every other request's round trip. An async
connection waits for PostgreSQL on the loop itself: no thread, and other requests go on meanwhile.

A pool belongs to the event loop it was made on (asyncio objects and connections cannot move between
loops); :meth:`~agl.store.postgres.database.PostgresDatabase._async_pool` makes a new one when the running
loop changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Awaitable, Callable, List

import psycopg

from agl.errors import StoreClosedError

logger = logging.getLogger("agl.store.postgres.store")


class AsyncPool:
    """Up to ``max_size`` async connections shared by the tasks of one event loop, opened on demand."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], max_size: int, is_open: Callable[[Any], bool]) -> None:
        """``is_open(conn)``: whether an idle connection's session still looks open (checked before reuse: a
        statement that commits on its own cannot be sent again once sent, so a dead session is replaced
        before, not after)."""
        self.loop = asyncio.get_running_loop()
        self._connect = connect
        self._is_open = is_open
        self._slots = asyncio.Semaphore(max_size)
        self._idle: List[Any] = []
        self._closed = False

    async def get(self) -> Any:
        await self._slots.acquire()
        try:
            while self._idle:
                conn = self._idle.pop()
                if self._is_open(conn):
                    return conn
                logger.warning(
                    "PostgreSQL ended an idle session of the async pool (server restart or session killed); retrying"
                )
                _finish(conn)
            if self._closed:
                raise StoreClosedError("the store was closed while this call waited for a connection")
            return await self._connect()
        except BaseException:
            self._slots.release()
            raise

    def put(self, conn: Any) -> None:
        """Give a connection back; a broken one, one left inside a transaction, or any once the pool is
        closed is closed instead."""
        reuse = not (self._closed or conn.closed or conn.broken)
        if reuse and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            reuse = False
        if reuse:
            self._idle.append(conn)
        else:
            _finish(conn)
        self._slots.release()

    def close(self) -> None:
        """Close the idle connections; those in use close when put back. From another thread while the loop
        runs (a store closed under its server), the idle ones are closed on the loop, which is using them."""
        self._closed = True
        if self.loop.is_running() and _running_loop() is not self.loop:
            try:
                self.loop.call_soon_threadsafe(self._close_idle)
                return
            except RuntimeError:  # the loop closed meanwhile: nobody uses the connections any more
                pass
        self._close_idle()

    def _close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _finish(conn)

    def abandon(self) -> List[Any]:
        """In a forked child: the parent's connections, to be kept referenced and never closed."""
        idle, self._idle = self._idle, []
        return idle


def _running_loop() -> Any:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _finish(conn: Any) -> None:
    """Close a connection without the event loop (libpq's own close: nothing to await)."""
    with contextlib.suppress(psycopg.Error, OSError):
        conn.pgconn.finish()
