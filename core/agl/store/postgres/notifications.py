"""How the PostgreSQL store's waiters learn of new work and finished rollouts: ``LISTEN``/``NOTIFY`` on one
connection per store object and process, whose thread wakes that process's waiting threads."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Set

import psycopg

from agl.errors import AglError, StoreClosedError
from agl.store.postgres.failures import _oneline
from agl.store.postgres.schema import DONE_CHANNEL, QUEUE_CHANNEL

logger = logging.getLogger("agl.store.postgres.store")  # the store's one logger, whichever module logs


class _Notifications:
    """One LISTEN connection per store object and process; its thread wakes this process's waiters.

    Each channel has a generation counter, bumped by every notification (and when the connection is lost
    or made again, as notifications may be missed then). A waiter notes the generation before it checks
    the database and sleeps until the generation moves: a notification sent after the check wakes it.

    While the connection is down (a database restart), waiting goes on by polling: a waiter looks at the
    database every ``_POLL_S`` seconds instead of raising, so a wait rides out an outage as every other
    operation does, and fails only when its own look at the database has retried for ``reconnect_timeout``.
    """

    _POLL_S = 0.5

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._cond = threading.Condition()
        self._generation = {QUEUE_CHANNEL: 0, DONE_CHANNEL: 0}
        self._listening = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()  # close() writes here to end the thread's select()

    @contextlib.contextmanager
    def listen(self, channel: str) -> Iterator[_Waiter]:
        with self._cond:
            if self._stop:
                raise StoreClosedError("the store was closed while waiting")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="agl-postgres-listen", daemon=True)
                self._thread.start()
            # the first wait of the process: until listening, or polling if that failed (see _wait)
            self._cond.wait_for(lambda: self._listening or self._error is not None or self._stop)
            seen = self._generation[channel]
        yield _Waiter(self, channel, seen)

    def _wait(self, waiter: _Waiter, timeout: Optional[float]) -> bool:
        with self._cond:
            if not self._listening:  # notifications would be missed: look at the database again soon
                timeout = self._POLL_S if timeout is None else min(timeout, self._POLL_S)
            moved = self._cond.wait_for(lambda: self._generation[waiter.channel] != waiter.seen or self._stop, timeout)
            waiter.seen = self._generation[waiter.channel]
            return bool(moved)

    def _bump(self, channels: Iterable[str]) -> None:
        with self._cond:
            for channel in channels:
                if channel in self._generation:
                    self._generation[channel] += 1
            self._cond.notify_all()

    # "notifications lost" is logged at most this often (each reconnect tries every 2 s at most, and while the
    # server refuses connections, e.g. "too many clients already", that went on for as long as the run lasted)
    _LOST_LOG_EVERY_S = 60.0

    def _run(self) -> None:
        delay = 0.05
        lost_logged_at: Optional[float] = None  # when "notifications lost" was last logged in this outage
        suppressed = 0
        while not self._stop:
            conn = None
            try:
                conn = self._connect()
                conn.execute(f"LISTEN {QUEUE_CHANNEL}")
                conn.execute(f"LISTEN {DONE_CHANNEL}")
                with self._cond:
                    self._listening, self._error = True, None
                    self._bump(list(self._generation))  # anything may have happened while we were not listening
                if lost_logged_at is not None:
                    logger.info("store notifications restored")
                delay, lost_logged_at, suppressed = 0.05, None, 0
                self._pump(conn)
            except (psycopg.Error, OSError, AglError) as exc:
                with self._cond:
                    if self._listening:  # sleeping waiters look again, then poll (see _wait)
                        self._bump(list(self._generation))
                    self._listening, self._error = False, exc
                    self._cond.notify_all()
                if not self._stop:
                    now = time.monotonic()
                    if lost_logged_at is None or now - lost_logged_at >= self._LOST_LOG_EVERY_S:
                        again = f" ({suppressed} more failed tries since the last report)" if suppressed else ""
                        logger.warning(
                            "store notifications lost (%s); reconnecting (waiters look at the database "
                            "meanwhile; said again at most every %g s)%s",
                            _oneline(exc),
                            self._LOST_LOG_EVERY_S,
                            again,
                        )
                        lost_logged_at, suppressed = now, 0
                    else:
                        suppressed += 1
                    select.select([self._wake_r], [], [], delay)  # close() cuts the back-off short
                    delay = min(delay * 2, 2.0)
            finally:
                if conn is not None:
                    with contextlib.suppress(psycopg.Error):
                        conn.close()
        with self._cond:
            self._listening = False
            self._cond.notify_all()

    def _pump(self, conn: Any) -> None:
        """Deliver notifications until ``close()``; raises when the connection is lost."""
        pgconn, fd = conn.pgconn, conn.fileno()
        while True:
            readable, _, _ = select.select([fd, self._wake_r], [], [])
            if self._wake_r in readable:
                return
            pgconn.consume_input()
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("the listening connection was closed by the server")
            channels: Set[str] = set()
            while (notify := pgconn.notifies()) is not None:
                channels.add(notify.relname.decode())
            if channels:
                self._bump(channels)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        self._wake_r.close()
        self._wake_w.close()


class _Waiter:
    def __init__(self, notifications: _Notifications, channel: str, seen: int) -> None:
        self._notifications = notifications
        self.channel = channel
        self.seen = seen

    def wait(self, timeout: Optional[float]) -> bool:
        return self._notifications._wait(self, timeout)
