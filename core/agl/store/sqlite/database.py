"""A SQLite store object's connections to its file (:class:`SqliteDatabase`): one per thread, reopened after
``os.fork``; every operation counted, so that ``close()`` and a fork wait for those in flight; write
transactions under this process's write lock."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from typing import Any, List, Optional, Tuple

from agl._util.fork_safety import hold_across_fork, keep_unused
from agl.errors import StoreAddressError, StoreClosedError, StoreStorageError
from agl.store.doorbell import Doorbell
from agl.store.sqlite.checkpoints import BACKSTOP_PAGES, WAL_SIZE_LIMIT, checkpointer
from agl.store.sqlite.file_check import _foreign_tables, _newer_agl_error, _not_a_store, _tables, check_existing_store
from agl.store.sqlite.schema import SCHEMA, SCHEMA_VERSION

logger = logging.getLogger("agl.store.sqlite.store")  # the store's one logger, whichever module logs

FORK_WAIT_S = 10.0  # how long a fork waits for this process's store operations in flight (agl._util.fork_safety)

# SQLite's primary result codes for a disk that is full or failing, with the words of its message (what Python
# 3.10, which has no ``sqlite_errorcode``, leaves to go by)
_SQLITE_FULL, _SQLITE_IOERR = 13, 10
_STORAGE_WORDS = {_SQLITE_FULL: "database or disk is full", _SQLITE_IOERR: "disk I/O error"}


def raise_if_storage_failed(path: str, exc: Optional[BaseException]) -> None:
    """Raise StoreStorageError from ``exc`` if SQLite failed because of the disk under ``path``: full, or an
    I/O error. It is an outage, not a bug nor bad input: the runners, the span writer and the store server
    ride it out as they do a store that does not answer, where sqlite3's own error crashed the runners."""
    kind = _storage_failure(exc)
    if kind is None:
        return
    name = getattr(exc, "sqlite_errorname", None)
    what = f"{exc}, {name}" if name else str(exc)
    if kind == _SQLITE_FULL:
        why = f"the disk holding the SQLite store {path} is full ({what}): free space on it"
    else:
        why = (
            f"the SQLite store {path} could not be read or written ({what}): its disk is full, failing, or went "
            "away (a network drive); check it"
        )
    raise StoreStorageError(
        f"{why}. Nothing of this call was stored. Runners wait for the store (up to their outage timeout) and the "
        "store server answers 503 meanwhile; to keep a long run's store bounded, delete old spans "
        "(Trainer(span_retention_steps=N), agl store prune)"
    ) from exc


def _storage_failure(exc: Optional[BaseException]) -> Optional[int]:
    """``_SQLITE_FULL`` or ``_SQLITE_IOERR`` if ``exc`` is SQLite's error for a full or failing disk, else None."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        primary = code & 0xFF  # an extended code (SQLITE_IOERR_WRITE) holds its primary one in its low byte
        return primary if primary in _STORAGE_WORDS else None
    return next((kind for kind, words in _STORAGE_WORDS.items() if words in str(exc)), None)


class _Operation:
    """``with store._session as conn``: this thread's connection for one operation of ``store``.

    ``close()`` waits for the operations in flight: closing a connection while another thread's statement
    runs on it crashes the interpreter (a segfault in CPython's sqlite3 module), e.g. when a store is closed
    while the tracer's writer still writes to it. A class rather than a generator-based context manager:
    every store call passes through here, and this costs a third as much.
    """

    __slots__ = ("store",)

    def __init__(self, store: SqliteDatabase) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        return self.store._begin_operation()

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        self.store._end_operation()
        raise_if_storage_failed(self.store.path, exc)


class _WriteTransaction:
    """``with store._write() as conn``: one write transaction (``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back
    on any exception), under this process's write lock, inside one operation (``_Operation``). A class
    rather than a generator-based context manager for the same reason: two of these per rollout cycle."""

    __slots__ = ("store", "conn")

    def __init__(self, store: SqliteDatabase) -> None:
        self.store = store

    def __enter__(self) -> sqlite3.Connection:
        store = self.store
        conn = self.conn = store._begin_operation()
        try:
            store._write_lock.acquire()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except BaseException:
                store._write_lock.release()
                raise
        except BaseException:
            store._end_operation()
            raise
        return conn

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException], tb: Any) -> None:
        conn, store = self.conn, self.store
        try:
            if exc_type is None:
                conn.execute("COMMIT")
                checkpointer.written(store.path)
        except sqlite3.Error as failed:  # a full disk often shows only here, when the WAL grows
            raise_if_storage_failed(store.path, failed)
            raise
        finally:
            try:
                if conn.in_transaction:  # an exception, or a failed COMMIT (else the next BEGIN would fail)
                    conn.execute("ROLLBACK")
            finally:
                store._write_lock.release()
                store._end_operation()
        raise_if_storage_failed(store.path, exc)


class SqliteDatabase:
    """The connections and transactions of a :class:`~agl.store.sqlite.store.SqliteLightningStore`; its store
    calls run inside ``with self._session as conn`` (reads) and ``with self._write() as c`` (writes)."""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout: float = 30.0, create: bool = True) -> None:
        """Open (creating if needed) the store at ``path``; ``busy_timeout`` bounds waiting for the write lock.

        ``create=False`` (what only reads: ``agl inspect``, ``agl export``): ``path`` must already be an agl
        store; a missing file, or a SQLite file of another application, raises before anything is written to it
        (no schema, no WAL switch, no ``user_version``), so a mistyped ``--store`` never alters someone's database.
        """
        self.path = os.path.abspath(os.fspath(path))
        self.busy_timeout = busy_timeout
        if not create:
            check_existing_store(self.path, busy_timeout)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._closed = False
        self._queue_bell = Doorbell(self.path, "queue")  # work was enqueued or requeued
        self._done_bell = Doorbell(self.path, "done")  # a rollout finished, or there is a new deadline to watch
        self._reset_process_state()
        hold_across_fork(self)
        if create:
            self._create_schema()

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._local = threading.local()
        self._conns: List[Tuple[threading.Thread, sqlite3.Connection]] = []  # strong refs: see agl._util.fork_safety
        self._conns_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._in_flight = 0  # operations between _begin_operation and _end_operation, in this process
        self._in_flight_lock = threading.Lock()  # taken directly on every operation: Condition's methods cost more
        self._idle = threading.Condition(self._in_flight_lock)
        self._forking = False  # a fork waits for the operations in flight; new ones wait for the fork
        self._fork_held = False  # _before_fork holds _in_flight_lock for the fork under way
        self._session = _Operation(self)

    # -- connections and transactions ----------------------------------------------------------------------
    def _closed_error(self) -> StoreClosedError:
        return StoreClosedError(f"{self!r} was closed; open the file again with SqliteLightningStore(path)")

    def _begin_operation(self) -> sqlite3.Connection:
        """This thread's connection, counted as in use until ``_end_operation`` (see ``_Operation``)."""
        if os.getpid() != self._pid:  # forked: the parent's connections and locks are not ours
            keep_unused(conn for _, conn in self._conns)
            self._reset_process_state()
        with self._in_flight_lock:
            while self._forking:
                self._idle.wait()
            if self._closed:
                raise self._closed_error()
            self._in_flight += 1
        try:
            return self._conn()
        except BaseException as exc:
            self._end_operation()
            raise_if_storage_failed(self.path, exc)
            raise

    def _end_operation(self) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
            if (self._closed or self._forking) and not self._in_flight:
                self._idle.notify_all()

    def _before_fork(self) -> None:
        """Before ``os.fork``: no thread of this process may be inside SQLite (see ``agl._util.fork_safety``).

        Holds new operations and waits up to ``FORK_WAIT_S`` for those in flight, then keeps
        ``_in_flight_lock`` through the fork, so no operation starts before ``_after_fork``."""
        if os.getpid() != self._pid:
            return  # a store inherited from a parent and unused here: its locks are the parent's copies
        self._in_flight_lock.acquire()
        self._fork_held = True
        self._forking = True
        if not self._idle.wait_for(lambda: self._in_flight == 0, timeout=FORK_WAIT_S):
            logger.warning(
                "%r: forking while %d store operation(s) still run in other threads; the child may block in "
                "its first store call",
                self,
                self._in_flight,
            )

    def _after_fork(self) -> None:
        """After ``os.fork``, in the parent and in the child: operations may start again."""
        if not self._fork_held:
            return
        self._fork_held = False
        self._forking = False
        self._idle.notify_all()
        self._in_flight_lock.release()

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (made on first use); only inside ``_session``."""
        conn: Optional[sqlite3.Connection] = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA cache_size = -32000")  # KiB: 32 MB per connection
            # checkpoints run on a background thread (agl.store.sqlite.checkpoints); a commit runs one only as a
            # backstop, when back-to-back writes never let that thread's checkpoints restart the WAL
            conn.execute(f"PRAGMA wal_autocheckpoint = {BACKSTOP_PAGES}")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
            with self._conns_lock:
                # close the connections of threads that ended (runners start a heartbeat thread per rollout)
                for thread, old in self._conns:
                    if not thread.is_alive():
                        old.close()
                self._conns = [(t, c) for t, c in self._conns if t.is_alive()]
                self._conns.append((threading.current_thread(), conn))
            self._local.conn = conn
        return conn

    def _write(self) -> _WriteTransaction:
        """One write transaction holding the database's write lock from its first statement."""
        return _WriteTransaction(self)

    def _create_schema(self) -> None:
        with self._session as conn:
            # 8 KiB pages (SQLite's default is 4): an LLM span with its token ids is a ~9 KB row, which 4 KiB
            # pages split into an overflow chain; inserting it costs ~30% less this way. Only a new, empty
            # file takes it; an existing store keeps its page size.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise _newer_agl_error(self.path, version)
            if version == 0 and _foreign_tables(conn):  # before the first write: another app's file stays as it was
                raise StoreAddressError(_not_a_store(self.path, _tables(conn)))
            conn.execute("PRAGMA page_size = 8192")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            logger.warning("%s: SQLite refused WAL mode (journal_mode=%s); is it on a network drive?", self.path, mode)
        if version < SCHEMA_VERSION:
            with self._write() as c:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        c.execute(statement)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        """Refuse new operations, wait (up to ``busy_timeout``) for those in flight, then close the connections.

        Connections another thread is still using after that wait are left open (closing them under a running
        statement would crash the process); the garbage collector closes them when that thread lets go."""
        if os.getpid() != self._pid:
            self._closed = True
            return  # the parent's connections are not ours to close
        with self._idle:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._in_flight == 0, timeout=self.busy_timeout)
            with self._conns_lock:
                conns, self._conns = self._conns, []
        checkpointer.release(self.path)  # before the store's own: the last connection to close folds the WAL
        me = threading.current_thread()
        with self._idle:  # no fork while a connection closes (see _before_fork); not nested with release's lock
            for thread, conn in conns:
                if idle or thread is me or not thread.is_alive():
                    conn.close()
        if not idle:
            logger.warning("%r closed while operations were still running in other threads", self)

    def file_size(self) -> int:
        """Bytes the store takes on disk: the database file and its write-ahead log."""
        return sum(os.path.getsize(p) for p in (self.path, f"{self.path}-wal") if os.path.exists(p))

    def vacuum(self) -> bool:
        """Give the space of deleted rows back to the file system. Without this SQLite keeps the file's size
        and reuses the space for new rows, which is enough to stop a pruned store from growing. Rewrites the
        whole file (seconds per GB) while every writer waits; meant for ``agl store prune --vacuum``.

        The rewritten file goes through the write-ahead log; False when another process still reads an older
        snapshot (waited for up to ``busy_timeout``), so the log could not be folded back yet: the file
        shrinks at a later checkpoint, after that reader is done, and until then takes more space, not less."""
        with self._session as conn:
            conn.execute("VACUUM")
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
        return not busy
