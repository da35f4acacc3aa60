"""Connections to the PostgreSQL store's database: the URL checked and redacted for messages, the libpq
options every connection gets, and the pool each store object keeps per process (:class:`_Pool`)."""

from __future__ import annotations

import contextlib
import logging
import re
import select
import threading
from typing import Any, Callable, Dict, List

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from agl._util.fork_safety import keep_unused
from agl.errors import AglError, StoreClosedError
from agl.store.postgres.failures import _oneline

logger = logging.getLogger("agl.store.postgres.store")  # the store's one logger, whichever module logs

_CONNECT_TIMEOUT_S = 10

# libpq settings on every connection, unless the URL sets its own (``?tcp_user_timeout=60000``). Without them
# a silent network (a partition, a database host gone without a reset) leaves a call waiting on its open
# connection until the kernel gives up retransmitting (~15 min on Linux): no error, so no retry and no outage
# ride-out. With them the kernel ends such a connection within about 40 s: a statement waiting for an answer
# sends keepalive probes after 10 s of silence, and data or probes unanswered for 30 s (tcp_user_timeout, in
# ms) end it; the call then fails as for any lost connection (retried, or "commit unknown" for a write).
CONNECTION_OPTIONS: Dict[str, Any] = {
    "connect_timeout": _CONNECT_TIMEOUT_S,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def _connection_options(dsn: str) -> Dict[str, Any]:
    """The keyword arguments of every connect: ``CONNECTION_OPTIONS`` less what ``dsn`` sets itself (a
    keyword would override the URL's value), and agl's application name."""
    given = conninfo_to_dict(dsn)
    options = {key: value for key, value in CONNECTION_OPTIONS.items() if key not in given}
    return {"autocommit": True, "application_name": "agl-store", **options}


# Where a password may be, for messages about a string libpq cannot read (so it cannot say which part is the
# password): in a URL, its user info up to the last "@" and a ``password=`` query parameter; in a key=value
# string, the value of ``password``.
_URL_PASSWORDS = (re.compile(r"^(\w+://[^:@/]*:)(.*)(@)"), re.compile(r"([?&]password=)([^&]*)()"))
_KEY_VALUE_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|.*?)()(?=\s+\w+\s*=|\s*$)")


def _checked_dsn(dsn: str) -> str:
    """``dsn``, or AglError saying what is wrong with it (psycopg's ProgrammingError named no store or URL)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise invalid_url(dsn, exc) from None  # not chained: libpq's own message may quote the password
    timeout = params.get("connect_timeout")
    if timeout is not None and not str(timeout).strip().lstrip("-").isdigit():  # psycopg int()s it (3.1: bare)
        raise invalid_url(dsn, ValueError(f"bad value for connect_timeout: {timeout!r} (whole seconds)"))
    return dsn


def invalid_url(dsn: str, exc: BaseException) -> AglError:
    """AglError saying that ``dsn`` is not a valid PostgreSQL URL and why (``exc``), without any of its password:
    libpq quotes the token it cannot read (``invalid percent-encoded token: "s3cr%ZZet"``), which may be it."""
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        why = _unreadable(dsn)
    else:
        why = _oneline(exc).replace(str(password), "***") if password else _oneline(exc)
    return AglError(
        f"the PostgreSQL URL given for the store is not valid: {why}; write it as "
        "postgresql://user:password@host:port/database, with only libpq's parameters after '?' "
        "(https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-PARAMKEYWORDS)"
    )


def _unreadable(dsn: str) -> str:
    """Why libpq cannot read ``dsn``, told from the same string with its password masked: libpq's error for
    what else is wrong, or that the password is what it cannot read."""
    masked = dsn
    for pattern in _URL_PASSWORDS if "://" in dsn else (_KEY_VALUE_PASSWORD,):
        masked = pattern.sub(r"\1***\3", masked)
    try:
        conninfo_to_dict(masked)
    except psycopg.ProgrammingError as exc:
        return _oneline(exc)
    return (
        "its password cannot be read (not shown here): in a URL, percent-encode its special characters "
        "(% as %25, @ as %40, / as %2F, : as %3A); in key=value form, quote it (password='...')"
    )


def redacted(dsn: str) -> str:
    """``dsn`` without its password, for messages and ``repr``."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    params.pop("password", None)
    return make_conninfo("", **params)


class _Pool:
    """Up to ``max_size`` connections shared by the threads of one process, opened on demand.

    A thread takes a connection for one operation and gives it back; when all are busy it waits. Threads
    that only wait for work (dequeue with a timeout) hold none while they sleep.
    """

    def __init__(self, connect: Callable[[], Any], max_size: int) -> None:
        self._connect = connect
        self._max_size = max_size
        self._idle: List[Any] = []
        self._size = 0
        self._cond = threading.Condition()
        self._closed = False

    def get(self) -> Any:
        """A connection whose session is open as far as can be seen without a round trip.

        An idle session the server ended (restart, ``pg_terminate_backend``) has its goodbye or end of file
        waiting on the socket: it is replaced here, before a statement is sent on it, because a statement
        that commits on its own cannot be retried once sent (it may have been committed).
        """
        while True:
            with self._cond:
                while not self._idle and self._size >= self._max_size and not self._closed:
                    self._cond.wait()
                if self._closed:
                    raise StoreClosedError("the store was closed while this call waited for a connection")
                conn = self._idle.pop() if self._idle else None
                if conn is None:
                    self._size += 1
            if conn is None:
                break
            if _idle_session_open(conn):
                return conn
            logger.warning("PostgreSQL ended an idle session of the pool (server restart or session killed); retrying")
            self._discard(conn)
        try:
            return self._connect()
        except BaseException:
            with self._cond:
                self._size -= 1
                self._cond.notify()
            raise

    def put(self, conn: Any) -> None:
        """Give a connection back; a broken one (or any, once the pool is closed) is closed instead."""
        reuse = not (self._closed or conn.closed or conn.broken)
        if reuse and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            reuse = False  # an operation was interrupted mid-transaction (KeyboardInterrupt): start afresh
        if not reuse:
            self._discard(conn)
            return
        with self._cond:
            self._idle.append(conn)
            self._cond.notify()

    def _discard(self, conn: Any) -> None:
        """Close a connection of the pool and free its place."""
        with contextlib.suppress(psycopg.Error):
            conn.close()
        with self._cond:
            self._size -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._size -= len(idle)
            self._cond.notify_all()
        for conn in idle:
            with contextlib.suppress(psycopg.Error):
                conn.close()

    def abandon(self) -> None:
        """In a forked child: forget the parent's connections without closing them."""
        keep_unused(self._idle)
        self._idle = []


def _idle_session_open(conn: Any) -> bool:
    """False if the server has ended this idle session: it sends nothing else unasked to a session that does
    not LISTEN, so anything readable (an error saying why, or end of file) means the session is gone."""
    if conn.closed:
        return False
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    return not poller.poll(0)
