"""A PostgreSQL store object's way to its database (:class:`PostgresDatabase`): this process's pool and
listener, the database server's clock, the schema, and running work with retries while that is safe (on a
thread's connection, or on an async one for the store server's event loop)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

import psycopg
from psycopg import errors as pg_errors

from agl._util.fork_safety import keep_unused
from agl.errors import AglError, StoreClosedError, StoreUnavailableError
from agl.store.postgres.async_pool import AsyncPool
from agl.store.postgres.connections import (
    _checked_dsn,
    _connection_options,
    _idle_session_open,
    _Pool,
    invalid_url,
    redacted,
)
from agl.store.postgres.failures import (
    _REFUSED_FOR_GOOD_WORDS,
    _ROLLED_BACK,
    _CommitUnknown,
    _data_error,
    _oneline,
    _raise_failure,
)
from agl.store.postgres.notifications import _Notifications
from agl.store.postgres.schema import MIGRATIONS, SCHEMA, SCHEMA_LOCK_KEY, SCHEMA_VERSION

logger = logging.getLogger("agl.store.postgres.store")  # the store's one logger, whichever module logs

T = TypeVar("T")

RECONNECT_TIMEOUT_S = 10.0  # how long an operation retries an unreachable server, unless told otherwise


class PostgresDatabase:
    """The connections, clock and retries of a :class:`~agl.store.postgres.store.PostgresLightningStore`; its
    store calls are built on :meth:`_run` (a thread's calls) and :meth:`_arun` (the event loop's)."""

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
        except psycopg.ProgrammingError as exc:  # a parameter psycopg reads itself
            raise invalid_url(dsn, exc) from None
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
                if version in MIGRATIONS:  # an older agl's store: brought up to date in this transaction
                    for old in range(version, SCHEMA_VERSION):
                        for statement in MIGRATIONS[old]:
                            conn.execute(statement)  # constant SQL
                    conn.execute("UPDATE agl_schema SET version = %s", (SCHEMA_VERSION,))
                    return
                raise AglError(  # no older schema than 1 exists: this can only be a damaged or foreign table
                    f"the database {redacted(self.dsn)} has an agl_schema table with version {version}, which no agl "
                    "wrote; use an empty database (or drop the agl_* tables)"
                )
            try:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)  # constant SQL
            except pg_errors.InsufficientPrivilege as exc:  # PostgreSQL 15+: only the owner may create in public
                raise AglError(
                    f"the database {redacted(self.dsn)} has no agl tables yet, and creating them was refused: "
                    f"{_oneline(exc)}. The role opening the store needs the CREATE privilege on the database's schema "
                    "(GRANT CREATE ON SCHEMA public TO <role>) the first time only: or open the store once as the "
                    "database's owner, after which a role with SELECT, INSERT, UPDATE, DELETE on the agl_* tables and "
                    "USAGE, UPDATE on their sequences is enough"
                ) from exc
            except (
                pg_errors.DuplicateTable,
                pg_errors.DuplicateObject,
            ) as exc:  # any object of ours: table, sequence...
                raise AglError(
                    f"the database {redacted(self.dsn)} has no agl_schema version but already holds an object the "
                    f"store "
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

    def _commit_unknown(self, unknown: _CommitUnknown) -> StoreUnavailableError:
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
