"""The store for many machines: one PostgreSQL database shared by the trainer and runners anywhere.

    store = PostgresLightningStore("postgresql://agl:secret@db-host:5432/agl")   # or open_store(url)

Why it is built this way:
- Runners on many machines claim work with ``FOR UPDATE SKIP LOCKED``: each claim locks the queued rows it
  takes and skips rows another claim holds, so claims never wait for each other nor hand out a rollout
  twice. Every other state change locks its rollout row (then the attempt's) first, so a completion, a
  cancel and a reap of the same attempt are applied one after the other, each seeing what the one before
  committed, and the shared rules (:mod:`agl.store._rules`) decide the outcome as in the other backends.
- Waiters are woken by ``LISTEN``/``NOTIFY``, not by polling: a writer's ``NOTIFY`` is sent when its
  transaction commits. Each store object keeps one listening connection per process (started on the
  first wait), whose thread wakes the waiting threads of that process.
- Connections come from a small pool (``max_connections`` per store object and process), opened on
  demand. A connection the server dropped (restart, ``pg_terminate_backend``, network cut) is replaced and
  the operation retried when nothing of it can have been committed; if the connection died while
  committing, the caller gets a :class:`~agl.errors.StoreUnavailableError` saying the outcome is unknown.
- Fork-safe (``multiprocess_safe``): a child process never touches its parent's connections (they stay
  referenced, never closed, as closing would end the parent's sessions) and opens its own. The object
  pickles as its DSN and options.
- Times come from this machine's clock corrected by its offset from the database server's clock
  (measured when the store opens), so machines whose clocks disagree still agree on deadlines.
- Spans go in with ``COPY`` (about ten times faster than ``INSERT`` here); a batch holding a span that is
  already stored (sent again) is inserted with ``ON CONFLICT DO NOTHING`` instead, so it is ignored.
- The calls of a runner's rollout cycle (claim, small span batches, completion, resources) also exist as
  coroutines (:class:`~agl.store.base.AsyncRolloutCalls`) on psycopg's async connections, for the store
  server's event loop: the same statements, results, errors and retries, without the hop to a worker
  thread, which costs the server more CPU than the call (see :mod:`agl.store.postgres.async_pool`).

The schema (tables prefixed ``agl_``) is created on first use and versioned; see
:mod:`agl.store.postgres.schema`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
import time
from typing import (
    Any,
    Callable,
    ClassVar,
    Dict,
    Iterable,
    Iterator,
    List,
    NoReturn,
    Optional,
    Sequence,
    Set,
    Tuple,
    TypeVar,
)

from pydantic_core import from_json, to_json

from agl.store.postgres.async_pool import AsyncPool
from agl.errors import (
    AglError,
    DuplicateResourcesError,
    StoreClosedError,
    StoreUnavailableError,
    UnknownAttemptError,
    UnknownResourcesError,
    UnknownRolloutError,
)
from agl._util.fork_safety import keep_unused
from agl.store import _rules
from agl.store.postgres.schema import (
    ADD_SPANS,
    ATTEMPT_COLS,
    claim_statement,
    COMPLETE,
    COPY_SPANS,
    DONE_CHANNEL,
    END_ATTEMPT,
    EXPIRED,
    HEARTBEAT,
    HEARTBEATS,
    INSERT_ROLLOUT,
    INSERT_SPANS,
    LIVE_ATTEMPT,
    NEXT_DEADLINE,
    QUEUE_CHANNEL,
    RENEW_HEARTBEATS,
    ROLLOUT_FAILED,
    ROLLOUT_REQUEUED,
    ROLLOUT_SUCCEEDED,
    SCHEMA,
    SCHEMA_LOCK_KEY,
    SCHEMA_VERSION,
    SELECT_ROLLOUTS,
    SERVER_START,
    SPAN_ATTEMPTS,
    SPAN_COLS,
)
from agl.store.sqlite.schema import attempt_from_row, rollout_from_row, span_from_row, span_to_row
from agl.store._waiting import wait_until
from agl.store.base import AsyncRolloutCalls, EnqueueRequest, LightningStore, StoreStats
from agl.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    AttemptStatus,
    Resource,
    ResourcesUpdate,
    Rollout,
    RolloutMode,
    RolloutStatus,
    Span,
    new_id,
    parse_resources,
)

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "the PostgreSQL store needs psycopg 3: pip install 'agl[postgres]' (or pip install 'psycopg[binary]')"
    ) from exc

logger = logging.getLogger("agl.store.postgres.store")

T = TypeVar("T")

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

# The server rolled the transaction back and it may simply be run again.
_ROLLED_BACK = (pg_errors.TransactionRollback, pg_errors.DeadlockDetected, pg_errors.SerializationFailure)

# The server ended the session (shutdown, pg_terminate_backend) and said so: a statement it was running was
# aborted, not committed (a commit that completed was answered before the session ended).
_SESSION_ENDED = (pg_errors.AdminShutdown, pg_errors.CrashShutdown, pg_errors.CannotConnectNow)
# libpq before 17 (psycopg-binary < 3.2.4, or an older system libpq) reports that goodbye as a plain
# OperationalError without its SQLSTATE ("consuming input failed: terminating connection due to ..."); the
# server's words are still there (in English; a server in another language falls back to "commit unknown").
_SESSION_ENDED_WORDS = (
    "terminating connection due to administrator command",  # 57P01
    "terminating connection because of crash of another server process",  # 57P02
    "the database system is shutting down",  # 57P03
)


# What the server says when it refuses a connection for good (libpq gives no SQLSTATE for a failed connection,
# only the server's words, in English; a server in another language falls back to being retried as an outage).
_REFUSED_FOR_GOOD_WORDS = (
    "does not exist",  # 3D000 (database), 28000 (role)
    "password authentication failed",  # 28P01
    "no pg_hba.conf entry",  # 28000
    "is not permitted to log in",  # 28000
    "permission denied for database",  # 42501: no CONNECT privilege
)


def _session_ended(exc: BaseException) -> bool:
    """Whether the server said it ended the session (so a statement it was running did not commit)."""
    if isinstance(exc, _SESSION_ENDED):
        return True
    return type(exc) is psycopg.OperationalError and any(words in str(exc) for words in _SESSION_ENDED_WORDS)

# Batches of up to this many spans go in with one statement (ADD_SPANS); bigger ones with COPY, which takes
# more round trips but less time per span.
_SMALL_SPAN_BATCH = 64


def _oneline(exc: Optional[BaseException]) -> str:
    """An error's message on one line (libpq's span several)."""
    return " ".join(str(exc).split())


def _connection_options(dsn: str) -> Dict[str, Any]:
    """The keyword arguments of every connect: ``CONNECTION_OPTIONS`` less what ``dsn`` sets itself (a
    keyword would override the URL's value), and agl's application name."""
    given = conninfo_to_dict(dsn)
    options = {key: value for key, value in CONNECTION_OPTIONS.items() if key not in given}
    return {"autocommit": True, "application_name": "agl-store", **options}


def _checked_dsn(dsn: str) -> str:
    """``dsn``, or AglError saying what is wrong with it (psycopg's ProgrammingError named no store or URL)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise AglError(
            f"the PostgreSQL URL given for the store is not valid: {_oneline(exc)}; write it as "
            "postgresql://user:password@host:port/database, with only libpq's parameters after '?' "
            "(https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-PARAMKEYWORDS)"
        ) from exc
    return dsn


def redacted(dsn: str) -> str:
    """``dsn`` without its password, for messages and ``repr``."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    params.pop("password", None)
    return make_conninfo(**params)


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
    def listen(self, channel: str) -> Iterator["_Waiter"]:
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

    def _wait(self, waiter: "_Waiter", timeout: Optional[float]) -> bool:
        with self._cond:
            if not self._listening:  # notifications would be missed: look at the database again soon
                timeout = self._POLL_S if timeout is None else min(timeout, self._POLL_S)
            moved = self._cond.wait_for(
                lambda: self._generation[waiter.channel] != waiter.seen or self._stop, timeout
            )
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
                        logger.warning("store notifications lost (%s); reconnecting (waiters look at the database "
                                       "meanwhile; said again at most every %g s)%s", _oneline(exc),
                                       self._LOST_LOG_EVERY_S, again)
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


class _CommitUnknown(Exception):
    """Internal: the connection died while a transaction was committing."""


def _raise_failure(exc: BaseException, conn: Any, committing: bool) -> NoReturn:
    """What a statement that failed with ``exc`` on ``conn`` means for the caller, raised: ``exc`` itself when
    nothing was committed and it may be retried, ``_CommitUnknown`` when the connection died while it may
    have been committing, else an AglError (the server refused the operation)."""
    if committing and (conn.closed or conn.broken) and not _session_ended(exc):
        raise _CommitUnknown() from exc
    if isinstance(exc, _ROLLED_BACK) or conn.closed or conn.broken:
        raise exc  # nothing was committed: the caller retries
    raise AglError(f"PostgreSQL refused the operation: {_oneline(exc)}") from exc


ROLLOUT_EXISTS = "SELECT 1 FROM agl_rollouts WHERE rollout_id = %s"


def _unknown(rollout_exists: bool, rollout_id: str, attempt_id: str) -> Exception:
    """For an attempt that was not found: UnknownRolloutError, or UnknownAttemptError if the rollout exists."""
    return UnknownAttemptError(rollout_id, attempt_id) if rollout_exists else UnknownRolloutError(rollout_id)


def _small_batch_params(rows: List[Tuple[Any, ...]], keys: List[Tuple[str, str]]) -> Dict[str, Any]:
    """ADD_SPANS's parameters: the batch as one JSON array (the first copy of a span in it wins)."""
    first: Dict[Tuple[str, str, str], Tuple[Any, ...]] = {}
    for row in rows:
        first.setdefault(row[:3], row)
    return {"spans": to_json(list(first.values())).decode(), "n_keys": len(keys)}


def _resources_query(resources_id: Optional[str]) -> Tuple[str, Tuple[Any, ...]]:
    if resources_id is None:
        return "SELECT * FROM agl_resources ORDER BY version DESC LIMIT 1", ()
    return "SELECT * FROM agl_resources WHERE resources_id = %s", (resources_id,)


def _resources_update(row: Optional[Tuple[Any, ...]], resources_id: Optional[str]) -> Optional[ResourcesUpdate]:
    if row is None:
        if resources_id is not None:
            raise UnknownResourcesError(resources_id)
        return None
    version, rid, encoded, create_time = row
    return ResourcesUpdate(
        resources_id=rid, version=version, resources=parse_resources(from_json(encoded)), create_time=create_time
    )


def _data_error(exc: BaseException) -> ValueError:
    return ValueError(
        f"PostgreSQL cannot store this value ({_oneline(exc)}); text must not contain NUL (\\x00) characters"
    )


RECONNECT_TIMEOUT_S = 10.0  # how long an operation retries an unreachable server, unless told otherwise


class PostgresLightningStore(LightningStore, AsyncRolloutCalls):
    """A LightningStore in a PostgreSQL database, shared by every process on every machine that opens it."""

    multiprocess_safe: ClassVar[bool] = True

    def __init__(self, dsn: str, *, max_connections: int = 8, reconnect_timeout: Optional[float] = None) -> None:
        """Open (creating the schema if needed) the store in the database ``dsn`` names.

        ``dsn``: a libpq URL (``postgresql://user:password@host:5432/database``) or ``key=value`` string.
        ``max_connections``: connections per store object and process (one more listens once a thread
        waits). ``reconnect_timeout``: how long an operation keeps retrying a server it cannot reach (None:
        ``RECONNECT_TIMEOUT_S``, or what a Trainer or ``agl runner`` asks for with :meth:`ride_out_outages`).
        """
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.dsn = _checked_dsn(dsn)
        self._connect_options = _connection_options(dsn)
        self.max_connections = max_connections
        self._own_reconnect_timeout = reconnect_timeout is not None
        self.reconnect_timeout = RECONNECT_TIMEOUT_S if reconnect_timeout is None else reconnect_timeout
        self._closed = False
        self._clock_offset = 0.0
        self._reset_process_state()
        try:
            conn = self._pool.get()
        except psycopg.OperationalError as exc:
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL ({redacted(dsn)}): {_oneline(exc)}; check that the server is "
                "running and the URL (postgresql://user:password@host:port/database)"
            ) from exc
        try:
            try:
                self._clock_offset = self._measure_clock_offset(conn)
                self._create_schema(conn)
            finally:
                self._pool.put(conn)
        except BaseException:
            self.close()
            raise

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._pool = _Pool(self._connect, self.max_connections)
        self._notifications = _Notifications(self._connect)
        self._apool: Optional[AsyncPool] = None  # made by the first async call, on its event loop

    def _state(self) -> Tuple[_Pool, _Notifications]:
        """This process's pool and listener (a forked child gets its own)."""
        if self._closed:
            raise StoreClosedError(f"{self!r} was closed; open the database again with PostgresLightningStore(dsn)")
        if os.getpid() != self._pid:  # a forked child: the parent's listening thread does not exist here
            self._pool.abandon()
            if self._apool is not None:
                keep_unused(self._apool.abandon())
            self._reset_process_state()
        return self._pool, self._notifications

    def __getstate__(self) -> Dict[str, Any]:
        return {"dsn": self.dsn, "max_connections": self.max_connections, "reconnect_timeout": self.reconnect_timeout}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        PostgresLightningStore.__init__(self, **state)  # not a subclass's __init__: it may take other arguments

    def __repr__(self) -> str:
        return f"PostgresLightningStore({redacted(self.dsn)!r})"

    def ride_out_outages(self, seconds: float) -> None:
        if not self._own_reconnect_timeout:
            self.reconnect_timeout = seconds

    # -- connections and transactions ----------------------------------------------------------------------
    def _connect(self) -> Any:
        try:
            return psycopg.connect(self.dsn, **self._connect_options)
        except psycopg.OperationalError as exc:
            self._check_refused_for_good(exc)
            raise

    @staticmethod
    def _measure_clock_offset(conn: Any) -> float:
        """Seconds to add to this machine's clock to read the database server's (half a round trip precise)."""
        before = time.time()
        (server,) = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        after = time.time()
        return float(server) - (before + after) / 2

    def _now(self) -> float:
        return time.time() + self._clock_offset

    def _create_schema(self, conn: Any) -> None:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            has_version = conn.execute("SELECT to_regclass('agl_schema') IS NOT NULL").fetchone()[0]
            if has_version:
                row = conn.execute("SELECT max(version) FROM agl_schema").fetchone()
                version = row[0] if row and row[0] is not None else 0
                if version > SCHEMA_VERSION:
                    raise AglError(
                        f"the database {redacted(self.dsn)} was written by a newer agl (store schema {version}, this "
                        f"agl knows {SCHEMA_VERSION}): upgrade agl, or use another database"
                    )
                if version == SCHEMA_VERSION:
                    return
                raise AglError(  # no older schema exists yet: this can only be a damaged or foreign table
                    f"the database {redacted(self.dsn)} has an agl_schema table with version {version}, which no agl "
                    "wrote; use an empty database (or drop the agl_* tables)"
                )
            try:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)  # type: ignore[arg-type]  # constant SQL
            except pg_errors.InsufficientPrivilege as exc:  # PostgreSQL 15+: only the owner may create in public
                raise AglError(
                    f"the database {redacted(self.dsn)} has no agl tables yet, and creating them was refused: "
                    f"{_oneline(exc)}. The role opening the store needs the CREATE privilege on the database's schema "
                    "(GRANT CREATE ON SCHEMA public TO <role>) the first time only: or open the store once as the "
                    "database's owner, after which a role with SELECT, INSERT, UPDATE, DELETE on the agl_* tables and "
                    "USAGE, UPDATE on their sequences is enough"
                ) from exc
            except (pg_errors.DuplicateTable, pg_errors.DuplicateObject) as exc:  # any object of ours: table, sequence...
                raise AglError(
                    f"the database {redacted(self.dsn)} has no agl_schema version but already holds an object the store "
                    f"would create ({_oneline(exc)}): it was not made by agl; use an empty database (or drop the "
                    "agl_* tables and sequences)"
                ) from exc
            conn.execute("INSERT INTO agl_schema (version) VALUES (%s)", (SCHEMA_VERSION,))

    def _run(self, work: Callable[[Any], T], *, write: bool = True, single: bool = False) -> T:
        """Run ``work(conn)`` (in one transaction if ``write``), retrying on a new connection while it is safe.

        ``single``: ``work`` writes with one statement, which commits on its own (no BEGIN and COMMIT: one
        round trip instead of three, which is most of the cost of a small write); once sent it may have
        been committed, so a connection lost during it is not retried unless the server said it aborted it.

        A retry happens when the connection was lost or the server rolled the transaction back (deadlock,
        serialisation failure) before the commit was sent: then nothing of it was stored. Connecting is
        retried with back-off for ``reconnect_timeout`` seconds.
        """
        pool, _ = self._state()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                return self._run_once(pool, work, write, single)
            except _CommitUnknown as unknown:
                raise self._commit_unknown(unknown) from unknown.__cause__
            except (psycopg.OperationalError, *_ROLLED_BACK) as exc:
                self._check_retry(exc, deadline, delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                pool, _ = self._state()  # raises if close() was called meanwhile

    def _run_once(self, pool: _Pool, work: Callable[[Any], T], write: bool, single: bool) -> T:
        conn = pool.get()
        committing = False
        try:
            if not write:
                return work(conn)
            if single:
                committing = True  # from the statement's start
                return work(conn)
            with conn.transaction():
                result = work(conn)
                committing = True
            return result
        except (psycopg.OperationalError, *_ROLLED_BACK) as exc:
            _raise_failure(exc, conn, committing)
        except psycopg.DataError as exc:
            raise _data_error(exc) from exc
        finally:
            pool.put(conn)

    def _commit_unknown(self, unknown: "_CommitUnknown") -> StoreUnavailableError:
        return StoreUnavailableError(
            f"the connection to PostgreSQL ({redacted(self.dsn)}) was lost while committing, so this change "
            "may or may not have been stored: read the state back (get_rollout, query_spans) before "
            f"repeating it ({_oneline(unknown.__cause__)})"
        )

    def _check_retry(self, exc: BaseException, deadline: float, delay: float) -> None:
        """Before a retry after ``exc``: give up (StoreUnavailableError) once ``reconnect_timeout`` is spent."""
        if time.monotonic() + delay > deadline:
            raise StoreUnavailableError(
                f"cannot reach PostgreSQL ({redacted(self.dsn)}) for {self.reconnect_timeout:g} s: "
                f"{_oneline(exc)}; check that the server is running"
            ) from exc
        logger.warning("PostgreSQL operation interrupted (%s); retrying", _oneline(exc))

    # -- async calls (the store server's event loop) -------------------------------------------------------
    def _async_pool(self) -> AsyncPool:
        """This process's async pool for the running event loop (a new loop gets a new pool)."""
        self._state()
        loop = asyncio.get_running_loop()
        if self._apool is None or self._apool.loop is not loop:
            if self._apool is not None:
                self._apool.close()
            self._apool = AsyncPool(self._aconnect, self.max_connections, _idle_session_open)
        return self._apool

    async def _aconnect(self) -> Any:
        try:
            return await psycopg.AsyncConnection.connect(self.dsn, **self._connect_options)
        except psycopg.OperationalError as exc:
            self._check_refused_for_good(exc)
            raise

    def _check_refused_for_good(self, exc: psycopg.OperationalError) -> None:
        """Raise AglError (not retried, unlike the OperationalError of an outage) if the server refused the
        connection for a reason that waiting does not cure: a database or role that does not exist, a wrong
        password. Else return: the caller retries, as a server that is down or starting up will answer later."""
        if "FATAL:" in str(exc) and any(words in str(exc) for words in _REFUSED_FOR_GOOD_WORDS):
            raise AglError(
                f"PostgreSQL ({redacted(self.dsn)}) refused the connection: {_oneline(exc)}; check the database, user "
                "and password in the URL (postgresql://user:password@host:port/database)"
            ) from exc

    async def _arun(self, sql: str, params: Any, *, write: bool, fetch_all: bool = False) -> Any:
        """One statement (committing on its own if ``write``) on an async connection: ``_run(..., single=True)``
        (or ``write=False``) for the event loop, with the same retries; returns fetchall() or fetchone()."""
        pool = self._async_pool()
        deadline = time.monotonic() + self.reconnect_timeout
        delay = 0.05
        while True:
            try:
                return await self._arun_once(pool, sql, params, write, fetch_all)
            except _CommitUnknown as unknown:
                raise self._commit_unknown(unknown) from unknown.__cause__
            except (psycopg.OperationalError, *_ROLLED_BACK) as exc:
                self._check_retry(exc, deadline, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                pool = self._async_pool()  # raises if close() was called meanwhile

    @staticmethod
    async def _arun_once(pool: AsyncPool, sql: str, params: Any, write: bool, fetch_all: bool) -> Any:
        conn = await pool.get()
        try:
            cursor = await conn.execute(sql, params)
            return await (cursor.fetchall() if fetch_all else cursor.fetchone())
        except (psycopg.OperationalError, *_ROLLED_BACK) as exc:
            _raise_failure(exc, conn, committing=write)
        except psycopg.DataError as exc:
            raise _data_error(exc) from exc
        finally:
            pool.put(conn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # the parent's connections are not ours to close
        self._notifications.close()
        self._pool.close()
        if self._apool is not None:
            self._apool.close()

    # -- shared steps (inside a transaction) ---------------------------------------------------------------
    @staticmethod
    def _select_one(c: Any, rollout_id: str) -> Rollout:
        row = c.execute(f"{SELECT_ROLLOUTS} WHERE r.rollout_id = %s", (rollout_id,)).fetchone()
        if row is None:
            raise UnknownRolloutError(rollout_id)
        return rollout_from_row(row)

    @staticmethod
    def _live_attempt(c: Any, rollout_id: str, attempt_id: str) -> Tuple[Any, ...]:
        """``LIVE_ATTEMPT``'s row (rollout and attempt locked); raises unless the attempt exists and is running."""
        row = c.execute(LIVE_ATTEMPT, (rollout_id, attempt_id)).fetchone()
        if row is None:
            PostgresLightningStore._raise_unknown(c, rollout_id, attempt_id)
        if row[1] != "running":
            raise _rules.stale_error(rollout_id, attempt_id, row[1], row[2])
        return row

    @staticmethod
    def _raise_unknown(c: Any, rollout_id: str, attempt_id: str) -> NoReturn:
        """For an attempt that was not found: UnknownRolloutError, or UnknownAttemptError if the rollout exists."""
        raise _unknown(c.execute(ROLLOUT_EXISTS, (rollout_id,)).fetchone() is not None, rollout_id, attempt_id)

    @staticmethod
    def _end_attempt(
        c: Any,
        rollout_id: str,
        aid: int,
        status: str,
        error: Optional[str],
        reward: Optional[float],
        n_attempts: int,
        max_attempts: int,
        now: float,
    ) -> Rollout:
        """End the live attempt ``aid``, move the rollout on per the shared retry rule and notify who waits for
        that (at commit); return the rollout as it now is. One statement: one round trip."""
        nxt = _rules.next_rollout_status(status, n_attempts, max_attempts)
        params: List[Any]
        if nxt == "succeeded":
            rollout_update, params = ROLLOUT_SUCCEEDED, [reward, now]
        elif nxt == "queued":
            rollout_update, params = ROLLOUT_REQUEUED, [error]
        else:
            rollout_update, params = ROLLOUT_FAILED, [error, now]
        channel = QUEUE_CHANNEL if nxt == "queued" else DONE_CHANNEL
        sql = END_ATTEMPT.format(rollout_update=rollout_update)
        return rollout_from_row(c.execute(sql, [status, now, error, aid, *params, rollout_id, channel]).fetchone())

    def _local_time(self, server_time: Optional[float]) -> Optional[float]:
        """A server-clock time on this machine's clock (what the wait loop sleeps against)."""
        return None if server_time is None else server_time - self._clock_offset

    def _reap(self) -> Tuple[List[Rollout], Optional[float]]:
        """End expired attempts; return the changed rollouts and the next pending deadline (server clock)."""
        next_deadline = self._run(lambda c: c.execute(NEXT_DEADLINE).fetchone()[0], write=False)
        now = self._now()
        if next_deadline is None or next_deadline > now:
            return [], next_deadline  # the common case: one indexed read, no transaction

        def work(c: Any) -> Tuple[List[Rollout], Optional[float]]:
            # a restarted database: its runners could not beat while it was down (see renew_heartbeats)
            c.execute(RENEW_HEARTBEATS, {"t": c.execute(SERVER_START).fetchone()[0]})
            changed: List[Rollout] = []
            for aid, rollout_id, start, timeout, hb_timeout, n_attempts, max_attempts in c.execute(
                EXPIRED, (now,)
            ).fetchall():
                status, error = _rules.expiry(start, now, timeout, hb_timeout)
                ended = self._end_attempt(c, rollout_id, aid, status, error, None, n_attempts, max_attempts, now)
                changed.append(ended)
            return changed, c.execute(NEXT_DEADLINE).fetchone()[0]

        return self._run(work)

    def _wait(
        self, channel: str, timeout: Optional[float], attempt: Callable[[], Tuple[Optional[T], Optional[float]]]
    ) -> Optional[T]:
        """:func:`~agl.store._waiting.wait_until`, woken by ``channel``'s notifications."""

        def listen() -> Any:
            return self._state()[1].listen(channel)

        def local_attempt() -> Tuple[Optional[T], Optional[float]]:
            result, next_expiry = attempt()
            return result, self._local_time(next_expiry)

        return wait_until(listen, timeout, local_attempt)

    # -- rollouts ------------------------------------------------------------------------------------------
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        if not requests:
            self._state()
            return []
        _rules.check_request_ids(requests)
        now = self._now()
        rollouts = [
            Rollout(
                rollout_id=request.rollout_id or new_id("ro"),
                task_id=request.task_id or new_id("task"),
                input=request.input,
                mode=request.mode,
                resources_id=request.resources_id,
                config=request.config.model_copy(),
                metadata=request.metadata,
                create_time=now,
            )
            for request in requests
        ]
        encoded = [
            (_rules.encode_json(r.input, "rollout input"), _rules.encode_json(r.metadata, "rollout metadata"))
            for r in rollouts
        ]
        resources_ids = list(dict.fromkeys(r.resources_id for r in requests if r.resources_id is not None))
        chosen = [r.rollout_id for r in requests if r.rollout_id is not None]

        def work(c: Any) -> None:
            if resources_ids:
                sql = "SELECT resources_id FROM agl_resources WHERE resources_id = ANY(%s)"
                known = {row[0] for row in c.execute(sql, (resources_ids,))}
                for resources_id in resources_ids:
                    if resources_id not in known:
                        raise UnknownResourcesError(resources_id)
            if chosen:
                sql = "SELECT rollout_id FROM agl_rollouts WHERE rollout_id = ANY(%s)"
                stored = {row[0] for row in c.execute(sql, (chosen,))}
                _rules.check_new_rollout_ids(requests, stored.__contains__)
            with c.cursor() as cur:
                cur.executemany(
                    INSERT_ROLLOUT,
                    [
                        (r.rollout_id, r.task_id, inp, r.mode, r.resources_id, r.config.max_attempts,
                         r.config.timeout_seconds, r.config.heartbeat_timeout_seconds, meta, now)
                        for r, (inp, meta) in zip(rollouts, encoded)
                    ],
                )
            c.execute(f"NOTIFY {QUEUE_CHANNEL}")

        try:
            self._run(work)
        except pg_errors.UniqueViolation:  # another machine stored a chosen id since our check: say which
            self._run(work)
        # what the caller gets back went through JSON as the stored copy did, and aliases nothing of theirs
        return [
            r.model_copy(update={"input": from_json(inp), "metadata": from_json(meta)})
            for r, (inp, meta) in zip(rollouts, encoded)
        ]

    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)

        def attempt() -> Tuple[Optional[List[Rollout]], Optional[float]]:
            claimed, next_expiry = self._claim(runner_id, limit)
            return claimed or None, next_expiry

        return self._wait(QUEUE_CHANNEL, timeout, attempt) or []

    def _claim(self, runner_id: str, limit: int) -> Tuple[List[Rollout], Optional[float]]:
        """Claim up to ``limit`` queued rollouts (reaping first if an attempt expired); also returns the next
        expiry. One statement, which also tells whether an attempt has expired: only then is there more."""
        claimed, deadlines, next_before, now = self._claim_once(runner_id, limit)
        if next_before is not None and next_before <= now:
            reaped, next_before = self._reap()
            if reaped and len(claimed) < limit:  # the reap may have requeued some: claim them in this call
                more, more_deadlines, _, _ = self._claim_once(runner_id, limit - len(claimed))
                claimed += more
                deadlines += more_deadlines
        return claimed, min((d for d in deadlines + [next_before] if d is not None), default=None)

    def _claim_once(
        self, runner_id: str, limit: int
    ) -> Tuple[List[Rollout], List[Optional[float]], Optional[float], float]:
        """One claim statement: the claimed rollouts, their attempts' deadlines, the earliest deadline of the
        attempts that were running before, and the time of the claim."""
        params = self._claim_params(runner_id, limit)
        sql = claim_statement(limit)
        return self._claimed(self._run(lambda c: c.execute(sql, params).fetchall(), single=True), params["now"])

    def _claim_params(self, runner_id: str, limit: int) -> Dict[str, Any]:
        attempt_ids = [new_id("at") for _ in range(limit)]
        return {"now": self._now(), "runner_id": runner_id, "attempt_ids": attempt_ids}

    @staticmethod
    def _claimed(rows: List[Tuple[Any, ...]], now: float) -> Tuple[List[Rollout], List[Optional[float]], Optional[float], float]:
        claimed = [row for row in rows if row[0] is not None]
        return [rollout_from_row(row[:25]) for row in claimed], [row[25] for row in claimed], rows[0][27], now

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        def work(c: Any) -> Attempt:
            now = self._now()
            aid, _, _, start, timeout, hb_timeout, _, _ = self._live_attempt(c, rollout_id, attempt_id)
            deadline = _rules.attempt_deadline(start, now, timeout, hb_timeout)
            return attempt_from_row(c.execute(HEARTBEAT, (now, deadline, aid)).fetchone())

        return self._run(work)

    def complete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus,
        *,
        reward: Optional[float] = None,
        error: Optional[str] = None,
    ) -> Rollout:
        params = self._complete_params(rollout_id, attempt_id, status, reward, error)
        row = self._run(lambda c: c.execute(COMPLETE, params).fetchone(), single=True)
        if row is None:
            return self._run(lambda c: self._raise_unknown(c, rollout_id, attempt_id), write=False)
        return self._completed(row, rollout_id, attempt_id)

    def _complete_params(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus, reward: Optional[float], error: Optional[str]
    ) -> Dict[str, Any]:
        reward = _rules.check_completion(status, reward)
        return {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "status": status,
            "reward": reward,
            "error": _rules.free_text(error),
            "now": self._now(),
            "on_retry": _rules.next_rollout_status(status, n_attempts=1, max_attempts=2),
            "on_last": _rules.next_rollout_status(status, n_attempts=2, max_attempts=2),
        }

    @staticmethod
    def _completed(row: Tuple[Any, ...], rollout_id: str, attempt_id: str) -> Rollout:
        """The rollout COMPLETE returned, or the error for an attempt that was no longer running."""
        attempt_status, rollout_status = row[:2]
        if attempt_status != "running":
            raise _rules.stale_error(rollout_id, attempt_id, attempt_status, rollout_status)
        return rollout_from_row(row[2:27])

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        def work(c: Any) -> Rollout:
            now = self._now()
            row = c.execute(
                "SELECT status, latest_aid FROM agl_rollouts WHERE rollout_id = %s FOR UPDATE", (rollout_id,)
            ).fetchone()
            if row is None:
                raise UnknownRolloutError(rollout_id)
            status, aid = row
            if status not in ("queued", "running", "cancelled"):
                raise _rules.cancel_error(rollout_id, status)
            if status == "running":
                c.execute(
                    "UPDATE agl_attempts SET status = 'cancelled', end_time = %s, deadline = NULL WHERE aid = %s",
                    (now, aid),
                )
            if status != "cancelled":
                c.execute(
                    "UPDATE agl_rollouts SET status = 'cancelled', end_time = %s, queue_pos = NULL "
                    "WHERE rollout_id = %s",
                    (now, rollout_id),
                )
                c.execute(f"NOTIFY {DONE_CHANNEL}")  # sent at commit
            return self._select_one(c, rollout_id)

        return self._run(work)

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._run(lambda c: self._select_one(c, rollout_id), write=False)

    def query_rollouts(
        self,
        *,
        status: Optional[Iterable[RolloutStatus]] = None,
        rollout_ids: Optional[Iterable[str]] = None,
        task_id: Optional[str] = None,
        mode: Optional[RolloutMode] = None,
        limit: Optional[int] = None,
        offset: int = 0,
    ) -> List[Rollout]:
        where: List[str] = ["TRUE"]
        params: List[Any] = []
        if status is not None:
            where.append("r.status = ANY(%s)")
            params.append(list(status))
        if rollout_ids is not None:
            where.append("r.rollout_id = ANY(%s)")
            params.append(list(rollout_ids))
        if task_id is not None:
            where.append("r.task_id = %s")
            params.append(task_id)
        if mode is not None:
            where.append("r.mode = %s")
            params.append(mode)
        sql = f"{SELECT_ROLLOUTS} WHERE {' AND '.join(where)} ORDER BY r.seq LIMIT %s OFFSET %s"
        rows = self._run(lambda c: c.execute(sql, params + [limit, offset]).fetchall(), write=False)
        return [rollout_from_row(row) for row in rows]

    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        def work(c: Any) -> List[Attempt]:
            sql = f"SELECT {ATTEMPT_COLS} FROM agl_attempts a WHERE a.rollout_id = %s ORDER BY a.sequence"
            rows = c.execute(sql, (rollout_id,)).fetchall()
            if not rows:
                self._select_one(c, rollout_id)  # raises if the rollout is unknown
            return [attempt_from_row(row) for row in rows]

        return self._run(work, write=False)

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        ids = list(dict.fromkeys(rollout_ids))
        pending = self._pending(ids, check_known=True)

        def attempt() -> Tuple[Optional[bool], Optional[float]]:
            nonlocal pending
            _, next_expiry = self._reap()
            pending = self._pending(pending, check_known=False)
            return (None if pending else True), next_expiry

        if pending:
            self._wait(DONE_CHANNEL, timeout, attempt)
        done = {r.rollout_id: r for r in self.query_rollouts(rollout_ids=ids) if r.is_terminal}
        return [done[i] for i in ids if i in done]

    def _pending(self, ids: Sequence[str], *, check_known: bool) -> List[str]:
        """Those of ``ids`` that are not terminal yet (raising for unknown ids when ``check_known``)."""
        if not ids:
            return []
        sql = "SELECT rollout_id, status FROM agl_rollouts WHERE rollout_id = ANY(%s)"
        status = dict(self._run(lambda c: c.execute(sql, (list(ids),)).fetchall(), write=False))
        if check_known and len(status) < len(ids):
            raise UnknownRolloutError(next(i for i in ids if i not in status))
        return [i for i in ids if status.get(i) not in TERMINAL_ROLLOUT_STATUSES]

    def reap_expired(self) -> List[Rollout]:
        return self._reap()[0]

    def renew_heartbeats(self) -> int:
        return self._run(lambda c: c.execute(RENEW_HEARTBEATS, {"t": self._now()}).rowcount)

    # -- spans ---------------------------------------------------------------------------------------------
    def add_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            self._state()
            return 0
        rows = [span_to_row(_rules.storable_span(span)) for span in spans]  # encoded before any round trip
        keys = list(dict.fromkeys((row[0], row[1]) for row in rows))
        if len(rows) <= _SMALL_SPAN_BATCH:
            return self._add_small_batch(rows, keys)

        def work(c: Any, copy: bool) -> int:
            now = self._now()
            found = self._span_attempts(c, keys)
            first: Dict[Tuple[int, str], Tuple[Any, ...]] = {}  # (aid, span_id) -> row: the first copy wins
            for row in rows:
                aid = found[(row[0], row[1])][0]
                first.setdefault((aid, row[2]), (aid,) + row)
            with c.cursor() as cur:
                if copy:
                    with cur.copy(COPY_SPANS) as stream:
                        for row in first.values():
                            stream.write_row(row)
                    stored = len(first)
                else:
                    cur.execute(INSERT_SPANS, [list(column) for column in zip(*first.values())])
                    stored = cur.rowcount
                beats = [  # a span of a running attempt counts as its heartbeat
                    (aid, _rules.attempt_deadline(start, now, timeout, hb_timeout))
                    for aid, status, start, timeout, hb_timeout in found.values()
                    if status == "running"
                ]
                if beats:
                    cur.execute(HEARTBEATS, (now, [b[0] for b in beats], [b[1] for b in beats]))
            return stored

        try:  # COPY is ~10 times faster than INSERT here, but cannot skip spans that are already stored
            return self._run(lambda c: work(c, copy=True))
        except pg_errors.UniqueViolation:  # some were (a batch sent again): insert skipping those
            return self._run(lambda c: work(c, copy=False))

    def _add_small_batch(self, rows: List[Tuple[Any, ...]], keys: List[Tuple[str, str]]) -> int:
        """``add_spans`` of a small batch: one statement (ADD_SPANS) in the common case."""
        params = _small_batch_params(rows, keys)
        while True:
            params["now"] = self._now()
            known, stored = self._run(lambda c: c.execute(ADD_SPANS, params).fetchone(), single=True)
            if known:
                return int(stored)
            self._check_span_attempts(keys)
            # all are known now (enqueued or claimed meanwhile): store them

    def _check_span_attempts(self, keys: List[Tuple[str, str]]) -> None:
        """After ADD_SPANS found an attempt missing: raise for the first unknown (rollout, attempt)."""
        self._run(lambda c: self._span_attempts(c, keys), write=False)

    @staticmethod
    def _span_attempts(c: Any, keys: List[Tuple[str, str]]) -> Dict[Tuple[str, str], Tuple[Any, ...]]:
        """(rollout_id, attempt_id) -> (aid, status, start_time, timeout, heartbeat timeout) for each key;
        raises UnknownRolloutError/UnknownAttemptError for the first unknown one, as the other backends."""
        found = {
            (r[0], r[1]): r[2:]
            for r in c.execute(SPAN_ATTEMPTS, ([k[0] for k in keys], [k[1] for k in keys])).fetchall()
        }
        for rollout_id, attempt_id in keys:
            if (rollout_id, attempt_id) not in found:
                PostgresLightningStore._raise_unknown(c, rollout_id, attempt_id)
        return found

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        def work(c: Any) -> List[Span]:
            if attempt_id == "latest":
                sql = (
                    f"SELECT {SPAN_COLS} FROM agl_spans s "
                    "WHERE s.aid = (SELECT latest_aid FROM agl_rollouts WHERE rollout_id = %s) "
                    "ORDER BY s.sequence_id, s.sid"
                )
                rows = c.execute(sql, (rollout_id,)).fetchall()
            elif attempt_id is None:
                sql = (
                    f"SELECT {SPAN_COLS} FROM agl_attempts a JOIN agl_spans s ON s.aid = a.aid "
                    "WHERE a.rollout_id = %s ORDER BY a.sequence, s.sequence_id, s.sid"
                )
                rows = c.execute(sql, (rollout_id,)).fetchall()
            else:
                sql = (
                    f"SELECT {SPAN_COLS} FROM agl_attempts a JOIN agl_spans s ON s.aid = a.aid "
                    "WHERE a.rollout_id = %s AND a.attempt_id = %s ORDER BY s.sequence_id, s.sid"
                )
                rows = c.execute(sql, (rollout_id, attempt_id)).fetchall()
            if not rows:  # only now find out whether the ids exist, to keep the common path one query
                self._select_one(c, rollout_id)
                if attempt_id not in ("latest", None):
                    sql = "SELECT 1 FROM agl_attempts WHERE rollout_id = %s AND attempt_id = %s"
                    if c.execute(sql, (rollout_id, attempt_id)).fetchone() is None:
                        raise UnknownAttemptError(rollout_id, attempt_id)  # type: ignore[arg-type]
            return [span_from_row(row) for row in rows]

        return self._run(work, write=False)

    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        ids = list(dict.fromkeys(rollout_ids))

        def work(c: Any) -> int:
            # FOR SHARE: a finished rollout stays finished, but an unfinished one must not finish in between
            sql = "SELECT rollout_id, status FROM agl_rollouts WHERE rollout_id = ANY(%s) FOR SHARE"
            status = dict(c.execute(sql, (ids,)).fetchall())
            for rollout_id in ids:  # every id is checked before anything is deleted: all or nothing
                if rollout_id not in status:
                    raise UnknownRolloutError(rollout_id)
                _rules.check_spans_deletable(rollout_id, status[rollout_id])
            return c.execute(
                "DELETE FROM agl_spans WHERE aid IN (SELECT aid FROM agl_attempts WHERE rollout_id = ANY(%s))", (ids,)
            ).rowcount

        return self._run(work) if ids else 0

    # -- resources -----------------------------------------------------------------------------------------
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        _rules.check_id(resources_id, "resources_id")
        encoded = _rules.encode_json(parse_resources(dict(resources)), "resources")

        def work(c: Any) -> Tuple[str, int, float]:
            now = self._now()
            # versions are numbered 1, 2, 3, ... across machines: one writer at a time (readers go on)
            c.execute("LOCK TABLE agl_resources IN SHARE ROW EXCLUSIVE MODE")
            rid = resources_id
            if rid is not None:
                if c.execute("SELECT 1 FROM agl_resources WHERE resources_id = %s", (rid,)).fetchone():
                    raise DuplicateResourcesError(rid)
            else:
                rid = new_id("res")
            version = c.execute("SELECT coalesce(max(version), 0) + 1 FROM agl_resources").fetchone()[0]
            c.execute("INSERT INTO agl_resources VALUES (%s, %s, %s, %s)", (version, rid, encoded, now))
            return rid, version, now

        rid, version, now = self._run(work)
        return ResourcesUpdate(
            resources_id=rid, version=version, resources=parse_resources(from_json(encoded)), create_time=now
        )

    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        sql, params = _resources_query(resources_id)
        return _resources_update(self._run(lambda c: c.execute(sql, params).fetchone(), write=False), resources_id)

    # -- the calls of a rollout cycle, for an event loop (see agl.store.base.AsyncRolloutCalls) ----------------
    async def aclaim(self, runner_id: str, limit: int = 1) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)
        params = self._claim_params(runner_id, limit)
        rows = await self._arun(claim_statement(limit), params, write=True, fetch_all=True)
        claimed, _, next_before, now = self._claimed(rows, params["now"])
        if next_before is not None and next_before <= now:  # an attempt has expired: reap (rare) on a thread
            reaped, _ = await asyncio.to_thread(self._reap)
            if reaped and len(claimed) < limit:  # the reap may have requeued some: claim them in this call
                claimed += await self.aclaim(runner_id, limit - len(claimed))
        return claimed

    async def aadd_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            self._state()
            return 0
        if len(spans) > _SMALL_SPAN_BATCH:
            return await asyncio.to_thread(self.add_spans, spans)  # big batches go in with COPY, on a thread
        rows = [span_to_row(_rules.storable_span(span)) for span in spans]
        keys = list(dict.fromkeys((row[0], row[1]) for row in rows))
        params = _small_batch_params(rows, keys)
        while True:
            params["now"] = self._now()
            known, stored = await self._arun(ADD_SPANS, params, write=True)
            if known:
                return int(stored)
            await asyncio.to_thread(self._check_span_attempts, keys)

    async def acomplete_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: AttemptStatus,
        *,
        reward: Optional[float] = None,
        error: Optional[str] = None,
    ) -> Rollout:
        params = self._complete_params(rollout_id, attempt_id, status, reward, error)
        row = await self._arun(COMPLETE, params, write=True)
        if row is None:
            exists = await self._arun(ROLLOUT_EXISTS, (rollout_id,), write=False) is not None
            raise _unknown(exists, rollout_id, attempt_id)
        return self._completed(row, rollout_id, attempt_id)

    async def aget_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        sql, params = _resources_query(resources_id)
        return _resources_update(await self._arun(sql, params, write=False), resources_id)

    # -- misc ----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        sql = (  # one statement: every count from the same snapshot
            "SELECT (SELECT coalesce(json_object_agg(status, n), '{}') FROM "
            "(SELECT status, count(*) AS n FROM agl_rollouts GROUP BY status) s)::text, "
            "(SELECT count(*) FROM agl_attempts), (SELECT count(*) FROM agl_spans), "
            "(SELECT count(*) FROM agl_resources)"
        )
        by_status, n_attempts, n_spans, n_versions = self._run(lambda c: c.execute(sql).fetchone(), write=False)
        counts = {status: 0 for status in _rules.ROLLOUT_STATUSES}
        counts.update(from_json(by_status))
        return StoreStats(rollouts=counts, attempts=n_attempts, spans=n_spans, resources_versions=n_versions)
