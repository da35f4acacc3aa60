"""The embedded default store: one SQLite file that several processes share safely.

Why it is built this way:
- WAL mode with ``synchronous=NORMAL``: readers never block the writer and a commit does not fsync (a power
  cut may lose the last commits, never corrupt the file); ``busy_timeout`` queues writers of other processes.
- One connection per thread, reopened after ``os.fork`` (SQLite connections must not cross a fork). The
  object pickles as its path and options, so it can be handed to ``multiprocessing`` children.
- Every state change is one ``BEGIN IMMEDIATE`` transaction: it takes the write lock before reading, so
  two processes can never claim the same rollout or end the same attempt twice. Threads of one process
  queue on a lock first, which is cheaper than SQLite's sleeping busy handler.
- Waiters in any process are woken through a :class:`~agl.store.doorbell.Doorbell`, not by polling.

The schema and row conversions live in :mod:`agl.store.sqlite.schema`, the connections, transactions and fork
safety in :mod:`agl.store.sqlite.database`.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

from agl.errors import UnknownAttemptError, UnknownResourcesError, UnknownRolloutError
from agl.store import _rules, _sql
from agl.store._waiting import wait_for_rollouts, wait_until
from agl.store.base import Completion, EnqueueRequest, LightningStore, RolloutQuery, StoreStats
from agl.store.prefixes import SharedPrefixes
from agl.store.sqlite.database import SqliteDatabase
from agl.store.sqlite.schema import (
    ATTEMPT_COLS,
    NEXT_QUEUE_POS,
    ROLLOUT_COLS,
    SELECT_ROLLOUTS,
    SPAN_ROWS_PER_INSERT,
    attempt_from_row,
    insert_spans_sql,
    json_list,
    rollout_from_row,
)
from agl.types import TERMINAL_ROLLOUT_STATUSES, Attempt, Resource, ResourcesUpdate, Rollout, Span, new_id

_DIALECT = _sql.Dialect(_sql.QMARK, "", SELECT_ROLLOUTS, arrival="s.rowid", next_queue_pos=NEXT_QUEUE_POS)

_NEXT_DEADLINE = "SELECT min(deadline) FROM attempts WHERE status = 'running' AND deadline IS NOT NULL"

# Each row goes to the back of the queue as it is inserted: no statement of its own to read the queue's end.
_INSERT_ROLLOUT = (
    "INSERT INTO rollouts (rollout_id, task_id, input, mode, resources_id, max_attempts, timeout_seconds, "
    "heartbeat_timeout_seconds, metadata, create_time, status, queue_pos) "
    f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', {NEXT_QUEUE_POS})"
)

# A dequeue's first read: the next attempt deadline (is there anything to reap?) and whether anything is queued.
_CLAIM_CHECK = f"SELECT ({_NEXT_DEADLINE}), EXISTS (SELECT 1 FROM rollouts WHERE queue_pos IS NOT NULL)"
# What _start reads of a rollout it starts: its columns, its seq, and the greatest attempt aid so far (the
# same in every row: the new attempts' aids follow it), so that a claim needs no statement to read it.
_STARTABLE_COLS = f"{ROLLOUT_COLS}, r.seq, (SELECT coalesce(max(aid), 0) FROM attempts)"
_CLAIMABLE = f"SELECT {_STARTABLE_COLS} FROM rollouts r WHERE r.queue_pos IS NOT NULL ORDER BY r.queue_pos LIMIT ?"
_STARTABLE = f"SELECT {_STARTABLE_COLS} FROM rollouts r WHERE r.rollout_id = ?"

# complete_attempt's read: the rollout with the attempt it names (a SELECT_ROLLOUTS row, but that attempt
# rather than the latest: they are the same when it is live), then the attempt's aid.
_COMPLETING = (
    f"SELECT {ROLLOUT_COLS}, {ATTEMPT_COLS}, a.aid FROM rollouts r "
    "LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.attempt_id = ? WHERE r.rollout_id = ?"
)
_ROLLOUT_AT = {column.strip()[2:]: i for i, column in enumerate(ROLLOUT_COLS.split(","))}
_ATTEMPT_AT = {column.strip()[2:]: len(_ROLLOUT_AT) + i for i, column in enumerate(ATTEMPT_COLS.split(","))}
_COMPLETING_AID = len(_ROLLOUT_AT) + len(_ATTEMPT_AT)


def _check_live(
    row: Optional[Sequence[Any]], rollout_id: str, attempt_id: str, aid_at: int, status_at: int, rollout_status_at: int
) -> None:
    """Raise unless ``row`` (a rollout left-joined with the attempt named) shows that attempt still running."""
    if row is None:
        raise UnknownRolloutError(rollout_id)
    if row[aid_at] is None:
        raise UnknownAttemptError(rollout_id, attempt_id)
    if row[status_at] != "running":
        raise _rules.stale_error(rollout_id, attempt_id, row[status_at], row[rollout_status_at])


# The live attempt's row joined with its rollout's bookkeeping; see _live_attempt.
_LIVE_ATTEMPT = (
    "SELECT a.aid, a.status, r.status, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
    "r.n_attempts, r.max_attempts, a.last_heartbeat FROM rollouts r "
    "LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.attempt_id = ? WHERE r.rollout_id = ?"
)


class SqliteLightningStore(SqliteDatabase, SharedPrefixes, LightningStore):
    """A LightningStore in one SQLite file, shared by every thread and process that opens the same path.

    Its connections, transactions and fork safety come from :class:`~agl.store.sqlite.database.SqliteDatabase`.
    """

    multiprocess_safe: ClassVar[bool] = True

    def __getstate__(self) -> Dict[str, Any]:
        return {"path": self.path, "busy_timeout": self.busy_timeout}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]  # unpickling reopens the store from its settings

    def __repr__(self) -> str:
        return f"SqliteLightningStore({self.path!r})"

    # -- shared steps --------------------------------------------------------------------------------------
    @staticmethod
    def _select_one(c: sqlite3.Connection, rollout_id: str) -> Rollout:
        return _sql.select_rollout(_DIALECT, c, rollout_id)

    @staticmethod
    def _live_attempt(c: sqlite3.Connection, rollout_id: str, attempt_id: str) -> Tuple[Any, ...]:
        """``_LIVE_ATTEMPT``'s row; raises unless the attempt exists and is still running."""
        row = c.execute(_LIVE_ATTEMPT, (attempt_id, rollout_id)).fetchone()
        _check_live(row, rollout_id, attempt_id, 0, 1, 2)
        return row

    @staticmethod
    def _end_attempt(c: sqlite3.Connection, rollout_id: str, aid: int, end: _rules.AttemptEnd) -> None:
        """End the live attempt ``aid`` and move the rollout on as ``end`` says."""
        c.execute(
            "UPDATE attempts SET status = ?, end_time = ?, error = ? WHERE aid = ?",
            (end.status, end.end_time, end.error, aid),
        )
        assignments = _sql.rollout_assignments(_DIALECT, end)
        c.execute(f"UPDATE rollouts SET {assignments} WHERE rollout_id = ?", (*end.rollout.values(), rollout_id))

    def _ring_for(self, statuses: Iterable[str]) -> None:
        """After a commit: wake runners for requeued work, and waiters for finished rollouts."""
        statuses = set(statuses)
        if "queued" in statuses:
            self._queue_bell.ring()
        if statuses & TERMINAL_ROLLOUT_STATUSES:
            self._done_bell.ring()

    def _reap(self) -> Tuple[List[Rollout], Optional[float]]:
        """End expired attempts; return the changed rollouts and the next pending deadline."""
        with self._session as conn:
            next_deadline = conn.execute(_NEXT_DEADLINE).fetchone()[0]
        now = time.time()
        if next_deadline is None or next_deadline > now:
            return [], next_deadline  # the common case: one indexed read, no write lock
        changed: List[Rollout] = []
        with self._write() as c:
            expired = c.execute(
                "SELECT a.aid, a.rollout_id, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds, "
                "r.n_attempts, r.max_attempts FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                "WHERE a.status = 'running' AND a.deadline <= ?",
                (now,),
            ).fetchall()
            for aid, rollout_id, start, timeout, hb_timeout, n_attempts, max_attempts in expired:
                status, error = _rules.expiry(start, now, timeout, hb_timeout)
                self._end_attempt(
                    c, rollout_id, aid, _rules.end_attempt(status, error, None, n_attempts, max_attempts, now)
                )
                changed.append(self._select_one(c, rollout_id))
            next_deadline = c.execute(_NEXT_DEADLINE).fetchone()[0]
        self._ring_for(r.status for r in changed)
        return changed, next_deadline

    # -- rollouts ------------------------------------------------------------------------------------------
    def enqueue_many(self, requests: Sequence[EnqueueRequest]) -> List[Rollout]:
        if not requests:
            return []
        _rules.check_request_ids(requests)
        now = time.time()
        rows = _sql.new_rollout_rows(requests, now)
        resources_ids = {r.resources_id for r in requests if r.resources_id is not None}
        with self._write() as c:
            for resources_id in resources_ids:
                if c.execute("SELECT 1 FROM resources WHERE resources_id = ?", (resources_id,)).fetchone() is None:
                    raise UnknownResourcesError(resources_id)
            chosen = [r.rollout_id for r in requests if r.rollout_id is not None]
            if chosen:
                sql = "SELECT 1 FROM rollouts WHERE rollout_id = ?"
                _rules.check_new_rollout_ids(requests, lambda i: c.execute(sql, (i,)).fetchone() is not None)
            c.executemany(_INSERT_ROLLOUT, rows)
            started = {r[0]: self._start_now(c, r[0], q.runner_id, now) for r, q in zip(rows, requests) if q.runner_id}
        self._queue_bell.ring()
        if any(deadline is not None for _, deadline in started.values()):
            self._done_bell.ring()  # a waiter sleeping until the next expiry must learn of these
        return [started[r[0]][0] if r[0] in started else _sql.queued_rollout(r) for r in rows]

    def _start_now(
        self, c: sqlite3.Connection, rollout_id: str, runner_id: str, now: float
    ) -> Tuple[Rollout, Optional[float]]:
        """Start the first attempt of a rollout just enqueued in this transaction (``start_rollout``)."""
        row = c.execute(_STARTABLE, (rollout_id,)).fetchone()
        [rollout], deadlines = self._start(c, [row], runner_id, now)
        return rollout, deadlines[0] if deadlines else None

    def dequeue_many(self, runner_id: str, limit: int = 1, *, timeout: float = 0.0) -> List[Rollout]:
        _rules.check_claim(runner_id, limit)

        def attempt() -> Tuple[Optional[List[Rollout]], Optional[float]]:
            claimed, next_expiry = self._claim(runner_id, limit)
            return claimed or None, next_expiry

        return wait_until(self._queue_bell.listen, timeout, attempt) or []

    def _claim(self, runner_id: str, limit: int) -> Tuple[List[Rollout], Optional[float]]:
        """Reap, then claim up to ``limit`` queued rollouts in one transaction; also returns the next expiry."""
        with self._session as conn:  # one read tells whether to reap and whether there is anything to claim
            next_expiry, queued = conn.execute(_CLAIM_CHECK).fetchone()
        if next_expiry is not None and next_expiry <= time.time():
            _, next_expiry = self._reap()
            queued = True  # the reap may have requeued some: the claim's own read tells
        if not queued:
            return [], next_expiry  # nothing queued: no need for the write lock
        now = time.time()
        with self._write() as c:
            rows = c.execute(_CLAIMABLE, (limit,)).fetchall()
            claimed, deadlines = self._start(c, rows, runner_id, now)
        if deadlines:
            self._done_bell.ring()  # a waiter sleeping until the next expiry must learn of these
            next_expiry = min(deadlines + ([next_expiry] if next_expiry is not None else []))
        return claimed, next_expiry

    @staticmethod
    def _start(
        c: sqlite3.Connection, rows: List[Tuple[Any, ...]], runner_id: str, now: float
    ) -> Tuple[List[Rollout], List[float]]:
        """Start a new attempt of each queued rollout in ``rows`` (``_STARTABLE_COLS``, in queue order) inside the
        caller's write transaction: the rollouts as they now are, and the attempts' deadlines."""
        aid = rows[0][17] if rows else 0  # the greatest aid so far; the new attempts take the next ones
        attempts = []  # INSERT INTO attempts parameters, one per claimed rollout
        for row in rows:
            aid += 1
            deadline = _rules.attempt_deadline(now, now, row[7], row[8])
            attempts.append((aid, row[0], new_id("at"), row[10] + 1, runner_id, now, now, deadline))
        c.executemany(
            "UPDATE rollouts SET status = 'running', queue_pos = NULL, n_attempts = ?, latest_aid = ?, "
            "start_time = coalesce(start_time, ?) WHERE seq = ?",
            [(a[3], a[0], now, row[16]) for row, a in zip(rows, attempts)],
        )
        c.executemany(
            "INSERT INTO attempts (aid, rollout_id, attempt_id, sequence, runner_id, status, start_time, "
            "last_heartbeat, deadline) VALUES (?, ?, ?, ?, ?, 'running', ?, ?, ?)",
            attempts,
        )
        claimed = [  # the SELECT_ROLLOUTS row each claimed rollout now has
            rollout_from_row(
                row[:4]
                + ("running",)
                + row[5:10]
                + (a[3],)
                + row[11:14]
                + (row[14] or now, row[15])
                + (a[1], a[2], a[3], runner_id, "running", now, None, now, None)
            )
            for row, a in zip(rows, attempts)
        ]
        return claimed, [a[7] for a in attempts if a[7] is not None]

    def heartbeat(self, rollout_id: str, attempt_id: str) -> Attempt:
        now = time.time()
        with self._write() as c:
            aid, _, _, start, timeout, hb_timeout, _, _, _ = self._live_attempt(c, rollout_id, attempt_id)
            deadline = _rules.attempt_deadline(start, now, timeout, hb_timeout)
            c.execute("UPDATE attempts SET last_heartbeat = ?, deadline = ? WHERE aid = ?", (now, deadline, aid))
            row = c.execute(f"SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.aid = ?", (aid,)).fetchone()
        return attempt_from_row(row)

    def _complete_attempt(self, done: Completion) -> Rollout:
        rollout_id, attempt_id, status, reward, error = done
        now = time.time()
        with self._write() as c:
            row = c.execute(_COMPLETING, (attempt_id, rollout_id)).fetchone()
            _check_live(row, rollout_id, attempt_id, _COMPLETING_AID, _ATTEMPT_AT["status"], _ROLLOUT_AT["status"])
            n_attempts, max_attempts = row[_ROLLOUT_AT["n_attempts"]], row[_ROLLOUT_AT["max_attempts"]]
            end = _rules.end_attempt(status, error, reward, n_attempts, max_attempts, now)
            self._end_attempt(c, rollout_id, row[_COMPLETING_AID], end)
        # the rollout as it now is, from the row read before the change: one query less per completion
        values = list(row[:_COMPLETING_AID])
        for column, value in end.rollout.items():
            values[_ROLLOUT_AT[column]] = value
        for column, value in (("status", end.status), ("end_time", end.end_time), ("error", end.error)):
            values[_ATTEMPT_AT[column]] = value
        rollout = rollout_from_row(values)
        self._ring_for([rollout.status])
        return rollout

    def cancel_rollout(self, rollout_id: str) -> Rollout:
        now = time.time()
        with self._write() as c:
            status, aid = _sql.cancellable(_DIALECT, c, rollout_id)
            if status == "running":
                c.execute("UPDATE attempts SET status = 'cancelled', end_time = ? WHERE aid = ?", (now, aid))
            if status != "cancelled":
                c.execute(
                    "UPDATE rollouts SET status = 'cancelled', end_time = ?, queue_pos = NULL WHERE rollout_id = ?",
                    (now, rollout_id),
                )
            rollout = self._select_one(c, rollout_id)
        if status != "cancelled":
            self._done_bell.ring()
        return rollout

    def get_rollout(self, rollout_id: str) -> Rollout:
        with self._session as conn:
            return self._select_one(conn, rollout_id)

    def _query_rollouts(self, query: RolloutQuery) -> List[Rollout]:
        sql, params = _sql.query_rollouts_sql(_DIALECT, query)
        with self._session as conn:
            rows = conn.execute(sql, params).fetchall()
        return [rollout_from_row(row) for row in rows]

    def query_attempts(self, rollout_id: str) -> List[Attempt]:
        sql = f"SELECT {ATTEMPT_COLS} FROM attempts a WHERE a.rollout_id = ? ORDER BY a.sequence"
        with self._session as conn:
            rows = conn.execute(sql, (rollout_id,)).fetchall()
            if not rows:
                self._select_one(conn, rollout_id)  # raises if the rollout is unknown
        return [attempt_from_row(row) for row in rows]

    def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> List[Rollout]:
        wait = functools.partial(wait_until, self._done_bell.listen)
        return wait_for_rollouts(self.query_rollouts, rollout_ids, timeout, self._statuses, self._reap, wait)

    def _statuses(self, ids: Sequence[str]) -> Dict[str, str]:
        with self._session as conn:
            rows = conn.execute(
                "SELECT rollout_id, status FROM rollouts WHERE rollout_id IN (SELECT value FROM json_each(?))",
                (json_list(ids),),
            ).fetchall()
        return dict(rows)

    def reap_expired(self) -> List[Rollout]:
        return self._reap()[0]

    def renew_heartbeats(self) -> int:
        now = time.time()
        with self._write() as c:
            running = c.execute(
                "SELECT a.aid, a.start_time, r.timeout_seconds, r.heartbeat_timeout_seconds FROM attempts a "
                "JOIN rollouts r ON r.rollout_id = a.rollout_id "
                "WHERE a.status = 'running' AND a.deadline IS NOT NULL AND r.heartbeat_timeout_seconds IS NOT NULL"
            ).fetchall()
            c.executemany(
                "UPDATE attempts SET last_heartbeat = ?, deadline = ? WHERE aid = ?",
                [(now, _rules.attempt_deadline(start, now, timeout, hb), aid) for aid, start, timeout, hb in running],
            )
        return len(running)

    # -- spans ---------------------------------------------------------------------------------------------
    def add_spans(self, spans: Sequence[Span]) -> int:
        if not spans:
            return 0
        rows, learnt = self._prefixes.rows(spans)  # encoded before taking the write lock
        now = time.time()
        with self._write() as c:
            aids: Dict[Tuple[str, str], int] = {}
            beats = []
            for row in rows:
                key = (row[0], row[1])
                if key in aids:
                    continue
                found = c.execute(_LIVE_ATTEMPT, (key[1], key[0])).fetchone()
                if found is None:
                    raise UnknownRolloutError(key[0])
                if found[0] is None:
                    raise UnknownAttemptError(key[0], key[1])
                aids[key] = found[0]
                if found[1] == "running" and _rules.span_heartbeat_due(found[8], now, found[5]):
                    beats.append((now, _rules.attempt_deadline(found[3], now, found[4], found[5]), found[0]))
            before = c.total_changes
            for start in range(0, len(rows), SPAN_ROWS_PER_INSERT):
                chunk = rows[start : start + SPAN_ROWS_PER_INSERT]
                params = [value for row in chunk for value in (aids[(row[0], row[1])],) + row]
                c.execute(insert_spans_sql(len(chunk)), params)
            stored = c.total_changes - before
            c.executemany("UPDATE attempts SET last_heartbeat = ?, deadline = ? WHERE aid = ?", beats)
        self._prefixes.learn(learnt)
        return stored

    def query_spans(self, rollout_id: str, attempt_id: Optional[str] = "latest") -> List[Span]:
        with self._session as conn:
            return _sql.query_spans(_DIALECT, conn, rollout_id, attempt_id)

    def delete_spans(self, rollout_ids: Sequence[str]) -> int:
        ids = list(dict.fromkeys(rollout_ids))
        listed = (json_list(ids),)
        with self._write() as c:
            sql = "SELECT rollout_id, status FROM rollouts WHERE rollout_id IN (SELECT value FROM json_each(?))"
            status = dict(c.execute(sql, listed).fetchall())
            for rollout_id in ids:  # every id is checked before anything is deleted: all or nothing
                if rollout_id not in status:
                    raise UnknownRolloutError(rollout_id)
                _rules.check_spans_deletable(rollout_id, status[rollout_id])
            before = c.total_changes
            c.execute(
                "DELETE FROM spans WHERE aid IN "
                "(SELECT aid FROM attempts WHERE rollout_id IN (SELECT value FROM json_each(?)))",
                listed,
            )
            deleted = c.total_changes - before
        self._prefixes.forget(ids)
        return deleted

    # -- resources -----------------------------------------------------------------------------------------
    def add_resources(self, resources: Dict[str, Resource], resources_id: Optional[str] = None) -> ResourcesUpdate:
        encoded = _rules.encode_resources(resources, resources_id)
        now = time.time()
        with self._write() as c:
            resources_id, version = _sql.insert_resources(_DIALECT, c, resources_id, encoded, now)
        return _sql.resources_from_row((version, resources_id, encoded, now))

    def get_resources(self, resources_id: Optional[str] = None) -> Optional[ResourcesUpdate]:
        sql, params = _sql.resources_query(_DIALECT, resources_id)
        with self._session as conn:
            return _sql.resources_update(conn.execute(sql, params).fetchone(), resources_id)

    # -- misc ----------------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._session as conn:
            conn.execute("BEGIN")  # one snapshot for every count
            try:
                counts = {status: 0 for status in _rules.ROLLOUT_STATUSES}
                counts.update(conn.execute("SELECT status, count(*) FROM rollouts GROUP BY status").fetchall())
                n_attempts, n_spans, n_versions = conn.execute(
                    "SELECT (SELECT count(*) FROM attempts), (SELECT count(*) FROM spans), (SELECT count(*) FROM "
                    "resources)"
                ).fetchone()
            finally:
                conn.execute("COMMIT")
            return StoreStats(rollouts=counts, attempts=n_attempts, spans=n_spans, resources_versions=n_versions)
